/* What the hook enforces, and where it comes from (../PROTOCOL.md, "Where the
 * hook reads its configuration").
 *
 * Inside a container, that is whenever /var/run/vgpu (or /run/vgpu) exists,
 * only the node agent's files count, and no environment variable changes them:
 *   /var/run/vgpu/hook.conf      wait for the limit file, compute policy
 *   /var/run/vgpu/limits         the limits (waited for, then required)
 *   /var/run/vgpu-state/         hook.region and relay.sock (read-write)
 * Both files must be regular files (never followed through a symlink) on a
 * read-only mount. If the limits never appear, or cannot be read, or the
 * region is not the hook's own layout, CUDA initialisation fails.
 *
 * On a bare host without that directory (development, tests), the
 * environment decides: $VGPU_CONTAINER_DIR (default /var/run/vgpu) holds
 * limits, hook.region and relay.sock; $VGPU_LIMIT_WAIT_MS (default 10000) is
 * the wait; else $VGPU_MEMORY_LIMIT_MIB for every device; else unlimited, with
 * a warning. VGPU_CONTEXT_OVERHEAD_MIB charges each context when the limit
 * file has no context_overhead_mib; VGPU_COMPUTE_POLICY is share (default):
 * hold each device to its cores share while others use the GPU; hard: always;
 * off: never throttle. */
#ifndef VGPU_CONFIG_H
#define VGPU_CONFIG_H

#include <stdint.h>

#include "limits.h"

#define VGPU_FIXED_DIR "/var/run/vgpu"
#define VGPU_FIXED_STATE_DIR "/var/run/vgpu-state"
#define VGPU_HOOK_CONF_FILE "hook.conf"
#define VGPU_DEFAULT_WAIT_MS 10000

struct vgpu_config {
    int in_container;                    /* the fixed directory exists: agent files only */
    char dir[4096];                      /* where the limit file is */
    char state_dir[4096];                /* where hook.region and relay.sock are */
    uint64_t memory_mib[VGPU_MAX_DEVICES]; /* per device ordinal; 0 = unlimited */
    unsigned cores[VGPU_MAX_DEVICES];    /* 0 or 100 = not limited */
    char uuid[VGPU_MAX_DEVICES][128];    /* "" when not given */
    int described_devices;               /* device_count of the limit file; -1 if none */
    uint64_t context_overhead_mib;
    int virtual_memory[VGPU_MAX_DEVICES]; /* 1: spill to managed memory when the card is full */
    uint64_t spill_limit_mib;             /* host memory all spilled allocations may take */
    enum vgpu_compute_policy policy;
};

/* Blocks while waiting for the limit file; logs what it decided.
 * Returns 0, or -1 if the limits are unknown (already logged). */
int vgpu_load_config(struct vgpu_config *out);

#endif
