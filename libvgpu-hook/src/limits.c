#include "limits.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

int vgpu_parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (!*s)
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        unsigned digit = (unsigned)(*s - '0');
        if (digit > max || v > (max - digit) / 10)
            return -1;
        v = v * 10 + digit;
    }
    *out = v;
    return 0;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

static void set_error(char *err, size_t errlen, const char *path, int line, const char *fmt,
                      ...) __attribute__((format(printf, 5, 6)));

static void set_error(char *err, size_t errlen, const char *path, int line, const char *fmt, ...)
{
    int n = line > 0 ? snprintf(err, errlen, "%s:%d: ", path, line)
                     : snprintf(err, errlen, "%s: ", path);
    if (n < 0 || (size_t)n >= errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
    va_end(ap);
}

/* Fails the parse when a known key appears twice (an ambiguous file). */
/* The next key=value line of f, both sides trimmed, skipping blank and '#' lines; *line counts
 * the lines read. 1: *key and *val point into *buf; 0: end of input; -1: a malformed line,
 * described in err. */
static int next_pair(FILE *f, const char *path, char **buf, size_t *cap, int *line, char **key,
                     char **val, char *err, size_t errlen)
{
    ssize_t len;
    while ((len = getline(buf, cap, f)) != -1) {
        ++*line;
        if (strlen(*buf) != (size_t)len) {
            set_error(err, errlen, path, *line, "NUL byte in line");
            return -1;
        }
        char *s = trim(*buf);
        if (*s == '\0' || *s == '#')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            set_error(err, errlen, path, *line, "expected key=value, got '%.64s'", s);
            return -1;
        }
        *eq = '\0';
        *key = trim(s);
        *val = trim(eq + 1);
        return 1;
    }
    return 0;
}

#define ONCE(seen_line, key)                                                            \
    do {                                                                                \
        if (seen_line)                                                                  \
            FAIL(line, "duplicate key '%s' (first set on line %d)", key, seen_line);    \
        seen_line = line;                                                               \
    } while (0)

#define FAIL(at, ...)                                          \
    do {                                                       \
        set_error(err, errlen, path, at, __VA_ARGS__);         \
        goto out;                                              \
    } while (0)

#define COPY(dst, value, key)                                                   \
    do {                                                                        \
        if (strlen(value) >= sizeof(dst))                                       \
            FAIL(line, "%s: value longer than %zu bytes", key, sizeof(dst) - 1); \
        strcpy(dst, value);                                                     \
    } while (0)

