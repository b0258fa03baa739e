/* Prototypes of the CUDA driver API functions used in this project: the ones
 * the simulated driver (sim/) implements and the test programs call.
 * Signatures match cuda.h (CUDA 12). src/real_cuda.c checks at compile time
 * that every entry of src/cuda_functions.def agrees with these. */
#ifndef VGPU_CUDA_API_H
#define VGPU_CUDA_API_H

#include "cuda_types.h"

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxGetDevice(CUdevice *device);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);

#endif
