/* The driver functions the test programs use, obtained the way an
 * application would: one of
 *   link        the symbols the program is linked against (-lcuda)
 *   dlsym       dlopen("libcuda.so.1") + dlsym on that handle (ctypes, numba)
 *   procaddr    cuGetProcAddress_v2, itself fetched through cuGetProcAddress as
 *               the CUDA 12 runtime does, asking for base names at CUDA 12.4
 *   procaddr_pt the same with the per-thread default stream flag (_ptsz)
 *   procaddr_v1 cuGetProcAddress (CUDA 11.3-11.8 style), at CUDA 11.8
 * Header-only, for test programs. */
#ifndef VGPU_TEST_API_H
#define VGPU_TEST_API_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"

/* API(name used here, base name for cuGetProcAddress, linked symbol); "name@version"
 * asks for an older variant than the default CUDA 12.4 (the signature used here). */
#define TEST_API_LIST                                                  \
    API(cuInit, "cuInit", cuInit)                                      \
    API(cuDeviceGet, "cuDeviceGet", cuDeviceGet)                       \
    API(cuDeviceTotalMem_v2, "cuDeviceTotalMem", cuDeviceTotalMem_v2)  \
    API(cuCtxCreate_v2, "cuCtxCreate@3020", cuCtxCreate_v2)            \
    API(cuCtxDestroy_v2, "cuCtxDestroy", cuCtxDestroy_v2)              \
    API(cuCtxSetCurrent, "cuCtxSetCurrent", cuCtxSetCurrent)           \
    API(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain) \
    API(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2) \
    API(cuMemGetInfo_v2, "cuMemGetInfo", cuMemGetInfo_v2)              \
    API(cuMemAlloc_v2, "cuMemAlloc", cuMemAlloc_v2)                    \
    API(cuMemFree_v2, "cuMemFree", cuMemFree_v2)                       \
    API(cuMemAllocPitch_v2, "cuMemAllocPitch", cuMemAllocPitch_v2)     \
    API(cuMemAllocManaged, "cuMemAllocManaged", cuMemAllocManaged)     \
    API(cuArrayCreate_v2, "cuArrayCreate", cuArrayCreate_v2)           \
    API(cuArray3DCreate_v2, "cuArray3DCreate", cuArray3DCreate_v2)     \
    API(cuArrayDestroy, "cuArrayDestroy", cuArrayDestroy)              \
    API(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", cuMipmappedArrayCreate) \
    API(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", cuMipmappedArrayDestroy) \
    API(cuMemAllocAsync, "cuMemAllocAsync", cuMemAllocAsync)           \
    API(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync) \
    API(cuMemFreeAsync, "cuMemFreeAsync", cuMemFreeAsync)              \
    API(cuMemPoolCreate, "cuMemPoolCreate", cuMemPoolCreate)           \
    API(cuMemPoolDestroy, "cuMemPoolDestroy", cuMemPoolDestroy)        \
    API(cuMemCreate, "cuMemCreate", cuMemCreate)                       \
    API(cuMemRelease, "cuMemRelease", cuMemRelease)                    \
    API(cuMemAddressReserve, "cuMemAddressReserve", cuMemAddressReserve) \
    API(cuMemAddressFree, "cuMemAddressFree", cuMemAddressFree)        \
    API(cuMemMap, "cuMemMap", cuMemMap)                                \
    API(cuMemUnmap, "cuMemUnmap", cuMemUnmap)                          \
    API(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", cuMemRetainAllocationHandle) \
    API(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", cuMemExportToShareableHandle) \
    API(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", cuMemImportFromShareableHandle) \
    API(cuMemPoolTrimTo, "cuMemPoolTrimTo", cuMemPoolTrimTo)           \
    API(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", cuMemPoolSetAttribute) \
    API(cuDeviceGetMemPool, "cuDeviceGetMemPool", cuDeviceGetMemPool)  \
    API(cuStreamCreate, "cuStreamCreate", cuStreamCreate)              \
    API(cuStreamDestroy_v2, "cuStreamDestroy", cuStreamDestroy_v2)     \
    API(cuStreamBeginCapture_v2, "cuStreamBeginCapture", cuStreamBeginCapture_v2) \
    API(cuStreamEndCapture, "cuStreamEndCapture", cuStreamEndCapture)  \
    API(cuCtxSetLimit, "cuCtxSetLimit", cuCtxSetLimit)                 \
    API(cuCtxGetLimit, "cuCtxGetLimit", cuCtxGetLimit)                 \
    API(cuIpcGetMemHandle, "cuIpcGetMemHandle", cuIpcGetMemHandle)     \
    API(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", cuIpcOpenMemHandle_v2) \
    API(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", cuIpcCloseMemHandle) \
    API(cuGraphCreate, "cuGraphCreate", cuGraphCreate)                 \
    API(cuGraphDestroy, "cuGraphDestroy", cuGraphDestroy)              \
    API(cuGraphAddKernelNode, "cuGraphAddKernelNode", cuGraphAddKernelNode) \
    API(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", cuGraphAddMemAllocNode) \
    API(cuGraphAddNode, "cuGraphAddNode@12020", cuGraphAddNode)        \
    API(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", cuGraphInstantiateWithFlags) \
    API(cuGraphInstantiate, "cuGraphInstantiate", cuGraphInstantiateWithFlags) \
    API(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", cuGraphInstantiateWithParams) \
    API(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", cuGraphAddMemFreeNode) \
    API(cuGraphClone, "cuGraphClone", cuGraphClone)                    \
    API(cuGraphUpload, "cuGraphUpload", cuGraphUpload)                 \
    API(cuGraphExecDestroy, "cuGraphExecDestroy", cuGraphExecDestroy)  \
    API(cuGraphLaunch, "cuGraphLaunch", cuGraphLaunch)                 \
    API(cuModuleLoadData, "cuModuleLoadData", cuModuleLoadData)        \
    API(cuModuleGetFunction, "cuModuleGetFunction", cuModuleGetFunction) \
    API(cuLaunchKernel, "cuLaunchKernel", cuLaunchKernel)              \
    API(cuLaunchKernelEx, "cuLaunchKernelEx", cuLaunchKernelEx)        \
    API(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", cuLaunchCooperativeKernel) \
    API(cuStreamSynchronize, "cuStreamSynchronize", cuStreamSynchronize) \
    API(cuCtxSynchronize, "cuCtxSynchronize", cuCtxSynchronize)

static struct {
#define API(field, base, sym) __typeof__(&sym) field;
    TEST_API_LIST
#undef API
} api;

static void *api_load_one(const char *mode, void *handle, const char *base, const char *sym)
{
    static CUresult (*gpa2)(const char *, void **, int, cuuint64_t,
                            CUdriverProcAddressQueryResult *);
    static CUresult (*gpa1)(const char *, void **, int, cuuint64_t);
    void *fn = NULL;
    char name[64];
    int version = 12040;
    snprintf(name, sizeof name, "%s", base);
    if (strchr(name, '@'))
        version = atoi(strchr(name, '@') + 1), *strchr(name, '@') = '\0';
    base = name;
    if (strcmp(mode, "dlsym") == 0)
        return dlsym(handle, sym);
    if (strcmp(mode, "procaddr_v1") == 0) {
        if (!gpa1)
            gpa1 = (__typeof__(gpa1))dlsym(handle, "cuGetProcAddress");
        return gpa1 && gpa1(base, &fn, version < 11080 ? version : 11080, 0) == CUDA_SUCCESS ? fn
                                                                                    : NULL;
    }
    if (!gpa2) {
        /* As the CUDA 12 runtime: the v1 entry point, asked for the current one. */
        gpa1 = (__typeof__(gpa1))dlsym(handle, "cuGetProcAddress");
        if (!gpa1 || gpa1("cuGetProcAddress", (void **)&gpa2, 12040, 0) != CUDA_SUCCESS)
            return NULL;
    }
    CUdriverProcAddressQueryResult status;
    cuuint64_t flags = strcmp(mode, "procaddr_pt") == 0
                           ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                           : CU_GET_PROC_ADDRESS_DEFAULT;
    return gpa2(base, &fn, version, flags, &status) == CUDA_SUCCESS ? fn : NULL;
}

/* Fills `api` by mode; exits 2 if the driver cannot be had. A function the
 * driver does not give out for the mode's version stays NULL. */
static void api_load(const char *mode)
{
    if (strcmp(mode, "link") == 0) {
#define API(field, base, sym) api.field = sym;
        TEST_API_LIST
#undef API
        return;
    }
    if (strcmp(mode, "dlsym") && strcmp(mode, "procaddr") && strcmp(mode, "procaddr_pt") &&
        strcmp(mode, "procaddr_v1")) {
        fprintf(stderr, "unknown resolve mode '%s'\n", mode);
        exit(2);
    }
    void *handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        exit(2);
    }
#define API(field, base, sym) api.field = (__typeof__(&sym))api_load_one(mode, handle, base, #sym);
    TEST_API_LIST
#undef API
}

static void api_check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, rc);
        exit(2);
    }
}

#endif
