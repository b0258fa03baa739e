/* Fork safety: a child never inherits one of the hook's mutexes locked by a
 * thread it does not have (such a child hung forever at its next allocation;
 * issue 13). Each process-private mutex is declared once, at file scope, as
 * one of two kinds:
 *
 *   VGPU_FORK_HOLD(id, &mutex)   a leaf: never held while calling the driver,
 *       NVML or anything else that may wait for another library's lock. Taken
 *       before fork (so what it guards is consistent in the child) and
 *       released after it, in parent and child. The wait for it is bounded
 *       (1 s; only a fork from a signal handler that interrupted its holder
 *       could need longer): past that, fork goes ahead without it and the
 *       child re-initialises it.
 *   VGPU_FORK_RESET(id, &mutex)  held across driver calls: taking it before
 *       fork could deadlock against the driver's own fork handlers, so the
 *       child re-initialises it instead (what it guards must be plain values
 *       that stay meaningful if an update was cut short).
 *
 * Not registered: the region's robust process-shared lock (its owner may be
 * another process, which releases it) and mutexes that are only try-locked.
 * Per-process state a child must not keep (its slot, the relay thread) is
 * reset by the child handlers listed in fork.c. */
#ifndef VGPU_FORK_H
#define VGPU_FORK_H

#include <pthread.h>

/* Registers a mutex (at load time, from a constructor: single-threaded). */
void vgpu_fork_register(pthread_mutex_t *mutex, int hold);

#define VGPU_FORK_ENTRY_(id, mutex_ptr, hold)                                                  \
    __attribute__((constructor)) static void vgpu_fork_register_##id(void)                     \
    {                                                                                          \
        vgpu_fork_register((mutex_ptr), (hold));                                               \
    }                                                                                          \
    _Static_assert(1, "")
#define VGPU_FORK_HOLD(id, mutex_ptr) VGPU_FORK_ENTRY_(id, mutex_ptr, 1)
#define VGPU_FORK_RESET(id, mutex_ptr) VGPU_FORK_ENTRY_(id, mutex_ptr, 0)

/* Child-side resets, called by fork.c's child handler (single-threaded child). */
void vgpu_state_after_fork_in_child(void);
void vgpu_relay_after_fork_in_child(void);

#endif
