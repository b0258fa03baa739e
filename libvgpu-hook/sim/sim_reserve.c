/* Simulated driver: device memory whose lifetime spans calls, modelled on the
 * real driver's rules so the hook's accounting of it can be tested.
 *
 * - VMM (cuMemCreate): an allocation lives while its handle is referenced
 *   (create, import and cuMemRetainAllocationHandle add a reference,
 *   cuMemRelease drops one) or any of it is mapped (cuMemMap / cuMemUnmap).
 *   cuMemExportToShareableHandle gives a POSIX file descriptor (a memfd
 *   describing the allocation: each export its own file) that another process
 *   imports with cuMemImportFromShareableHandle.
 * - Pools: an allocation from a pool grows the pool's reservation (in 2 MiB
 *   granules) when its free part is too small; a free returns memory to the
 *   pool, which keeps it. Reserved memory above the release threshold
 *   (default 0) is given back at the next synchronisation, all of it unused
 *   above minBytesToKeep by cuMemPoolTrimTo, the rest when the pool is
 *   destroyed and its last allocation freed. cuMemAllocAsync allocates on the
 *   stream's device from that device's current pool. Into a stream that is
 *   capturing a graph, cuMemAllocAsync and cuMemFreeAsync add allocation and
 *   free nodes to the graph instead (its memory is taken when it runs).
 * - Context limits: raising CU_LIMIT_MALLOC_HEAP_SIZE or
 *   CU_LIMIT_PRINTF_FIFO_SIZE above their defaults takes the difference;
 *   CU_LIMIT_STACK_SIZE takes it for every thread the device can hold
 *   (SMs x threads per SM). Given back with the context.
 * Graph memory is with the graphs, in sim_exec.c. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_cuda.h"

#define MIB (1024ull * 1024ull)
#define GRANULE (2 * MIB) /* the granularity the real driver reports for device memory */
#define EXPORT_MAGIC 0x5645585053494d31ull /* "VGPUSIMX" */
#define SIM_SMS 108                        /* an A100's */
#define SIM_THREADS_PER_SM 2048

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t round_up(uint64_t v, uint64_t to)
{
    return (v + to - 1) / to * to;
}

/* --- device attributes, context stack, streams -------------------------------------------- */

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pi)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        *pi = SIM_SMS;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
        *pi = SIM_THREADS_PER_SM;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

#define STACK_DEPTH 16
static _Thread_local CUcontext ctx_stack[STACK_DEPTH];
static _Thread_local int ctx_depth;

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult rc = sim_check_init();
    if (rc || !ctx || ctx_depth == STACK_DEPTH)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    ctx_stack[ctx_depth++] = sim_current;
    sim_current = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx)
        *pctx = sim_current;
    sim_current = ctx_depth > 0 ? ctx_stack[--ctx_depth] : NULL;
    return CUDA_SUCCESS;
}

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

SIM_EXPORT CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    CUresult rc = sim_check_init();
    if (rc || !pctx)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (hStream == NULL || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD) {
        if (!sim_current)
            return CUDA_ERROR_INVALID_CONTEXT;
        *pctx = sim_current;
    } else {
        *pctx = hStream->ctx;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx)
{
    return cuStreamGetCtx(hStream, pctx);
}

/* --- stream capture (memory nodes only) ---------------------------------------------------- */

