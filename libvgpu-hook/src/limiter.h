/* The compute limiter's policy, pure and unit-tested (no CUDA, no clock).
 *
 * A container holding `share` percent of a device may use cost*100/share of
 * wall time per launch of GPU cost `cost`. A virtual clock (one per device in
 * the shared region, so all the container's processes draw on it) advances by
 * that much per launch; a launch waits while the clock is more than `burst`
 * ahead of now. Two clamps keep the clock honest:
 *  - no banked credit: the clock never lags behind now, so an idle (or
 *    throttled-and-late) container gets at most `burst` of head start;
 *  - bounded debt: the clock never runs more than `max_debt` ahead of now, so
 *    no launch waits longer than that, whatever was charged before.
 * Charges are corrected once the real GPU time of a sampled launch is known
 * (a refund or an extra charge on the same clock, under the same clamps).
 *
 * Cost is learned per kernel signature (function + grid, or graph), so short
 * and long kernels are each charged their own measured GPU time: the estimate
 * has no bias by kernel length or by the mix. How it is measured: launch.c. */
#ifndef VGPU_LIMITER_H
#define VGPU_LIMITER_H

#include <stdatomic.h>
#include <stdint.h>

/* Moves the virtual clock *tat for a launch at time now: gives back refund_ns
 * (reserved earlier, not used), then reserves charge_ns, clamped to
 * [now, now + max_debt]. Returns how long the launch must wait (0: go); the
 * wait is never more than max_debt - burst. */
uint64_t vgpu_clock_take(_Atomic uint64_t *tat, uint64_t now, uint64_t charge_ns,
                         uint64_t refund_ns, uint64_t burst_ns, uint64_t max_debt_ns);

/* Wall time one launch of cost_ns is charged under share_percent (1-99). */
uint64_t vgpu_launch_charge(uint64_t cost_ns, unsigned share_percent);

/* Exponentially weighted average: the first sample sets it; then 1/4 weight. */
uint64_t vgpu_cost_average(uint64_t old_ns, uint64_t sample_ns);

/* GPU time of a sampled launch: the time between its two events, less the
 * host-side gap between recording the start event and launching when the
 * device was idle at the start event (then the events also span that gap). */
uint64_t vgpu_sample_cost(uint64_t elapsed_ns, uint64_t idle_gap_ns);

/* Measured cost per kernel signature: a fixed-size, lock-free open-addressing
 * table (a process's working set of kernels; when full, old entries are
 * overwritten and relearned). Readers never write. */
#define VGPU_COST_ENTRIES 1024
#define VGPU_COST_PROBES 8

struct vgpu_cost_table {
    struct {
        _Atomic uint64_t key;
        _Atomic uint64_t cost_ns; /* cost + 1; 0 = not measured yet */
        _Atomic uint32_t suspects; /* high samples in a row */
    } e[VGPU_COST_ENTRIES];
};

/* A signature's key (never 0) from up to four words, in two steps: a cheap
 * combination (the launch path compares it with the thread's last one) and the
 * finaliser that spreads it over the table. */
static inline uint64_t vgpu_cost_mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return a ^ (b * 0x9e3779b97f4a7c15ull) ^ (c * 0xc2b2ae3d27d4eb4full) ^
           (d * 0x165667b19e3779f9ull);
}

static inline uint64_t vgpu_cost_finish(uint64_t x)
{
    /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x ? x : 1;
}

static inline uint64_t vgpu_cost_key(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return vgpu_cost_finish(vgpu_cost_mix(a, b, c, d));
}

/* The learned cost of key; returns 0 and sets *known = 0 when not learned. */
static inline uint64_t vgpu_cost_lookup(struct vgpu_cost_table *t, uint64_t key, int *known)
{
    for (unsigned i = 0; i < VGPU_COST_PROBES; i++) {
        unsigned at = (unsigned)(key + i) & (VGPU_COST_ENTRIES - 1);
        uint64_t k = atomic_load_explicit(&t->e[at].key, memory_order_acquire);
        if (k == key) {
            uint64_t c = atomic_load_explicit(&t->e[at].cost_ns, memory_order_relaxed);
            *known = c != 0;
            return c ? c - 1 : 0;
        }
        if (k == 0)
            break;
    }
    *known = 0;
    return 0;
}

/* Folds a measured sample into key's average (inserting it if new) and returns
 * the new average. A measurement can only be too long (another tenant's work
 * slipped into the bracket), never too short. An `exact` sample (its kernel
 * was bracketed on an idle stream) counts 1/4 either way, except that one more
 * than 1.5 times the average is suspect and counts 1/16, until
 * VGPU_COST_SUSPECTS of them in a row show the kernel did get longer. Any
 * other sample is only an upper bound: it can lower the average (1/4), never
 * raise it. */
#define VGPU_COST_SUSPECTS 4
uint64_t vgpu_cost_learn(struct vgpu_cost_table *t, uint64_t key, uint64_t sample_ns, int exact);

#endif
