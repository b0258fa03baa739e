/* Simulated CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * Devices come from VGPU_SIM_GPUS=<count>x<MiB> (default 1x40960). Device
 * memory is bookkeeping only: allocations get fake, increasing device
 * addresses and their sizes are recorded; nothing of that size is allocated
 * on the host. Like the real driver it returns CUDA_ERROR_NOT_INITIALIZED
 * before cuInit and CUDA_ERROR_OUT_OF_MEMORY when a device is full.
 * Thread-safe; contexts are per-thread current, as in CUDA. Simplifications:
 * no context stack, allocations belong to devices rather than contexts. */
#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_api.h"

#define SIM_EXPORT __attribute__((visibility("default")))
#define SIM_MAX_DEVICES 16
#define MIB (1024ull * 1024ull)
#define ALIGN 512ull

struct CUctx_st {
    CUdevice dev;
};

struct sim_alloc {
    CUdeviceptr ptr;
    size_t bytes;
    int dev;
    struct sim_alloc *next;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int initialized;
static int device_count;
static struct {
    size_t total, used;
    CUdeviceptr next;
} devices[SIM_MAX_DEVICES];
static struct sim_alloc *allocs; /* newest first */
static _Thread_local CUcontext current;

/* "<count>x<MiB>" */
static int parse_gpus(const char *spec, int *count, unsigned long long *mib)
{
    char *end;
    if (!isdigit((unsigned char)spec[0]))
        return -1;
    unsigned long n = strtoul(spec, &end, 10);
    if (*end != 'x' || n < 1 || n > SIM_MAX_DEVICES || !isdigit((unsigned char)end[1]))
        return -1;
    *mib = strtoull(end + 1, &end, 10);
    if (*end || *mib == 0 || *mib > (1ull << 24))
        return -1;
    *count = (int)n;
    return 0;
}

static CUresult check_init(void)
{
    return atomic_load(&initialized) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

static CUresult check_device(CUdevice dev)
{
    CUresult rc = check_init();
    return rc ? rc : dev >= 0 && dev < device_count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

SIM_EXPORT CUresult cuInit(unsigned int flags)
{
    CUresult rc = CUDA_SUCCESS;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!atomic_load(&initialized)) {
        const char *spec = getenv("VGPU_SIM_GPUS");
        unsigned long long mib;
        if (!spec || !*spec)
            spec = "1x40960";
        if (parse_gpus(spec, &device_count, &mib) != 0) {
            fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_GPUS='%s' (want <count>x<MiB>, e.g. 2x40960)\n",
                    spec);
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            for (int i = 0; i < device_count; i++) {
                devices[i].total = mib * MIB;
                devices[i].next = (CUdeviceptr)(i + 1) << 40;
            }
            atomic_store(&initialized, 1);
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = check_init();
    if (rc || !count)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *count = device_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = check_device(ordinal);
    if (rc || !device)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = check_device(dev);
    if (rc || !name || len <= 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "vGPU simulated device %d", dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = check_device(dev);
    if (rc || !bytes)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *bytes = devices[dev].total;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    CUresult rc = check_device(dev);
    if (rc || !pctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    CUcontext ctx = malloc(sizeof *ctx);
    if (!ctx)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ctx->dev = dev;
    *pctx = current = ctx;
    return CUDA_SUCCESS;
}

/* Other threads must not use ctx afterwards, as with the real driver. */
SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult rc = check_init();
    if (rc || !ctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (current == ctx)
        current = NULL;
    free(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    CUresult rc = check_init();
    if (rc || !device)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = current->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = check_init();
    if (rc)
        return rc;
    current = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CUresult rc = check_init();
    if (rc || !dptr || bytesize == 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_alloc *a = malloc(sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    int dev = current->dev;
    pthread_mutex_lock(&mu);
    if (bytesize > devices[dev].total - devices[dev].used) {
        pthread_mutex_unlock(&mu);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->ptr = devices[dev].next;
    a->bytes = bytesize;
    a->dev = dev;
    a->next = allocs;
    allocs = a;
    devices[dev].next += (bytesize + ALIGN - 1) / ALIGN * ALIGN;
    devices[dev].used += bytesize;
    pthread_mutex_unlock(&mu);
    *dptr = a->ptr;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CUresult rc = check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&mu);
    struct sim_alloc **link = &allocs, *a;
    while ((a = *link) && a->ptr != dptr)
        link = &a->next;
    if (a) {
        *link = a->next;
        devices[a->dev].used -= a->bytes;
    }
    pthread_mutex_unlock(&mu);
    free(a);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult rc = check_init();
    if (rc || !free_bytes || !total_bytes)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    *free_bytes = devices[current->dev].total - devices[current->dev].used;
    *total_bytes = devices[current->dev].total;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
