/* cuGetProcAddress of the simulated driver, following the real driver's rules:
 * a symbol is asked for by its base name ("cuMemAlloc") and the CUDA version
 * the caller was built for; the answer is the newest variant introduced at or
 * before that version ("cuMemAlloc_v2" from 3020 on). With
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM the per-thread (_ptsz)
 * variant is preferred where there is one. Pointers are the driver's own
 * functions (the library is linked -Bsymbolic), never an interposer's. */
#include <string.h>

#include "sim_cuda.h"

struct entry {
    const char *symbol; /* base name */
    int since;          /* first CUDA version that gets this variant */
    int per_thread;     /* a _ptsz/_ptds variant */
    void *fn;
};

#define E(sym, since, fn) {#sym, since, 0, (void *)fn}
#define PT(sym, since, fn) {#sym, since, 1, (void *)fn}

static const struct entry table[] = {
    E(cuInit, 2000, cuInit),
    E(cuDriverGetVersion, 2020, cuDriverGetVersion),
    E(cuGetProcAddress, 11030, cuGetProcAddress),
    E(cuGetProcAddress, 12000, cuGetProcAddress_v2),
    E(cuDeviceGetCount, 2000, cuDeviceGetCount),
    E(cuDeviceGet, 2000, cuDeviceGet),
    E(cuDeviceGetName, 2000, cuDeviceGetName),
    E(cuDeviceTotalMem, 2000, cuDeviceTotalMem),
    E(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2),
    E(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    E(cuCtxCreate, 2000, cuCtxCreate),
    E(cuCtxCreate, 3020, cuCtxCreate_v2),
    E(cuCtxCreate, 11040, cuCtxCreate_v3),
    E(cuCtxCreate, 12050, cuCtxCreate_v4),
    E(cuCtxDestroy, 2000, cuCtxDestroy),
    E(cuCtxDestroy, 4000, cuCtxDestroy_v2),
    E(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    E(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    E(cuCtxGetDevice, 2000, cuCtxGetDevice),
    E(cuCtxSynchronize, 2000, cuCtxSynchronize),
    E(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2),
    E(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2),
    E(cuCtxSetLimit, 3010, cuCtxSetLimit),
    E(cuCtxGetLimit, 3010, cuCtxGetLimit),
    E(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    E(cuDevicePrimaryCtxRelease, 7000, cuDevicePrimaryCtxRelease),
    E(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2),
    E(cuDevicePrimaryCtxReset, 7000, cuDevicePrimaryCtxReset),
    E(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2),
    E(cuMemGetInfo, 2000, cuMemGetInfo),
    E(cuMemGetInfo, 3020, cuMemGetInfo_v2),
    E(cuMemAlloc, 2000, cuMemAlloc),
    E(cuMemAlloc, 3020, cuMemAlloc_v2),
    E(cuMemAllocPitch, 2000, cuMemAllocPitch),
    E(cuMemAllocPitch, 3020, cuMemAllocPitch_v2),
    E(cuMemAllocManaged, 6000, cuMemAllocManaged),
    E(cuMemAdvise, 8000, cuMemAdvise),
    E(cuPointerGetAttribute, 4000, cuPointerGetAttribute),
    E(cuMemFree, 3020, cuMemFree_v2),
    E(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2),
    E(cuArrayCreate, 2000, cuArrayCreate),
    E(cuArrayCreate, 3020, cuArrayCreate_v2),
    E(cuArray3DCreate, 2000, cuArray3DCreate),
    E(cuArray3DCreate, 3020, cuArray3DCreate_v2),
    E(cuArrayDestroy, 2000, cuArrayDestroy),
    E(cuMipmappedArrayCreate, 5000, cuMipmappedArrayCreate),
    E(cuMipmappedArrayDestroy, 5000, cuMipmappedArrayDestroy),
    E(cuMemAllocAsync, 11020, cuMemAllocAsync),
    PT(cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz),
    E(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync),
    PT(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz),
    E(cuMemFreeAsync, 11020, cuMemFreeAsync),
    PT(cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz),
    E(cuMemPoolCreate, 11020, cuMemPoolCreate),
    E(cuMemPoolDestroy, 11020, cuMemPoolDestroy),
    E(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool),
    E(cuDeviceGetMemPool, 11020, cuDeviceGetMemPool),
    E(cuDeviceSetMemPool, 11020, cuDeviceSetMemPool),
    E(cuMemPoolTrimTo, 11020, cuMemPoolTrimTo),
    E(cuMemPoolSetAttribute, 11020, cuMemPoolSetAttribute),
    E(cuMemPoolGetAttribute, 11020, cuMemPoolGetAttribute),
    E(cuMemCreate, 10020, cuMemCreate),
    E(cuMemRelease, 10020, cuMemRelease),
    E(cuMemAddressReserve, 10020, cuMemAddressReserve),
    E(cuMemAddressFree, 10020, cuMemAddressFree),
    E(cuMemMap, 10020, cuMemMap),
    E(cuMemUnmap, 10020, cuMemUnmap),
    E(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle),
    E(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle),
    E(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle),
    E(cuMemGetAllocationPropertiesFromHandle, 10020, cuMemGetAllocationPropertiesFromHandle),
    E(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle),
    E(cuIpcOpenMemHandle, 4010, cuIpcOpenMemHandle),
    E(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle_v2),
    E(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle),
    E(cuStreamCreate, 2000, cuStreamCreate),
    E(cuStreamDestroy, 4000, cuStreamDestroy_v2),
    E(cuStreamSynchronize, 2000, cuStreamSynchronize),
    E(cuStreamQuery, 2000, cuStreamQuery),
    E(cuStreamIsCapturing, 10000, cuStreamIsCapturing),
    E(cuStreamGetCtx, 9020, cuStreamGetCtx),
    PT(cuStreamGetCtx, 9020, cuStreamGetCtx_ptsz),
    E(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2),
    E(cuStreamEndCapture, 10000, cuStreamEndCapture),
    E(cuStreamGetCaptureInfo, 11030, cuStreamGetCaptureInfo_v2),
    E(cuEventCreate, 2000, cuEventCreate),
    E(cuEventRecord, 2000, cuEventRecord),
    E(cuEventQuery, 2000, cuEventQuery),
    E(cuEventSynchronize, 2000, cuEventSynchronize),
    E(cuEventElapsedTime, 2000, cuEventElapsedTime),
    E(cuEventDestroy, 4000, cuEventDestroy_v2),
    E(cuModuleLoadData, 2000, cuModuleLoadData),
    E(cuModuleGetFunction, 2000, cuModuleGetFunction),
    E(cuModuleUnload, 2000, cuModuleUnload),
    E(cuLaunchKernel, 4000, cuLaunchKernel),
    PT(cuLaunchKernel, 7000, cuLaunchKernel_ptsz),
    E(cuLaunchKernelEx, 11060, cuLaunchKernelEx),
    PT(cuLaunchKernelEx, 11060, cuLaunchKernelEx_ptsz),
    E(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel),
    PT(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel_ptsz),
    E(cuGraphCreate, 10000, cuGraphCreate),
    E(cuGraphDestroy, 10000, cuGraphDestroy),
    E(cuGraphAddKernelNode, 10000, cuGraphAddKernelNode),
    E(cuGraphAddMemAllocNode, 11040, cuGraphAddMemAllocNode),
    E(cuGraphAddNode, 12020, cuGraphAddNode),
    E(cuGraphAddNode, 12030, cuGraphAddNode_v2),
    E(cuGraphAddMemFreeNode, 11040, cuGraphAddMemFreeNode),
    E(cuGraphClone, 10000, cuGraphClone),
    E(cuGraphInstantiate, 10000, cuGraphInstantiate),
    E(cuGraphInstantiate, 11000, cuGraphInstantiate_v2),
    E(cuGraphInstantiate, 12000, cuGraphInstantiateWithFlags), /* cuda.h maps it so from 12.0 */
    E(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags),
    E(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams),
    PT(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams_ptsz),
    E(cuGraphUpload, 11010, cuGraphUpload),
    PT(cuGraphUpload, 11010, cuGraphUpload_ptsz),
    E(cuGraphExecDestroy, 10000, cuGraphExecDestroy),
    E(cuGraphLaunch, 10000, cuGraphLaunch),
    PT(cuGraphLaunch, 10000, cuGraphLaunch_ptsz),
};

static CUresult answer(void **pfn, CUdriverProcAddressQueryResult *status,
                       CUdriverProcAddressQueryResult why, void *fn)
{
    *pfn = fn;
    if (status)
        *status = why;
    return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn || flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        return CUDA_ERROR_INVALID_VALUE;
    int want_pt = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, known = 0;
    const struct entry *best = NULL;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        const struct entry *e = &table[i];
        if (strcmp(e->symbol, symbol) != 0)
            continue;
        known = 1;
        if (e->since > cudaVersion || (e->per_thread && !want_pt))
            continue;
        /* newest variant; a per-thread one beats a plain one of any age */
        if (!best || e->per_thread > best->per_thread ||
            (e->per_thread == best->per_thread && e->since > best->since))
            best = e;
    }
    if (best)
        return answer(pfn, status, CU_GET_PROC_ADDRESS_SUCCESS, best->fn);
    return answer(pfn, status,
                  known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                        : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
                  NULL);
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
