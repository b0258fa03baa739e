/* Allocates device memory through one path until the first failure, then
 * reports and gives everything back through the matching path.
 *
 *   mem_paths <path> [resolve=link] [context=create] [chunk_mib=64] [hold]
 *
 * path:    alloc pitch managed array array3d mipmap async pool vmm graph graph_node
 *          (graph, graph_node: one executable graph per chunk, with one allocation node,
 *          instantiated and uploaded; given back by destroying the executable graph)
 * resolve: how the driver functions are found (api.h)
 * context: create (cuCtxCreate), primary (cuDevicePrimaryCtxRetain, as the
 *          CUDA runtime does), destroy (create; at the end destroy the context
 *          instead of freeing, then report from a fresh context)
 * hold:    after the first line, wait for stdin to close before giving back
 *
 * Prints one line:
 *   allocated_mib=<n> result=<first failure> total_mib=<t> free_mib=<f>
 *   device_total_mib=<d> free_after_mib=<f after giving back>
 *
 * IPC (two processes):
 *   mem_paths ipc-export <mib> [resolve]  allocates, prints handle=<hex>, holds until stdin closes
 *   mem_paths ipc-import <hex> [resolve]  imports, prints result=<r> free_mib=<f>, closes it
 * Exit 2 on an unexpected driver error (named on stderr). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

#define MIB (1024ull * 1024ull)
#define MAX_OBJECTS 100000

static unsigned long long objects[MAX_OBJECTS];
static CUgraph graphs[MAX_OBJECTS];
static size_t count;
static CUmemoryPool pool;

/* A graph with one allocation node of `bytes` (added one way or the other), made
 * executable and uploaded: the driver takes graph memory for the executable graph. */
static CUresult graph_exec(const char *path, size_t bytes, CUgraph *graph, CUgraphExec *exec)
{
    CUgraphNode node;
    CUresult rc;
    api_check(api.cuGraphCreate(graph, 0), "cuGraphCreate");
    if (strcmp(path, "graph") == 0) {
        CUDA_MEM_ALLOC_NODE_PARAMS a = {0};
        a.poolProps.allocType = 1;
        a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a.bytesize = bytes;
        api_check(api.cuGraphAddMemAllocNode(&node, *graph, NULL, 0, &a), "cuGraphAddMemAllocNode");
        rc = api.cuGraphInstantiateWithFlags(exec, *graph, 0);
        if (rc == CUDA_SUCCESS && (rc = api.cuGraphUpload(*exec, NULL)) != CUDA_SUCCESS)
            api.cuGraphExecDestroy(*exec);
    } else {
        CUgraphNodeParams params;
        memset(&params, 0, sizeof params);
        params.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
        params.alloc.poolProps.allocType = 1;
        params.alloc.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        params.alloc.bytesize = bytes;
        api_check(api.cuGraphAddNode(&node, *graph, NULL, 0, &params), "cuGraphAddNode");
        CUstream stream;
        api_check(api.cuStreamCreate(&stream, 0), "cuStreamCreate");
        CUDA_GRAPH_INSTANTIATE_PARAMS ip = {.hUploadStream = stream};
        rc = api.cuGraphInstantiateWithParams(exec, *graph, &ip);
        api_check(api.cuStreamDestroy_v2(stream), "cuStreamDestroy_v2");
    }
    if (rc != CUDA_SUCCESS)
        api_check(api.cuGraphDestroy(*graph), "cuGraphDestroy");
    return rc;
}

