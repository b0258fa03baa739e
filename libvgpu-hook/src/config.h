/* What the hook enforces, and where it comes from.
 *
 * Limits, in order: $VGPU_CONTAINER_DIR/limits (default dir /var/run/vgpu),
 * waited for up to $VGPU_LIMIT_WAIT_MS (default 10000), polling every 20 ms;
 * else $VGPU_MEMORY_LIMIT_MIB for every device; else nothing: unlimited, with
 * a warning. A limit file (or variable) that cannot be read or parsed is an
 * error: the hook refuses to run with unknown limits.
 *
 * Other settings, from the environment:
 *   VGPU_CONTEXT_OVERHEAD_MIB  charge per CUDA context when the limit file has
 *                              no context_overhead_mib (default 0)
 *   VGPU_COMPUTE_POLICY        share (default): hold each device to its cores
 *                              share while others use the GPU; hard: always;
 *                              off: never throttle */
#ifndef VGPU_CONFIG_H
#define VGPU_CONFIG_H

#include <stdint.h>

#include "limits.h"

enum vgpu_compute_policy { VGPU_COMPUTE_SHARE, VGPU_COMPUTE_HARD, VGPU_COMPUTE_OFF };

struct vgpu_config {
    char dir[4096];                      /* the container directory */
    uint64_t memory_mib[VGPU_MAX_DEVICES]; /* per device ordinal; 0 = unlimited */
    unsigned cores[VGPU_MAX_DEVICES];    /* 0 or 100 = not limited */
    char uuid[VGPU_MAX_DEVICES][128];    /* "" when not given */
    int described_devices;               /* device_count of the limit file; -1 if none */
    uint64_t context_overhead_mib;
    enum vgpu_compute_policy policy;
};

/* Blocks while waiting for the limit file; logs what it decided.
 * Returns 0, or -1 if the limits are unknown (already logged). */
int vgpu_load_config(struct vgpu_config *out);

#endif
