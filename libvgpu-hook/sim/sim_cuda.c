/* Simulated CUDA driver (libcuda.so.1) for tests and `vgpu up` on machines
 * without a GPU: initialisation, devices, contexts and every kind of device
 * memory the hook accounts for. Execution (streams, events, kernels, graphs)
 * is in sim_exec.c, cuGetProcAddress in sim_procaddr.c.
 *
 * Device memory is bookkeeping only: allocations get fake, increasing device
 * addresses and their sizes are recorded per process; nothing of that size is
 * allocated on the host. Like the real driver it returns
 * CUDA_ERROR_NOT_INITIALIZED before cuInit and CUDA_ERROR_OUT_OF_MEMORY when a
 * device is full. Thread-safe; contexts are per-thread current, as in CUDA.
 * Simplifications: no context stack; allocations belong to devices, not
 * contexts. Kernel execution time is shared by all processes (sim_exec.c).
 * What each process holds is recorded in the device's shared process table
 * (sim_procs.h), which the simulated NVML lists as the real one would, and the
 * card's capacity is shared through it: an allocation fits only in what no
 * live process holds (checked, then taken: two processes racing for the last
 * bytes may both get them).
 *
 * Managed memory (cuMemAllocManaged) pages, within VGPU_SIM_HOST_MIB of host
 * memory per process (default 0: it must fit on the card, as before): the part
 * that fits on the card when it is allocated is resident there (and counts on
 * the device, in NVML), the rest stays on the host. At
 * every kernel launch, host-resident managed memory of the process whose
 * preferred location is a device (cuMemAdvise, or none given) pages onto that
 * device where it has room; a device allocation that does not fit first pages
 * the process's own managed memory out to the host. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_cuda.h"
#include "sim_procs.h"

#define MIB (1024ull * 1024ull)
#define ALIGN 512ull
#define IPC_MAGIC 0x5647505553494d31ull /* "VGPUSIM1" */

enum alloc_kind { LINEAR, ARRAY, MIPMAP, VMM, IMPORT, POOL };

struct sim_alloc {
    unsigned long long key; /* device pointer, or handle for arrays and VMM */
    size_t bytes;
    int dev, charged; /* charged: counts towards the device's used memory */
    /* Managed memory: bytes of it on the device (charged) and on the host, and its
     * preferred location (cuMemAdvise; -1 the host, -2 none given). */
    int managed, preferred;
    size_t resident, on_host;
    enum alloc_kind kind;
    struct sim_alloc *next;
};

struct CUarray_st {
    int unused;
};
struct CUmipmappedArray_st {
    int unused;
};

struct sim_config sim_cfg;
struct sim_timeline *sim_timelines[SIM_MAX_DEVICES];
_Thread_local CUcontext sim_current;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int initialized;
static struct {
    size_t total, used;
    CUdeviceptr next;
    struct CUctx_st *primary;
    int primary_refs;
} devices[SIM_MAX_DEVICES];
static struct sim_alloc *allocs; /* newest first */
static unsigned long long next_handle = 1;
static struct sim_procs procs[SIM_MAX_DEVICES]; /* what NVML lists per process (sim_procs.h) */
static _Atomic uint64_t managed_on_host; /* bytes of this process's managed memory on the host */

/* This process's device memory as the device sees it, whatever the hook saw.
 * Called with mu held, from every path that takes or gives charged memory. */
static void device_charge(int dev, int64_t delta)
{
    sim_procs_charge(&procs[dev], delta);
}

/* The process shows on the device from its first context, as on hardware. */
static void device_joined(int dev)
{
    pthread_mutex_lock(&mu);
    sim_procs_charge(&procs[dev], 0);
    pthread_mutex_unlock(&mu);
}

void sim_device_busy(int dev, uint64_t gpu_ns)
{
    sim_procs_busy(&procs[dev], gpu_ns);
}