static CUresult alloc_one(const char *path, size_t bytes, unsigned long long *out)
{
    CUdeviceptr p = 0;
    CUresult rc;
    if (strcmp(path, "alloc") == 0) {
        rc = api.cuMemAlloc_v2(&p, bytes);
    } else if (strcmp(path, "pitch") == 0) {
        size_t pitch;
        rc = api.cuMemAllocPitch_v2(&p, &pitch, MIB - 100, bytes / MIB, 4);
        if (rc == CUDA_SUCCESS && pitch != MIB) {
            fprintf(stderr, "pitch %zu, expected %llu\n", pitch, MIB);
            exit(2);
        }
    } else if (strcmp(path, "managed") == 0) {
        rc = api.cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL);
    } else if (strcmp(path, "array") == 0) {
        CUDA_ARRAY_DESCRIPTOR d = {MIB / 4, bytes / MIB, CU_AD_FORMAT_FLOAT, 1};
        CUarray a;
        rc = api.cuArrayCreate_v2(&a, &d);
        p = (CUdeviceptr)(uintptr_t)a;
    } else if (strcmp(path, "array3d") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR d = {MIB / 8, bytes / MIB, 2, CU_AD_FORMAT_FLOAT, 1, 0};
        CUarray a;
        rc = api.cuArray3DCreate_v2(&a, &d);
        p = (CUdeviceptr)(uintptr_t)a;
    } else if (strcmp(path, "mipmap") == 0) {
        /* level 0: rows of 1 MiB; level 1 adds a quarter: 5/4 of bytes in all */
        CUDA_ARRAY3D_DESCRIPTOR d = {MIB / 4, bytes / MIB * 4 / 5, 0, CU_AD_FORMAT_FLOAT, 1, 0};
        CUmipmappedArray m;
        rc = api.cuMipmappedArrayCreate(&m, &d, 2);
        p = (CUdeviceptr)(uintptr_t)m;
    } else if (strcmp(path, "async") == 0) {
        rc = api.cuMemAllocAsync(&p, bytes, NULL);
    } else if (strcmp(path, "pool") == 0) {
        rc = api.cuMemAllocFromPoolAsync(&p, bytes, pool, NULL);
    } else if (strcmp(path, "vmm") == 0) {
        CUmemAllocationProp prop = {0};
        prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        CUmemGenericAllocationHandle h;
        rc = api.cuMemCreate(&h, bytes, &prop, 0);
        p = h;
    } else if (strcmp(path, "graph") == 0 || strcmp(path, "graph_node") == 0) {
        CUgraphExec exec = NULL;
        rc = graph_exec(path, bytes, &graphs[count], &exec);
        p = (CUdeviceptr)(uintptr_t)exec;
    } else {
        fprintf(stderr, "unknown path '%s'\n", path);
        exit(2);
    }
    *out = p;
    return rc;
}

static void give_back(const char *path)
{
    while (count > 0) {
        unsigned long long p = objects[--count];
        CUresult rc;
        if (strcmp(path, "graph") == 0 || strcmp(path, "graph_node") == 0) {
            api_check(api.cuGraphDestroy(graphs[count]), "cuGraphDestroy");
            rc = api.cuGraphExecDestroy((CUgraphExec)(uintptr_t)p);
        } else if (strcmp(path, "array") == 0 || strcmp(path, "array3d") == 0)
            rc = api.cuArrayDestroy((CUarray)(uintptr_t)p);
        else if (strcmp(path, "mipmap") == 0)
            rc = api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)p);
        else if (strcmp(path, "async") == 0 || strcmp(path, "pool") == 0)
            rc = api.cuMemFreeAsync(p, NULL);
        else if (strcmp(path, "vmm") == 0)
            rc = api.cuMemRelease(p);
        else
            rc = api.cuMemFree_v2(p);
        api_check(rc, "giving back");
    }
    /* A pool gives back what it keeps above its release threshold (0) at a synchronisation. */
    if (strcmp(path, "async") == 0 || strcmp(path, "pool") == 0)
        api_check(api.cuCtxSynchronize(), "cuCtxSynchronize");
}

