#include "region.h"

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "liveness.h"
#include "log.h"

static void set_err(char *err, size_t errlen, const char *path, const char *what)
{
    snprintf(err, errlen, "%s: %s", path, what);
}

static int init_lock(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int rc = pthread_mutexattr_init(&a);
    rc = rc ? rc : pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    rc = rc ? rc : pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    rc = rc ? rc : pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
}

_Static_assert(offsetof(struct vgpu_region, lock) == VGPU_REGION_HEADER_BYTES,
               "the header the node agent writes is magic, layout and size");

struct header {
    uint64_t magic;
    uint32_t layout, size;
};

/* Why a header is neither the agent's (magic, layout 0, size 0: "grow me") nor
 * this hook's own, or "" if it is one of them. */
static void judge_header(const struct header *h, char *why, size_t whylen)
{
    if (h->magic == 0 && h->layout == 0 && h->size == 0)
        snprintf(why, whylen, "its header is zeroed (not the node agent's, not this hook's layout)");
    else if (h->magic != VGPU_REGION_MAGIC)
        snprintf(why, whylen, "was not written for this hook (magic 0x%016llx, not 0x%016llx)",
                 (unsigned long long)h->magic, (unsigned long long)VGPU_REGION_MAGIC);
    else if (h->layout != 0 && h->layout != VGPU_REGION_LAYOUT)
        snprintf(why, whylen, "has layout %u, not this hook's layout %u", h->layout,
                 VGPU_REGION_LAYOUT);
    else if ((h->layout == 0) != (h->size == 0) ||
             (h->size != 0 && h->size != sizeof(struct vgpu_region)))
        snprintf(why, whylen, "says layout %u of %u bytes; this hook's layout %u is %zu bytes",
                 h->layout, h->size, VGPU_REGION_LAYOUT, sizeof(struct vgpu_region));
}

int vgpu_region_intact(const struct vgpu_region *r)
{
    return __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) == VGPU_REGION_MAGIC &&
           r->layout == VGPU_REGION_LAYOUT && r->size == sizeof *r;
}

struct vgpu_region *vgpu_region_open(const char *path, int create, char *err, size_t errlen)
{
    struct vgpu_region *r = MAP_FAILED;
    struct stat st;
    struct header h;
    char why[256] = "";
    /* O_NONBLOCK: a FIFO planted under the name cannot block the open. */
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (create ? O_CREAT : 0),
                  0666);
    if (fd < 0) {
        if (errno == ELOOP)
            set_err(err, errlen, path, "is a symbolic link (refused)");
        else if (errno == ENOENT && !create)
            set_err(err, errlen, path, "does not exist (the node agent creates it)");
        else
            set_err(err, errlen, path, strerror(errno));
        return NULL;
    }
    /* flock serialises first-time initialisation between processes starting
     * together; a crash releases it with the process. */
    if (flock(fd, LOCK_EX) != 0 || fstat(fd, &st) != 0) {
        snprintf(why, sizeof why, "%s", strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, sizeof why, "is not a regular file");
        goto out;
    }
    if (st.st_size == 0 && create) { /* ours to create: write the header the agent would */
        (void)fchmod(fd, 0666);      /* processes of the container may run as other users */
        h = (struct header){.magic = VGPU_REGION_MAGIC};
        if (pwrite(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
            snprintf(why, sizeof why, "cannot write its header: %s", strerror(errno));
            goto out;
        }
        st.st_size = sizeof h;
    }
    if (st.st_size == VGPU_REGION_HEADER_BYTES) { /* the header alone: grow it to our layout */
        if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
            snprintf(why, sizeof why, "cannot read its header: %s", strerror(errno));
            goto out;
        }
        judge_header(&h, why, sizeof why);
        if (!why[0] && h.size != 0)
            snprintf(why, sizeof why, "is only a header but says it is %u bytes", h.size);
        if (why[0])
            goto out;
        if (ftruncate(fd, sizeof *r) != 0) {
            snprintf(why, sizeof why, "cannot size it: %s", strerror(errno));
            goto out;
        }
    } else if (st.st_size != (off_t)sizeof *r) {
        snprintf(why, sizeof why,
                 "is %lld bytes: neither the node agent's %d-byte header nor the %zu of this "
                 "hook's layout",
                 (long long)st.st_size, VGPU_REGION_HEADER_BYTES, sizeof *r);
        goto out;
    }
    r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        snprintf(why, sizeof why, "cannot map it: %s", strerror(errno));
        goto out;
    }
    h = (struct header){.magic = r->magic, .layout = r->layout, .size = r->size};
    judge_header(&h, why, sizeof why);
    if (!why[0] && r->size == 0) { /* first user (or one that died before finishing) */
        if (init_lock(&r->lock) != 0) {
            snprintf(why, sizeof why, "cannot create its robust process-shared lock");
            goto out;
        }
        r->layout = VGPU_REGION_LAYOUT;
        __atomic_store_n(&r->size, (uint32_t)sizeof *r, __ATOMIC_RELEASE);
    }
    if (!why[0])
        vgpu_liveness_register(r, path, &st);
