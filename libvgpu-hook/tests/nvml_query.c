/* Asks NVML what nvidia-smi asks, the way nvidia-smi does: dlopen of
 * libnvidia-ml.so.1 and dlsym on its handle.
 * Prints "count=<n>", then per device:
 *   device=<i> uuid=<uuid> total_mib=<t> used_mib=<u> free_mib=<f> total2_mib=<t> used2_mib=<u>
 * Exit 2 on an NVML error (named on stderr). */
#include <dlfcn.h>
#include <stdio.h>

#include "nvml_api.h"

#define MIB (1024ull * 1024ull)
#define GET(name) __typeof__(&name) p_##name = (__typeof__(&name))dlsym(h, #name)

static int check(nvmlReturn_t rc, const char *what)
{
    if (rc != NVML_SUCCESS)
        fprintf(stderr, "%s failed: %d\n", what, rc);
    return rc != NVML_SUCCESS;
}

int main(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return fprintf(stderr, "dlopen: %s\n", dlerror()), 2;
    GET(nvmlInit_v2);
    GET(nvmlDeviceGetCount_v2);
    GET(nvmlDeviceGetHandleByIndex_v2);
    GET(nvmlDeviceGetUUID);
    GET(nvmlDeviceGetMemoryInfo);
    GET(nvmlDeviceGetMemoryInfo_v2);
    GET(nvmlShutdown);
    if (!p_nvmlInit_v2 || !p_nvmlDeviceGetCount_v2 || !p_nvmlDeviceGetHandleByIndex_v2 ||
        !p_nvmlDeviceGetUUID || !p_nvmlDeviceGetMemoryInfo || !p_nvmlDeviceGetMemoryInfo_v2 ||
        !p_nvmlShutdown)
        return fprintf(stderr, "missing NVML functions\n"), 2;
    unsigned n;
    if (check(p_nvmlInit_v2(), "nvmlInit_v2") || check(p_nvmlDeviceGetCount_v2(&n), "count"))
        return 2;
    printf("count=%u\n", n);
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        char uuid[96];
        nvmlMemory_t m;
        nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
        if (check(p_nvmlDeviceGetHandleByIndex_v2(i, &d), "handle") ||
            check(p_nvmlDeviceGetUUID(d, uuid, sizeof uuid), "uuid") ||
            check(p_nvmlDeviceGetMemoryInfo(d, &m), "memory") ||
            check(p_nvmlDeviceGetMemoryInfo_v2(d, &m2), "memory v2"))
            return 2;
        printf("device=%u uuid=%s total_mib=%llu used_mib=%llu free_mib=%llu total2_mib=%llu "
               "used2_mib=%llu\n",
               i, uuid, m.total / MIB, m.used / MIB, m.free / MIB, m2.total / MIB, m2.used / MIB);
    }
    p_nvmlShutdown();
    return 0;
}