static CUcontext open_context(const char *mode, CUdevice dev)
{
    CUcontext ctx;
    if (strcmp(mode, "primary") == 0) {
        api_check(api.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
        api_check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    } else {
        api_check(api.cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    }
    return ctx;
}

static void wait_for_stdin_to_close(void)
{
    fflush(stdout);
    char buf[64];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
}

static int ipc(const char *what, const char *arg)
{
    CUdevice dev;
    api_check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    open_context("create", dev);
    if (strcmp(what, "ipc-export") == 0) {
        CUdeviceptr p;
        CUipcMemHandle h;
        api_check(api.cuMemAlloc_v2(&p, strtoull(arg, NULL, 10) * MIB), "cuMemAlloc_v2");
        api_check(api.cuIpcGetMemHandle(&h, p), "cuIpcGetMemHandle");
        printf("handle=");
        for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++)
            printf("%02x", (unsigned char)h.reserved[i]);
        printf("\n");
        wait_for_stdin_to_close();
        api_check(api.cuMemFree_v2(p), "cuMemFree_v2");
        return 0;
    }
    CUipcMemHandle h;
    for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
        unsigned v;
        if (sscanf(arg + 2 * i, "%2x", &v) != 1)
            return fprintf(stderr, "bad handle\n"), 2;
        h.reserved[i] = (char)v;
    }
    CUdeviceptr p = 0;
    size_t free_b, total_b, free_after, total_after;
    CUresult rc = api.cuIpcOpenMemHandle_v2(&p, h, 1);
    api_check(api.cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo_v2");
    if (rc == CUDA_SUCCESS)
        api_check(api.cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle");
    api_check(api.cuMemGetInfo_v2(&free_after, &total_after), "cuMemGetInfo_v2");
    printf("result=%d free_mib=%llu free_after_mib=%llu\n", rc, (unsigned long long)(free_b / MIB),
           (unsigned long long)(free_after / MIB));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: mem_paths <path> [resolve] [context] [chunk_mib] [hold]\n");
        return 2;
    }
    const char *path = argv[1];
    int ipc_mode = strncmp(path, "ipc-", 4) == 0;
    const char *resolve = argc > (ipc_mode ? 3 : 2) ? argv[ipc_mode ? 3 : 2] : "link";
    api_load(resolve);
    CUresult rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init_result=%d\n", rc);
        return 1;
    }
    if (ipc_mode)
        return argc > 2 ? ipc(path, argv[2]) : 2;
    const char *ctx_mode = argc > 3 ? argv[3] : "create";
    unsigned long long chunk = (argc > 4 ? strtoull(argv[4], NULL, 10) : 64) * MIB;
    int hold = argc > 5 && strcmp(argv[5], "hold") == 0;

    CUdevice dev;
    api_check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    CUcontext ctx = open_context(ctx_mode, dev);
    if (strcmp(path, "pool") == 0) {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = 1;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        api_check(api.cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
    }

    CUresult result;
    while (count < MAX_OBJECTS && (result = alloc_one(path, chunk, &objects[count])) == 0)
        count++;
    size_t allocated = count, free_b, total_b, device_total, free_after, total_after;
    api_check(api.cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo_v2");
    api_check(api.cuDeviceTotalMem_v2(&device_total, dev), "cuDeviceTotalMem_v2");
    if (hold) {
        printf("holding allocated_mib=%llu\n", allocated * chunk / MIB);
        wait_for_stdin_to_close();
    }
    if (strcmp(ctx_mode, "destroy") == 0) {
        api_check(api.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2");
        ctx = open_context("create", dev);
    } else {
        give_back(path);
        if (pool)
            api_check(api.cuMemPoolDestroy(pool), "cuMemPoolDestroy");
    }
    api_check(api.cuMemGetInfo_v2(&free_after, &total_after), "cuMemGetInfo_v2 after");
    if (strcmp(ctx_mode, "primary") == 0)
        api_check(api.cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease_v2");
    else
        api_check(api.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2");
    printf("allocated_mib=%llu result=%d total_mib=%llu free_mib=%llu device_total_mib=%llu "
           "free_after_mib=%llu\n",
           allocated * chunk / MIB, result, (unsigned long long)(total_b / MIB),
           (unsigned long long)(free_b / MIB), (unsigned long long)(device_total / MIB),
           (unsigned long long)(free_after / MIB));
    return 0;
}
