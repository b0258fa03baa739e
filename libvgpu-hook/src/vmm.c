/* Interposers of virtual memory management (cuda_memory.def).
 *
 * Physical memory is taken by cuMemCreate and lives while anything refers to
 * it: its handle (create, import and cuMemRetainAllocationHandle each add a
 * reference, cuMemRelease drops one) or a mapping (cuMemMap / cuMemUnmap).
 * It stays charged until it is both released and unmapped everywhere.
 *
 * Sharing (cuMemExportToShareableHandle / cuMemImportFromShareableHandle):
 * the exporter lists the allocation in the container's region under a key
 * that names the allocation, not the process: for a POSIX file descriptor the
 * file's (device, inode), which every process that received the descriptor
 * sees alike -- unless the file is a device node (then all exports may share
 * one inode and the key would not name the allocation); for a fabric handle
 * its 64 bytes. A process of the same container importing it takes a
 * reference in the region instead of a second charge; the one charge moves
 * to another holder when its holder lets go or dies. Memory imported from
 * elsewhere (or under a key that cannot be trusted) is charged again when
 * mapped, by the mapped size: counted twice at worst, never zero times. */
#include <stdlib.h>
#include <sys/stat.h>

#include "log.h"
#include "memory.h"

/* Physical memory is taken by cuMemCreate; mapping it takes nothing more. */
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    REAL_OR_RETURN(cuMemCreate);
    READY_OR_RETURN();
    if (!handle || !prop || size == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= VGPU_MAX_DEVICES)
        return real(handle, size, prop, flags); /* host memory, or invalid */
    int dev = prop->location.id;
    CUresult rc = vgpu_mem_charge(dev, size);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(dev, size);
        return rc;
    }
    /* Not bound to a context: it outlives them. */
    struct vgpu_object o = {.kind = VGPU_VMM, .key = *handle, .bytes = size, .dev = dev,
                            .size = size, .refs = 1};
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory tracking a VMM allocation on device %d", dev);
    return rc;
}

struct vmm_delta {
    int refs, maps;
};

static int apply_delta(struct vgpu_object *o, void *arg)
{
    const struct vmm_delta *d = arg;
    o->refs += d->refs;
    o->maps += d->maps;
    return o->refs <= 0 && o->maps <= 0;
}

/* Nothing in this process refers to the allocation any more. */
static void vmm_gone(const struct vgpu_object *o)
{
    if (o->shared)
        vgpu_region_share_leave(vgpu_region, vgpu_slot(), o->shared);
    if (o->bytes)
        vgpu_uncharge(o->dev, o->bytes);
}

static void vmm_adjust(CUmemGenericAllocationHandle handle, int refs, int maps)
{
    struct vmm_delta d = {refs, maps};
    struct vgpu_object o;
    if (vgpu_track_update(&vgpu_objects, VGPU_VMM, handle, apply_delta, &d, &o) == 1)
        vmm_gone(&o);
}

/* The reference is dropped before the driver can free the memory and hand the
 * handle out again; restored if the driver refuses. */
CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REAL_OR_RETURN(cuMemRelease);
    struct vmm_delta d = {-1, 0};
    struct vgpu_object o;
    int state = vgpu_track_update(&vgpu_objects, VGPU_VMM, handle, apply_delta, &d, &o);
    CUresult rc = real(handle);
    if (rc == CUDA_SUCCESS && state == 1) {
        vmm_gone(&o);
    } else if (rc != CUDA_SUCCESS && state == 1) {
        o.refs++;
        if (vgpu_track_add(&vgpu_objects, &o) != 0)
            vgpu_log_error("out of host memory re-tracking a VMM allocation on device %d", o.dev);
    } else if (rc != CUDA_SUCCESS && state == 0) {
        vmm_adjust(handle, +1, 0);
    }
    return rc;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    REAL_OR_RETURN(cuMemRetainAllocationHandle);
    CUresult rc = real(handle, addr);
    if (rc == CUDA_SUCCESS && handle)
        vmm_adjust(*handle, +1, 0);
    return rc;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    REAL_OR_RETURN(cuMemMap);
    READY_OR_RETURN();
    struct vgpu_object a;
    if (vgpu_track_find(&vgpu_objects, VGPU_VMM, handle, &a) != 0)
        return real(ptr, size, offset, handle, flags); /* not device memory the hook counts */
    uint64_t bytes = a.flags & VGPU_CHARGE_ON_MAP ? size : 0;
    CUresult rc = bytes ? vgpu_mem_charge(a.dev, bytes) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(a.dev, bytes);
        return rc;
    }
    struct vgpu_object m = {.kind = VGPU_MAPPING, .key = ptr, .bytes = bytes, .dev = a.dev,
                            .size = size, .parent = handle};
    if (vgpu_track_add(&vgpu_objects, &m) != 0) /* the allocation stays counted as mapped */
        vgpu_log_error("out of host memory tracking a mapping on device %d", a.dev);
    vmm_adjust(handle, 0, +1);
    return rc;
}

static void unmapped(const struct vgpu_object *m)
{
    if (m->bytes)
        vgpu_uncharge(m->dev, m->bytes);
    vmm_adjust(m->parent, 0, -1);
}