static int special(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

SIM_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    CUresult rc = sim_check_init();
    if (rc || special(hStream) || (unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return rc ? rc : CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; /* the legacy stream cannot */
    if (hStream->capture)
        return CUDA_ERROR_INVALID_VALUE;
    return cuGraphCreate(&hStream->capture, 0);
}

SIM_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    CUresult rc = sim_check_init();
    if (rc || special(hStream) || !phGraph || !hStream->capture)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *phGraph = hStream->capture;
    hStream->capture = NULL;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *status,
                                              cuuint64_t *id, CUgraph *graph,
                                              const CUgraphNode **deps, size_t *numDeps)
{
    CUcontext ctx;
    CUresult rc = cuStreamGetCtx(hStream, &ctx);
    if (rc || !status)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    CUgraph g = special(hStream) ? NULL : hStream->capture;
    *status = g ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    if (id)
        *id = (uintptr_t)g;
    if (graph)
        *graph = g;
    if (deps)
        *deps = NULL;
    if (numDeps)
        *numDeps = 0;
    return CUDA_SUCCESS;
}

static CUgraph capturing(CUstream s)
{
    return special(s) ? NULL : s->capture;
}

/* An allocation node in the capture graph instead of an allocation. */
static CUresult capture_alloc(CUgraph g, CUdevice dev, CUdeviceptr *dptr, size_t bytes)
{
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    CUgraphNode node;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = dev;
    p.bytesize = bytes;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuGraphAddMemAllocNode(&node, g, NULL, 0, &p);
    if (rc == CUDA_SUCCESS)
        *dptr = p.dptr;
    return rc;
}

CUresult sim_stream_device(CUstream s, CUdevice *dev)
{
    CUcontext ctx;
    CUresult rc = cuStreamGetCtx(s, &ctx);
    if (rc == CUDA_SUCCESS)
        *dev = ctx->dev;
    return rc;
}

/* --- context limits ------------------------------------------------------------------------ */

static const size_t limit_default[3] = {
    [CU_LIMIT_STACK_SIZE] = 1024,
    [CU_LIMIT_PRINTF_FIFO_SIZE] = 1 * MIB,
    [CU_LIMIT_MALLOC_HEAP_SIZE] = 8 * MIB,
};

/* Device memory a limit of this value holds beyond what the context has anyway. */
static uint64_t limit_held(CUlimit limit, size_t value)
{
    if (value <= limit_default[limit])
        return 0;
    uint64_t extra = value - limit_default[limit];
    return limit == CU_LIMIT_STACK_SIZE ? extra * SIM_SMS * SIM_THREADS_PER_SM : extra;
}

static size_t limit_value(CUcontext ctx, CUlimit limit)
{
    return ctx->limits[limit] ? ctx->limits[limit] : limit_default[limit];
}

SIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((unsigned)limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return CUDA_ERROR_INVALID_VALUE;
    if (limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_SUCCESS; /* accepted, not modelled: they take no memory here */
    pthread_mutex_lock(&mu);
    uint64_t before = limit_held(limit, limit_value(sim_current, limit));
    uint64_t after = limit_held(limit, value);
    if (after > before)
        rc = sim_reserve(sim_current->dev, after - before);
    else
        sim_unreserve(sim_current->dev, before - after);
    if (rc == CUDA_SUCCESS)
        sim_current->limits[limit] = value;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    CUresult rc = sim_check_init();
    if (rc || !pvalue || (unsigned)limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    *pvalue = limit <= CU_LIMIT_MALLOC_HEAP_SIZE ? limit_value(sim_current, limit) : 0;
    return CUDA_SUCCESS;
}

void sim_ctx_limits_release(CUcontext ctx)
{
    pthread_mutex_lock(&mu);
    for (int l = CU_LIMIT_STACK_SIZE; l <= CU_LIMIT_MALLOC_HEAP_SIZE; l++)
        sim_unreserve(ctx->dev, limit_held((CUlimit)l, limit_value(ctx, (CUlimit)l)));
    pthread_mutex_unlock(&mu);
}

/* --- virtual memory management ------------------------------------------------------------ */

struct vmm {
    CUmemGenericAllocationHandle handle;
    size_t bytes;
    int dev, refs, maps;
    struct vmm *next;
};

struct mapping {
    CUdeviceptr va;
    size_t size;
    struct vmm *alloc;
    struct mapping *next;
};

static struct vmm *vmms;
static struct mapping *mappings;

/* Caller holds mu. */
static struct vmm *find_vmm(CUmemGenericAllocationHandle h)
{
    struct vmm *v = vmms;
    while (v && v->handle != h)
        v = v->next;
    return v;
}

/* Caller holds mu: frees the allocation once nothing references or maps it. */
static void maybe_free(struct vmm *v)
{
    if (v->refs > 0 || v->maps > 0)
        return;
    struct vmm **link = &vmms;
    while (*link != v)
        link = &(*link)->next;
    *link = v->next;
    sim_vmm_give(v->handle);
    free(v);
}

static CUresult new_vmm(int dev, size_t bytes, int charge, CUmemGenericAllocationHandle *handle)
{
    struct vmm *v = calloc(1, sizeof *v);
    if (!v)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = sim_vmm_take(dev, bytes, charge, &v->handle);
    if (rc) {
        free(v);
        return rc;
    }
    v->bytes = bytes, v->dev = dev, v->refs = 1;
    pthread_mutex_lock(&mu);
    v->next = vmms;
    vmms = v;
    pthread_mutex_unlock(&mu);
    *handle = v->handle;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc || !handle || !prop || flags || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if ((rc = sim_check_device(prop->location.id)))
        return rc;
    if (size == 0 || size % GRANULE)
        return CUDA_ERROR_INVALID_VALUE;
    return new_vmm(prop->location.id, size, 1, handle);
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&mu);
    struct vmm *v = find_vmm(handle);
    if (!v || v->refs == 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        v->refs--;
        maybe_free(v);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    CUresult rc = sim_check_init();
    if (rc || !prop)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct vmm *v = find_vmm(handle);
    if (v && v->refs > 0) {
        memset(prop, 0, sizeof *prop);
        prop->type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = v->dev;
    } else {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags)
{
    (void)alignment, (void)addr, (void)flags;
    static CUdeviceptr next_va = 0x7f0000000000ull;
    CUresult rc = sim_check_init();
    if (rc || !ptr || size == 0 || size % GRANULE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *ptr = next_va;
    next_va += size;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    (void)ptr, (void)size;
    return sim_check_init();
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc || flags || size == 0 || ptr % GRANULE || size % GRANULE || offset % GRANULE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    struct mapping *m = malloc(sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    struct vmm *v = find_vmm(handle);
    if (!v || v->refs == 0 || offset > v->bytes || size > v->bytes - offset)
        rc = CUDA_ERROR_INVALID_VALUE;
    for (struct mapping *o = mappings; o && rc == CUDA_SUCCESS; o = o->next)
        if (ptr < o->va + o->size && o->va < ptr + size)
            rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    if (rc == CUDA_SUCCESS) {
        *m = (struct mapping){.va = ptr, .size = size, .alloc = v, .next = mappings};
        mappings = m;
        v->maps++;
    }
    pthread_mutex_unlock(&mu);
    if (rc)
        free(m);
    return rc;
}

/* Unmaps every mapping that starts in [ptr, ptr + size). */
SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = sim_check_init();
    if (rc || size == 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    int found = 0;
    pthread_mutex_lock(&mu);
    struct mapping **link = &mappings, *m;
    while ((m = *link)) {
        if (m->va >= ptr && m->va - ptr < size) {
            *link = m->next;
            m->alloc->maps--;
            maybe_free(m->alloc);
            free(m);
            found++;
        } else {
            link = &m->next;
        }
    }
    pthread_mutex_unlock(&mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CUresult rc = sim_check_init();
    if (rc || !handle)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (struct mapping *m = mappings; m; m = m->next) {
        if (a >= m->va && a - m->va < m->size) {
            m->alloc->refs++;
            *handle = m->alloc->handle;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

struct export_payload {
    uint64_t magic, bytes;
    int32_t dev;
};

SIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle,
                                                 CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType,
                                                 unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc || !shareableHandle || flags)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    struct vmm *v = find_vmm(handle);
    struct export_payload p = {EXPORT_MAGIC, v ? v->bytes : 0, v ? v->dev : -1};
    pthread_mutex_unlock(&mu);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("vgpu-sim-vmm-export", MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (pwrite(fd, &p, sizeof p, 0) != (ssize_t)sizeof p) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

/* The importer maps the exporter's memory: a new handle that takes no device memory here
 * (memory is simulated per process; the exporter's process counts it). */
SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                   void *osHandle,
                                                   CUmemAllocationHandleType shHandleType)
{
    CUresult rc = sim_check_init();
    if (rc || !handle)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    struct export_payload p;
    int fd = (int)(intptr_t)osHandle;
    if (pread(fd, &p, sizeof p, 0) != (ssize_t)sizeof p || p.magic != EXPORT_MAGIC ||
        sim_check_device(p.dev) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    return new_vmm(p.dev, p.bytes, 0, handle);
}

/* --- memory pools and stream-ordered allocation --------------------------------------------- */

struct CUmemPoolHandle_st {
    CUdevice dev;
    uint64_t reserved, used, threshold;
    int destroyed;
    struct CUmemPoolHandle_st *next;
};

struct pool_alloc {
    CUdeviceptr dptr;
    size_t bytes;
    CUmemoryPool pool;
    struct pool_alloc *next;
};

static struct CUmemPoolHandle_st default_pools[SIM_MAX_DEVICES];
static CUmemoryPool current_pools[SIM_MAX_DEVICES];
static struct CUmemPoolHandle_st *pools; /* made with cuMemPoolCreate */
static struct pool_alloc *pool_allocs;

/* Caller holds mu. */
static CUmemoryPool default_pool(CUdevice dev)
{
    default_pools[dev].dev = dev;
    return &default_pools[dev];
}

/* Caller holds mu: gives back reserved memory above max(keep, what is in use). */
static void shrink(CUmemoryPool p, uint64_t keep)
{
    if (keep >= p->reserved)
        return;
    uint64_t floor = round_up(p->used, GRANULE);
    if (keep > floor)
        floor = round_up(keep, GRANULE);
    if (p->reserved > floor) {
        sim_unreserve(p->dev, p->reserved - floor);
        p->reserved = floor;
    }
}

/* Caller holds mu. */
static void maybe_drop_pool(CUmemoryPool p)
{
    if (!p->destroyed || p->used > 0)
        return;
    shrink(p, 0);
    struct CUmemPoolHandle_st **link = &pools;
    while (*link && *link != p)
        link = &(*link)->next;
    if (*link)
        *link = p->next;
    free(p);
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool)
{
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct pool_alloc *a = malloc(sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    if (pool->destroyed)
        rc = CUDA_ERROR_INVALID_VALUE;
    uint64_t need = round_up(pool->used + bytes, GRANULE);
    if (rc == CUDA_SUCCESS && need > pool->reserved) {
        rc = sim_reserve(pool->dev, need - pool->reserved);
        if (rc == CUDA_SUCCESS)
            pool->reserved = need;
    }
    if (rc == CUDA_SUCCESS)
        rc = sim_pool_address_take(pool->dev, bytes, dptr);
    if (rc == CUDA_SUCCESS) {
        pool->used += bytes;
        *a = (struct pool_alloc){.dptr = *dptr, .bytes = bytes, .pool = pool, .next = pool_allocs};
        pool_allocs = a;
    }
    pthread_mutex_unlock(&mu);
    if (rc)
        free(a);
    return rc;
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CUdevice dev;
    CUresult rc = sim_stream_device(hStream, &dev);
    if (rc)
        return rc;
    if (capturing(hStream))
        return capture_alloc(capturing(hStream), dev, dptr, bytesize);
    pthread_mutex_lock(&mu);
    CUmemoryPool pool = current_pools[dev] ? current_pools[dev] : default_pool(dev);
    pthread_mutex_unlock(&mu);
    return pool_alloc(dptr, bytesize, pool);
}

SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return cuMemAllocAsync(dptr, bytesize, hStream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream hStream)
{
    CUdevice dev;
    CUresult rc = sim_stream_device(hStream, &dev);
    if (rc || !pool)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (capturing(hStream))
        return capture_alloc(capturing(hStream), pool->dev, dptr, bytesize);
    return pool_alloc(dptr, bytesize, pool);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                 CUmemoryPool pool, CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
}

/* The memory goes back to its pool, which keeps it reserved. While capturing: a free
 * node (an allocation made before the capture stays, as the graph has not run). */
SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    CUdevice dev;
    CUgraphNode node;
    CUresult rc = sim_stream_device(hStream, &dev);
    if (rc)
        return rc;
    if (capturing(hStream))
        return cuGraphAddMemFreeNode(&node, capturing(hStream), NULL, 0, dptr);
    pthread_mutex_lock(&mu);
    struct pool_alloc **link = &pool_allocs, *a;
    while ((a = *link) && a->dptr != dptr)
        link = &a->next;
    if (a) {
        *link = a->next;
        a->pool->used -= a->bytes;
        sim_pool_address_give(dptr);
        maybe_drop_pool(a->pool);
    }
    pthread_mutex_unlock(&mu);
    free(a);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return cuMemFreeAsync(dptr, hStream);
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CUresult rc = sim_check_init();
    if (rc || !pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if ((rc = sim_check_device(props->location.id)))
        return rc;
    CUmemoryPool p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->dev = props->location.id;
    pthread_mutex_lock(&mu);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&mu);
    *pool = p;
    return CUDA_SUCCESS;
}

/* Its memory is given back once its last allocation is freed. */
SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult rc = sim_check_init();
    if (rc || !pool)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (pool == &default_pools[pool->dev])
        return CUDA_ERROR_INVALID_VALUE; /* a device's default pool cannot be destroyed */
    pthread_mutex_lock(&mu);
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (current_pools[d] == pool)
            current_pools[d] = NULL;
    pool->destroyed = 1;
    maybe_drop_pool(pool);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pool)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *pool = default_pool(dev);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pool)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *pool = current_pools[dev] ? current_pools[dev] : default_pool(dev);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CUresult rc = sim_check_device(dev);
    if (rc || !pool || pool->dev != dev || pool->destroyed)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    current_pools[dev] = pool;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CUresult rc = sim_check_init();
    if (rc || !pool || pool->destroyed)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    shrink(pool, minBytesToKeep);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr,
                                          void *value)
{
    CUresult rc = sim_check_init();
    if (rc || !pool || !value || pool->destroyed)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        pool->threshold = *(cuuint64_t *)value;
    else if (attr < CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES ||
             attr > CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr,
                                          void *value)
{
    CUresult rc = sim_check_init();
    if (rc || !pool || !value || pool->destroyed)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        *(cuuint64_t *)value = pool->threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
        *(cuuint64_t *)value = pool->reserved;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        *(cuuint64_t *)value = pool->used;
        break;
    default:
        rc = CUDA_ERROR_NOT_SUPPORTED;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

void sim_pools_sync(void)
{
    pthread_mutex_lock(&mu);
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (default_pools[d].reserved)
            shrink(&default_pools[d], default_pools[d].threshold);
    for (CUmemoryPool p = pools; p; p = p->next)
        shrink(p, p->threshold);
    pthread_mutex_unlock(&mu);
}
