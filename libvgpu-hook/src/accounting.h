/* Per-process accounting of device memory: bytes in use per device, and the
 * size and device of every live allocation, keyed by device pointer.
 * Pure policy (no CUDA calls), thread-safe, unit-tested directly.
 *
 * This is per process only. The cross-process shared region, so that all the
 * processes of a container draw on one budget, comes in a later issue. */
#ifndef VGPU_ACCOUNTING_H
#define VGPU_ACCOUNTING_H

#include <pthread.h>
#include <stdint.h>

#include "limits.h"

#define VGPU_ACCT_BUCKETS 4096

struct vgpu_acct_entry;

struct vgpu_acct {
    pthread_mutex_t mu;
    uint64_t used[VGPU_MAX_DEVICES]; /* bytes, reserved or allocated */
    struct vgpu_acct_entry *buckets[VGPU_ACCT_BUCKETS];
};

#define VGPU_ACCT_INIT {.mu = PTHREAD_MUTEX_INITIALIZER}

/* Reserves bytes on dev if used + bytes <= limit (limit 0 = unlimited), so that
 * check and charge are one atomic step. Returns 0, or -1 when over the limit
 * or dev is out of range. *used_before (may be NULL) gets the bytes in use
 * before the call either way. */
int vgpu_acct_reserve(struct vgpu_acct *a, int dev, uint64_t bytes, uint64_t limit,
                      uint64_t *used_before);

/* Gives back a reservation whose allocation did not happen. */
void vgpu_acct_unreserve(struct vgpu_acct *a, int dev, uint64_t bytes);

/* Remembers a successful allocation (after vgpu_acct_reserve). Returns 0, or
 * -1 if out of host memory (nothing recorded). */
int vgpu_acct_track(struct vgpu_acct *a, uint64_t ptr, int dev, uint64_t bytes);

/* Forgets the allocation at ptr and gives its bytes back. Returns 0 with *dev
 * and *bytes set, or -1 if ptr is not tracked. */
int vgpu_acct_untrack(struct vgpu_acct *a, uint64_t ptr, int *dev, uint64_t *bytes);

/* Bytes in use on dev (0 for an out-of-range dev). */
uint64_t vgpu_acct_used(struct vgpu_acct *a, int dev);

#endif
