/* Launches kernels back to back for a while and reports how many ran.
 *
 *   launch_load <seconds> [grids=1000] [kind=kernel] [resolve=link] [sync=1] [threads=1]
 *
 * grids: one grid size, or several separated by commas ("100,20000"): each
 * launch then picks one at random (a mix of short and long kernels).
 * kind: kernel (cuLaunchKernel), ex (cuLaunchKernelEx), coop
 * (cuLaunchCooperativeKernel), graph (cuGraphLaunch of one-kernel graphs).
 * On the simulated driver a kernel of `grid` blocks takes grid microseconds
 * of GPU time (VGPU_SIM_NS_PER_BLOCK). sync=1 waits for each launch (the GPU
 * sees one kernel at a time from this process); sync=0 only at the end.
 * threads>1: that many threads launch at once, each on its own stream (with
 * resolve=link only).
 * Prints: launches=<n> seconds=<wall> gpu_ms=<GPU time of the kernels launched>
 * busy_share=<gpu time / wall> per_thread=<n/threads/wall> per_cpu_second=<launches
 * per second of the launching threads' own CPU time: the per-thread rate with a
 * core each, robust to other load> per_second=<n/wall>
 * (the simulated GPU time follows from the grid sizes: the ground truth of how
 * much of the GPU this process used, whatever the CPU load). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api.h"

#define MAX_GRIDS 8
#define MAX_THREADS 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *kind;
static unsigned grids[MAX_GRIDS];
static int ngrids, sync_each;
static double end_at;
static CUcontext ctx;
static CUfunction fn;
static CUgraphExec execs[MAX_GRIDS];

struct worker {
    pthread_t tid;
    CUstream stream;
    unsigned long long launches, blocks;
    double cpu_s; /* CPU time the thread used */
    unsigned rng;
};

static void *work(void *arg)
{
    struct worker *w = arg;
    if (w->stream)
        api_check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    while (now_s() < end_at) {
        int i = ngrids > 1 ? (int)((w->rng = w->rng * 1103515245u + 12345u) >> 16) % ngrids : 0;
        unsigned grid = grids[i];
        CUlaunchConfig config = {grid, 1, 1, 32, 1, 1, 0, w->stream, NULL, 0};
        CUresult rc;
        if (strcmp(kind, "kernel") == 0)
            rc = api.cuLaunchKernel(fn, grid, 1, 1, 32, 1, 1, 0, w->stream, NULL, NULL);
        else if (strcmp(kind, "ex") == 0)
            rc = api.cuLaunchKernelEx(&config, fn, NULL, NULL);
        else if (strcmp(kind, "coop") == 0)
            rc = api.cuLaunchCooperativeKernel(fn, grid, 1, 1, 32, 1, 1, 0, w->stream, NULL);
        else
            rc = api.cuGraphLaunch(execs[i], w->stream);
        api_check(rc, "launch");
        w->launches++;
        w->blocks += grid;
        if (sync_each)
            api_check(api.cuStreamSynchronize(w->stream), "cuStreamSynchronize");
    }
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    w->cpu_s = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: launch_load <seconds> [grids] [kind] [resolve] [sync] [threads]\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    const char *spec = argc > 2 ? argv[2] : "1000";
    for (const char *p = spec; *p && ngrids < MAX_GRIDS; p += strcspn(p, ","), p += *p == ',')
        grids[ngrids++] = (unsigned)atoi(p);
    kind = argc > 3 ? argv[3] : "kernel";
    const char *resolve = argc > 4 ? argv[4] : "link";
    api_load(resolve);
    sync_each = argc > 5 ? atoi(argv[5]) : 1;
    int threads = argc > 6 ? atoi(argv[6]) : 1;
    if (ngrids < 1 || threads < 1 || threads > MAX_THREADS ||
        (threads > 1 && strcmp(resolve, "link") != 0))
        return fprintf(stderr, "bad grids '%s' or threads %d\n", spec, threads), 2;
    if (strcmp(kind, "kernel") && strcmp(kind, "ex") && strcmp(kind, "coop") &&
        strcmp(kind, "graph"))
        return fprintf(stderr, "unknown kind '%s'\n", kind), 2;
    const char *npb = getenv("VGPU_SIM_NS_PER_BLOCK");
    double ns_per_block = npb && *npb ? atof(npb) : 1000;

    CUresult rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init_result=%d\n", rc);
        return 1;
    }
    CUdevice dev;
    CUmodule mod;
    api_check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    api_check(api.cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    api_check(api.cuModuleLoadData(&mod, "vgpu-sim"), "cuModuleLoadData");
    api_check(api.cuModuleGetFunction(&fn, mod, "spin"), "cuModuleGetFunction");
    if (strcmp(kind, "graph") == 0) {
        for (int i = 0; i < ngrids; i++) {
            CUgraph g;
            CUgraphNode node;
            CUDA_KERNEL_NODE_PARAMS p = {fn, grids[i], 1, 1, 32, 1, 1, 0, NULL, NULL};
            api_check(api.cuGraphCreate(&g, 0), "cuGraphCreate");
            api_check(api.cuGraphAddKernelNode(&node, g, NULL, 0, &p), "cuGraphAddKernelNode");
            api_check(api.cuGraphInstantiateWithFlags(&execs[i], g, 0),
                      "cuGraphInstantiateWithFlags");
        }
    }

    static struct worker workers[MAX_THREADS];
    double start = now_s();
    end_at = start + seconds;
    for (int t = 0; t < threads; t++) {
        workers[t].rng = 12345u + (unsigned)t;
        if (threads > 1) {
            api_check(cuStreamCreate(&workers[t].stream, 0), "cuStreamCreate");
            if (pthread_create(&workers[t].tid, NULL, work, &workers[t]) != 0)
                return fprintf(stderr, "pthread_create failed\n"), 2;
        }
    }
    if (threads == 1)
        work(&workers[0]);
    unsigned long long launches = 0, blocks = 0;
    double cpu_s = 0;
    for (int t = 0; t < threads; t++) {
        if (threads > 1)
            pthread_join(workers[t].tid, NULL);
        launches += workers[t].launches;
        blocks += workers[t].blocks;
        cpu_s += workers[t].cpu_s;
    }
    api_check(api.cuCtxSynchronize(), "cuCtxSynchronize");
    double wall = now_s() - start, gpu_ms = (double)blocks * ns_per_block / 1e6;
    /* per_second last: older callers split the line on it. */
    printf("launches=%llu seconds=%.3f gpu_ms=%.1f busy_share=%.4f per_thread=%.1f "
           "per_cpu_second=%.1f per_second=%.1f\n",
           launches, wall, gpu_ms, gpu_ms / 1e3 / wall, (double)launches / threads / wall,
           cpu_s > 0 ? (double)launches / cpu_s : 0.0, (double)launches / wall);
    return 0;
}
