/* Parser for the container's limit file, written by the node agent.
 * Format and semantics: ../PROTOCOL.md, section "Limit file". Pure policy:
 * no CUDA, no interception, no logging, so it is unit-tested directly. */
#ifndef VGPU_LIMITS_H
#define VGPU_LIMITS_H

#include <stdint.h>
#include <stdio.h>

#define VGPU_MAX_DEVICES 64
#define VGPU_LIMITS_VERSION 1
#define VGPU_MAX_MEMORY_MIB (UINT64_MAX >> 20) /* so that MiB -> bytes cannot overflow */

struct vgpu_device_limits {
    char uuid[128];
    uint64_t memory_limit_mib; /* 0 = unlimited */
    unsigned cores;            /* 0-100; 0 = no compute limit */
    int line_of_uuid, line_of_memory, line_of_cores; /* 0 = key absent */
    int first_line; /* first line naming this device, 0 if none */
};

struct vgpu_limits {
    unsigned version;
    int device_count;
    uint64_t context_overhead_mib; /* optional; charged per CUDA context */
    int line_of_context_overhead;  /* 0 = key absent */
    char namespace_[254], pod[254], container[254];
    struct vgpu_device_limits devices[VGPU_MAX_DEVICES];
};

/* Parses the limit file read from f; path is only used in messages.
 * Returns 0, or -1 with err set to "<path>:<line>: <problem>" (or
 * "<path>: <problem>" when no single line is at fault). */
int vgpu_limits_parse(FILE *f, const char *path, struct vgpu_limits *out, char *err,
                      size_t errlen);

/* Parses a plain decimal number (digits only, no sign, no spaces) <= max.
 * Returns 0, or -1 if s is not such a number. */
int vgpu_parse_u64(const char *s, uint64_t max, uint64_t *out);

#endif