out:
    /* Explicitly: the mapping keeps the open file, and with it the flock, alive. */
    flock(fd, LOCK_UN);
    close(fd);
    if (why[0]) {
        set_err(err, errlen, path, why);
        if (r != MAP_FAILED)
            munmap(r, sizeof *r);
        return NULL;
    }
    return r;
}

struct vgpu_region *vgpu_region_private(void)
{
    struct vgpu_region *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED || init_lock(&r->lock) != 0)
        return NULL;
    r->magic = VGPU_REGION_MAGIC;
    r->layout = VGPU_REGION_LAYOUT;
    r->size = sizeof *r;
    return r;
}

uint64_t vgpu_process_start_time(pid_t pid)
{
    char path[64], buf[1024];
    /* Our own through "self": /proc may be another PID namespace's. */
    if (pid == getpid())
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Field 2 (comm) may hold spaces and parentheses: count from its end. */
    char *p = strrchr(buf, ')');
    unsigned long long start = 0;
    /* after ") ": state(3) ... starttime is field 22, the 20th after comm */
    if (!p || sscanf(p + 2,
                     "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d "
                     "%llu",
                     &start) != 1)
        return 0;
    return start;
}

/* Caller holds the lock; my_pidns: vgpu_pidns(). */
static int slot_alive(struct vgpu_region *r, int slot, uint32_t my_pidns)
{
    const struct vgpu_slot *s = &r->slots[slot];
    return vgpu_liveness_alive(r, slot, s->locked, s->pid, s->pidns, s->start_time, my_pidns);
}

/* Caller holds the lock. */
static void recompute_totals(struct vgpu_region *r)
{
    memset(r->used, 0, sizeof r->used);
    memset(r->spilled, 0, sizeof r->spilled);
    for (int i = 0; i < VGPU_REGION_SLOTS; i++)
        if (r->slots[i].pid)
            for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
                r->used[d] += r->slots[i].used[d];
                r->spilled[d] += r->slots[i].spilled[d];
            }
}

void vgpu_region_lock(struct vgpu_region *r)
{
    int rc = pthread_mutex_lock(&r->lock);
    if (rc == EOWNERDEAD) {
        recompute_totals(r);
        pthread_mutex_consistent(&r->lock);
        vgpu_log_error("a process died holding the shared accounting lock; recovered it");
    } else if (rc != 0) {
        /* Only possible if an owner died and recovery itself was interrupted
         * before marking the lock consistent. */
        vgpu_log_error("shared accounting lock unusable (%s); re-creating it", strerror(rc));
        init_lock(&r->lock);
        pthread_mutex_lock(&r->lock);
        recompute_totals(r);
    }
}

void vgpu_region_unlock(struct vgpu_region *r)
{
    pthread_mutex_unlock(&r->lock);
}

