/* pthread_atfork handlers for the whole hook (fork.h). Registered once, from
 * a constructor: registering lazily, from an interposer, would take glibc's
 * atfork lock inside the hook's own paths. */
#include "fork.h"

#include <stdlib.h>
#include <time.h>

#include "liveness.h"
#include "log.h"

#define MAX_LOCKS 32

/* How long before fork waits for a leaf. Its holders never wait for anything
 * (fork.h), so only a fork from a signal handler that interrupted a holder on
 * the forking thread itself can run into it: that fork goes ahead without
 * the mutex, and the child re-initialises it, rather than hang forever. */
#define HOLD_WAIT_NS 1000000000L

static struct {
    pthread_mutex_t *mutex;
    int hold;
    int taken; /* by before_fork, this fork */
} locks[MAX_LOCKS];
static int lock_count;

void vgpu_fork_register(pthread_mutex_t *mutex, int hold)
{
    if (lock_count == MAX_LOCKS) {
        vgpu_log_error("more than %d fork-guarded mutexes: raise MAX_LOCKS in fork.c", MAX_LOCKS);
        abort();
    }
    locks[lock_count].mutex = mutex;
    locks[lock_count].hold = hold;
    lock_count++;
}

/* Leaves are never held while another is taken, so any order is deadlock-free. */
static void before_fork(void)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += HOLD_WAIT_NS % 1000000000L;
    deadline.tv_sec += HOLD_WAIT_NS / 1000000000L + deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    for (int i = 0; i < lock_count; i++)
        locks[i].taken = locks[i].hold && pthread_mutex_timedlock(locks[i].mutex, &deadline) == 0;
}

/* Default (non-robust, non-checking) mutexes: the child's only thread may
 * unlock what the forking thread locked. */
static void after_fork_in_parent(void)
{
    for (int i = 0; i < lock_count; i++)
        if (locks[i].taken)
            pthread_mutex_unlock(locks[i].mutex);
}

static void after_fork_in_child(void)
{
    for (int i = 0; i < lock_count; i++)
        if (locks[i].taken)
            pthread_mutex_unlock(locks[i].mutex);
        else
            pthread_mutex_init(locks[i].mutex, NULL);
    vgpu_state_after_fork_in_child();
    vgpu_relay_after_fork_in_child();
    vgpu_log_after_fork_in_child();
    vgpu_liveness_after_fork_in_child();
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}
