/* Interposers of memory pools and stream-ordered allocation (cuda_memory.def).
 *
 * A pool holds device memory beyond its live allocations: a free returns
 * memory to the pool, which keeps it until it is trimmed (cuMemPoolTrimTo),
 * its release threshold lets it go at a synchronisation, or the pool is
 * destroyed. So a pool, not each allocation, is charged: at least the bytes
 * of its live allocations, and whatever the driver says it reserves
 * (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) whenever the hook looks -- at each
 * allocation, trim, attribute change, cuMemGetInfo and before refusing an
 * allocation. An allocation that would take the pool past what is charged
 * charges the difference first, so the pool never holds more than the limit
 * allows.
 *
 * cuMemAllocAsync allocates from the current pool of the stream's device,
 * found through the stream's context; cuMemAllocFromPoolAsync from the
 * pool's device. Into a stream that is capturing a graph, both only add an
 * allocation node to the graph (and cuMemFreeAsync a free node): nothing is
 * taken then, and the graph's executable graphs are charged for it
 * (graph_memory.c). */
#include <pthread.h>

#include "fork.h"
#include "log.h"
#include "memory.h"

/* Serialises this process's pool bookkeeping (not the driver's allocations). */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
VGPU_FORK_RESET(pool_mu, &pool_mu); /* held across driver calls (fork.h) */

static int assign(struct vgpu_object *o, void *arg)
{
    *o = *(const struct vgpu_object *)arg;
    return 0;
}

static int drop(struct vgpu_object *o, void *arg)
{
    (void)o, (void)arg;
    return 1;
}

static uint64_t key_of(CUmemoryPool pool)
{
    return (uint64_t)(uintptr_t)pool;
}

/* The device of a pool: from cuMemPoolCreate, else the device whose default or
 * current pool it is. 0, or -1 if it cannot be told. */
static int pool_device(CUmemoryPool pool, int *dev)
{
    struct vgpu_object p;
    if (vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), &p) == 0) {
        *dev = p.dev;
        return 0;
    }
    vgpu_cuDeviceGetCount_fn count = REAL(cuDeviceGetCount);
    vgpu_cuDeviceGetDefaultMemPool_fn get_default = REAL(cuDeviceGetDefaultMemPool);
    vgpu_cuDeviceGetMemPool_fn get_current = REAL(cuDeviceGetMemPool);
    int n;
    if (!count || count(&n) != CUDA_SUCCESS)
        return -1;
    for (int d = 0; d < n && d < VGPU_MAX_DEVICES; d++) {
        CUmemoryPool q;
        if ((get_default && get_default(&q, d) == CUDA_SUCCESS && q == pool) ||
            (get_current && get_current(&q, d) == CUDA_SUCCESS && q == pool)) {
            *dev = d;
            return 0;
        }
    }
    return -1;
}

/* What the driver says the pool reserves. 0, or -1 if it cannot say. */
static int pool_reserved(CUmemoryPool pool, uint64_t *out)
{
    vgpu_cuMemPoolGetAttribute_fn get = REAL(cuMemPoolGetAttribute);
    cuuint64_t v = 0;
    if (!get || get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *out = v;
    return 0;
}

/* The pools this process has records of (under pool_mu), so that refreshing
 * them does not search the whole object table. A pool past the last entry is
 * not refreshed: its charge stays where it was, too high at worst. */
#define MAX_POOLS 256
static uint64_t pool_keys[MAX_POOLS];
static int pool_count;

/* Caller holds pool_mu. Records a pool object (0, or -1 if out of host memory). */
static int pool_add(struct vgpu_object *p)
{
    if (vgpu_track_add(&vgpu_objects, p) != 0)
        return -1;
    if (pool_count < MAX_POOLS)
        pool_keys[pool_count++] = p->key;
    return 0;
}

/* Caller holds pool_mu. Forgets a pool object. */
static void pool_drop(uint64_t key)
{
    vgpu_track_update(&vgpu_objects, VGPU_POOL, key, drop, NULL, NULL);
    for (int i = 0; i < pool_count; i++)
        if (pool_keys[i] == key) {
            pool_keys[i] = pool_keys[--pool_count];
            break;
        }
}

/* Caller holds pool_mu. The pool's record, made on first use. 0, or -1. */
static int pool_get(CUmemoryPool pool, int dev, struct vgpu_object *p)
{
    if (vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), p) == 0)
        return 0;
    *p = (struct vgpu_object){.kind = VGPU_POOL, .key = key_of(pool), .dev = dev};
    return pool_add(p);
}

