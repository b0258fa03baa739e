/* Parsers for the files the node agent writes for the hook: the container's
 * limit file and the hook settings (hook.conf). Formats and semantics:
 * ../PROTOCOL.md, sections "Limit file" and "Hook settings". Pure policy: no
 * CUDA, no interception, no logging, so they are unit-tested directly. */
#ifndef VGPU_LIMITS_H
#define VGPU_LIMITS_H

#include <stdint.h>
#include <stdio.h>

#define VGPU_MAX_DEVICES 64
#define VGPU_LIMITS_VERSION 1
#define VGPU_MAX_MEMORY_MIB (UINT64_MAX >> 20) /* so that MiB -> bytes cannot overflow */
#define VGPU_HOOK_CONF_VERSION 1
#define VGPU_MAX_WAIT_MS 600000 /* ten minutes: longer is a mistake, not a wait */

enum vgpu_compute_policy { VGPU_COMPUTE_SHARE, VGPU_COMPUTE_HARD, VGPU_COMPUTE_OFF };

struct vgpu_device_limits {
    char uuid[128];
    uint64_t memory_limit_mib; /* 0 = unlimited */
    unsigned cores;            /* 0-100; 0 = no compute limit */
    int virtual_memory;        /* 1: spill what the card cannot hold to managed memory */
    int line_of_uuid, line_of_memory, line_of_cores, line_of_virtual; /* 0 = key absent */
    int first_line; /* first line naming this device, 0 if none */
};

struct vgpu_limits {
    unsigned version;
    int device_count;
    uint64_t context_overhead_mib; /* optional; charged per CUDA context */
    int line_of_context_overhead;  /* 0 = key absent */
    uint64_t spill_limit_mib;      /* host memory spilled allocations may take, all devices */
    int line_of_spill_limit;       /* 0 = key absent (then nothing may spill) */
    char namespace_[254], pod[254], container[254];
    struct vgpu_device_limits devices[VGPU_MAX_DEVICES];
};

/* Parses the limit file read from f; path is only used in messages.
 * Returns 0, or -1 with err set to "<path>:<line>: <problem>" (or
 * "<path>: <problem>" when no single line is at fault). */
int vgpu_limits_parse(FILE *f, const char *path, struct vgpu_limits *out, char *err,
                      size_t errlen);

/* The hook settings the node agent writes next to the limit file. */
struct vgpu_hook_conf {
    uint64_t limit_wait_ms;          /* how long to wait for the limit file */
    enum vgpu_compute_policy policy;
};

/* Parses hook.conf from f into out (which holds the defaults on entry: keys
 * absent from the file keep them). Same contract as vgpu_limits_parse. */
int vgpu_hook_conf_parse(FILE *f, const char *path, struct vgpu_hook_conf *out, char *err,
                         size_t errlen);

/* "share", "hard" or "off" to the policy. 0, or -1 for anything else. */
int vgpu_parse_policy(const char *s, enum vgpu_compute_policy *out);

/* Parses a plain decimal number (digits only, no sign, no spaces) <= max.
 * Returns 0, or -1 if s is not such a number. */
int vgpu_parse_u64(const char *s, uint64_t max, uint64_t *out);

#endif
