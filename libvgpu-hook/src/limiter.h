/* The compute limiter's policy, pure and unit-tested (no CUDA, no clock).
 *
 * Each launch costs an estimated `cost` of GPU time. A container holding
 * `share` percent of a device may use cost*100/share of wall time per launch:
 * a virtual clock (GCRA's theoretical arrival time, one per device in the
 * shared region so all the container's processes draw on it) advances by that
 * much per launch, and a launch waits while the clock is more than `burst`
 * ahead of now. Over any long stretch the container then launches at most
 * share% of the GPU's time in kernels. How `cost` is learned: launch.c. */
#ifndef VGPU_LIMITER_H
#define VGPU_LIMITER_H

#include <stdatomic.h>
#include <stdint.h>

/* Reserves the next slot on the virtual clock *tat for a launch charged
 * charge_ns at time now. Returns how long the launch must wait (0: go). */
uint64_t vgpu_gcra_admit(_Atomic uint64_t *tat, uint64_t now, uint64_t charge_ns,
                         uint64_t burst_ns);

/* Wall time one launch of cost_ns is charged under share_percent (1-99). */
uint64_t vgpu_launch_charge(uint64_t cost_ns, unsigned share_percent);

/* Exponentially weighted average: the first sample sets it; then 1/4 weight. */
uint64_t vgpu_cost_average(uint64_t old_ns, uint64_t sample_ns);

/* Cost per launch implied by a measured utilisation: util_percent of window_ns
 * spent in `launches` launches. 0 when it cannot be told. */
uint64_t vgpu_cost_from_util(double util_percent, uint64_t window_ns, uint64_t launches);

#endif
