/* The relay protocol's lines (PROTOCOL.md, "Relay socket"): building the
 * hook's messages and reading the agent's `util`. Pure, unit-tested. Each
 * builder writes one line with its '\n' and returns its length, or -1 if it
 * does not fit in len (at most 4096, the protocol's line limit). */
#ifndef VGPU_RELAY_MSG_H
#define VGPU_RELAY_MSG_H

#include <stddef.h>
#include <stdint.h>

#define VGPU_RELAY_MAX_LINE 4096

struct vgpu_hello_device {
    int index;
    const char *uuid;
    uint64_t limit_mib;
    unsigned cores;
};

struct vgpu_usage_device {
    int index;
    uint64_t used_mib, process_used_mib;
    int64_t spilled_mib; /* of used_mib: virtual device memory; -1 = not on (field left out) */
};

struct vgpu_util {
    int index;
    double sm_util, container_sm_util; /* container_sm_util < 0: unknown */
};

int vgpu_msg_hello(char *buf, size_t len, int pid, const char *comm,
                   const struct vgpu_hello_device *devices, int n);
int vgpu_msg_usage(char *buf, size_t len, int pid, uint64_t ts_ms,
                   const struct vgpu_usage_device *devices, int n, uint64_t launches,
                   uint64_t throttled_ms);
int vgpu_msg_exit(char *buf, size_t len, int pid);

/* Reads a `util` line (without its '\n'). Returns how many devices were put
 * in out (at most max), or -1 if the line is not a well-formed v1 util
 * message. Unknown fields are ignored. */
int vgpu_msg_parse_util(const char *line, size_t len, struct vgpu_util *out, int max);

#endif
