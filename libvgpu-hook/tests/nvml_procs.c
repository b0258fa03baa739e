/* Lists the processes NVML shows on each device, the way nvidia-smi and
 * monitoring agents ask: dlopen of libnvidia-ml.so.1, dlsym on its handle,
 * and the two-call protocol (count first, then a buffer that size).
 * Prints per device, for every version of the compute list:
 *   device=<i> v1=<pid>:<mib>,... v2=... v3=...
 * ("-" for an empty list). Exit 2 on an NVML error (named on stderr). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "nvml_api.h"

#define MIB (1024ull * 1024ull)

typedef nvmlReturn_t (*list_v1)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *);
typedef nvmlReturn_t (*list_v3)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);

static int failed(nvmlReturn_t rc, const char *what)
{
    if (rc != NVML_SUCCESS)
        fprintf(stderr, "%s failed: %d\n", what, rc);
    return rc != NVML_SUCCESS;
}

static void print_entry(unsigned i, unsigned pid, unsigned long long used)
{
    printf("%s%u:%llu", i ? "," : "", pid, used / MIB);
}

/* Count first (no buffer), then the list; the count may have grown meanwhile. */
static int show_v1(list_v1 list, nvmlDevice_t d)
{
    unsigned n = 0;
    nvmlReturn_t rc = list(d, &n, NULL);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_INSUFFICIENT_SIZE)
        return failed(rc, "count (v1)");
    nvmlProcessInfo_v1_t *infos = calloc(n + 8, sizeof *infos);
    n += 8;
    if (!infos || failed(list(d, &n, infos), "list (v1)"))
        return 1;
    printf(" v1=%s", n ? "" : "-");
    for (unsigned i = 0; i < n; i++)
        print_entry(i, infos[i].pid, infos[i].usedGpuMemory);
    free(infos);
    return 0;
}

static int show_v3(list_v3 list, nvmlDevice_t d, const char *version)
{
    unsigned n = 0;
    nvmlReturn_t rc = list(d, &n, NULL);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_INSUFFICIENT_SIZE)
        return failed(rc, version);
    nvmlProcessInfo_t *infos = calloc(n + 8, sizeof *infos);
    n += 8;
    if (!infos || failed(list(d, &n, infos), version))
        return 1;
    printf(" %s=%s", version, n ? "" : "-");
    for (unsigned i = 0; i < n; i++)
        print_entry(i, infos[i].pid, infos[i].usedGpuMemory);
    free(infos);
    return 0;
}

int main(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return fprintf(stderr, "dlopen: %s\n", dlerror()), 2;
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))dlsym(h, "nvmlInit_v2");
    nvmlReturn_t (*count)(unsigned *) = (nvmlReturn_t(*)(unsigned *))dlsym(h, "nvmlDeviceGetCount_v2");
    nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) =
        (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    list_v1 v1 = (list_v1)dlsym(h, "nvmlDeviceGetComputeRunningProcesses");
    list_v3 v2 = (list_v3)dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v2");
    list_v3 v3 = (list_v3)dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!init || !count || !by_index || !v1 || !v2 || !v3)
        return fprintf(stderr, "missing NVML functions\n"), 2;
    unsigned n;
    if (failed(init(), "nvmlInit_v2") || failed(count(&n), "count"))
        return 2;
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        if (failed(by_index(i, &d), "handle"))
            return 2;
        printf("device=%u", i);
        if (show_v1(v1, d) || show_v3(v2, d, "v2") || show_v3(v3, d, "v3"))
            return 2;
        printf("\n");
    }
    return 0;
}
