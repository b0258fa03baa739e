/* Internals of the simulated libcuda.so.1, shared by its source files. */
#ifndef VGPU_SIM_CUDA_H
#define VGPU_SIM_CUDA_H

#include <stdatomic.h>
#include <stdint.h>

#include "cuda_api.h"
#include "sim.h"

struct CUstream_st {
    CUcontext ctx;
    _Atomic uint64_t last_end_ns; /* when the last work queued on this stream ends */
    CUgraph capture;              /* the graph it is capturing into (sim_reserve.c), or NULL */
    /* The last event recorded here if no work was queued after it yet (sim_exec.c),
     * and its generation then (events are reused, never freed). */
    struct CUevent_st *_Atomic waiting_event;
    _Atomic uint64_t waiting_gen;
};

struct CUctx_st {
    CUdevice dev;
    size_t limits[3]; /* CU_LIMIT_STACK_SIZE .. CU_LIMIT_MALLOC_HEAP_SIZE; 0 = the default */
    struct CUstream_st null_stream;
    _Atomic uint64_t last_end_ns; /* over all its streams, for cuCtxSynchronize */
};

extern struct sim_config sim_cfg;
extern struct sim_timeline *sim_timelines[SIM_MAX_DEVICES];
extern _Thread_local CUcontext sim_current;

/* CUDA_SUCCESS once cuInit succeeded, else CUDA_ERROR_NOT_INITIALIZED. */
CUresult sim_check_init(void);
CUresult sim_check_device(CUdevice dev);

/* sim_cuda.c, for sim_exec.c: charges gpu_ns of kernel time to this process on dev (what
 * the agent reads as its SM share). Lock-free: called at every launch. */
void sim_device_busy(int dev, uint64_t gpu_ns);

/* sim_cuda.c, for sim_reserve.c. VMM handles: recorded on dev, counted in its used memory
 * when charge is set (an import of another process's memory is not). Pool addresses: not
 * counted (the pool's reservation is, through sim_reserve). */
CUresult sim_vmm_take(int dev, size_t bytes, int charge, CUmemGenericAllocationHandle *handle);
CUresult sim_vmm_give(CUmemGenericAllocationHandle handle);
CUresult sim_pool_address_take(int dev, size_t bytes, CUdeviceptr *dptr);
CUresult sim_pool_address_give(CUdeviceptr dptr);
/* Device memory held without an address of its own (pool reservations, graph memory,
 * context limits): CUDA_ERROR_OUT_OF_MEMORY if it does not fit. */
CUresult sim_reserve(int dev, size_t bytes);
void sim_unreserve(int dev, size_t bytes);
/* Pages host-resident managed memory of this process onto its preferred devices where
 * they have room (called at every launch; cheap when there is none). */
void sim_managed_page_in(void);

/* sim_reserve.c: what a context's limits hold is given back with it; pools give back
 * what they keep above their release threshold at every synchronisation. */
void sim_ctx_limits_release(CUcontext ctx);
void sim_pools_sync(void);
/* The device a stream's work runs on (NULL and the special handles: the current context's). */
CUresult sim_stream_device(CUstream s, CUdevice *dev);

/* Raises an atomic to at least v. */
static inline void sim_atomic_max(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (old < v && !atomic_compare_exchange_weak(a, &old, v)) {
    }
}

#endif