int vgpu_limits_parse(FILE *f, const char *path, struct vgpu_limits *out, char *err,
                      size_t errlen)
{
    int rc = -1, line = 0;
    int line_of_version = 0, line_of_count = 0, line_of_ns = 0, line_of_pod = 0,
        line_of_container = 0;
    char *buf = NULL;
    size_t cap = 0;
    uint64_t v;

    memset(out, 0, sizeof *out);
    char *key, *val;
    int got;
    while ((got = next_pair(f, path, &buf, &cap, &line, &key, &val, err, errlen)) > 0) {
        if (*key == '\0')
            FAIL(line, "empty key before '='");

        if (strcmp(key, "version") == 0) {
            ONCE(line_of_version, key);
            if (vgpu_parse_u64(val, UINT32_MAX, &v) != 0)
                FAIL(line, "version: '%.32s' is not a number", val);
            if (v != VGPU_LIMITS_VERSION)
                FAIL(line, "unsupported version %llu (this hook reads version=%d)",
                     (unsigned long long)v, VGPU_LIMITS_VERSION);
            out->version = (unsigned)v;
        } else if (strcmp(key, "device_count") == 0) {
            ONCE(line_of_count, key);
            if (vgpu_parse_u64(val, VGPU_MAX_DEVICES, &v) != 0)
                FAIL(line, "device_count: '%.32s' is not a number from 0 to %d", val,
                     VGPU_MAX_DEVICES);
            out->device_count = (int)v;
        } else if (strcmp(key, "context_overhead_mib") == 0) {
            ONCE(out->line_of_context_overhead, key);
            if (vgpu_parse_u64(val, VGPU_MAX_MEMORY_MIB, &out->context_overhead_mib) != 0)
                FAIL(line, "context_overhead_mib: '%.32s' is not a whole number of MiB", val);
        } else if (strcmp(key, "spill_limit_mib") == 0) {
            ONCE(out->line_of_spill_limit, key);
            if (vgpu_parse_u64(val, VGPU_MAX_MEMORY_MIB, &out->spill_limit_mib) != 0)
                FAIL(line, "spill_limit_mib: '%.32s' is not a whole number of MiB", val);
        } else if (strcmp(key, "namespace") == 0) {
            ONCE(line_of_ns, key);
            COPY(out->namespace_, val, key);
        } else if (strcmp(key, "pod") == 0) {
            ONCE(line_of_pod, key);
            COPY(out->pod, val, key);
        } else if (strcmp(key, "container") == 0) {
            ONCE(line_of_container, key);
            COPY(out->container, val, key);
        } else if (strncmp(key, "device.", 7) == 0 && strchr(key + 7, '.')) {
            /* device.<index>.<field> */
            char *index = key + 7, *field = strchr(index, '.');
            *field++ = '\0';
            if ((index[0] == '0' && index[1] != '\0') ||
                vgpu_parse_u64(index, UINT32_MAX, &v) != 0)
                FAIL(line, "invalid device index '%.32s' in key 'device.%.32s.%.64s'", index,
                     index, field);
            if (v >= VGPU_MAX_DEVICES)
                FAIL(line, "device index %llu out of range (at most %d devices)",
                     (unsigned long long)v, VGPU_MAX_DEVICES);
            struct vgpu_device_limits *dev = &out->devices[v];
            if (!dev->first_line)
                dev->first_line = line;
            char name[96];
            snprintf(name, sizeof name, "device.%llu.%.64s", (unsigned long long)v, field);

            if (strcmp(field, "memory_limit_mib") == 0) {
                ONCE(dev->line_of_memory, name);
                if (vgpu_parse_u64(val, VGPU_MAX_MEMORY_MIB, &dev->memory_limit_mib) != 0)
                    FAIL(line, "%s: '%.32s' is not a whole number of MiB", name, val);
            } else if (strcmp(field, "cores") == 0) {
                ONCE(dev->line_of_cores, name);
                if (vgpu_parse_u64(val, 100, &v) != 0)
                    FAIL(line, "%s: '%.32s' is not a number from 0 to 100", name, val);
                dev->cores = (unsigned)v;
            } else if (strcmp(field, "virtual_memory") == 0) {
                ONCE(dev->line_of_virtual, name);
                if (vgpu_parse_u64(val, 1, &v) != 0)
                    FAIL(line, "%s: '%.32s' is not 0 or 1", name, val);
                dev->virtual_memory = (int)v;
            } else if (strcmp(field, "uuid") == 0) {
                ONCE(dev->line_of_uuid, name);
                COPY(dev->uuid, val, name);
            } /* other device fields: ignored, for forward compatibility */
        } /* other keys: ignored, for forward compatibility */
    }
    if (got < 0)
        goto out;
    if (ferror(f))
        FAIL(0, "read error: %s", strerror(errno));

    if (!line_of_version)
        FAIL(0, "missing required key 'version'");
    if (!line_of_count)
        FAIL(0, "missing required key 'device_count'");
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        const struct vgpu_device_limits *dev = &out->devices[i];
        if (i >= out->device_count && dev->first_line)
            FAIL(dev->first_line, "device index %d out of range: device_count is %d", i,
                 out->device_count);
        if (i < out->device_count && !dev->line_of_memory)
            FAIL(0, "missing required key 'device.%d.memory_limit_mib'", i);
    }
    rc = 0;
out:
    free(buf);
    return rc;
}

int vgpu_parse_policy(const char *s, enum vgpu_compute_policy *out)
{
    if (strcmp(s, "share") == 0)
        *out = VGPU_COMPUTE_SHARE;
    else if (strcmp(s, "hard") == 0)
        *out = VGPU_COMPUTE_HARD;
    else if (strcmp(s, "off") == 0)
        *out = VGPU_COMPUTE_OFF;
    else
        return -1;
    return 0;
}

int vgpu_hook_conf_parse(FILE *f, const char *path, struct vgpu_hook_conf *out, char *err,
                         size_t errlen)
{
    int rc = -1, line = 0, line_of_version = 0, line_of_wait = 0, line_of_policy = 0;
    char *buf = NULL;
    size_t cap = 0;
    uint64_t v;

    char *key, *val;
    int got;
    while ((got = next_pair(f, path, &buf, &cap, &line, &key, &val, err, errlen)) > 0) {
        if (strcmp(key, "version") == 0) {
            ONCE(line_of_version, key);
            if (vgpu_parse_u64(val, UINT32_MAX, &v) != 0 || v != VGPU_HOOK_CONF_VERSION)
                FAIL(line, "unsupported version '%.32s' (this hook reads version=%d)", val,
                     VGPU_HOOK_CONF_VERSION);
        } else if (strcmp(key, "limit_wait_ms") == 0) {
            ONCE(line_of_wait, key);
            if (vgpu_parse_u64(val, VGPU_MAX_WAIT_MS, &out->limit_wait_ms) != 0)
                FAIL(line, "limit_wait_ms: '%.32s' is not a number of milliseconds from 0 to %d",
                     val, VGPU_MAX_WAIT_MS);
        } else if (strcmp(key, "compute_policy") == 0) {
            ONCE(line_of_policy, key);
            if (vgpu_parse_policy(val, &out->policy) != 0)
                FAIL(line, "compute_policy: '%.32s' is not one of share, hard, off", val);
        } /* other keys: ignored, for forward compatibility */
    }
    if (got < 0)
        goto out;
    if (ferror(f))
        FAIL(0, "read error: %s", strerror(errno));
    if (!line_of_version)
        FAIL(0, "missing required key 'version'");
    rc = 0;
out:
    free(buf);
    return rc;
}
