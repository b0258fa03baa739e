/* Interposers of the initialisation and context family (cuda_context.def):
 * cuInit loads the limits and starts the relay; contexts are charged their
 * configured overhead and, when destroyed, give back everything made in them;
 * memory queries report the container's slice. */
#include <pthread.h>

#include "fork.h"
#include "functions.h"
#include "launch.h"
#include "log.h"
#include "memory.h"
#include "relay.h"
#include "state.h"

static int started;

static void check_device_count(void)
{
    vgpu_cuDeviceGetCount_fn get_count = REAL(cuDeviceGetCount);
    int count;
    if (vgpu_cfg.described_devices < 0 || !get_count || get_count(&count) != CUDA_SUCCESS)
        return;
    if (count > vgpu_cfg.described_devices)
        vgpu_log_error("the driver shows %d devices but the limit file describes %d; "
                       "devices %d and up are not limited",
                       count, vgpu_cfg.described_devices, vgpu_cfg.described_devices);
}

/* After the first successful cuInit: checks, and the relay to the node agent. */
static void start(void)
{
    check_device_count();
    vgpu_launch_init();
    vgpu_relay_start();
}

CUresult cuInit(unsigned int flags)
{
    REAL_OR_RETURN(cuInit);
    if (!vgpu_ready())
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = real(flags);
    /* The first to succeed starts; the others do not wait for it (no
     * once-lock: a cuInit from a library constructor, under the loader lock,
     * must not wait for a thread that may be waiting for the loader). */
    if (rc == CUDA_SUCCESS && !__atomic_exchange_n(&started, 1, __ATOMIC_ACQ_REL))
        start();
    return rc;
}

/* --- what the application is told about memory --------------------------------------------- */

/* Clamps the driver's figures for dev to the container's slice. */
static void clamp_to_slice(int dev, uint64_t *free_bytes, uint64_t *total_bytes)
{
    uint64_t limit = vgpu_limit_bytes(dev);
    if (limit == 0)
        return;
    vgpu_pools_refresh(dev); /* what pools gave back at synchronisations */
    uint64_t used = vgpu_region_used(vgpu_region, dev);
    uint64_t left = used < limit ? limit - used : 0;
    if (vgpu_cfg.virtual_memory[dev]) {
        /* What the card cannot hold spills: the whole slice is there to take. */
        *total_bytes = limit;
        *free_bytes = left;
        return;
    }
    if (*total_bytes > limit)
        *total_bytes = limit;
    if (*free_bytes > left)
        *free_bytes = left;
}

/* The same for the device of the current context (left alone when there is none). */
static void clamp_current_to_slice(uint64_t *free_bytes, uint64_t *total_bytes)
{
    CUcontext ctx;
    CUdevice dev;
    if (vgpu_current(&ctx, &dev) == 0)
        clamp_to_slice(dev, free_bytes, total_bytes);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    REAL_OR_RETURN(cuMemGetInfo_v2);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !free_bytes || !total_bytes)
        return rc;
    uint64_t f = *free_bytes, t = *total_bytes;
    clamp_current_to_slice(&f, &t);
    *free_bytes = f, *total_bytes = t;
    return rc;
}

CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    REAL_OR_RETURN(cuMemGetInfo);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !free_bytes || !total_bytes)
        return rc;
    uint64_t f = *free_bytes, t = *total_bytes;
    clamp_current_to_slice(&f, &t);
    *free_bytes = (unsigned int)f, *total_bytes = (unsigned int)t;
    return rc;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REAL_OR_RETURN(cuDeviceTotalMem_v2);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(bytes, dev);
    uint64_t limit = vgpu_limit_bytes(dev);
    if (rc == CUDA_SUCCESS && bytes && limit && (*bytes > limit || vgpu_cfg.virtual_memory[dev]))
        *bytes = limit;
    return rc;
}

CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    REAL_OR_RETURN(cuDeviceTotalMem);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(bytes, dev);
    uint64_t limit = vgpu_limit_bytes(dev);
    if (rc == CUDA_SUCCESS && bytes && limit && *bytes > limit)
        *bytes = (unsigned int)limit;
    return rc;
}

/* --- contexts ------------------------------------------------------------------------------ */

static uint64_t overhead_bytes(void)
{
    return vgpu_cfg.context_overhead_mib * MIB;
}

