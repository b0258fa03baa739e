/* The per-device process table of the simulated GPU (sim_procs.h). */
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_procs.h"

#define SLOT_OFFSET(i) ((off_t)offsetof(struct sim_proc_table, slot) + (off_t)(i) * 64)

_Static_assert(sizeof(struct sim_proc_slot) == 64, "slot layout is shared with the agent");
_Static_assert(offsetof(struct sim_proc_table, slot) == 64, "header layout is shared");

/* Who this process is, in terms that outlive PID reuse. */
static void identity(uint64_t *pidns, uint64_t *start)
{
    struct stat st;
    *pidns = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
    *start = 0;
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
    /* after ")": state is field 3; start time is field 22 */
    for (int field = 2; p && field < 22; field++)
        p = strchr(p + 1, ' ');
    if (p)
        *start = strtoull(p + 1, NULL, 10);
}

static int lock_slot(int fd, int i, int cmd, struct flock *fl)
{
    memset(fl, 0, sizeof *fl);
    fl->l_type = F_WRLCK;
    fl->l_whence = SEEK_SET;
    fl->l_start = SLOT_OFFSET(i);
    fl->l_len = 1;
    return fcntl(fd, cmd, fl);
}

static int map_table(struct sim_procs *p, const char *path)
{
    /* Never closed while the process lives: closing any descriptor of the file
     * would drop this process's lock, and with it its slot. */
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    (void)fchmod(fd, 0666); /* the creator's umask must not keep other users out */
    struct stat st;
    if (fstat(fd, &st) != 0 ||
        (st.st_size < (off_t)sizeof *p->table && ftruncate(fd, sizeof *p->table) != 0)) {
        close(fd);
        return -1;
    }
    void *m = mmap(NULL, sizeof *p->table, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return -1;
    }
    p->table = m;
    p->fd = fd;
    /* Every opener writes the same constants: no race to lose. */
    p->table->magic = SIM_PROCS_MAGIC;
    p->table->version = SIM_PROCS_VERSION;
    p->table->slots = SIM_PROCS_SLOTS;
    return 0;
}

int sim_procs_open(struct sim_procs *p, const char *state_dir, const char *uuid)
{
    memset(p, 0, sizeof *p);
    p->fd = -1;
    p->mine = -1;
    (void)mkdir(state_dir, 0777);
    snprintf(p->path, sizeof p->path, "%s/%s.procs", state_dir, uuid);
    if (map_table(p, p->path) == 0)
        return 0;
    fprintf(stderr, "vgpu-sim: cannot share %s (%s); NVML will not list processes of %s\n",
            p->path, strerror(errno), uuid);
    p->table = NULL;
    return -1;
}

static void take_slot(struct sim_procs *p)
{
    struct flock fl;
    uint64_t pidns, start;
    identity(&pidns, &start);
    p->mine = -1;
    for (int i = 0; i < SIM_PROCS_SLOTS; i++) {
        if (lock_slot(p->fd, i, F_SETLK, &fl) != 0)
            continue; /* a live process holds it */
        struct sim_proc_slot *s = &p->table->slot[i];
        atomic_store(&s->used_bytes, 0); /* what a dead owner left */
        atomic_store(&s->busy_ns, 0);
        s->pid = (int32_t)getpid();
        s->pidns_inode = pidns;
        s->start_ticks = start;
        p->mine = i;
        break;
    }
    p->mine_pid = (int)getpid();
    if (p->mine < 0)
        fprintf(stderr, "vgpu-sim: all %d process slots of a device are taken; this process "
                        "will not show in NVML\n", SIM_PROCS_SLOTS);
}

void sim_procs_charge(struct sim_procs *p, int64_t delta)
{
    if (!p->table)
        return;
    if (p->mine_pid != (int)getpid()) {
        take_slot(p); /* a forked child takes a slot of its own */
    } else if (p->mine >= 0 && fcntl(p->fd, F_GETFD) == -1) {
        /* The program closed our descriptor, and with it dropped our lock. */
        int fd = open(p->path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            p->fd = fd;
            take_slot(p);
        }
    }
    if (p->mine < 0)
        return;
    struct sim_proc_slot *s = &p->table->slot[p->mine];
    if (delta >= 0) {
        atomic_fetch_add(&s->used_bytes, (uint64_t)delta);
    } else {
        uint64_t old = atomic_load(&s->used_bytes), down = (uint64_t)-delta;
        while (!atomic_compare_exchange_weak(&s->used_bytes, &old, old > down ? old - down : 0)) {
        }
    }
}

void sim_procs_busy(struct sim_procs *p, uint64_t ns)
{
    if (p->table && p->mine >= 0 && p->mine_pid == (int)getpid())
        atomic_fetch_add(&p->table->slot[p->mine].busy_ns, ns);
}

uint64_t sim_procs_others_used(struct sim_procs *p)
{
    if (!p->table)
        return 0;
    uint64_t total = 0;
    int me = p->mine_pid == (int)getpid() ? p->mine : -1;
    for (int i = 0; i < SIM_PROCS_SLOTS; i++) {
        struct flock fl;
        struct sim_proc_slot *s = &p->table->slot[i];
        uint64_t used = atomic_load(&s->used_bytes);
        if (i == me || s->pid == 0 || used == 0 || lock_slot(p->fd, i, F_GETLK, &fl) != 0)
            continue;
        if (fl.l_type != F_UNLCK) /* held: its owner lives (in whatever PID namespace) */
            total += used;
    }
    return total;
}

int sim_procs_list(struct sim_procs *p, struct sim_proc_info *out, int max)
{
    if (!p->table)
        return 0;
    uint64_t my_ns = 0, my_start = 0;
    int me = (int)getpid(), known = 0, n = 0;
    for (int i = 0; i < SIM_PROCS_SLOTS; i++) {
        struct flock fl;
        struct sim_proc_slot *s = &p->table->slot[i];
        unsigned pid;
        if (s->pid == 0 || lock_slot(p->fd, i, F_GETLK, &fl) != 0)
            continue; /* never taken, or cannot tell */
        if (fl.l_type != F_UNLCK) {
            if (fl.l_pid <= 0)
                continue; /* outside the caller's PID namespace: it cannot name it */
            pid = (unsigned)fl.l_pid;
        } else {
            /* The caller's own lock never conflicts with itself: recognise its slot. */
            if (s->pid != me)
                continue;
            if (!known)
                identity(&my_ns, &my_start), known = 1;
            if (s->pidns_inode != my_ns || s->start_ticks != my_start)
                continue;
            pid = (unsigned)me;
        }
        if (n < max) {
            out[n].pid = pid;
            out[n].used_bytes = atomic_load(&s->used_bytes);
        }
        n++;
    }
    return n;
}
