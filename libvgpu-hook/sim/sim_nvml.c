/* Simulated NVML (libnvidia-ml.so.1): the devices of VGPU_SIM_GPUS with the
 * UUIDs of VGPU_SIM_UUIDS (sim.h), the compute processes of each device and
 * their memory from the simulated driver's process table (sim_procs.h: what
 * every process really holds, hook or no hook, with PIDs as the caller's PID
 * namespace sees them), used memory as their sum, and GPU utilisation from the
 * shared timeline the simulated driver's kernels run on. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "nvml_api.h"
#include "sim.h"
#include "sim_procs.h"

#define MIB (1024ull * 1024ull)

struct nvmlDevice_st {
    int index;
    uint64_t last_sample_ns, last_busy_ns; /* for utilisation between two calls */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static struct sim_config cfg;
static struct nvmlDevice_st devices[SIM_MAX_DEVICES];
static struct sim_timeline *timelines[SIM_MAX_DEVICES];
/* Opened once and never closed: closing would drop the locks by which this
 * process's own simulated driver shows its slots (sim_procs.h). */
static struct sim_procs procs[SIM_MAX_DEVICES];
static int procs_open[SIM_MAX_DEVICES];

SIM_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&mu);
    if (init_count == 0) {
        if (sim_load_config(&cfg) != 0) {
            rc = NVML_ERROR_UNKNOWN;
        } else {
            for (int i = 0; i < cfg.device_count; i++) {
                devices[i].index = i;
                if (!timelines[i])
                    timelines[i] = sim_timeline_open(&cfg, i);
                if (!procs_open[i])
                    (void)sim_procs_open(&procs[i], cfg.state_dir, cfg.uuid[i]), procs_open[i] = 1;
            }
        }
    }
    if (rc == NVML_SUCCESS)
        init_count++;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInit_v2();
}

/* pynvml's nvmlInit; no flag changes anything here. */
SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return nvmlInit_v2();
}

SIM_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&mu);
    nvmlReturn_t rc = init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (init_count > 0)
        init_count--;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    default:
        return "Unknown Error";
    }
}

static nvmlReturn_t ready(void)
{
    pthread_mutex_lock(&mu);
    int n = init_count;
    pthread_mutex_unlock(&mu);
    return n > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

static nvmlReturn_t valid(nvmlDevice_t d)
{
    nvmlReturn_t rc = ready();
    if (rc)
        return rc;
    return d && d >= devices && d < devices + cfg.device_count ? NVML_SUCCESS
                                                                : NVML_ERROR_INVALID_ARGUMENT;
}

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = ready();
    return rc ? rc : copy_string(version, length, "550.54.15-vgpu-sim");
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t rc = ready();
    if (rc || !count)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)cfg.device_count;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return nvmlDeviceGetCount_v2(count);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = ready();
    if (rc || !device || index >= (unsigned)cfg.device_count)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = ready();
    if (rc || !uuid || !device)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < cfg.device_count; i++) {
        if (strcmp(cfg.uuid[i], uuid) == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t rc = valid(device);
    if (rc || !index)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)device->index;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t rc = valid(device);
    return rc ? rc : copy_string(uuid, length, cfg.uuid[device->index]);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    char buf[64];
    nvmlReturn_t rc = valid(device);
    if (rc)
        return rc;
    snprintf(buf, sizeof buf, "vGPU simulated device %d", device->index);
    return copy_string(name, length, buf);
}

#define MAX_LISTED SIM_PROCS_SLOTS

/* The device's memory held by live processes. */
static unsigned long long used_bytes(nvmlDevice_t device)
{
    struct sim_proc_info found[MAX_LISTED];
    unsigned long long used = 0;
    pthread_mutex_lock(&mu);
    int n = sim_procs_list(&procs[device->index], found, MAX_LISTED);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n && i < MAX_LISTED; i++)
        used += found[i].used_bytes;
    return used < cfg.mib * MIB ? used : cfg.mib * MIB;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t rc = valid(device);
    if (rc || !memory)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    memory->total = cfg.mib * MIB;
    memory->used = used_bytes(device);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t rc = valid(device);
    if (rc || !memory)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = cfg.mib * MIB;
    memory->reserved = 0;
    memory->used = used_bytes(device);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* Busy share of the time since the previous call on this device. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *u)
{
    nvmlReturn_t rc = valid(device);
    if (rc || !u)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&mu);
    uint64_t now = sim_now_ns();
    uint64_t busy = timelines[device->index] ? atomic_load(&timelines[device->index]->busy_ns_total)
                                             : 0;
    uint64_t dt = now - device->last_sample_ns, db = busy - device->last_busy_ns;
    u->gpu = device->last_sample_ns && dt ? (unsigned)(db >= dt ? 100 : db * 100 / dt) : 0;
    u->memory = 0;
    device->last_sample_ns = now;
    device->last_busy_ns = busy;
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

/* NVML's two-call protocol: too small a buffer (or none) gets the count and
 * INSUFFICIENT_SIZE; no processes is SUCCESS with a count of 0. */
static nvmlReturn_t running(nvmlDevice_t device, unsigned int *count, struct sim_proc_info *found,
                            int *n)
{
    nvmlReturn_t rc = valid(device);
    if (rc || !count)
        return rc ? rc : NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&mu);
    *n = sim_procs_list(&procs[device->index], found, MAX_LISTED);
    pthread_mutex_unlock(&mu);
    if (*n > MAX_LISTED)
        *n = MAX_LISTED;
    if ((unsigned)*n > *count) {
        *count = (unsigned)*n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = (unsigned)*n;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                                unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos)
{
    struct sim_proc_info found[MAX_LISTED];
    int n;
    nvmlReturn_t rc = running(device, infoCount, found, &n);
    if (rc)
        return rc;
    if (n && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++) {
        infos[i].pid = found[i].pid;
        infos[i].usedGpuMemory = found[i].used_bytes;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
    }
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                                unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos)
{
    return nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                                             unsigned int *infoCount,
                                                             nvmlProcessInfo_v1_t *infos)
{
    struct sim_proc_info found[MAX_LISTED];
    int n;
    nvmlReturn_t rc = running(device, infoCount, found, &n);
    if (rc)
        return rc;
    if (n && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++) {
        infos[i].pid = found[i].pid;
        infos[i].usedGpuMemory = found[i].used_bytes;
    }
    return NVML_SUCCESS;
}

/* A forked child must not inherit mu locked by a thread it does not have:
 * held across fork, released on both sides. */
static void fork_lock(void)
{
    pthread_mutex_lock(&mu);
}

static void fork_unlock(void)
{
    pthread_mutex_unlock(&mu);
}

__attribute__((constructor)) static void sim_register_fork_handlers(void)
{
    pthread_atfork(fork_lock, fork_unlock, fork_unlock);
}
