/* Interposers of the device-memory family (cuda_memory.def): every path that
 * takes device memory charges it to the container before the driver is asked
 * (so nothing ever exceeds the limit), and every path that gives it back
 * uncharges it. Legacy 32-bit entry points are refused. */
#include <string.h>

#include "functions.h"
#include "log.h"
#include "state.h"

#define MIB (1024ull * 1024ull)
#define PITCH_ALIGN 512ull /* the real driver's pitch alignment on current GPUs */

/* Declares `real`, the real function; returns if the driver lacks it. */
#define REAL_OR_RETURN(name)            \
    vgpu_##name##_fn real = REAL(name); \
    if (!real)                          \
        return CUDA_ERROR_NOT_FOUND

#define READY_OR_RETURN()    \
    if (!vgpu_ready())       \
    return CUDA_ERROR_NOT_INITIALIZED

/* After the driver answered an allocation that was charged beforehand:
 * remember it on success, give the charge back on failure. */
static CUresult settle(CUresult rc, enum vgpu_kind kind, uint64_t key, int dev, uint64_t bytes,
                       CUcontext ctx)
{
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(dev, bytes);
        return rc;
    }
    struct vgpu_object o = {.kind = kind, .key = key, .bytes = bytes, .dev = dev,
                            .ctx = (uint64_t)(uintptr_t)ctx};
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        /* It stays charged for the life of the process: safe, if pessimistic. */
        vgpu_log_error("out of host memory tracking an allocation of %llu bytes on device %d",
                       (unsigned long long)bytes, dev);
    return rc;
}

/* Gives back an object the driver has just released. */
static void forget(enum vgpu_kind kind, uint64_t key)
{
    struct vgpu_object o;
    if (vgpu_track_remove(&vgpu_objects, kind, key, &o) == 0)
        vgpu_release_object(&o, NULL);
}

static CUresult refuse_legacy(const char *name)
{
    vgpu_log_error("%s (legacy 32-bit entry point) is refused under vgpu: use %s_v2", name, name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* --- linear memory ------------------------------------------------------------------------- */

typedef CUresult (*alloc_call)(void *args, CUdeviceptr *dptr);

/* Charges bytes on the current context's device, then lets call allocate. */
static CUresult alloc_linear(CUdeviceptr *dptr, size_t bytes, alloc_call call, void *args)
{
    READY_OR_RETURN();
    CUcontext ctx;
    CUdevice dev;
    if (!dptr || bytes == 0 || vgpu_current(&ctx, &dev) != 0)
        return call(args, dptr); /* nothing to account: the driver reports the error */
    CUresult rc = vgpu_charge(dev, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = call(args, dptr);
    return settle(rc, VGPU_LINEAR, rc == CUDA_SUCCESS ? *dptr : 0, dev, bytes, ctx);
}

struct plain_args {
    vgpu_cuMemAlloc_v2_fn real;
    size_t bytes;
};

static CUresult call_plain(void *p, CUdeviceptr *dptr)
{
    struct plain_args *a = p;
    return a->real(dptr, a->bytes);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    REAL_OR_RETURN(cuMemAlloc_v2);
    struct plain_args a = {real, bytesize};
    return alloc_linear(dptr, bytesize, call_plain, &a);
}

CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    (void)dptr, (void)bytesize;
    return refuse_legacy("cuMemAlloc");
}

struct managed_args {
    vgpu_cuMemAllocManaged_fn real;
    size_t bytes;
    unsigned flags;
};

static CUresult call_managed(void *p, CUdeviceptr *dptr)
{
    struct managed_args *a = p;
    return a->real(dptr, a->bytes, a->flags);
}

/* Managed memory is charged in full to the current device: it may live there. */
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    REAL_OR_RETURN(cuMemAllocManaged);
    struct managed_args a = {real, bytesize, flags};
    return alloc_linear(dptr, bytesize, call_managed, &a);
}

/* The pitch is only known afterwards: charge the aligned estimate, then settle
 * the difference (refusing, and freeing, if the real pitch does not fit). */
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height,
                            unsigned int elementSize)
{
    REAL_OR_RETURN(cuMemAllocPitch_v2);
    READY_OR_RETURN();
    CUcontext ctx;
    CUdevice dev;
    if (!dptr || !pPitch || width == 0 || height == 0 || width > SIZE_MAX - PITCH_ALIGN ||
        vgpu_current(&ctx, &dev) != 0)
        return real(dptr, pPitch, width, height, elementSize);
    uint64_t pitch = (width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    if (pitch > UINT64_MAX / height)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t estimate = pitch * height;
    CUresult rc = vgpu_charge(dev, estimate);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, pPitch, width, height, elementSize);
    if (rc != CUDA_SUCCESS)
        return settle(rc, VGPU_LINEAR, 0, dev, estimate, ctx);
    uint64_t actual = (uint64_t)*pPitch * height;
    if (actual > estimate && vgpu_charge(dev, actual - estimate) != CUDA_SUCCESS) {
        vgpu_cuMemFree_v2_fn real_free = REAL(cuMemFree_v2);
        if (real_free)
            real_free(*dptr);
        vgpu_uncharge(dev, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate)
        vgpu_uncharge(dev, estimate - actual);
    return settle(rc, VGPU_LINEAR, *dptr, dev, actual, ctx);
}

CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int width,
                         unsigned int height, unsigned int elementSize)
{
    (void)dptr, (void)pPitch, (void)width, (void)height, (void)elementSize;
    return refuse_legacy("cuMemAllocPitch");
}

