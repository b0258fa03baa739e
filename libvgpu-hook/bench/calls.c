/* Microbenchmark of the driver calls the hook intercepts, for bench/hook.py.
 *
 *   calls launch <batches> <per_batch>  median ns per cuLaunchKernel (1 block)
 *   calls alloc <batches> <per_batch>   median ns per cuMemAlloc_v2 (1 MiB; freed untimed)
 *   calls init                          microseconds from main() to the first allocation done:
 *                                       cuInit, a context, one cuMemAlloc_v2
 * Linked against libcuda (the simulated one); run with or without the hook
 * preloaded. Prints "<what>_ns=<median>" or "init_us=<n>". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"

int main(int argc, char **argv)
{
    unsigned long long start = now_ns();
    if (argc < 2)
        return fprintf(stderr, "usage: calls launch|alloc|init [batches per_batch]\n"), 2;
    const char *what = argv[1];
    int batches = argc > 2 ? atoi(argv[2]) : 200, per = argc > 3 ? atoi(argv[3]) : 1000;
    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    if (strcmp(what, "init") == 0) {
        CUdeviceptr p;
        check(cuMemAlloc_v2(&p, 1 << 20), "cuMemAlloc_v2");
        printf("init_us=%llu\n", (now_ns() - start) / 1000);
        return 0;
    }
    if (batches < 1 || per < 1)
        return 2;
    double *per_call = malloc(sizeof(double) * (size_t)batches);
    CUdeviceptr *ptrs = malloc(sizeof(CUdeviceptr) * (size_t)per);
    CUmodule mod;
    CUfunction fn;
    check(cuModuleLoadData(&mod, "vgpu-sim"), "cuModuleLoadData");
    check(cuModuleGetFunction(&fn, mod, "spin"), "cuModuleGetFunction");
    for (int b = 0; b < batches; b++) {
        unsigned long long t0 = now_ns();
        if (strcmp(what, "launch") == 0) {
            for (int i = 0; i < per; i++)
                check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "launch");
        } else if (strcmp(what, "alloc") == 0) {
            for (int i = 0; i < per; i++)
                check(cuMemAlloc_v2(&ptrs[i], 1 << 20), "cuMemAlloc_v2");
        } else {
            return fprintf(stderr, "unknown '%s'\n", what), 2;
        }
        per_call[b] = (double)(now_ns() - t0) / per;
        if (strcmp(what, "alloc") == 0)
            for (int i = 0; i < per; i++)
                check(cuMemFree_v2(ptrs[i]), "cuMemFree_v2");
    }
    qsort(per_call, (size_t)batches, sizeof *per_call, cmp);
    printf("%s_ns=%.1f\n", what, per_call[batches / 2]);
    return 0;
}