/* Caller holds the lock. Moves bytes on dev from one slot to another (the total stays). */
static void move_charge(struct vgpu_region *r, int from, int to, int dev, uint64_t bytes)
{
    uint64_t *f = &r->slots[from].used[dev];
    uint64_t b = bytes < *f ? bytes : *f;
    *f -= b;
    r->slots[to].used[dev] += b;
}

/* Caller holds the lock: slot holds no more references to e. */
static void shared_let_go(struct vgpu_region *r, struct vgpu_shared *e, int slot)
{
    e->holds[slot] = 0;
    if (e->owner != slot)
        return;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        if (e->holds[i] && r->slots[i].pid) {
            move_charge(r, slot, i, e->dev, e->bytes);
            e->owner = i;
            return;
        }
    }
    /* Nobody else holds it: the memory is gone. */
    uint64_t *u = &r->slots[slot].used[e->dev];
    uint64_t b = e->bytes < *u ? e->bytes : *u;
    *u -= b;
    r->used[e->dev] -= b < r->used[e->dev] ? b : r->used[e->dev];
    memset(e, 0, sizeof *e);
}

/* Caller holds the lock. */
static struct vgpu_shared *shared_find(struct vgpu_region *r, uint64_t key)
{
    for (int i = 0; key && i < VGPU_REGION_SHARED; i++)
        for (int k = 0; k < VGPU_SHARED_KEYS; k++)
            if (r->shared[i].keys[k] == key)
                return &r->shared[i];
    return NULL;
}

/* Caller holds the lock. */
static void free_slot(struct vgpu_region *r, int slot)
{
    struct vgpu_slot *s = &r->slots[slot];
    for (int i = 0; i < VGPU_REGION_SHARED; i++)
        if (r->shared[i].keys[0] && r->shared[i].holds[slot])
            shared_let_go(r, &r->shared[i], slot);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        r->used[d] -= s->used[d] < r->used[d] ? s->used[d] : r->used[d];
        s->used[d] = 0;
        r->spilled[d] -= s->spilled[d] < r->spilled[d] ? s->spilled[d] : r->spilled[d];
        s->spilled[d] = 0;
        atomic_store_explicit(&s->launches[d], 0, memory_order_relaxed);
    }
    for (int i = 0; i < VGPU_REGION_EXPORTS; i++)
        if (r->exports[i].hash && r->exports[i].slot == slot)
            r->exports[i].hash = 0;
    s->start_time = 0;
    s->pidns = 0;
    s->locked = 0;
    s->pid = 0;
}

/* Caller holds the lock. */
static int reap_locked(struct vgpu_region *r)
{
    int reaped = 0;
    uint32_t my_pidns = vgpu_pidns();
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        if (r->slots[i].pid && !slot_alive(r, i, my_pidns)) {
            free_slot(r, i);
            reaped++;
        }
    }
    return reaped;
}

int vgpu_region_has_process(struct vgpu_region *r, int32_t pid, uint32_t pidns)
{
    int found = 0;
    if (pid <= 0 || !pidns)
        return 0;
    vgpu_region_lock(r);
    for (int i = 0; i < VGPU_REGION_SLOTS && !found; i++)
        found = r->slots[i].pid == pid && r->slots[i].pidns == pidns && slot_alive(r, i, pidns);
    vgpu_region_unlock(r);
    return found;
}

int vgpu_region_reap(struct vgpu_region *r)
{
    vgpu_region_lock(r);
    int n = reap_locked(r);
    vgpu_region_unlock(r);
    return n;
}