/* Forgets the allocation before the driver can hand its address out again;
 * puts it back if the driver refuses to free it. */
static CUresult free_linear(CUdeviceptr dptr, CUresult (*call)(void *, CUdeviceptr), void *args)
{
    struct vgpu_object o;
    int tracked = vgpu_track_remove(&vgpu_objects, VGPU_LINEAR, dptr, &o) == 0;
    CUresult rc = call(args, dptr);
    if (tracked && rc == CUDA_SUCCESS)
        vgpu_release_object(&o, NULL);
    else if (tracked && vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory re-tracking an allocation on device %d", o.dev);
    return rc;
}

static CUresult call_free(void *p, CUdeviceptr dptr)
{
    return ((vgpu_cuMemFree_v2_fn)p)(dptr);
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    REAL_OR_RETURN(cuMemFree_v2);
    return free_linear(dptr, call_free, (void *)real);
}

/* --- stream-ordered allocation and pools --------------------------------------------------- */

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

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocAsync);
    struct async_args a = {real, bytesize, hStream};
    return alloc_linear(dptr, bytesize, call_async, &a);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocAsync_ptsz);
    struct async_args a = {real, bytesize, hStream};
    return alloc_linear(dptr, bytesize, call_async, &a);
}

/* Pools made with cuMemPoolCreate allocate on their own device; others (a
 * device's default pool) on the current context's. */
static CUresult alloc_from_pool(vgpu_cuMemAllocFromPoolAsync_fn real, CUdeviceptr *dptr,
                                size_t bytes, CUmemoryPool pool, CUstream stream)
{
    READY_OR_RETURN();
    CUcontext ctx;
    CUdevice dev;
    struct vgpu_object p;
    int have_ctx = vgpu_current(&ctx, &dev) == 0;
    if (vgpu_track_find(&vgpu_objects, VGPU_POOL, (uint64_t)(uintptr_t)pool, &p) == 0)
        dev = p.dev;
    else if (!have_ctx)
        return real(dptr, bytes, pool, stream);
    if (!have_ctx)
        ctx = NULL;
    if (!dptr || bytes == 0)
        return real(dptr, bytes, pool, stream);
    CUresult rc = vgpu_charge(dev, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytes, pool, stream);
    return settle(rc, VGPU_LINEAR, rc == CUDA_SUCCESS ? *dptr : 0, dev, bytes, ctx);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocFromPoolAsync);
    return alloc_from_pool(real, dptr, bytesize, pool, hStream);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream)
{
    REAL_OR_RETURN(cuMemAllocFromPoolAsync_ptsz);
    return alloc_from_pool(real, dptr, bytesize, pool, hStream);
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

/* Given back when the free is queued: later allocations are ordered after it
 * on the stream, or wait for it, so the pool never holds both at once for us. */
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_RETURN(cuMemFreeAsync);
    struct free_async_args a = {real, hStream};
    return free_linear(dptr, call_free_async, &a);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_RETURN(cuMemFreeAsync_ptsz);
    struct free_async_args a = {real, hStream};
    return free_linear(dptr, call_free_async, &a);
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    REAL_OR_RETURN(cuMemPoolCreate);
    CUresult rc = real(pool, props);
    if (rc == CUDA_SUCCESS && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
        props->location.id >= 0 && props->location.id < VGPU_MAX_DEVICES) {
        struct vgpu_object o = {.kind = VGPU_POOL, .key = (uint64_t)(uintptr_t)*pool,
                                .dev = props->location.id};
        vgpu_track_add(&vgpu_objects, &o);
    }
    return rc;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REAL_OR_RETURN(cuMemPoolDestroy);
    CUresult rc = real(pool);
    if (rc == CUDA_SUCCESS)
        forget(VGPU_POOL, (uint64_t)(uintptr_t)pool);
    return rc;
}

