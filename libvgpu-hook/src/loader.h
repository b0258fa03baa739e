/* Where the hook's limits come from, in order:
 *   1. $VGPU_CONTAINER_DIR/limits (default dir /var/run/vgpu), waited for up to
 *      $VGPU_LIMIT_WAIT_MS (default 10000), polling every 20 ms;
 *   2. $VGPU_MEMORY_LIMIT_MIB, applied to every device;
 *   3. nothing: unlimited, with a warning.
 * A limit file (or VGPU_MEMORY_LIMIT_MIB) that cannot be read or parsed is an
 * error: the hook refuses to run with unknown limits. */
#ifndef VGPU_LOADER_H
#define VGPU_LOADER_H

#include <stdint.h>

#include "limits.h"

struct vgpu_memory_limits {
    uint64_t mib[VGPU_MAX_DEVICES]; /* per device ordinal; 0 = unlimited */
    int described_devices;          /* device_count of the limit file; -1 if none */
};

/* Blocks while waiting for the limit file; logs what it decided.
 * Returns 0, or -1 if the limits are unknown (already logged). */
int vgpu_load_memory_limits(struct vgpu_memory_limits *out);

#endif
