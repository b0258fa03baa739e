/* Interposers of the device-memory family (cuda_memory.def): linear memory,
 * arrays and IPC. Every path that takes device memory charges it to the
 * container before the driver is asked (so nothing ever exceeds the limit),
 * and every path that gives it back uncharges it. Legacy 32-bit entry points
 * are refused. Pools are in pool.c, VMM in vmm.c, graphs in graph_memory.c. */
#include <string.h>

#include "log.h"
#include "memory.h"

#define PITCH_ALIGN 512ull /* the real driver's pitch alignment on current GPUs */

CUresult vgpu_mem_charge(int dev, uint64_t bytes)
{
    uint64_t limit = vgpu_limit_bytes(dev);
    if (limit && (bytes > limit || vgpu_region_used(vgpu_region, dev) > limit - bytes))
        vgpu_pools_refresh(dev); /* pools may have given memory back at a synchronisation */
    return vgpu_charge(dev, bytes);
}

void vgpu_mem_force_charge(int dev, uint64_t bytes)
{
    int slot = vgpu_slot();
    if (bytes && slot >= 0)
        vgpu_region_reserve(vgpu_region, slot, dev, bytes, 0, NULL);
}

CUresult vgpu_mem_settle(CUresult rc, enum vgpu_kind kind, uint64_t key, int dev, uint64_t bytes,
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

void vgpu_mem_forget(enum vgpu_kind kind, uint64_t key)
{
    struct vgpu_object o;
    if (vgpu_track_remove(&vgpu_objects, kind, key, &o) == 0)
        vgpu_release_object(&o, NULL);
}

int vgpu_stream_device(CUstream stream, CUdevice *dev)
{
    CUcontext cur = NULL, sc = NULL, popped;
    CUdevice cur_dev = 0;
    int have = vgpu_current(&cur, &cur_dev) == 0;
    vgpu_cuStreamGetCtx_fn get_ctx = REAL(cuStreamGetCtx);
    vgpu_cuCtxPushCurrent_v2_fn push = REAL(cuCtxPushCurrent_v2);
    vgpu_cuCtxPopCurrent_v2_fn pop = REAL(cuCtxPopCurrent_v2);
    vgpu_cuCtxGetDevice_fn get_dev = REAL(cuCtxGetDevice);
    if (!get_ctx || get_ctx(stream, &sc) != CUDA_SUCCESS || !sc || (have && sc == cur) || !push ||
        !pop || !get_dev || push(sc) != CUDA_SUCCESS) {
        *dev = cur_dev; /* the stream's own context is the current one, or cannot be told */
        return have ? 0 : -1;
    }
    CUresult rc = get_dev(dev);
    pop(&popped);
    return rc == CUDA_SUCCESS && *dev >= 0 && *dev < VGPU_MAX_DEVICES ? 0 : -1;
}

#define settle vgpu_mem_settle
#define forget vgpu_mem_forget

static CUresult refuse_legacy(const char *name)
{
    static struct vgpu_log_limit legacy = VGPU_LOG_LIMIT("legacy 32-bit entry point refused");
    vgpu_log_error_limited(&legacy, "%s (legacy 32-bit entry point) is refused under vgpu: use %s_v2",
                           name, name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* --- linear memory ------------------------------------------------------------------------- */

typedef CUresult (*alloc_call)(void *args, CUdeviceptr *dptr);

/* Virtual device memory (device.<i>.virtual_memory in the limit file, written for GPUs
 * whose memory scaling is above 1): an allocation that fits the slice, already charged,
 * but that the card cannot hold any more is given as managed memory that prefers the
 * device, so it lives on the card where it fits and pages to host memory where it does
 * not. The container's spilled bytes are bounded by the limit file's spill_limit_mib. */
static CUresult spill(CUdeviceptr *dptr, size_t bytes, int dev, CUcontext ctx)
{
    static struct vgpu_log_limit bound = VGPU_LOG_LIMIT("cannot spill to host memory");
    vgpu_cuMemAllocManaged_fn managed = REAL(cuMemAllocManaged);
    vgpu_cuMemAdvise_fn advise = REAL(cuMemAdvise);
    int slot = vgpu_slot();
    if (!managed || slot < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (vgpu_region_spill(vgpu_region, slot, dev, bytes, vgpu_cfg.spill_limit_mib * MIB) != 0) {
        char a[32];
        vgpu_log_error_limited(&bound,
                               "out of memory on device %d: the card is full and %s more would "
                               "take spilled memory past its host bound (spill_limit_mib=%llu)",
                               dev, vgpu_format_size(a, sizeof a, bytes),
                               (unsigned long long)vgpu_cfg.spill_limit_mib);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = managed(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
    if (rc != CUDA_SUCCESS) {
        vgpu_region_unspill(vgpu_region, slot, dev, bytes);
        return rc;
    }
    if (advise) { /* advice only steers paging: the memory is usable without it */
        (void)advise(*dptr, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, dev);
        (void)advise(*dptr, bytes, CU_MEM_ADVISE_SET_ACCESSED_BY, dev);
    }
    struct vgpu_object o = {.kind = VGPU_LINEAR, .key = *dptr, .bytes = bytes, .dev = dev,
                            .ctx = (uint64_t)(uintptr_t)ctx, .flags = VGPU_SPILLED};
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory tracking an allocation of %llu bytes on device %d",
                       (unsigned long long)bytes, dev);
    return CUDA_SUCCESS;
}

/* Charges bytes on the current context's device, then lets call allocate. */
static CUresult alloc_linear(CUdeviceptr *dptr, size_t bytes, alloc_call call, void *args,
                             int may_spill)
{
    READY_OR_RETURN();
    CUcontext ctx;
    CUdevice dev;
    if (!dptr || bytes == 0 || vgpu_current(&ctx, &dev) != 0)
        return call(args, dptr); /* nothing to account: the driver reports the error */
    CUresult rc = vgpu_mem_charge(dev, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = call(args, dptr);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && may_spill && vgpu_cfg.virtual_memory[dev]) {
        rc = spill(dptr, bytes, dev, ctx); /* within the slice, but the card is full */
        if (rc == CUDA_SUCCESS)
            return rc;
    }
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
    return alloc_linear(dptr, bytesize, call_plain, &a, 1);
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
    return alloc_linear(dptr, bytesize, call_managed, &a, 0);
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
    CUresult rc = vgpu_mem_charge(dev, estimate);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, pPitch, width, height, elementSize);
    if (rc != CUDA_SUCCESS)
        return settle(rc, VGPU_LINEAR, 0, dev, estimate, ctx);
    uint64_t actual = (uint64_t)*pPitch * height;
    if (actual > estimate && vgpu_mem_charge(dev, actual - estimate) != CUDA_SUCCESS) {
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

CUresult vgpu_free_linear(CUdeviceptr dptr, CUresult (*call)(void *, CUdeviceptr), void *args)
{
    struct vgpu_object o;
    int tracked = vgpu_track_remove(&vgpu_objects, VGPU_LINEAR, dptr, &o) == 0;
    CUresult rc = call(args, dptr);
    if (tracked && rc == CUDA_SUCCESS && o.parent)
        vgpu_pool_freed(o.parent, o.size); /* back to its pool, which stays charged */
    else if (tracked && rc == CUDA_SUCCESS)
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
    return vgpu_free_linear(dptr, call_free, (void *)real);
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
    CUresult rc = vgpu_mem_charge(dev, bytes);
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
        if (size == 0 || vgpu_mem_charge(dev, bytes) != CUDA_SUCCESS) {
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
