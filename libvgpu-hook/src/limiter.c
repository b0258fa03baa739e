#include "limiter.h"

uint64_t vgpu_clock_take(_Atomic uint64_t *tat, uint64_t now, uint64_t charge_ns,
                         uint64_t refund_ns, uint64_t burst_ns, uint64_t max_debt_ns)
{
    uint64_t old = atomic_load_explicit(tat, memory_order_relaxed), start, next;
    uint64_t ceiling = now + max_debt_ns;
    do {
        start = old > refund_ns ? old - refund_ns : 0;
        if (start < now) /* idle time is not banked */
            start = now;
        if (start > ceiling) /* debt from before (e.g. a clock shared with an older hook) */
            start = ceiling;
        next = charge_ns > ceiling - start ? ceiling : start + charge_ns;
    } while (!atomic_compare_exchange_weak_explicit(tat, &old, next, memory_order_relaxed,
                                                    memory_order_relaxed));
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

uint64_t vgpu_sample_cost(uint64_t elapsed_ns, uint64_t idle_gap_ns)
{
    return elapsed_ns > idle_gap_ns ? elapsed_ns - idle_gap_ns : 0;
}

/* The new average of an entry holding c (cost + 1, 0 = none) after sample. */
static uint64_t fold(uint64_t c, uint64_t sample, int exact, _Atomic uint32_t *suspects)
{
    if (!c)
        return sample; /* the first sample sets it, even a 0 */
    uint64_t avg = c - 1;
    if (!exact)
        return sample < avg ? avg - (avg - sample) / 4 : avg;
    if (sample > avg + avg / 2 &&
        atomic_fetch_add_explicit(suspects, 1, memory_order_relaxed) + 1 < VGPU_COST_SUSPECTS)
        return avg - avg / 16 + sample / 16;
    atomic_store_explicit(suspects, 0, memory_order_relaxed);
    return avg - avg / 4 + sample / 4;
}

uint64_t vgpu_cost_learn(struct vgpu_cost_table *t, uint64_t key, uint64_t sample_ns, int exact)
{
    unsigned home = (unsigned)key & (VGPU_COST_ENTRIES - 1);
    for (unsigned i = 0; i < VGPU_COST_PROBES; i++) {
        unsigned at = (unsigned)(key + i) & (VGPU_COST_ENTRIES - 1);
        uint64_t k = atomic_load_explicit(&t->e[at].key, memory_order_acquire);
        if (k == 0) {
            /* Claim the empty entry; if another thread took it meanwhile, look at it again. */
            if (atomic_compare_exchange_strong(&t->e[at].key, &k, key))
                k = key;
        }
        if (k == key) {
            uint64_t c = atomic_load_explicit(&t->e[at].cost_ns, memory_order_relaxed);
            uint64_t avg = fold(c, sample_ns, exact, &t->e[at].suspects);
            /* Racing learners: the last one wins; both were measurements. */
            atomic_store_explicit(&t->e[at].cost_ns, avg + 1, memory_order_relaxed);
            return avg;
        }
    }
    /* No room near home: evict it. Readers in between see "not measured". */
    atomic_store_explicit(&t->e[home].cost_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->e[home].suspects, 0, memory_order_relaxed);
    atomic_store_explicit(&t->e[home].key, key, memory_order_release);
    atomic_store_explicit(&t->e[home].cost_ns, sample_ns + 1, memory_order_relaxed);
    return sample_ns;
}
