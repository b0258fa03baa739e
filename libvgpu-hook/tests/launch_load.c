/* Launches kernels back to back for a while and reports how many ran.
 *
 *   launch_load <seconds> [grid=1000] [kind=kernel] [resolve=link] [sync=1]
 *
 * kind: kernel (cuLaunchKernel), ex (cuLaunchKernelEx), coop
 * (cuLaunchCooperativeKernel), graph (cuGraphLaunch of a one-kernel graph).
 * On the simulated driver a kernel of `grid` blocks takes grid microseconds
 * of GPU time (VGPU_SIM_NS_PER_BLOCK). sync=1 waits for each launch (the GPU
 * sees one kernel at a time from this process); sync=0 only at the end.
 * Prints: launches=<n> seconds=<wall> per_second=<n/wall> */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: launch_load <seconds> [grid] [kind] [resolve] [sync]\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    unsigned grid = argc > 2 ? (unsigned)atoi(argv[2]) : 1000;
    const char *kind = argc > 3 ? argv[3] : "kernel";
    api_load(argc > 4 ? argv[4] : "link");
    int sync = argc > 5 ? atoi(argv[5]) : 1;

    CUresult rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init_result=%d\n", rc);
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    api_check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    api_check(api.cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    api_check(api.cuModuleLoadData(&mod, "vgpu-sim"), "cuModuleLoadData");
    api_check(api.cuModuleGetFunction(&fn, mod, "spin"), "cuModuleGetFunction");
    CUgraphExec exec = NULL;
    if (strcmp(kind, "graph") == 0) {
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS p = {fn, grid, 1, 1, 32, 1, 1, 0, NULL, NULL};
        api_check(api.cuGraphCreate(&g, 0), "cuGraphCreate");
        api_check(api.cuGraphAddKernelNode(&node, g, NULL, 0, &p), "cuGraphAddKernelNode");
        api_check(api.cuGraphInstantiateWithFlags(&exec, g, 0), "cuGraphInstantiateWithFlags");
    }
    CUlaunchConfig config = {grid, 1, 1, 32, 1, 1, 0, NULL, NULL, 0};

    unsigned long long launches = 0;
    double start = now_s(), end = start + seconds;
    while (now_s() < end) {
        if (strcmp(kind, "kernel") == 0)
            rc = api.cuLaunchKernel(fn, grid, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        else if (strcmp(kind, "ex") == 0)
            rc = api.cuLaunchKernelEx(&config, fn, NULL, NULL);
        else if (strcmp(kind, "coop") == 0)
            rc = api.cuLaunchCooperativeKernel(fn, grid, 1, 1, 32, 1, 1, 0, NULL, NULL);
        else if (strcmp(kind, "graph") == 0)
            rc = api.cuGraphLaunch(exec, NULL);
        else
            return fprintf(stderr, "unknown kind '%s'\n", kind), 2;
        api_check(rc, "launch");
        launches++;
        if (sync)
            api_check(api.cuStreamSynchronize(NULL), "cuStreamSynchronize");
    }
    api_check(api.cuCtxSynchronize(), "cuCtxSynchronize");
    double wall = now_s() - start;
    printf("launches=%llu seconds=%.3f per_second=%.1f\n", launches, wall, (double)launches / wall);
    return 0;
}