/* --- arrays -------------------------------------------------------------------------------- */

/* Formats the header does not name (packed, compressed, video) are charged 16 bytes per
 * channel, more than any of them takes. */
static uint64_t format_bytes(CUarray_format f)
{
    size_t known = cuda_format_bytes(f);
    return known ? known : 16;
}

/* 0 when the descriptor is invalid (the driver will refuse it) or overflows. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f,
                            unsigned channels)
{
    uint64_t b = format_bytes(f) * (channels ? channels : 1);
    uint64_t dims[3] = {w, h ? h : 1, d ? d : 1};
    if (w == 0)
        return 0;
    for (int i = 0; i < 3; i++) {
        if (dims[i] > UINT64_MAX / b)
            return 0;
        b *= dims[i];
    }
    return b;
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t total = 0, w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned i = 0; i < levels; i++) {
        uint64_t level = array_bytes(w, h, z, d->Format, d->NumChannels);
        if (level == 0 || total > UINT64_MAX - level)
            return 0;
        total += level;
        w = w > 1 ? w / 2 : 1, h = h > 1 ? h / 2 : h, z = z > 1 ? z / 2 : z;
    }
    return total;
}

typedef CUresult (*handle_call)(void *args, void **handle);

static CUresult create_handle(enum vgpu_kind kind, uint64_t bytes, void **handle,
                              handle_call call, void *args)
{
    READY_OR_RETURN();
    CUcontext ctx;
    CUdevice dev;
    if (!handle || bytes == 0 || vgpu_current(&ctx, &dev) != 0)
        return call(args, handle);
    CUresult rc = vgpu_charge(dev, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = call(args, handle);
    return settle(rc, kind, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*handle : 0, dev, bytes,
                  ctx);
}

struct array_args {
    vgpu_cuArrayCreate_v2_fn real;
    const CUDA_ARRAY_DESCRIPTOR *desc;
};

static CUresult call_array(void *p, void **handle)
{
    struct array_args *a = p;
    return a->real((CUarray *)handle, a->desc);
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    REAL_OR_RETURN(cuArrayCreate_v2);
    struct array_args a = {real, d};
    uint64_t bytes = d ? array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels) : 0;
    return create_handle(VGPU_ARRAY, bytes, (void **)pHandle, call_array, &a);
}

struct array3d_args {
    vgpu_cuArray3DCreate_v2_fn real;
    const CUDA_ARRAY3D_DESCRIPTOR *desc;
};

static CUresult call_array3d(void *p, void **handle)
{
    struct array3d_args *a = p;
    return a->real((CUarray *)handle, a->desc);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    REAL_OR_RETURN(cuArray3DCreate_v2);
    struct array3d_args a = {real, d};
    uint64_t bytes = d ? array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels) : 0;
    return create_handle(VGPU_ARRAY, bytes, (void **)pHandle, call_array3d, &a);
}

CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    (void)pHandle, (void)d;
    return refuse_legacy("cuArrayCreate");
}

CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    (void)pHandle, (void)d;
    return refuse_legacy("cuArray3DCreate");
}

CUresult cuArrayDestroy(CUarray hArray)
{
    REAL_OR_RETURN(cuArrayDestroy);
    CUresult rc = real(hArray);
    if (rc == CUDA_SUCCESS)
        forget(VGPU_ARRAY, (uint64_t)(uintptr_t)hArray);
    return rc;
}

struct mipmap_args {
    vgpu_cuMipmappedArrayCreate_fn real;
    const CUDA_ARRAY3D_DESCRIPTOR *desc;
    unsigned levels;
};

static CUresult call_mipmap(void *p, void **handle)
{
    struct mipmap_args *a = p;
    return a->real((CUmipmappedArray *)handle, a->desc, a->levels);
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int levels)
{
    REAL_OR_RETURN(cuMipmappedArrayCreate);
    struct mipmap_args a = {real, d, levels};
    return create_handle(VGPU_MIPMAP, d ? mipmap_bytes(d, levels) : 0, (void **)pHandle,
                         call_mipmap, &a);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    REAL_OR_RETURN(cuMipmappedArrayDestroy);
    CUresult rc = real(h);
    if (rc == CUDA_SUCCESS)
        forget(VGPU_MIPMAP, (uint64_t)(uintptr_t)h);
    return rc;
}

/* --- virtual memory management ------------------------------------------------------------- */

