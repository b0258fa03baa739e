/* pthread_atfork handlers for the whole hook (fork.h). Registered once, from
 * a constructor: registering lazily, from an interposer, would take glibc's
 * atfork lock inside the hook's own paths. */
#include "fork.h"

#include <stddef.h>

/* Bounds of the section, provided by the linker. */
extern const struct vgpu_fork_lock __start_vgpu_fork_locks[] __attribute__((visibility("hidden")));
extern const struct vgpu_fork_lock __stop_vgpu_fork_locks[] __attribute__((visibility("hidden")));

/* At least one entry, so that the section (and its bounds) always exists. */
static pthread_mutex_t unused_mu = PTHREAD_MUTEX_INITIALIZER;
VGPU_FORK_LOCK(unused_mu, &unused_mu, VGPU_FORK_RANK_LEAF);

static void lock_all(void)
{
    for (int rank = 0; rank <= VGPU_FORK_RANK_MAX; rank++)
        for (const struct vgpu_fork_lock *l = __start_vgpu_fork_locks; l < __stop_vgpu_fork_locks;
             l++)
            if (l->rank == rank)
                pthread_mutex_lock(l->mutex);
}

/* Default (non-robust, non-checking) mutexes: the child's only thread may
 * unlock what the forking thread locked. */
static void unlock_all(void)
{
    for (const struct vgpu_fork_lock *l = __start_vgpu_fork_locks; l < __stop_vgpu_fork_locks; l++)
        pthread_mutex_unlock(l->mutex);
}

static void in_child(void)
{
    unlock_all();
    vgpu_state_after_fork_in_child();
    vgpu_relay_after_fork_in_child();
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(lock_all, unlock_all, in_child);
}