/* Charges a new context's overhead before the driver creates it. */
static CUresult before_context(CUdevice dev)
{
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= VGPU_MAX_DEVICES || overhead_bytes() == 0)
        return CUDA_SUCCESS;
    return vgpu_charge(dev, overhead_bytes());
}

static CUresult after_context(CUresult rc, CUdevice dev, CUcontext *pctx)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES || overhead_bytes() == 0)
        return rc;
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(dev, overhead_bytes());
        return rc;
    }
    struct vgpu_object o = {.kind = VGPU_CONTEXT, .key = (uint64_t)(uintptr_t)*pctx,
                            .bytes = overhead_bytes(), .dev = dev};
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory tracking a context on device %d", dev);
    return rc;
}

#define CREATE_CONTEXT(name, ...)                     \
    REAL_OR_RETURN(name);                             \
    CUresult rc = before_context(dev);                \
    if (rc != CUDA_SUCCESS)                           \
        return rc;                                    \
    return after_context(real(__VA_ARGS__), dev, pctx)

CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CREATE_CONTEXT(cuCtxCreate, pctx, flags, dev);
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CREATE_CONTEXT(cuCtxCreate_v2, pctx, flags, dev);
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags,
                        CUdevice dev)
{
    CREATE_CONTEXT(cuCtxCreate_v3, pctx, params, n, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                        CUdevice dev)
{
    CREATE_CONTEXT(cuCtxCreate_v4, pctx, params, flags, dev);
}

/* The driver frees everything made in a context with it. */
static void context_gone(CUcontext ctx)
{
    struct vgpu_object o;
    if (vgpu_track_remove(&vgpu_objects, VGPU_CONTEXT, (uint64_t)(uintptr_t)ctx, &o) == 0)
        vgpu_release_object(&o, NULL);
    vgpu_track_drop_context(&vgpu_objects, (uint64_t)(uintptr_t)ctx, vgpu_release_object, NULL);
}

CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    REAL_OR_RETURN(cuCtxDestroy_v2);
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS)
        context_gone(ctx);
    return rc;
}

CUresult cuCtxDestroy(CUcontext ctx)
{
    REAL_OR_RETURN(cuCtxDestroy);
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS)
        context_gone(ctx);
    return rc;
}

/* Primary contexts are reference-counted by the driver; the overhead is
 * charged on the first retain and given back when the count drops to zero. */
static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int refs;
    CUcontext ctx;
} primary[VGPU_MAX_DEVICES];
/* Held across driver calls. */
VGPU_FORK_RESET(primary_mu, &primary_mu);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REAL_OR_RETURN(cuDevicePrimaryCtxRetain);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return real(pctx, dev);
    pthread_mutex_lock(&primary_mu);
    CUresult rc = primary[dev].refs == 0 && overhead_bytes() ? vgpu_charge(dev, overhead_bytes())
                                                              : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        rc = real(pctx, dev);
        if (rc == CUDA_SUCCESS)
            primary[dev].refs++, primary[dev].ctx = *pctx;
        else if (primary[dev].refs == 0 && overhead_bytes())
            vgpu_uncharge(dev, overhead_bytes());
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* Called with primary_mu held after the driver released (reset=0) or reset it. */
static void primary_released(CUdevice dev, int reset)
{
    if (primary[dev].refs == 0)
        return;
    if (!reset && --primary[dev].refs > 0)
        return;
    primary[dev].refs = 0;
    if (overhead_bytes())
        vgpu_uncharge(dev, overhead_bytes());
    vgpu_track_drop_context(&vgpu_objects, (uint64_t)(uintptr_t)primary[dev].ctx,
                            vgpu_release_object, NULL);
}

#define PRIMARY(name, reset)                               \
    REAL_OR_RETURN(name);                                  \
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)                \
        return real(dev);                                  \
    pthread_mutex_lock(&primary_mu);                       \
    CUresult rc = real(dev);                               \
    if (rc == CUDA_SUCCESS)                                \
        primary_released(dev, reset);                      \
    pthread_mutex_unlock(&primary_mu);                     \
    return rc

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    PRIMARY(cuDevicePrimaryCtxRelease_v2, 0);
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    PRIMARY(cuDevicePrimaryCtxRelease, 0);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    PRIMARY(cuDevicePrimaryCtxReset_v2, 1);
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    PRIMARY(cuDevicePrimaryCtxReset, 1);
}

