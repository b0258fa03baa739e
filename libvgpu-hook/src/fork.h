/* Fork safety: the hook's process-private mutexes are held across fork, so a
 * child never inherits one locked by a thread it does not have (that child
 * hung forever at its next allocation; issue 13).
 *
 * A module declares each of its mutexes once, at file scope:
 *     VGPU_FORK_LOCK(primary_mu, &primary_mu, VGPU_FORK_RANK_OUTER);
 * Before fork the hook locks them all, lowest rank first (rank = lock order:
 * a mutex held while taking another has the lower rank); after fork both
 * parent and child unlock them. Leaves (held while taking no other registered
 * mutex) use VGPU_FORK_RANK_LEAF. Not registered: the region's robust,
 * process-shared lock (its owner may be another process, which releases it),
 * and mutexes only ever try-locked.
 *
 * Per-process state a child must not inherit is reset by the child handlers
 * listed in fork.c (a child's slot in the region, the relay thread). */
#ifndef VGPU_FORK_H
#define VGPU_FORK_H

#include <pthread.h>

struct vgpu_fork_lock {
    pthread_mutex_t *mutex;
    int rank;
};

enum { VGPU_FORK_RANK_OUTER = 0, VGPU_FORK_RANK_LEAF = 10, VGPU_FORK_RANK_MAX = 10 };

/* One entry in the "vgpu_fork_locks" section, which fork.c walks. */
#define VGPU_FORK_LOCK(id, mutex_ptr, lock_rank)                                               \
    __attribute__((used, section("vgpu_fork_locks"), aligned(sizeof(void *)))) static const  \
    struct vgpu_fork_lock vgpu_fork_lock_##id = {(mutex_ptr), (lock_rank)}

/* Child-side resets, called by fork.c's child handler (single-threaded child). */
void vgpu_state_after_fork_in_child(void);
void vgpu_relay_after_fork_in_child(void);

#endif