/* Physical memory is taken by cuMemCreate and given back by cuMemRelease;
 * mapping it (cuMemMap) takes nothing more. */
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    REAL_OR_RETURN(cuMemCreate);
    READY_OR_RETURN();
    if (!handle || !prop || size == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= VGPU_MAX_DEVICES)
        return real(handle, size, prop, flags); /* host memory, or invalid */
    int dev = prop->location.id;
    CUresult rc = vgpu_charge(dev, size);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(handle, size, prop, flags);
    /* Not bound to a context: it outlives them. */
    return settle(rc, VGPU_VMM, rc == CUDA_SUCCESS ? *handle : 0, dev, size, NULL);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REAL_OR_RETURN(cuMemRelease);
    CUresult rc = real(handle);
    if (rc == CUDA_SUCCESS)
        forget(VGPU_VMM, handle);
    return rc;
}

/* --- inter-process memory ------------------------------------------------------------------ */

static uint64_t handle_hash(const CUipcMemHandle *h)
{
    uint64_t x = 0xcbf29ce484222325ull; /* FNV-1a */
    for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++)
        x = (x ^ (unsigned char)h->reserved[i]) * 0x100000001b3ull;
    return x ? x : 1;
}

/* Exports are listed in the region so that the container's other processes
 * do not count the same memory again when they import it. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    REAL_OR_RETURN(cuIpcGetMemHandle);
    CUresult rc = real(pHandle, dptr);
    if (rc == CUDA_SUCCESS && vgpu_ready()) {
        uint64_t hash = handle_hash(pHandle);
        if (vgpu_track_set_export(&vgpu_objects, VGPU_LINEAR, dptr, hash) == 0)
            vgpu_region_export_add(vgpu_region, vgpu_slot(), hash);
    }
    return rc;
}

/* Memory imported from outside the container is charged at its full size
 * (it is only known once mapped: if it does not fit, it is unmapped again). */