/* --- context limits ------------------------------------------------------------------------ */

/* Threads a device can hold at once, which each get CU_LIMIT_STACK_SIZE of stack. */
static uint64_t resident_threads(CUdevice dev)
{
    vgpu_cuDeviceGetAttribute_fn attr = REAL(cuDeviceGetAttribute);
    int sms = 0, per_sm = 0;
    if (!attr || attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
        attr(&per_sm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) != CUDA_SUCCESS ||
        sms <= 0 || per_sm <= 0)
        return 256ull * 2048; /* more than any GPU holds: the driver cannot say, so err high */
    return (uint64_t)sms * (uint64_t)per_sm;
}

/* Device memory a limit at `value` takes beyond what it took at `base` (the
 * value the context had when the hook first saw it, part of its overhead);
 * UINT64_MAX on overflow, which no limit admits. */
static uint64_t limit_bytes(CUlimit limit, uint64_t value, uint64_t base, CUdevice dev)
{
    uint64_t extra = value > base ? value - base : 0;
    if (limit != CU_LIMIT_STACK_SIZE || extra == 0)
        return extra;
    uint64_t threads = resident_threads(dev);
    return extra > UINT64_MAX / threads ? UINT64_MAX : extra * threads;
}

static int assign(struct vgpu_object *o, void *arg)
{
    *o = *(const struct vgpu_object *)arg;
    return 0;
}

static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;
VGPU_FORK_RESET(limit_mu, &limit_mu); /* held across driver calls (fork.h) */

/* The malloc heap, the printf FIFO and the stack (per resident thread) take
 * device memory: a larger limit is charged before the driver is asked, and
 * refused with CUDA_ERROR_OUT_OF_MEMORY when it does not fit. */
CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    REAL_OR_RETURN(cuCtxSetLimit);
    if (!vgpu_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext ctx;
    CUdevice dev;
    vgpu_cuCtxGetLimit_fn get = REAL(cuCtxGetLimit);
    if ((unsigned)limit > CU_LIMIT_MALLOC_HEAP_SIZE || vgpu_current(&ctx, &dev) != 0)
        return real(limit, value); /* takes no memory, or fails in the driver */
    pthread_mutex_lock(&limit_mu);
    size_t before = 0;
    int known = get && get(&before, limit) == CUDA_SUCCESS;
    struct vgpu_object o = {.kind = VGPU_CTX_LIMIT, .key = vgpu_limit_key((uintptr_t)ctx, limit),
                            .dev = dev, .ctx = (uintptr_t)ctx, .size = known ? before : 0};
    int tracked = vgpu_track_find(&vgpu_objects, VGPU_CTX_LIMIT, o.key, &o) == 0;
    uint64_t want = limit_bytes(limit, value, o.size, dev);
    uint64_t charged = want > o.bytes ? want - o.bytes : 0; /* on top of o.bytes */
    CUresult rc = charged ? vgpu_mem_charge(dev, charged) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&limit_mu);
        return rc;
    }
    rc = real(limit, value);
    size_t after = value;
    if (rc == CUDA_SUCCESS && get && get(&after, limit) == CUDA_SUCCESS &&
        limit_bytes(limit, after, o.size, dev) > want) {
        /* The driver rounded it up: that must fit too, else the old value comes back. */
        uint64_t more = limit_bytes(limit, after, o.size, dev) - want;
        if (vgpu_mem_charge(dev, more) == CUDA_SUCCESS) {
            want += more, charged += more;
        } else {
            real(limit, known ? before : 0);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(dev, charged);
    } else {
        if (want < o.bytes)
            vgpu_uncharge(dev, o.bytes - want);
        o.bytes = want;
        if (tracked)
            vgpu_track_update(&vgpu_objects, VGPU_CTX_LIMIT, o.key, assign, &o, NULL);
        else if (vgpu_track_add(&vgpu_objects, &o) != 0) /* charged for the life of the process */
            vgpu_log_error("out of host memory tracking a context limit on device %d", dev);
    }
    pthread_mutex_unlock(&limit_mu);
    return rc;
}