CUresult sim_check_init(void)
{
    return atomic_load(&initialized) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_check_device(CUdevice dev)
{
    CUresult rc = sim_check_init();
    return rc                                              ? rc
           : dev >= 0 && dev < sim_cfg.device_count ? CUDA_SUCCESS
                                                     : CUDA_ERROR_INVALID_DEVICE;
}

SIM_EXPORT CUresult cuInit(unsigned int flags)
{
    CUresult rc = CUDA_SUCCESS;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!atomic_load(&initialized)) {
        if (sim_load_config(&sim_cfg) != 0) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            for (int i = 0; i < sim_cfg.device_count && rc == CUDA_SUCCESS; i++) {
                devices[i].total = sim_cfg.mib * MIB;
                devices[i].next = (CUdeviceptr)(i + 1) << 40;
                if (!(sim_timelines[i] = sim_timeline_open(&sim_cfg, i)))
                    rc = CUDA_ERROR_OUT_OF_MEMORY;
                else
                    (void)sim_procs_open(&procs[i], sim_cfg.state_dir, sim_cfg.uuid[i]);
            }
            if (rc == CUDA_SUCCESS)
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
    CUresult rc = sim_check_init();
    if (rc || !count)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *count = sim_cfg.device_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = sim_check_device(ordinal);
    if (rc || !device)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !name || len <= 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "vGPU simulated device %d", dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !bytes)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *bytes = devices[dev].total;
    return CUDA_SUCCESS;
}

/* Legacy 32-bit entry point: sizes over 4 GiB do not fit, as with the real one. */
SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
    return rc;
}

/* --- contexts ---------------------------------------------------------------------------- */