static CUresult open_ipc(vgpu_cuIpcOpenMemHandle_v2_fn real, CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    READY_OR_RETURN();
    CUresult rc = real(pdptr, handle, flags);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    CUdeviceptr base;
    size_t size = 0;
    vgpu_cuMemGetAddressRange_v2_fn range = REAL(cuMemGetAddressRange_v2);
    int have_ctx = vgpu_current(&ctx, &dev) == 0;
    uint64_t bytes = 0;
    if (!vgpu_region_export_known(vgpu_region, handle_hash(&handle))) {
        if (!have_ctx || !range || range(&base, &size, *pdptr) != CUDA_SUCCESS) {
            vgpu_log_error("cannot tell the size of imported IPC memory; refusing the import");
            size = 0;
        }
        bytes = size;
        if (size == 0 || vgpu_charge(dev, bytes) != CUDA_SUCCESS) {
            vgpu_cuIpcCloseMemHandle_fn close = REAL(cuIpcCloseMemHandle);
            if (close)
                close(*pdptr);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    struct vgpu_object o = {.kind = VGPU_IMPORT, .key = *pdptr, .bytes = bytes, .dev = dev,
                            .ctx = (uint64_t)(uintptr_t)ctx};
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory tracking an IPC import on device %d", dev);
    return CUDA_SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    REAL_OR_RETURN(cuIpcOpenMemHandle_v2);
    return open_ipc(real, pdptr, handle, flags);
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    REAL_OR_RETURN(cuIpcOpenMemHandle);
    return open_ipc(real, pdptr, handle, flags);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    REAL_OR_RETURN(cuIpcCloseMemHandle);
    CUresult rc = real(dptr);
    if (rc == CUDA_SUCCESS)
        forget(VGPU_IMPORT, dptr);
    return rc;
}

/* --- graph memory nodes -------------------------------------------------------------------- */

/* A graph's allocation nodes are charged when added and given back when the
 * graph is destroyed: the memory is the graph's to use whenever it runs. */
static CUresult add_alloc_node(CUgraph graph, CUDA_MEM_ALLOC_NODE_PARAMS *p, CUresult (*call)(void *),
                               void *args)
{
    READY_OR_RETURN();
    if (!p || p->bytesize == 0 || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        p->poolProps.location.id < 0 || p->poolProps.location.id >= VGPU_MAX_DEVICES)
        return call(args);
    int dev = p->poolProps.location.id;
    CUresult rc = vgpu_charge(dev, p->bytesize);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = call(args);
    return settle(rc, VGPU_GRAPH, (uint64_t)(uintptr_t)graph, dev, p->bytesize, NULL);
}

struct alloc_node_args {
    vgpu_cuGraphAddMemAllocNode_fn real;
    CUgraphNode *node;
    CUgraph graph;
    const CUgraphNode *deps;
    size_t n;
    CUDA_MEM_ALLOC_NODE_PARAMS *params;
};

static CUresult call_alloc_node(void *p)
{
    struct alloc_node_args *a = p;
    return a->real(a->node, a->graph, a->deps, a->n, a->params);
}

CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                const CUgraphNode *deps, size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    REAL_OR_RETURN(cuGraphAddMemAllocNode);
    struct alloc_node_args a = {real, phGraphNode, hGraph, deps, n, p};
    return add_alloc_node(hGraph, p, call_alloc_node, &a);
}

struct add_node_args {
    vgpu_cuGraphAddNode_v2_fn real_v2;
    vgpu_cuGraphAddNode_fn real;
    CUgraphNode *node;
    CUgraph graph;
    const CUgraphNode *deps;
    const CUgraphEdgeData *edges;
    size_t n;
    CUgraphNodeParams *params;
};

static CUresult call_add_node(void *p)
{
    struct add_node_args *a = p;
    return a->real_v2 ? a->real_v2(a->node, a->graph, a->deps, a->edges, a->n, a->params)
                      : a->real(a->node, a->graph, a->deps, a->n, a->params);
}

static CUresult add_node(struct add_node_args *a)
{
    if (a->params && a->params->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return add_alloc_node(a->graph, &a->params->alloc, call_add_node, a);
    return call_add_node(a);
}

CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                        size_t n, CUgraphNodeParams *p)
{
    REAL_OR_RETURN(cuGraphAddNode);
    struct add_node_args a = {NULL, real, phGraphNode, hGraph, deps, NULL, n, p};
    return add_node(&a);
}

CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                           const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p)
{
    REAL_OR_RETURN(cuGraphAddNode_v2);
    struct add_node_args a = {real, NULL, phGraphNode, hGraph, deps, edges, n, p};
    return add_node(&a);
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    REAL_OR_RETURN(cuGraphDestroy);
    CUresult rc = real(hGraph);
    if (rc == CUDA_SUCCESS) {
        struct vgpu_object o;
        while (vgpu_track_remove(&vgpu_objects, VGPU_GRAPH, (uint64_t)(uintptr_t)hGraph, &o) == 0)
            vgpu_release_object(&o, NULL);
    }
    return rc;
}