int vgpu_region_attach(struct vgpu_region *r, pid_t pid)
{
    int slot = -1;
    uint64_t start = vgpu_process_start_time(pid);
    uint32_t pidns = vgpu_pidns();
    vgpu_region_lock(r);
    reap_locked(r);
    for (int i = 0; i < VGPU_REGION_SLOTS && slot < 0; i++) {
        if (!r->slots[i].pid) {
            slot = i;
            memset(r->slots[i].used, 0, sizeof r->slots[i].used);
            memset(r->slots[i].spilled, 0, sizeof r->slots[i].spilled);
            /* The lock before the pid: a reaper never sees the slot taken but unlocked. */
            r->slots[i].locked = pid == getpid() && vgpu_liveness_claim(r, i);
            r->slots[i].pidns = pidns;
            r->slots[i].start_time = start;
            r->slots[i].pid = pid;
        }
    }
    vgpu_region_unlock(r);
    return slot;
}

void vgpu_region_detach(struct vgpu_region *r, int slot)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS)
        return;
    vgpu_region_lock(r);
    free_slot(r, slot);
    vgpu_liveness_release(r, slot);
    vgpu_region_unlock(r);
}

static int fits(uint64_t used, uint64_t bytes, uint64_t limit)
{
    return limit == 0 || (bytes <= limit && used <= limit - bytes);
}

int vgpu_region_reserve(struct vgpu_region *r, int slot, int dev, uint64_t bytes, uint64_t limit,
                        uint64_t *used_before)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES) {
        if (used_before)
            *used_before = 0;
        return -1;
    }
    vgpu_region_lock(r);
    if (!vgpu_region_intact(r)) { /* overwritten since it was opened: its figures mean nothing */
        static int said;
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
            vgpu_log_error("the shared accounting region's header was overwritten while in use; "
                           "every allocation is refused");
        vgpu_region_unlock(r);
        if (used_before)
            *used_before = 0;
        return -1;
    }
    int ok = fits(r->used[dev], bytes, limit);
    if (!ok && reap_locked(r) > 0) /* what dead processes held may be enough */
        ok = fits(r->used[dev], bytes, limit);
    if (used_before)
        *used_before = r->used[dev];
    if (ok) {
        r->slots[slot].used[dev] += bytes;
        r->used[dev] += bytes;
    }
    vgpu_region_unlock(r);
    return ok ? 0 : -1;
}

void vgpu_region_release(struct vgpu_region *r, int slot, int dev, uint64_t bytes)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return;
    vgpu_region_lock(r);
    struct vgpu_slot *s = &r->slots[slot];
    uint64_t b = bytes < s->used[dev] ? bytes : s->used[dev];
    s->used[dev] -= b;
    r->used[dev] -= b < r->used[dev] ? b : r->used[dev];
    vgpu_region_unlock(r);
}

int vgpu_region_spill(struct vgpu_region *r, int slot, int dev, uint64_t bytes,
                      uint64_t host_limit)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return -1;
    vgpu_region_lock(r);
    uint64_t spilled = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        spilled += r->spilled[d];
    int ok = bytes <= host_limit && spilled <= host_limit - bytes;
    if (!ok && reap_locked(r) > 0) {
        spilled = 0;
        for (int d = 0; d < VGPU_MAX_DEVICES; d++)
            spilled += r->spilled[d];
        ok = bytes <= host_limit && spilled <= host_limit - bytes;
    }
    if (ok) {
        r->slots[slot].spilled[dev] += bytes;
        r->spilled[dev] += bytes;
    }
    vgpu_region_unlock(r);
    return ok ? 0 : -1;
}

void vgpu_region_unspill(struct vgpu_region *r, int slot, int dev, uint64_t bytes)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return;
    vgpu_region_lock(r);
    struct vgpu_slot *s = &r->slots[slot];
    uint64_t b = bytes < s->spilled[dev] ? bytes : s->spilled[dev];
    s->spilled[dev] -= b;
    r->spilled[dev] -= b < r->spilled[dev] ? b : r->spilled[dev];
    vgpu_region_unlock(r);
}

uint64_t vgpu_region_spilled(struct vgpu_region *r, int dev)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return 0;
    return __atomic_load_n(&r->spilled[dev], __ATOMIC_RELAXED);
}

