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
};

struct CUctx_st {
    CUdevice dev;
    struct CUstream_st null_stream;
    _Atomic uint64_t last_end_ns; /* over all its streams, for cuCtxSynchronize */
};

extern struct sim_config sim_cfg;
extern struct sim_timeline *sim_timelines[SIM_MAX_DEVICES];
extern _Thread_local CUcontext sim_current;

/* CUDA_SUCCESS once cuInit succeeded, else CUDA_ERROR_NOT_INITIALIZED. */
CUresult sim_check_init(void);
CUresult sim_check_device(CUdevice dev);

/* Raises an atomic to at least v. */
static inline void sim_atomic_max(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (old < v && !atomic_compare_exchange_weak(a, &old, v)) {
    }
}

#endif