static CUresult new_context(CUcontext *pctx, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    CUcontext ctx = calloc(1, sizeof *ctx);
    if (!ctx)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ctx->dev = dev;
    ctx->null_stream.ctx = ctx;
    *pctx = sim_current = ctx;
    device_joined(dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    return new_context(pctx, dev);
}

SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return cuCtxCreate_v2(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                   unsigned int flags, CUdevice dev)
{
    (void)params;
    (void)n;
    return cuCtxCreate_v2(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                   CUdevice dev)
{
    (void)params;
    return cuCtxCreate_v2(pctx, flags, dev);
}

/* Other threads must not use ctx afterwards, as with the real driver. */
SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult rc = sim_check_init();
    if (rc || !ctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (sim_current == ctx)
        sim_current = NULL;
    sim_ctx_limits_release(ctx);
    free(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return cuCtxDestroy_v2(ctx);
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = sim_check_init();
    if (rc || !pctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *pctx = sim_current;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    sim_current = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    CUresult rc = sim_check_init();
    if (rc || !device)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = sim_current->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!devices[dev].primary) {
        CUcontext ctx = calloc(1, sizeof *ctx);
        if (ctx) {
            ctx->dev = dev;
            ctx->null_stream.ctx = ctx;
        }
        devices[dev].primary = ctx;
    }
    if (devices[dev].primary) {
        devices[dev].primary_refs++;
        device_charge(dev, 0);
    }
    *pctx = devices[dev].primary;
    pthread_mutex_unlock(&mu);
    return *pctx ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* The primary context stays allocated (threads may still have it current);
 * only its reference count drops, which is all callers can observe here. */
SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc)
        return rc;
    pthread_mutex_lock(&mu);
    rc = devices[dev].primary_refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (rc == CUDA_SUCCESS)
        devices[dev].primary_refs--;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return sim_check_device(dev);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return cuDevicePrimaryCtxReset_v2(dev);
}

/* --- memory ------------------------------------------------------------------------------ */

/* What the card has free: its memory less what this process and every other
 * live one hold on it. Called with mu held. */
static size_t device_free(int dev)
{
    uint64_t used = devices[dev].used;
    if (!sim_cfg.private_memory)
        used += sim_procs_others_used(&procs[dev]);
    return used < devices[dev].total ? devices[dev].total - used : 0;
}

/* Moves up to want bytes of this process's managed memory on dev between the card and
 * the host (out: to the host, within its room there). Called with mu held; returns the
 * bytes moved. */
static size_t page(int dev, size_t want, int out)
{
    size_t moved = 0;
    if (out) {
        uint64_t host = sim_cfg.host_mib * MIB, now = atomic_load(&managed_on_host);
        uint64_t room = now < host ? host - now : 0;
        want = want < room ? want : room;
    }
    for (struct sim_alloc *a = allocs; a && moved < want; a = a->next) {
        if (!a->managed || a->dev != dev)
            continue;
        size_t n = out ? a->resident : (a->preferred == -1 ? 0 : a->on_host);
        n = n < want - moved ? n : want - moved;
        if (!n)
            continue;
        if (out) {
            a->resident -= n, a->on_host += n;
            devices[dev].used -= n;
            device_charge(dev, -(int64_t)n);
            atomic_fetch_add(&managed_on_host, n);
        } else {
            a->resident += n, a->on_host -= n;
            devices[dev].used += n;
            device_charge(dev, (int64_t)n);
            atomic_fetch_sub(&managed_on_host, n);
        }
        moved += n;
    }
    return moved;
}

/* Whether bytes fit on dev, paging this process's managed memory out to make room
 * (as the driver evicts managed pages for a device allocation). Called with mu held. */
static int make_room(int dev, size_t bytes)
{
    size_t free_now = device_free(dev);
    if (bytes <= free_now)
        return 1;
    page(dev, bytes - free_now, 1);
    return bytes <= device_free(dev);
}

void sim_managed_page_in(void)
{
    if (!atomic_load_explicit(&managed_on_host, memory_order_relaxed))
        return; /* the common case: nothing to page, no lock */
    pthread_mutex_lock(&mu);
    for (int dev = 0; dev < sim_cfg.device_count; dev++) {
        size_t room = device_free(dev);
        if (room)
            page(dev, room, 0);
    }
    pthread_mutex_unlock(&mu);
}

/* Records an allocation of bytes on dev; *key gets a fresh device address
 * (linear kinds) or handle (others). */
static CUresult take(int dev, size_t bytes, enum alloc_kind kind, int charge,
                     unsigned long long *key)
{
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_alloc *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    if (charge && !make_room(dev, bytes)) {
        pthread_mutex_unlock(&mu);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (kind == ARRAY || kind == MIPMAP || kind == VMM) {
        a->key = next_handle++;
    } else {
        a->key = devices[dev].next;
        devices[dev].next += (bytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    a->bytes = bytes;
    a->dev = dev;
    a->charged = charge;
    a->kind = kind;
    a->resident = charge ? bytes : 0;
    a->next = allocs;
    allocs = a;
    if (charge) {
        devices[dev].used += bytes;
        device_charge(dev, (int64_t)bytes);
    }
    pthread_mutex_unlock(&mu);
    *key = a->key;
    return CUDA_SUCCESS;
}

static CUresult give(unsigned long long key, enum alloc_kind kind);

/* Managed memory: on the card as far as it fits now, the rest on the host. */
static CUresult take_managed(int dev, size_t bytes, CUdeviceptr *key)
{
    CUresult rc = take(dev, bytes, LINEAR, 0, key);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&mu);
    struct sim_alloc *a = allocs; /* take() put it first; other threads may have since */
    while (a->key != *key || a->kind != LINEAR)
        a = a->next;
    size_t room = device_free(dev);
    uint64_t host = sim_cfg.host_mib * MIB, on_host = atomic_load(&managed_on_host);
    size_t host_room = on_host < host ? host - on_host : 0;
    if (bytes > room && bytes - room > host_room) {
        /* Neither the card nor the host memory it may page to can hold it. */
        pthread_mutex_unlock(&mu);
        give(*key, LINEAR);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->managed = 1;
    a->preferred = -2;
    a->charged = 1;
    a->resident = bytes < room ? bytes : room;
    a->on_host = bytes - a->resident;
    devices[dev].used += a->resident;
    device_charge(dev, (int64_t)a->resident);
    atomic_fetch_add(&managed_on_host, a->on_host);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* Forgets the allocation; CUDA_ERROR_INVALID_VALUE if there is none. */
static CUresult give(unsigned long long key, enum alloc_kind kind)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&mu);
    struct sim_alloc **link = &allocs, *a;
    while ((a = *link) && !(a->key == key && a->kind == kind))
        link = &a->next;
    if (a) {
        *link = a->next;
        if (a->charged) {
            devices[a->dev].used -= a->resident;
            device_charge(a->dev, -(int64_t)a->resident);
        }
        if (a->on_host)
            atomic_fetch_sub(&managed_on_host, a->on_host);
    }
    pthread_mutex_unlock(&mu);
    free(a);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult current_device(int *dev)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *dev = sim_current->dev;
    return CUDA_SUCCESS;
}

static CUresult alloc_linear(CUdeviceptr *dptr, size_t bytes, enum alloc_kind kind)
{
    int dev;
    CUresult rc = current_device(&dev);
    if (rc || !dptr)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    return take(dev, bytes, kind, 1, dptr);
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_linear(dptr, bytesize, LINEAR);
}

/* Legacy 32-bit pointers cannot hold the simulated addresses (as on a real 64-bit GPU). */
SIM_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    (void)dptr;
    (void)bytesize;
    return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width,
                                       size_t height, unsigned int elementSize)
{
    if (!pPitch || width == 0 || height == 0 ||
        (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (width + ALIGN - 1) / ALIGN * ALIGN;
    CUresult rc = alloc_linear(dptr, pitch * height, LINEAR);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch,
                                    unsigned int width, unsigned int height,
                                    unsigned int elementSize)
{
    (void)dptr, (void)pPitch, (void)width, (void)height, (void)elementSize;
    return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != 0x2 /* CU_MEM_ATTACH_HOST */)
        return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult rc = current_device(&dev);
    if (rc || !dptr)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    return take_managed(dev, bytesize, dptr);
}

/* Whether an address is managed memory (the only attribute simulated). */
SIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
                                          CUdeviceptr ptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!data || attribute != CU_POINTER_ATTRIBUTE_IS_MANAGED)
        return CUDA_ERROR_INVALID_VALUE;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (struct sim_alloc *a = allocs; a; a = a->next) {
        if (a->kind == LINEAR && ptr >= a->key && ptr - a->key < a->bytes) {
            *(unsigned int *)data = (unsigned int)a->managed;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* Advice on managed memory only (the real driver refuses other memory); the preferred
 * location steers paging (see the top of this file). */
SIM_EXPORT CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice,
                                CUdevice device)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY ||
        count == 0 || (device != -1 /* CU_DEVICE_CPU */ && sim_check_device(device)))
        return CUDA_ERROR_INVALID_VALUE;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (struct sim_alloc *a = allocs; a; a = a->next) {
        if (a->managed && devPtr >= a->key && devPtr - a->key < a->bytes &&
            count <= a->bytes - (devPtr - a->key)) {
            if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION)
                a->preferred = device;
            else if (advice == CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION)
                a->preferred = -2;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return give(dptr, LINEAR);
}

SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    rc = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&mu);
    for (struct sim_alloc *a = allocs; a; a = a->next) {
        if (a->kind == ARRAY || a->kind == MIPMAP || a->kind == VMM)
            continue;
        if (dptr >= a->key && dptr - a->key < a->bytes) {
            if (pbase)
                *pbase = a->key;
            if (psize)
                *psize = a->bytes;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    int dev;
    CUresult rc = current_device(&dev);
    if (rc || !free_bytes || !total_bytes)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *free_bytes = device_free(dev);
    *total_bytes = devices[dev].total;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    size_t f, t;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free_bytes = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
        *total_bytes = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    }
    return rc;
}

/* --- arrays ------------------------------------------------------------------------------ */

static size_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels)
{
    size_t e = cuda_format_bytes(f);
    if (!e || w == 0 || (channels != 1 && channels != 2 && channels != 4))
        return 0;
    return w * (h ? h : 1) * (d ? d : 1) * e * channels;
}

static CUresult new_array(void **handle, size_t bytes, enum alloc_kind kind)
{
    int dev;
    unsigned long long key;
    CUresult rc = current_device(&dev);
    if (rc || !handle || bytes == 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    rc = take(dev, bytes, kind, 1, &key);
    if (rc == CUDA_SUCCESS)
        *handle = (void *)(uintptr_t)key;
    return rc;
}

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    size_t bytes = d ? array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels) : 0;
    return new_array((void **)pHandle, bytes, ARRAY);
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    size_t bytes = d ? array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels) : 0;
    return new_array((void **)pHandle, bytes, ARRAY);
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    (void)pHandle, (void)d;
    return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    (void)pHandle, (void)d;
    return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    return give((uint64_t)(uintptr_t)hArray, ARRAY);
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                           const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    size_t bytes = 0;
    if (d && levels > 0) {
        size_t w = d->Width, h = d->Height, z = d->Depth;
        for (unsigned i = 0; i < levels && w; i++) {
            bytes += array_bytes(w, h, z, d->Format, d->NumChannels);
            w = w > 1 ? w / 2 : 1, h = h > 1 ? h / 2 : h, z = z > 1 ? z / 2 : z;
        }
    }
    return new_array((void **)pHandle, bytes, MIPMAP);
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return give((uint64_t)(uintptr_t)h, MIPMAP);
}

