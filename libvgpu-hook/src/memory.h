/* Helpers shared by the device-memory interposers: memory.c (linear memory,
 * arrays, IPC), pool.c (pools, stream-ordered allocation), vmm.c (virtual
 * memory management), graph_memory.c (graph allocation nodes) and context.c. */
#ifndef VGPU_MEMORY_H
#define VGPU_MEMORY_H

#include "functions.h"
#include "state.h"

#define MIB (1024ull * 1024ull)

/* Declares `real`, the real function; returns if the driver lacks it. */
#define REAL_OR_RETURN(name)            \
    vgpu_##name##_fn real = REAL(name); \
    if (!real)                          \
    return CUDA_ERROR_NOT_FOUND

#define READY_OR_RETURN()    \
    if (!vgpu_ready())       \
    return CUDA_ERROR_NOT_INITIALIZED

/* vgpu_charge, but before refusing it asks the driver what this process's
 * pools still hold (they give memory back at synchronisations). */
CUresult vgpu_mem_charge(int dev, uint64_t bytes);

/* Charges memory the driver has already handed out, whatever the limit:
 * the count must show what is held. */
void vgpu_mem_force_charge(int dev, uint64_t bytes);

/* After the driver answered an allocation that was charged beforehand:
 * remember it on success, give the charge back on failure. */
CUresult vgpu_mem_settle(CUresult rc, enum vgpu_kind kind, uint64_t key, int dev, uint64_t bytes,
                         CUcontext ctx);

/* Gives back an object the driver has just released. */
void vgpu_mem_forget(enum vgpu_kind kind, uint64_t key);

/* Frees linear or stream-ordered memory through call: forgets the allocation
 * before the driver can hand its address out again, puts it back if the
 * driver refuses to free it. */
CUresult vgpu_free_linear(CUdeviceptr dptr, CUresult (*call)(void *, CUdeviceptr), void *args);

/* The device a stream's work runs on (through its context). 0, or -1. */
int vgpu_stream_device(CUstream stream, CUdevice *dev);

/* graph_memory.c: an allocation or free node of a template graph (made by
 * stream capture), recorded to be charged to its executable graphs. */
void vgpu_graph_record_alloc(CUgraph graph, int dev, uint64_t size, CUdeviceptr dptr);
void vgpu_graph_record_free(CUgraph graph, CUdeviceptr dptr);

/* pool.c: asks the driver what each of this process's pools on dev holds and
 * charges exactly that; an allocation from a pool went back to it. */
void vgpu_pools_refresh(int dev);
void vgpu_pool_freed(uint64_t pool, uint64_t size);

#endif