/* Every mapping that starts in [ptr, ptr + size) is gone. */
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REAL_OR_RETURN(cuMemUnmap);
    CUresult rc = real(ptr, size);
    if (rc != CUDA_SUCCESS || size == 0)
        return rc;
    uint64_t at = ptr, end = ptr + size < ptr ? UINT64_MAX : ptr + size;
    struct vgpu_object m;
    /* Usually mappings are unmapped as they were mapped: follow them from ptr. */
    while (at < end && vgpu_track_remove(&vgpu_objects, VGPU_MAPPING, at, &m) == 0) {
        unmapped(&m);
        at = m.size && at + m.size > at ? at + m.size : end;
    }
    if (at >= end)
        return rc;
    int n = vgpu_track_collect(&vgpu_objects, VGPU_MAPPING, 0, 1, NULL, 0);
    struct vgpu_object *all = n > 0 ? malloc((size_t)n * sizeof *all) : NULL;
    if (all)
        n = vgpu_track_collect(&vgpu_objects, VGPU_MAPPING, 0, 1, all, n);
    for (int i = 0; all && i < n; i++)
        if (all[i].key >= at && all[i].key < end &&
            vgpu_track_remove(&vgpu_objects, VGPU_MAPPING, all[i].key, &m) == 0)
            unmapped(&m);
    free(all);
    return rc;
}

/* --- sharing between processes ------------------------------------------------------------- */

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

/* The container-wide key of a shareable handle (see the top of this file); 0
 * if it has none that names the allocation. `fd` for POSIX descriptors,
 * `fabric` for fabric handles. */
static uint64_t shareable_key(CUmemAllocationHandleType type, int fd,
                              const CUmemFabricHandle *fabric)
{
    uint64_t h = type;
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0 || S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))
            return 0;
        h = mix(mix(h, (uint64_t)st.st_dev), (uint64_t)st.st_ino);
    } else if (type == CU_MEM_HANDLE_TYPE_FABRIC && fabric) {
        for (size_t i = 0; i < sizeof fabric->data; i++)
            h = mix(h, fabric->data[i]);
    } else {
        return 0;
    }
    return h ? h : 1;
}

static int mark_shared(struct vgpu_object *o, void *arg)
{
    o->shared = *(const uint64_t *)arg;
    o->bytes = 0; /* the region carries the charge now */
    return 0;
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType,
                                      unsigned long long flags)
{
    REAL_OR_RETURN(cuMemExportToShareableHandle);
    CUresult rc = real(shareableHandle, handle, handleType, flags);
    struct vgpu_object o;
    if (rc != CUDA_SUCCESS || !shareableHandle || !vgpu_ready() ||
        vgpu_track_find(&vgpu_objects, VGPU_VMM, handle, &o) != 0)
        return rc;
    uint64_t key = shareable_key(handleType,
                                 handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                     ? *(const int *)shareableHandle
                                     : -1,
                                 shareableHandle);
    if (!key || (o.flags & VGPU_CHARGE_ON_MAP))
        return rc; /* importers in the container charge it again */
    if (o.shared)
        vgpu_region_share_alias(vgpu_region, o.shared, key);
    else if (vgpu_region_share_add(vgpu_region, vgpu_slot(), key, o.dev, o.bytes) == 0)
        vgpu_track_update(&vgpu_objects, VGPU_VMM, handle, mark_shared, &key, NULL);
    return rc;
}

/* The device an imported allocation lives on (the current one if the driver cannot say). */
static int imported_device(CUmemGenericAllocationHandle handle)
{
    vgpu_cuMemGetAllocationPropertiesFromHandle_fn props =
        REAL(cuMemGetAllocationPropertiesFromHandle);
    CUmemAllocationProp p;
    CUcontext ctx;
    CUdevice dev = 0;
    if (props && props(&p, handle) == CUDA_SUCCESS &&
        p.location.type == CU_MEM_LOCATION_TYPE_DEVICE && p.location.id >= 0 &&
        p.location.id < VGPU_MAX_DEVICES)
        return p.location.id;
    vgpu_current(&ctx, &dev);
    return dev;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType)
{
    REAL_OR_RETURN(cuMemImportFromShareableHandle);
    READY_OR_RETURN();
    /* The descriptor is passed as the pointer's value, a fabric handle through it. */
    uint64_t key = shareable_key(shHandleType, (int)(intptr_t)osHandle, osHandle);
    CUresult rc = real(handle, osHandle, shHandleType);
    if (rc != CUDA_SUCCESS || !handle)
        return rc;
    struct vgpu_object o = {.kind = VGPU_VMM, .key = *handle, .refs = 1};
    uint64_t bytes;
    if (key && vgpu_region_share_join(vgpu_region, vgpu_slot(), key, &o.dev, &bytes)) {
        o.shared = key, o.size = bytes; /* a process of this container holds the charge */
    } else {
        o.flags = VGPU_CHARGE_ON_MAP;
        o.dev = imported_device(*handle);
    }
    if (vgpu_track_add(&vgpu_objects, &o) != 0)
        vgpu_log_error("out of host memory tracking an imported VMM allocation on device %d",
                       o.dev);
    return rc;
}