/* --- for sim_reserve.c: memory whose lifetime spans calls ---------------------------------- */

CUresult sim_vmm_take(int dev, size_t bytes, int charge, CUmemGenericAllocationHandle *handle)
{
    return take(dev, bytes, VMM, charge, handle);
}

CUresult sim_vmm_give(CUmemGenericAllocationHandle handle)
{
    return give(handle, VMM);
}

CUresult sim_pool_address_take(int dev, size_t bytes, CUdeviceptr *dptr)
{
    return take(dev, bytes, POOL, 0, dptr);
}

CUresult sim_pool_address_give(CUdeviceptr dptr)
{
    return give(dptr, POOL);
}

CUresult sim_reserve(int dev, size_t bytes)
{
    CUresult rc = sim_check_device(dev);
    if (rc)
        return rc;
    pthread_mutex_lock(&mu);
    if (!make_room(dev, bytes)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        devices[dev].used += bytes;
        device_charge(dev, (int64_t)bytes);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

void sim_unreserve(int dev, size_t bytes)
{
    if (sim_check_device(dev))
        return;
    pthread_mutex_lock(&mu);
    uint64_t b = bytes < devices[dev].used ? bytes : devices[dev].used;
    devices[dev].used -= b;
    device_charge(dev, -(int64_t)b);
    pthread_mutex_unlock(&mu);
}

/* --- inter-process memory ---------------------------------------------------------------- */

struct ipc_payload {
    uint64_t magic, bytes;
    int32_t dev;
};

SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    CUdeviceptr base;
    size_t size;
    CUresult rc = cuMemGetAddressRange_v2(&base, &size, dptr);
    if (rc || !pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = (int)(base >> 40) - 1;
    struct ipc_payload p = {.magic = IPC_MAGIC, .bytes = size, .dev = dev};
    memset(pHandle, 0, sizeof *pHandle);
    memcpy(pHandle->reserved, &p, sizeof p);
    memcpy(pHandle->reserved + 32, &base, sizeof base); /* makes each handle distinct */
    return CUDA_SUCCESS;
}

/* Opening maps the exporter's memory: it takes no new device memory. */
SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                          unsigned int flags)
{
    (void)flags;
    struct ipc_payload p;
    memcpy(&p, handle.reserved, sizeof p);
    CUresult rc = sim_check_init();
    if (rc || !pdptr || p.magic != IPC_MAGIC || sim_check_device(p.dev) != CUDA_SUCCESS)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    return take(p.dev, p.bytes, IMPORT, 0, pdptr);
}

SIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                       unsigned int flags)
{
    return cuIpcOpenMemHandle_v2(pdptr, handle, flags);
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    return give(dptr, IMPORT);
}

/* A forked child must not inherit mu locked by a thread it does not have
 * (its first driver call would hang): held across fork, released on both sides. */
static void fork_lock(void)
{
    pthread_mutex_lock(&mu);
}

static void fork_unlock(void)
{
    pthread_mutex_unlock(&mu);
}

__attribute__((constructor)) static void sim_register_fork_handlers(void)
{
    pthread_atfork(fork_lock, fork_unlock, fork_unlock);
}
