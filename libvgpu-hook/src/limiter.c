#include "limiter.h"

uint64_t vgpu_gcra_admit(_Atomic uint64_t *tat, uint64_t now, uint64_t charge_ns,
                         uint64_t burst_ns)
{
    uint64_t old = atomic_load_explicit(tat, memory_order_relaxed), start;
    do
        start = old > now ? old : now;
    while (!atomic_compare_exchange_weak_explicit(tat, &old, start + charge_ns,
                                                  memory_order_relaxed, memory_order_relaxed));
    return start > now + burst_ns ? start - now - burst_ns : 0;
}

uint64_t vgpu_launch_charge(uint64_t cost_ns, unsigned share_percent)
{
    if (share_percent == 0 || share_percent >= 100)
        return cost_ns;
    return cost_ns > UINT64_MAX / 100 ? UINT64_MAX / share_percent
                                      : cost_ns * 100 / share_percent;
}

uint64_t vgpu_cost_average(uint64_t old_ns, uint64_t sample_ns)
{
    return old_ns ? (old_ns * 3 + sample_ns) / 4 : sample_ns;
}

uint64_t vgpu_cost_from_util(double util_percent, uint64_t window_ns, uint64_t launches)
{
    if (!(util_percent > 0) || util_percent > 100 || window_ns == 0 || launches == 0)
        return 0;
    return (uint64_t)(util_percent / 100.0 * (double)window_ns / (double)launches);
}
