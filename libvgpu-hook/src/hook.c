/* The interposers. libvgpu.so is LD_PRELOADed into GPU containers; its
 * exported cu* functions shadow the driver's, enforce the container's
 * device-memory limits, and call the real driver (real_cuda.h).
 *
 * What is intercepted is exactly the CUDA_HOOK entries of cuda_functions.def;
 * see ../README.md for what is knowingly not intercepted yet. */
#include <pthread.h>
#include <stdio.h>

#include "accounting.h"
#include "loader.h"
#include "log.h"
#include "real_cuda.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define MIB (1024ull * 1024ull)

/* Declarations of the interposers, generated from the one list: the only
 * symbols libvgpu.so exports (everything else is -fvisibility=hidden). */
#define CUDA_HOOK(name, ret, params) VGPU_EXPORT ret name params;
#define CUDA_CALL(name, ret, params)
#include "cuda_functions.def"

/* Per-process accounting only; the cross-process shared region (one budget
 * for all processes of a container) comes in a later issue. */
static struct vgpu_acct acct = VGPU_ACCT_INIT;

static struct vgpu_memory_limits limits;
static int limits_known;
static pthread_once_t limits_once = PTHREAD_ONCE_INIT;
static pthread_once_t device_check_once = PTHREAD_ONCE_INIT;

static void load_limits(void)
{
    limits_known = vgpu_load_memory_limits(&limits) == 0;
}

/* Limits are loaded by the first intercepted call, normally cuInit. Entry
 * points other than cuInit load them too, so no allocation ever runs
 * unchecked, even if cuInit reached the driver some other way. */
static int ensure_limits(void)
{
    pthread_once(&limits_once, load_limits);
    return limits_known;
}

static uint64_t limit_bytes(CUdevice dev)
{
    return dev >= 0 && dev < VGPU_MAX_DEVICES ? limits.mib[dev] * MIB : 0;
}

/* The device of the calling thread's current context; 0 without one. */
static CUdevice current_device(void)
{
    vgpu_cuCtxGetDevice_fn get_device = REAL(cuCtxGetDevice);
    CUdevice dev;
    return get_device && get_device(&dev) == CUDA_SUCCESS ? dev : 0;
}

static const char *format_size(char *buf, size_t len, uint64_t bytes)
{
    if (bytes % MIB == 0)
        snprintf(buf, len, "%llu MiB", (unsigned long long)(bytes / MIB));
    else
        snprintf(buf, len, "%llu bytes", (unsigned long long)bytes);
    return buf;
}

static void check_device_count(void)
{
    vgpu_cuDeviceGetCount_fn get_count = REAL(cuDeviceGetCount);
    int count;
    if (limits.described_devices < 0 || !get_count || get_count(&count) != CUDA_SUCCESS)
        return;
    if (count > limits.described_devices)
        vgpu_log_error("the driver shows %d devices but the limit file describes %d; "
                       "devices %d and up are not limited",
                       count, limits.described_devices, limits.described_devices);
}

/* Declares `real`, the real name; returns if the driver lacks it (logged). */
#define REAL_OR_RETURN(name)            \
    vgpu_##name##_fn real = REAL(name); \
    if (!real)                          \
        return CUDA_ERROR_NOT_FOUND

CUresult cuInit(unsigned int flags)
{
    REAL_OR_RETURN(cuInit);
    if (!ensure_limits())
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = real(flags);
    if (rc == CUDA_SUCCESS)
        pthread_once(&device_check_once, check_device_count);
    return rc;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    REAL_OR_RETURN(cuMemAlloc_v2);
    if (!ensure_limits())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUdevice dev = current_device();
    if (!dptr || bytesize == 0 || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return real(dptr, bytesize); /* nothing to account: the driver decides */

    uint64_t limit = limit_bytes(dev), used;
    if (vgpu_acct_reserve(&acct, dev, bytesize, limit, &used) != 0) {
        char u[32], a[32], l[32];
        vgpu_log_error("out of memory on device %d: used %s + asked %s > limit %s", dev,
                       format_size(u, sizeof u, used), format_size(a, sizeof a, bytesize),
                       format_size(l, sizeof l, limit));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real(dptr, bytesize);
    if (rc != CUDA_SUCCESS) {
        vgpu_acct_unreserve(&acct, dev, bytesize);
        return rc;
    }
    if (vgpu_acct_track(&acct, *dptr, dev, bytesize) != 0) {
        /* Cannot remember it, so cannot give it back later: undo. */
        vgpu_cuMemFree_v2_fn real_free = REAL(cuMemFree_v2);
        if (real_free)
            real_free(*dptr);
        vgpu_acct_unreserve(&acct, dev, bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    REAL_OR_RETURN(cuMemFree_v2);
    int dev;
    uint64_t bytes;
    /* Forget it before the driver can hand the address out again. */
    int tracked = vgpu_acct_untrack(&acct, dptr, &dev, &bytes) == 0;
    CUresult rc = real(dptr);
    if (rc != CUDA_SUCCESS && tracked) {
        /* Still allocated: put it back (unconditionally, it was charged before). */
        vgpu_acct_reserve(&acct, dev, bytes, 0, NULL);
        if (vgpu_acct_track(&acct, dptr, dev, bytes) != 0)
            vgpu_acct_unreserve(&acct, dev, bytes);
    }
    return rc;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    REAL_OR_RETURN(cuMemGetInfo_v2);
    if (!ensure_limits())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(free_bytes, total_bytes);
    CUdevice dev = current_device();
    uint64_t limit = limit_bytes(dev);
    if (rc != CUDA_SUCCESS || limit == 0 || !free_bytes || !total_bytes)
        return rc;
    uint64_t used = vgpu_acct_used(&acct, dev);
    uint64_t left = used < limit ? limit - used : 0;
    if (*total_bytes > limit)
        *total_bytes = limit;
    if (*free_bytes > left)
        *free_bytes = left;
    return rc;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REAL_OR_RETURN(cuDeviceTotalMem_v2);
    if (!ensure_limits())
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(bytes, dev);
    uint64_t limit = limit_bytes(dev);
    if (rc == CUDA_SUCCESS && bytes && limit && *bytes > limit)
        *bytes = limit;
    return rc;
}
