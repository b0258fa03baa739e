#include "liveness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "region.h"

#define MAX_MAPPINGS 4

static struct mapping {
    struct vgpu_region *r; /* NULL: entry unused */
    char path[4200];
    dev_t dev;
    ino_t ino;
    int fd;     /* this process's own open file description, or -1 */
    pid_t pid;  /* the process that opened fd: a forked child opens its own */
    uint64_t held[VGPU_REGION_SLOTS / 64]; /* slots whose lock fd holds */
} mappings[MAX_MAPPINGS] = {[0 ... MAX_MAPPINGS - 1] = {.fd = -1}};

void vgpu_liveness_register(struct vgpu_region *r, const char *path, const struct stat *st)
{
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        struct mapping *m = &mappings[i];
        if (m->r)
            continue;
        snprintf(m->path, sizeof m->path, "%s", path);
        m->dev = st->st_dev, m->ino = st->st_ino;
        __atomic_store_n(&m->r, r, __ATOMIC_RELEASE);
        return;
    } /* more mappings than that (tests only): those slots are judged by pid */
}

static struct mapping *find(struct vgpu_region *r)
{
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (__atomic_load_n(&mappings[i].r, __ATOMIC_ACQUIRE) == r)
            return &mappings[i];
    return NULL;
}

static int same_file(int fd, const struct mapping *m)
{
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_dev == m->dev && st.st_ino == m->ino;
}

/* Drops a descriptor this process inherited (it is its parent's open file:
 * keeping it would keep the parent's locks alive after the parent died). */
static void forget_inherited(struct mapping *m)
{
    if (m->fd >= 0 && same_file(m->fd, m)) /* not a number the program reused */
        close(m->fd);
    m->fd = -1;
    memset(m->held, 0, sizeof m->held);
}

/* This process's descriptor of the region file: opened by path (checked to
 * be the mapped file), close-on-exec. -1 if it cannot be had. */
static int own_fd(struct mapping *m)
{
    if (m->fd >= 0 && m->pid == getpid())
        return m->fd;
    forget_inherited(m);
    int fd = open(m->path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd >= 0 && !same_file(fd, m)) { /* replaced since: not our region */
        close(fd);
        fd = -1;
    }
    m->fd = fd;
    m->pid = getpid();
    return fd;
}

static off_t lock_offset(int slot)
{
    return (off_t)(offsetof(struct vgpu_region, slots) + (size_t)slot * sizeof(struct vgpu_slot));
}

static int set_lock(int fd, int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = lock_offset(slot), .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

int vgpu_liveness_claim(struct vgpu_region *r, int slot)
{
    struct mapping *m = find(r);
    int fd = m ? own_fd(m) : -1;
    if (fd < 0 || set_lock(fd, slot, F_WRLCK) != 0)
        return 0;
    m->held[slot / 64] |= 1ull << (slot % 64);
    return 1;
}

int vgpu_liveness_mine(struct vgpu_region *r, int slot)
{
    struct mapping *m = find(r);
    return m && m->fd >= 0 && m->pid == getpid() && (m->held[slot / 64] >> (slot % 64)) & 1;
}

void vgpu_liveness_release(struct vgpu_region *r, int slot)
{
    if (!vgpu_liveness_mine(r, slot))
        return;
    struct mapping *m = find(r);
    set_lock(m->fd, slot, F_UNLCK);
    m->held[slot / 64] &= ~(1ull << (slot % 64));
}

/* Tested from a descriptor that holds no slot's lock in this process's view:
 * our own descriptor does not see its own locks, so our own slots are
 * answered from held[] first. */
static int lock_held(struct mapping *m, int slot)
{
    int fd = own_fd(m);
    if (fd < 0)
        return 1; /* cannot tell: alive */
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = lock_offset(slot), .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 1;
    return fl.l_type != F_UNLCK;
}

static int pid_alive(int32_t pid, uint64_t start_time)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    /* The pid exists (or we may not signal it): is it still the same process? */
    uint64_t start = vgpu_process_start_time(pid);
    return !(start && start_time && start != start_time);
}

int vgpu_liveness_alive(struct vgpu_region *r, int slot, int locked, int32_t pid, uint32_t pidns,
                        uint64_t start_time, uint32_t my_pidns)
{
    if (vgpu_liveness_mine(r, slot))
        return 1;
    if (locked) {
        struct mapping *m = find(r);
        return !m || lock_held(m, slot);
    }
    /* Without the lock only the pid is known, and it means this process only
     * in the namespace that recorded it. */
    if (!pidns || pidns != my_pidns)
        return 1;
    return pid_alive(pid, start_time);
}

uint32_t vgpu_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint32_t)st.st_ino : 0;
}

void vgpu_liveness_after_fork_in_child(void)
{
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (mappings[i].r && mappings[i].fd >= 0 && mappings[i].pid != getpid())
            forget_inherited(&mappings[i]);
}