static void pool_put(const struct vgpu_object *p)
{
    vgpu_track_update(&vgpu_objects, VGPU_POOL, p->key, assign, (void *)p, NULL);
}

/* Caller holds pool_mu. Charges the pool what the driver says it holds (else
 * `fallback`), never less than its live allocations. */
static void pool_settle(struct vgpu_object *p, uint64_t fallback)
{
    uint64_t r;
    if (p->flags & VGPU_POOL_DESTROYED)
        return; /* the driver no longer answers for it: kept until its last free */
    if (pool_reserved((CUmemoryPool)(uintptr_t)p->key, &r) != 0)
        r = fallback;
    if (r < p->size)
        r = p->size;
    if (r > p->bytes)
        vgpu_mem_force_charge(p->dev, r - p->bytes);
    else if (r < p->bytes)
        vgpu_uncharge(p->dev, p->bytes - r);
    p->bytes = r;
}

void vgpu_pools_refresh(int dev)
{
    struct vgpu_object p;
    pthread_mutex_lock(&pool_mu);
    for (int i = 0; i < pool_count; i++) {
        if (vgpu_track_find(&vgpu_objects, VGPU_POOL, pool_keys[i], &p) == 0 && p.dev == dev) {
            pool_settle(&p, p.bytes);
            pool_put(&p);
        }
    }
    pthread_mutex_unlock(&pool_mu);
}

void vgpu_pool_freed(uint64_t pool, uint64_t size)
{
    struct vgpu_object p;
    pthread_mutex_lock(&pool_mu);
    if (vgpu_track_find(&vgpu_objects, VGPU_POOL, pool, &p) == 0) {
        p.size -= size < p.size ? size : p.size;
        if ((p.flags & VGPU_POOL_DESTROYED) && p.size == 0) {
            /* The driver frees a destroyed pool with its last allocation. */
            vgpu_uncharge(p.dev, p.bytes);
            pool_drop(pool);
        } else {
            pool_put(&p);
        }
    }
    pthread_mutex_unlock(&pool_mu);
}

typedef CUresult (*pool_call)(void *args, CUdeviceptr *dptr);

/* Allocates bytes from pool (on dev) through call. */
static CUresult alloc_in_pool(CUmemoryPool pool, int dev, CUstream stream, CUdeviceptr *dptr,
                              size_t bytes, pool_call call, void *args)
{
    uint64_t limit = vgpu_limit_bytes(dev);
    struct vgpu_object p;
    if (limit && (bytes > limit || vgpu_region_used(vgpu_region, dev) > limit - bytes))
        vgpu_pools_refresh(dev);
    pthread_mutex_lock(&pool_mu);
    if (pool_get(pool, dev, &p) != 0) {
        pthread_mutex_unlock(&pool_mu);
        vgpu_log_error("out of host memory tracking a memory pool on device %d", dev);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* What the pool has free covers part of it; the rest is new memory. */
    uint64_t grow = p.size + bytes > p.bytes ? p.size + bytes - p.bytes : 0;
    CUresult rc = grow ? vgpu_charge(dev, grow) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        p.bytes += grow, p.size += bytes;
        pool_put(&p);
    }
    pthread_mutex_unlock(&pool_mu);
    if (rc != CUDA_SUCCESS)
        return rc;

    rc = call(args, dptr);

    pthread_mutex_lock(&pool_mu);
    vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), &p);
    uint64_t reserved;
    if (rc == CUDA_SUCCESS && pool_reserved(pool, &reserved) == 0 && reserved > p.bytes) {
        /* The pool took more than asked (its granularity): charge that too, or,
         * if it does not fit, give the allocation back and refuse it. */
        if (vgpu_charge(dev, reserved - p.bytes) == CUDA_SUCCESS) {
            p.bytes = reserved;
        } else {
            vgpu_cuMemFreeAsync_fn free_async = REAL(cuMemFreeAsync);
            if (free_async)
                free_async(*dptr, stream);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS) {
        p.size -= bytes < p.size ? bytes : p.size;
        pool_settle(&p, p.bytes); /* what the pool still reserves stays counted */
    } else {
        struct vgpu_object a = {.kind = VGPU_LINEAR, .key = *dptr, .dev = dev, .size = bytes,
                                .parent = key_of(pool)};
        if (vgpu_track_add(&vgpu_objects, &a) != 0) /* its pool stays charged for it */
            vgpu_log_error("out of host memory tracking a pool allocation on device %d", dev);
    }
    pool_put(&p);
    pthread_mutex_unlock(&pool_mu);
    return rc;
}

