/* Allocates device memory in chunks until the first failure, then reports.
 *
 *   alloc_limit [chunk_mib=100] [device=0] [threads=1]
 *
 * Linked against libcuda (the simulated one in tests). With several threads,
 * each allocates on the same context until its first failure. Prints one line:
 *   allocated_mib=<n> result=<first failure> total_mib=<t> free_mib=<f>
 *   device_total_mib=<d> free_after_mib=<f after freeing everything>
 * or, if cuInit fails, "init_result=<code>" and exits 1. Exit 2 on any other
 * unexpected driver error (named on stderr). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_api.h"

#define MIB (1024ull * 1024ull)
#define MAX_THREADS 64

struct worker {
    CUcontext ctx;
    size_t chunk;
    CUdeviceptr *ptrs;
    size_t count, cap;
    CUresult result;
};

static void *allocate_until_failure(void *arg)
{
    struct worker *w = arg;
    if ((w->result = cuCtxSetCurrent(w->ctx)) != CUDA_SUCCESS)
        return NULL;
    for (;;) {
        if (w->count == w->cap) {
            w->cap = w->cap ? 2 * w->cap : 64;
            w->ptrs = realloc(w->ptrs, w->cap * sizeof *w->ptrs);
            if (!w->ptrs) {
                perror("alloc_limit: realloc");
                exit(2);
            }
        }
        CUresult rc = cuMemAlloc_v2(&w->ptrs[w->count], w->chunk);
        if (rc != CUDA_SUCCESS) {
            w->result = rc;
            return NULL;
        }
        w->count++;
    }
}

static void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "alloc_limit: %s failed: %d\n", what, rc);
        exit(2);
    }
}

int main(int argc, char **argv)
{
    unsigned long long chunk_mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 100;
    int ordinal = argc > 2 ? atoi(argv[2]) : 0;
    int nthreads = argc > 3 ? atoi(argv[3]) : 1;
    if (chunk_mib == 0 || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr, "usage: alloc_limit [chunk_mib>0] [device] [threads 1-%d]\n", MAX_THREADS);
        return 2;
    }

    CUresult rc = cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init_result=%d\n", rc);
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    check(cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");

    struct worker workers[MAX_THREADS] = {0};
    pthread_t threads[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        workers[i].ctx = ctx;
        workers[i].chunk = chunk_mib * MIB;
        if (pthread_create(&threads[i], NULL, allocate_until_failure, &workers[i]) != 0) {
            fprintf(stderr, "alloc_limit: pthread_create failed\n");
            return 2;
        }
    }
    size_t chunks = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(threads[i], NULL);
        chunks += workers[i].count;
        if (workers[i].result != workers[0].result) {
            fprintf(stderr, "alloc_limit: threads failed differently: %d vs %d\n",
                    workers[i].result, workers[0].result);
            return 2;
        }
    }

    size_t free_bytes, total_bytes, device_total, free_after, total_after;
    check(cuMemGetInfo_v2(&free_bytes, &total_bytes), "cuMemGetInfo_v2");
    check(cuDeviceTotalMem_v2(&device_total, dev), "cuDeviceTotalMem_v2");
    for (int i = 0; i < nthreads; i++) {
        while (workers[i].count > 0)
            check(cuMemFree_v2(workers[i].ptrs[--workers[i].count]), "cuMemFree_v2");
        free(workers[i].ptrs);
    }
    check(cuMemGetInfo_v2(&free_after, &total_after), "cuMemGetInfo_v2 after freeing");
    check(cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2");

    printf("allocated_mib=%llu result=%d total_mib=%llu free_mib=%llu device_total_mib=%llu "
           "free_after_mib=%llu\n",
           chunks * chunk_mib, workers[0].result, (unsigned long long)(total_bytes / MIB),
           (unsigned long long)(free_bytes / MIB), (unsigned long long)(device_total / MIB),
           (unsigned long long)(free_after / MIB));
    return 0;
}
