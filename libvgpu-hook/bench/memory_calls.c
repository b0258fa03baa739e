/* Microbenchmark of the memory paths whose lifetime the hook follows, for
 * bench/hook_memory.py. Linked against libcuda (the simulated one); run with or
 * without the hook preloaded.
 *
 *   memory_calls <what> <batches> <per_batch>
 *
 * what: async  cuMemAllocAsync (1 MiB, default pool) + cuMemFreeAsync
 *       pool   the same from a pool that keeps what is freed (release threshold: max)
 *       vmm    cuMemCreate (2 MiB) + cuMemMap + cuMemUnmap + cuMemRelease
 *       graph  cuGraphInstantiateWithFlags + cuGraphExecDestroy (one 2 MiB allocation node)
 *       limit  cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE), 16 MiB and back to 8 MiB
 * Prints "<what>_ns=<median ns per operation>". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"

#define MIB (1024ull * 1024ull)
#define MAX_PER 1000

static CUdeviceptr ptrs[MAX_PER];
static CUmemoryPool pool;
static CUdeviceptr va;
static CUgraph graph;

static void setup(const char *what)
{
    if (strcmp(what, "pool") == 0) {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = 1;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        check(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
        cuuint64_t keep = UINT64_MAX;
        check(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep), "threshold");
    } else if (strcmp(what, "vmm") == 0) {
        check(cuMemAddressReserve(&va, 2 * MIB, 0, 0, 0), "cuMemAddressReserve");
    } else if (strcmp(what, "graph") == 0) {
        CUgraphNode node;
        CUDA_MEM_ALLOC_NODE_PARAMS a;
        memset(&a, 0, sizeof a);
        a.poolProps.allocType = 1;
        a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a.bytesize = 2 * MIB;
        check(cuGraphCreate(&graph, 0), "cuGraphCreate");
        check(cuGraphAddMemAllocNode(&node, graph, NULL, 0, &a), "cuGraphAddMemAllocNode");
    }
}

/* One batch of per operations. */
static void batch(const char *what, int per)
{
    if (strcmp(what, "async") == 0 || strcmp(what, "pool") == 0) {
        for (int i = 0; i < per; i++)
            check(pool ? cuMemAllocFromPoolAsync(&ptrs[i], MIB, pool, NULL)
                       : cuMemAllocAsync(&ptrs[i], MIB, NULL),
                  "alloc");
        for (int i = 0; i < per; i++)
            check(cuMemFreeAsync(ptrs[i], NULL), "cuMemFreeAsync");
    } else if (strcmp(what, "vmm") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        for (int i = 0; i < per; i++) {
            CUmemGenericAllocationHandle h;
            check(cuMemCreate(&h, 2 * MIB, &prop, 0), "cuMemCreate");
            check(cuMemMap(va, 2 * MIB, 0, h, 0), "cuMemMap");
            check(cuMemUnmap(va, 2 * MIB), "cuMemUnmap");
            check(cuMemRelease(h), "cuMemRelease");
        }
    } else if (strcmp(what, "graph") == 0) {
        for (int i = 0; i < per; i++) {
            CUgraphExec e;
            check(cuGraphInstantiateWithFlags(&e, graph, 0), "cuGraphInstantiateWithFlags");
            check(cuGraphExecDestroy(e), "cuGraphExecDestroy");
        }
    } else if (strcmp(what, "limit") == 0) {
        for (int i = 0; i < per; i++)
            check(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, i % 2 ? 8 * MIB : 16 * MIB),
                  "cuCtxSetLimit");
    } else {
        fprintf(stderr, "unknown '%s'\n", what);
        exit(2);
    }
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return fprintf(stderr, "usage: memory_calls <what> <batches> <per_batch>\n"), 2;
    const char *what = argv[1];
    int batches = atoi(argv[2]), per = atoi(argv[3]);
    if (batches < 1 || per < 1 || per > MAX_PER)
        return 2;
    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    setup(what);
    double *per_op = malloc(sizeof(double) * (size_t)batches);
    for (int b = 0; b < batches; b++) {
        unsigned long long t0 = now_ns();
        batch(what, per);
        per_op[b] = (double)(now_ns() - t0) / per;
    }
    qsort(per_op, (size_t)batches, sizeof *per_op, cmp);
    printf("%s_ns=%.1f\n", what, per_op[batches / 2]);
    return 0;
}