/* --- stream-ordered allocation --------------------------------------------------------------- */

#define CU_STREAM_PER_THREAD ((CUstream)0x2)

/* The graph the stream is capturing into, or NULL. A _ptsz entry point's
 * NULL stream is the calling thread's default stream. */
static CUgraph capturing(CUstream stream, int per_thread)
{
    vgpu_cuStreamGetCaptureInfo_v2_fn info = REAL(cuStreamGetCaptureInfo_v2);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUgraph graph = NULL;
    if (!stream && per_thread)
        stream = CU_STREAM_PER_THREAD;
    if (!info || info(stream, &status, NULL, &graph, NULL, NULL) != CUDA_SUCCESS ||
        status != CU_STREAM_CAPTURE_STATUS_ACTIVE)
        return NULL;
    return graph;
}

/* While capturing: an allocation node, recorded for the graph, not charged. */
static CUresult capture_alloc(CUgraph graph, int dev, CUdeviceptr *dptr, size_t bytes,
                              pool_call call, void *args)
{
    CUresult rc = call(args, dptr);
    if (rc == CUDA_SUCCESS)
        vgpu_graph_record_alloc(graph, dev, bytes, *dptr);
    return rc;
}

struct async_args {
    vgpu_cuMemAllocAsync_fn real;
    size_t bytes;
    CUstream stream;
};

static CUresult call_async(void *p, CUdeviceptr *dptr)
{
    struct async_args *a = p;
    return a->real(dptr, a->bytes, a->stream);
}

/* From the current pool of the stream's device. */
static CUresult alloc_async(vgpu_cuMemAllocAsync_fn real, CUdeviceptr *dptr, size_t bytes,
                            CUstream stream, int per_thread)
{
    READY_OR_RETURN();
    CUdevice dev;
    CUmemoryPool pool = NULL;
    vgpu_cuDeviceGetMemPool_fn get_pool = REAL(cuDeviceGetMemPool);
    if (!dptr || bytes == 0 || vgpu_stream_device(stream, &dev) != 0)
        return real(dptr, bytes, stream); /* nothing to account: the driver reports the error */
    if (!get_pool || get_pool(&pool, dev) != CUDA_SUCCESS || !pool) {
        vgpu_log_error("cannot find the memory pool of device %d; refusing cuMemAllocAsync", dev);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct async_args a = {real, bytes, stream};
    CUgraph graph = capturing(stream, per_thread);
    if (graph)
        return capture_alloc(graph, dev, dptr, bytes, call_async, &a);
    return alloc_in_pool(pool, dev, stream, dptr, bytes, call_async, &a);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocAsync);
    return alloc_async(real, dptr, bytesize, hStream, 0);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocAsync_ptsz);
    return alloc_async(real, dptr, bytesize, hStream, 1);
}

struct from_pool_args {
    vgpu_cuMemAllocFromPoolAsync_fn real;
    size_t bytes;
    CUmemoryPool pool;
    CUstream stream;
};

static CUresult call_from_pool(void *p, CUdeviceptr *dptr)
{
    struct from_pool_args *a = p;
    return a->real(dptr, a->bytes, a->pool, a->stream);
}

