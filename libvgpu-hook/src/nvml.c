/* NVML interposers (nvml_functions.def): nvidia-smi and frameworks' memory
 * planners inside the container see the container's slice.
 *
 * Visible devices are the limit file's, by UUID, in its index order: device
 * counts, handles by index and indices are remapped to them (so a container
 * sees its GPUs as 0..n-1, like CUDA does). Without UUIDs for every device
 * the driver's numbering is kept. Memory info of a limited device reports
 * total = min(limit, real total), used = what the container's processes hold
 * (the shared region), free = total - used. Process lists (compute, graphics,
 * MPS; every version) show only the container's processes: those with a live
 * slot in its region. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fork.h"
#include "functions.h"
#include "liveness.h"
#include "log.h"
#include "state.h"

#define REAL_OR_RETURN(name)            \
    vgpu_##name##_fn real = REAL(name); \
    if (!real)                          \
        return NVML_ERROR_FUNCTION_NOT_FOUND

static pthread_mutex_t map_mu = PTHREAD_MUTEX_INITIALIZER;
static int mapped;  /* 1: visible[] holds the container's devices; -1: keep numbering */
static int visible_count;
static nvmlDevice_t visible[VGPU_MAX_DEVICES];
/* Held while asking NVML. */
VGPU_FORK_RESET(map_mu, &map_mu);

/* Builds the map once NVML answers (it cannot before nvmlInit). */
static int device_map(void)
{
    pthread_mutex_lock(&map_mu);
    if (!mapped) {
        int n = vgpu_cfg.described_devices, ok = n > 0;
        for (int i = 0; i < n && ok; i++)
            ok = vgpu_cfg.uuid[i][0] != '\0';
        vgpu_nvmlDeviceGetHandleByUUID_fn by_uuid = REAL(nvmlDeviceGetHandleByUUID);
        if (!ok || !by_uuid) {
            mapped = -1;
        } else {
            nvmlReturn_t rc = NVML_SUCCESS;
            for (int i = 0; i < n && rc == NVML_SUCCESS; i++)
                rc = by_uuid(vgpu_cfg.uuid[i], &visible[i]);
            if (rc == NVML_SUCCESS) {
                visible_count = n, mapped = 1;
            } else if (rc != NVML_ERROR_UNINITIALIZED) {
                vgpu_log_error("NVML does not know every device of the limit file (%d); keeping "
                               "the driver's device numbering",
                               (int)rc);
                mapped = -1;
            }
        }
    }
    int m = mapped;
    pthread_mutex_unlock(&map_mu);
    return m;
}

/* The container's index of a device, or -1 if it is not one of them. */
static int container_index(nvmlDevice_t device)
{
    if (device_map() == 1) {
        for (int i = 0; i < visible_count; i++)
            if (visible[i] == device)
                return i;
        return -1;
    }
    vgpu_nvmlDeviceGetIndex_fn get_index = REAL(nvmlDeviceGetIndex);
    unsigned idx;
    return get_index && get_index(device, &idx) == NVML_SUCCESS && idx < VGPU_MAX_DEVICES
               ? (int)idx
               : -1;
}

static nvmlReturn_t count(vgpu_nvmlDeviceGetCount_v2_fn real, unsigned int *n)
{
    nvmlReturn_t rc = real(n);
    if (rc == NVML_SUCCESS && vgpu_ready() && device_map() == 1)
        *n = (unsigned)visible_count;
    return rc;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    REAL_OR_RETURN(nvmlDeviceGetCount_v2);
    return count(real, deviceCount);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    REAL_OR_RETURN(nvmlDeviceGetCount);
    return count(real, deviceCount);
}

