#include "state.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fork.h"
#include "functions.h"
#include "log.h"

#define MIB (1024ull * 1024ull)

struct vgpu_config vgpu_cfg;
struct vgpu_region *vgpu_region;
struct vgpu_track vgpu_objects = VGPU_TRACK_INIT;

static int limits_known;
static pthread_once_t ready_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static int slot = -1;
static pid_t slot_pid;
VGPU_FORK_HOLD(slot_mu, &slot_mu);
VGPU_FORK_HOLD(objects_mu, &vgpu_objects.mu);

static void leave_region(void)
{
    pthread_mutex_lock(&slot_mu);
    if (slot >= 0 && slot_pid == getpid())
        vgpu_region_detach(vgpu_region, slot);
    slot = -1;
    pthread_mutex_unlock(&slot_mu);
}

/* A forked child is another process: it must not give back its parent's
 * holdings at exit, and takes its own slot if it uses CUDA. */
void vgpu_state_after_fork_in_child(void)
{
    slot = -1;
}

/* 0, or -1 when the limits cannot be enforced as the container's (logged). */
static int join_region(void)
{
    char path[4200], err[4400];
    snprintf(path, sizeof path, "%s/%s", vgpu_cfg.state_dir, VGPU_REGION_FILE);
    /* In a container the node agent made the file; only a bare host makes its own. */
    vgpu_region = vgpu_region_open(path, !vgpu_cfg.in_container, err, sizeof err);
    if (!vgpu_region && vgpu_cfg.in_container) {
        /* Per-process limits would multiply the container's slice: fail closed. */
        vgpu_log_error("cannot share accounting through %s; refusing to run: cuInit returns "
                       "CUDA_ERROR_INVALID_VALUE",
                       err);
        return -1;
    }
    if (!vgpu_region) {
        vgpu_log_error("cannot share accounting through %s; limits apply to each process alone",
                       err);
        vgpu_region = vgpu_region_private();
    }
    if (!vgpu_region) {
        vgpu_log_error("cannot map even a private accounting region; aborting");
        abort();
    }
    return 0;
}

/* Runs under ready_once, which other threads wait for: it must never call
 * into the loader (no REAL(), dlopen or dlsym), or a thread holding the loader
 * lock (a library constructor) that calls an interposer would wait for a
 * thread that waits for that lock. */
static void load(void)
{
    limits_known = vgpu_load_config(&vgpu_cfg) == 0 && join_region() == 0;
    if (!limits_known)
        return;
    atexit(leave_region);
}

int vgpu_ready(void)
{
    pthread_once(&ready_once, load);
    return limits_known;
}

int vgpu_slot(void)
{
    pthread_mutex_lock(&slot_mu);
    if (slot < 0) {
        slot_pid = getpid();
        slot = vgpu_region_attach(vgpu_region, slot_pid);
        if (slot < 0)
            vgpu_log_error("all %d process slots of the shared accounting region are taken by live "
                           "processes; allocations are refused",
                           VGPU_REGION_SLOTS);
    }
    int s = slot;
    pthread_mutex_unlock(&slot_mu);
    return s;
}

int vgpu_current(CUcontext *ctx, CUdevice *dev)
{
    vgpu_cuCtxGetCurrent_fn get_ctx = REAL(cuCtxGetCurrent);
    vgpu_cuCtxGetDevice_fn get_dev = REAL(cuCtxGetDevice);
    CUcontext c = NULL;
    if (!get_ctx || !get_dev || get_ctx(&c) != CUDA_SUCCESS || !c)
        return -1;
    if (get_dev(dev) != CUDA_SUCCESS || *dev < 0 || *dev >= VGPU_MAX_DEVICES)
        return -1;
    *ctx = c;
    return 0;
}

uint64_t vgpu_limit_bytes(int dev)
{
    return dev >= 0 && dev < VGPU_MAX_DEVICES ? vgpu_cfg.memory_mib[dev] * MIB : 0;
}

const char *vgpu_format_size(char *buf, size_t len, uint64_t bytes)
{
    if (bytes % MIB == 0)
        snprintf(buf, len, "%llu MiB", (unsigned long long)(bytes / MIB));
    else
        snprintf(buf, len, "%llu bytes", (unsigned long long)bytes);
    return buf;
}

CUresult vgpu_charge(int dev, uint64_t bytes)
{
    uint64_t limit = vgpu_limit_bytes(dev), used = 0;
    int s = vgpu_slot();
    if (s >= 0 && vgpu_region_reserve(vgpu_region, s, dev, bytes, limit, &used) == 0)
        return CUDA_SUCCESS;
    static struct vgpu_log_limit over_limit = VGPU_LOG_LIMIT("out of memory on device");
    char u[32], a[32], l[32];
    vgpu_log_error_limited(&over_limit, "out of memory on device %d: used %s + asked %s > limit %s",
                           dev, vgpu_format_size(u, sizeof u, used),
                           vgpu_format_size(a, sizeof a, bytes),
                           vgpu_format_size(l, sizeof l, limit));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void vgpu_uncharge(int dev, uint64_t bytes)
{
    vgpu_region_release(vgpu_region, vgpu_slot(), dev, bytes);
}

void vgpu_release_object(const struct vgpu_object *o, void *unused)
{
    (void)unused;
    if (o->export)
        vgpu_region_export_remove(vgpu_region, o->export);
    if (o->bytes)
        vgpu_uncharge(o->dev, o->bytes);
    if (o->kind == VGPU_LINEAR && (o->flags & VGPU_SPILLED))
        vgpu_region_unspill(vgpu_region, vgpu_slot(), o->dev, o->bytes);
}

uint64_t vgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