static CUresult alloc_from_pool(vgpu_cuMemAllocFromPoolAsync_fn real, CUdeviceptr *dptr,
                                size_t bytes, CUmemoryPool pool, CUstream stream, int per_thread)
{
    READY_OR_RETURN();
    int dev;
    if (!dptr || bytes == 0 || !pool ||
        (pool_device(pool, &dev) != 0 && vgpu_stream_device(stream, &dev) != 0))
        return real(dptr, bytes, pool, stream);
    struct from_pool_args a = {real, bytes, pool, stream};
    CUgraph graph = capturing(stream, per_thread);
    if (graph)
        return capture_alloc(graph, dev, dptr, bytes, call_from_pool, &a);
    return alloc_in_pool(pool, dev, stream, dptr, bytes, call_from_pool, &a);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocFromPoolAsync);
    return alloc_from_pool(real, dptr, bytesize, pool, hStream, 0);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocFromPoolAsync_ptsz);
    return alloc_from_pool(real, dptr, bytesize, pool, hStream, 1);
}

struct free_async_args {
    vgpu_cuMemFreeAsync_fn real;
    CUstream stream;
};

static CUresult call_free_async(void *p, CUdeviceptr dptr)
{
    struct free_async_args *a = p;
    return a->real(dptr, a->stream);
}

/* The memory goes back to its pool, which stays charged for it. While
 * capturing, a free node: it frees nothing until the graph runs, so what it
 * names stays charged (an allocation made outside the graph: until the
 * application frees it again or its context goes; counted too long, never too
 * short). */
static CUresult free_async(vgpu_cuMemFreeAsync_fn real, CUdeviceptr dptr, CUstream stream,
                           int per_thread)
{
    CUgraph graph = capturing(stream, per_thread);
    if (!graph) {
        struct free_async_args a = {real, stream};
        return vgpu_free_linear(dptr, call_free_async, &a);
    }
    CUresult rc = real(dptr, stream);
    if (rc == CUDA_SUCCESS)
        vgpu_graph_record_free(graph, dptr);
    return rc;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_RETURN(cuMemFreeAsync);
    return free_async(real, dptr, hStream, 0);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_RETURN(cuMemFreeAsync_ptsz);
    return free_async(real, dptr, hStream, 1);
}

/* --- pools ----------------------------------------------------------------------------------- */

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    REAL_OR_RETURN(cuMemPoolCreate);
    CUresult rc = real(pool, props);
    if (rc == CUDA_SUCCESS && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
        props->location.id >= 0 && props->location.id < VGPU_MAX_DEVICES) {
        struct vgpu_object o = {.kind = VGPU_POOL, .key = key_of(*pool), .dev = props->location.id};
        pthread_mutex_lock(&pool_mu);
        if (pool_add(&o) != 0)
            vgpu_log_error("out of host memory tracking a memory pool on device %d", o.dev);
        pthread_mutex_unlock(&pool_mu);
    }
    return rc;
}

/* The driver frees the pool's memory once its last allocation is freed. */
CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REAL_OR_RETURN(cuMemPoolDestroy);
    CUresult rc = real(pool);
    struct vgpu_object p;
    pthread_mutex_lock(&pool_mu);
    if (rc == CUDA_SUCCESS &&
        vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), &p) == 0) {
        if (p.size == 0) {
            vgpu_uncharge(p.dev, p.bytes);
            pool_drop(p.key);
        } else {
            p.flags |= VGPU_POOL_DESTROYED;
            pool_put(&p);
        }
    }
    pthread_mutex_unlock(&pool_mu);
    return rc;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    REAL_OR_RETURN(cuMemPoolTrimTo);
    CUresult rc = real(pool, minBytesToKeep);
    struct vgpu_object p;
    pthread_mutex_lock(&pool_mu);
    if (rc == CUDA_SUCCESS &&
        vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), &p) == 0) {
        pool_settle(&p, p.bytes < minBytesToKeep ? p.bytes : minBytesToKeep);
        pool_put(&p);
    }
    pthread_mutex_unlock(&pool_mu);
    return rc;
}

/* A new release threshold may let the pool give memory back (at the next synchronisation). */
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    REAL_OR_RETURN(cuMemPoolSetAttribute);
    CUresult rc = real(pool, attr, value);
    struct vgpu_object p;
    pthread_mutex_lock(&pool_mu);
    if (rc == CUDA_SUCCESS &&
        vgpu_track_find(&vgpu_objects, VGPU_POOL, key_of(pool), &p) == 0) {
        pool_settle(&p, p.bytes);
        pool_put(&p);
    }
    pthread_mutex_unlock(&pool_mu);
    return rc;
}