static nvmlReturn_t by_index(vgpu_nvmlDeviceGetHandleByIndex_v2_fn real, unsigned int index,
                             nvmlDevice_t *device)
{
    if (!vgpu_ready() || device_map() != 1)
        return real(index, device);
    if (!device || index >= (unsigned)visible_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = visible[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    REAL_OR_RETURN(nvmlDeviceGetHandleByIndex_v2);
    return by_index(real, index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    REAL_OR_RETURN(nvmlDeviceGetHandleByIndex);
    return by_index(real, index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    REAL_OR_RETURN(nvmlDeviceGetIndex);
    nvmlReturn_t rc = real(device, index);
    if (rc == NVML_SUCCESS && vgpu_ready() && device_map() == 1) {
        int i = container_index(device);
        if (i >= 0)
            *index = (unsigned)i;
    }
    return rc;
}

/* The slice of a device: 0 when it is not limited (report the driver's figures). */
static uint64_t slice(nvmlDevice_t device, uint64_t real_total, uint64_t *used)
{
    if (!vgpu_ready())
        return 0;
    int i = container_index(device);
    uint64_t limit = i >= 0 ? vgpu_limit_bytes(i) : 0;
    if (limit == 0)
        return 0;
    *used = vgpu_region_used(vgpu_region, i);
    return limit < real_total ? limit : real_total;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    REAL_OR_RETURN(nvmlDeviceGetMemoryInfo);
    nvmlReturn_t rc = real(device, memory);
    uint64_t used = 0, total;
    if (rc == NVML_SUCCESS && memory && (total = slice(device, memory->total, &used))) {
        memory->total = total;
        memory->used = used < total ? used : total;
        memory->free = total - memory->used;
    }
    return rc;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    REAL_OR_RETURN(nvmlDeviceGetMemoryInfo_v2);
    nvmlReturn_t rc = real(device, memory);
    uint64_t used = 0, total;
    if (rc == NVML_SUCCESS && memory && (total = slice(device, memory->total, &used))) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used < total ? used : total;
        memory->free = total - memory->used;
    }
    return rc;
}

/* --- process lists: only the container's processes ----------------------------------------- */

typedef nvmlReturn_t (*list_call)(void *real, nvmlDevice_t device, unsigned int *count, void *buf);

#define LIST_ON_STACK 64

/* Asks the driver for the whole list (growing the buffer as it says), keeps
 * the entries whose pid is a live process of this container's region (pids
 * as this process's PID namespace numbers them), and answers with NVML's
 * two-call protocol: too small a buffer gets the count and
 * NVML_ERROR_INSUFFICIENT_SIZE. Every entry type starts with the pid. */
static nvmlReturn_t only_ours(list_call call, void *real, size_t size, nvmlDevice_t device,
                              unsigned int *count, void *infos)
{
    if (!count || !vgpu_ready())
        return call(real, device, count, infos);
    unsigned char on_stack[LIST_ON_STACK * sizeof(nvmlProcessInfo_t)];
    unsigned char *buf = on_stack;
    unsigned cap = LIST_ON_STACK, n = cap;
    nvmlReturn_t rc = call(real, device, &n, buf);
    for (int tries = 0; rc == NVML_ERROR_INSUFFICIENT_SIZE && n > cap && tries < 4; tries++) {
        cap = n + 16; /* room for processes that start meanwhile */
        unsigned char *bigger = realloc(buf == on_stack ? NULL : buf, (size_t)cap * size);
        if (!bigger) {
            rc = NVML_ERROR_MEMORY;
            break;
        }
        buf = bigger, n = cap;
        rc = call(real, device, &n, buf);
    }
    if (rc == NVML_SUCCESS) {
        uint32_t pidns = vgpu_pidns();
        unsigned kept = 0;
        for (unsigned i = 0; i < n; i++) {
            unsigned int pid;
            memcpy(&pid, buf + (size_t)i * size, sizeof pid);
            if (vgpu_region_has_process(vgpu_region, (int32_t)pid, pidns))
                memmove(buf + (size_t)kept++ * size, buf + (size_t)i * size, size);
        }
        if (*count < kept)
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        else if (kept && !infos)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (kept)
            memcpy(infos, buf, (size_t)kept * size);
        *count = kept;
    }
    if (buf != on_stack)
        free(buf);
    return rc;
}

#define PROCESS_LIST(name, info_t)                                                             \
    static nvmlReturn_t call_##name(void *real, nvmlDevice_t device, unsigned int *count,      \
                                    void *buf)                                                 \
    {                                                                                          \
        return ((vgpu_##name##_fn)real)(device, count, (info_t *)buf);                         \
    }                                                                                          \
    nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, info_t *infos)             \
    {                                                                                          \
        REAL_OR_RETURN(name);                                                                  \
        return only_ours(call_##name, (void *)real, sizeof(info_t), device, infoCount, infos); \
    }                                                                                          \
    _Static_assert(1, "")

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t);
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t);
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t);
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t);
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t);
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t);
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t);
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t);
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t);
