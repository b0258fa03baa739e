/* Internals shared by the simulated libcuda.so.1 and libnvidia-ml.so.1.
 *
 * Environment (read once, at cuInit / nvmlInit):
 *   VGPU_SIM_GPUS=<count>x<MiB>       devices (default 1x40960)
 *   VGPU_SIM_UUIDS=<uuid>,<uuid>...   their UUIDs (default GPU-5e4c0000-0000-4000-8000-<index>)
 *   VGPU_SIM_NS_PER_BLOCK=<ns>        time a kernel takes per block of its grid (default 1000)
 *   VGPU_SIM_QUEUE_US=<us>            how far ahead of the GPU a stream may queue before a
 *                                     launch blocks (default 20000), like a full launch queue
 *   VGPU_SIM_PRIVATE_MEMORY=1         each process sees the whole card, as if alone on it
 *                                     (for tests whose programs each take a whole card)
 *   VGPU_SIM_HOST_MIB=<MiB>           host memory a process's managed memory may page out
 *                                     to (default 0: managed memory must fit on the card)
 *   VGPU_SIM_STATE_DIR=<dir>          where the per-device timelines and process tables
 *                                     (sim_procs.h) shared by all processes live
 *                                     (default /tmp/vgpu-sim-<uid>) */
#ifndef VGPU_SIM_H
#define VGPU_SIM_H

#include <stdatomic.h>
#include <stdint.h>

#define SIM_EXPORT __attribute__((visibility("default")))
#define SIM_MAX_DEVICES 16
#define SIM_UUID_LEN 96

struct sim_config {
    int device_count;
    unsigned long long mib;
    char uuid[SIM_MAX_DEVICES][SIM_UUID_LEN];
    uint64_t ns_per_block, queue_ns;
    uint64_t host_mib; /* VGPU_SIM_HOST_MIB */
    int private_memory; /* VGPU_SIM_PRIVATE_MEMORY=1 */
    char state_dir[512];
};

/* Parses the environment; 0, or -1 after printing "vgpu-sim: ..." to stderr. */
int sim_load_config(struct sim_config *out);

/* One simulated GPU as all processes see it: kernels from every process run
 * one after another on it (time-sharing, first come first served). Lives in a
 * file under the state dir, mapped shared. */
struct sim_timeline {
    _Atomic uint64_t busy_until_ns; /* CLOCK_MONOTONIC: when the last queued kernel ends */
    _Atomic uint64_t busy_ns_total; /* sum of kernel time ever queued */
};

/* Maps the timeline of device dev (a private one if the state dir is unusable). */
struct sim_timeline *sim_timeline_open(const struct sim_config *cfg, int dev);

uint64_t sim_now_ns(void);
void sim_sleep_until(uint64_t t_ns);

#endif
