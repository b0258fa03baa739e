/* Minimal subset of the CUDA driver API types from cuda.h.
 *
 * Neither the build machines nor CI have a CUDA toolkit, so the few types the
 * hook, the simulated driver and the test programs need are declared here.
 * Names and values match cuda.h (CUDA 12), so code written against this header
 * behaves the same against the real driver. */
#ifndef VGPU_CUDA_TYPES_H
#define VGPU_CUDA_TYPES_H

#include <stddef.h>

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
} CUresult;

typedef int CUdevice;                   /* device ordinal */
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2: 64-bit device address */
typedef struct CUctx_st *CUcontext;     /* opaque context handle */

#endif