uint64_t vgpu_region_used(struct vgpu_region *r, int dev)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return 0;
    return __atomic_load_n(&r->used[dev], __ATOMIC_RELAXED);
}

uint64_t vgpu_region_slot_used(struct vgpu_region *r, int slot, int dev)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return 0;
    return __atomic_load_n(&r->slots[slot].used[dev], __ATOMIC_RELAXED);
}

void vgpu_region_export_add(struct vgpu_region *r, int slot, uint64_t hash)
{
    if (!hash)
        return;
    vgpu_region_lock(r);
    for (int i = 0; i < VGPU_REGION_EXPORTS; i++) {
        if (!r->exports[i].hash) {
            r->exports[i].hash = hash;
            r->exports[i].slot = slot;
            break;
        } /* table full: importers count it again, which errs on the safe side */
    }
    vgpu_region_unlock(r);
}

int vgpu_region_export_known(struct vgpu_region *r, uint64_t hash)
{
    int known = 0;
    uint32_t my_pidns = vgpu_pidns();
    vgpu_region_lock(r);
    for (int i = 0; i < VGPU_REGION_EXPORTS && !known; i++)
        known = hash && r->exports[i].hash == hash && r->slots[r->exports[i].slot].pid &&
                slot_alive(r, r->exports[i].slot, my_pidns);
    vgpu_region_unlock(r);
    return known;
}

void vgpu_region_export_remove(struct vgpu_region *r, uint64_t hash)
{
    if (!hash)
        return;
    vgpu_region_lock(r);
    for (int i = 0; i < VGPU_REGION_EXPORTS; i++)
        if (r->exports[i].hash == hash)
            r->exports[i].hash = 0;
    vgpu_region_unlock(r);
}

int vgpu_region_share_add(struct vgpu_region *r, int slot, uint64_t key, int dev, uint64_t bytes)
{
    if (!key || slot < 0 || slot >= VGPU_REGION_SLOTS || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return -1;
    int rc = -1;
    vgpu_region_lock(r);
    struct vgpu_shared *e = shared_find(r, key);
    for (int i = 0; !e && i < VGPU_REGION_SHARED; i++) {
        if (!r->shared[i].keys[0]) {
            e = &r->shared[i];
            memset(e, 0, sizeof *e);
            e->keys[0] = key, e->bytes = bytes, e->dev = dev, e->owner = slot;
        }
    }
    if (e && e->holds[slot] < UINT16_MAX) {
        e->holds[slot]++;
        rc = 0;
    }
    vgpu_region_unlock(r);
    return rc;
}

int vgpu_region_share_alias(struct vgpu_region *r, uint64_t key, uint64_t alias)
{
    int rc = -1;
    vgpu_region_lock(r);
    struct vgpu_shared *e = shared_find(r, key);
    if (e && shared_find(r, alias) == e)
        rc = 0;
    for (int k = 0; e && rc && alias && k < VGPU_SHARED_KEYS; k++)
        if (!e->keys[k])
            e->keys[k] = alias, rc = 0;
    vgpu_region_unlock(r);
    return rc;
}

int vgpu_region_share_join(struct vgpu_region *r, int slot, uint64_t key, int *dev,
                           uint64_t *bytes)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS)
        return 0;
    vgpu_region_lock(r);
    struct vgpu_shared *e = shared_find(r, key);
    int found = e && e->holds[slot] < UINT16_MAX;
    if (found) {
        e->holds[slot]++;
        *dev = e->dev, *bytes = e->bytes;
    }
    vgpu_region_unlock(r);
    return found;
}

void vgpu_region_share_leave(struct vgpu_region *r, int slot, uint64_t key)
{
    if (slot < 0 || slot >= VGPU_REGION_SLOTS)
        return;
    vgpu_region_lock(r);
    struct vgpu_shared *e = shared_find(r, key);
    if (e && e->holds[slot] && --e->holds[slot] == 0)
        shared_let_go(r, e, slot);
    vgpu_region_unlock(r);
}
