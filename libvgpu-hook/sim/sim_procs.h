/* The simulated GPU's per-process memory, as the driver knows it and NVML
 * lists it: one table per device, shared by every process through a file
 * under the state dir, `<state dir>/<uuid>.procs` (keyed by UUID, not index,
 * so a container that sees only some GPUs, renumbered, still shares them).
 *
 * Each process that holds a context or device memory on a device owns one
 * slot, and holds a POSIX record lock on the slot's first byte while it lives.
 * The kernel drops the lock when the process dies, however it dies, so a slot
 * is live exactly while its lock is held; and F_GETLK reports the holder's
 * PID as the reader's PID namespace sees it, so a reader on the host (the
 * node agent) gets host PIDs, as NVML does on hardware. The driver charges
 * every allocation here whether or not a hook saw it: a process that calls the
 * driver directly (RTLD_DEEPBIND, dlsym on libcuda, no LD_PRELOAD) or fools
 * the hook's accounting still shows its real usage.
 *
 * Layout (little-endian, read by services/nodeagent/gpus/simulated.py too):
 *   header, 64 bytes: u64 magic SIM_PROCS_MAGIC, u32 version 1, u32 slot count
 *   slot i at 64 + 64*i: u64 used bytes, i32 pid (in the owner's own PID
 *   namespace), u32 0, u64 PID-namespace inode, u64 start time (clock ticks
 *   since boot, /proc/<pid>/stat field 22), u64 GPU time (ns) of the kernels the
 *   process queued on the device (what NVML's per-process SM samples measure on
 *   hardware), 24 bytes reserved. The GPU-time field was reserved (zero) before,
 *   so readers of version 1 that ignore it are unaffected. */
#ifndef VGPU_SIM_PROCS_H
#define VGPU_SIM_PROCS_H

#include <stdatomic.h>
#include <stdint.h>

#include "sim.h"

#define SIM_PROCS_MAGIC 0x31534f5250534756ull /* "VGSPROS1" */
#define SIM_PROCS_VERSION 1
#define SIM_PROCS_SLOTS 256

struct sim_proc_slot {
    _Atomic uint64_t used_bytes;
    int32_t pid;
    uint32_t reserved0;
    uint64_t pidns_inode;
    uint64_t start_ticks;
    _Atomic uint64_t busy_ns;
    uint64_t reserved[3];
};

struct sim_proc_table {
    uint64_t magic;
    uint32_t version, slots;
    uint8_t reserved[48];
    struct sim_proc_slot slot[SIM_PROCS_SLOTS];
};

/* One device's table as this process has it mapped. */
struct sim_procs {
    struct sim_proc_table *table;
    int fd;
    int mine;      /* index of this process's slot, -1 before it took one */
    int mine_pid;  /* getpid() when it took it: a forked child takes its own */
    char path[640];
};

/* Maps the table of the device with this UUID; 0, or -1 (the device then
 * records nothing, and says so on stderr once). */
int sim_procs_open(struct sim_procs *p, const char *state_dir, const char *uuid);

/* Adds delta bytes to this process's figure on the device (taking a slot
 * first if it has none yet; delta 0 just makes the process show). Callers
 * serialise calls on one struct sim_procs. */
void sim_procs_charge(struct sim_procs *p, int64_t delta);

/* Adds ns of GPU time to this process's figure on the device. Lock-free (a kernel
 * launch calls it); does nothing before the process took a slot (its first
 * context does) or in a forked child that has not taken its own yet. */
void sim_procs_busy(struct sim_procs *p, uint64_t ns);

struct sim_proc_info {
    unsigned pid;                 /* as the caller's PID namespace sees it */
    unsigned long long used_bytes;
};

/* What every other live process holds on the device (the card is shared: an
 * allocation fits only in what none of them holds). */
uint64_t sim_procs_others_used(struct sim_procs *p);

/* The live processes of the device, at most max of them into out; returns how
 * many there are (which may exceed max). */
int sim_procs_list(struct sim_procs *p, struct sim_proc_info *out, int max);

#endif
