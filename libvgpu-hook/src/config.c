#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

#define DEFAULT_CONTAINER_DIR "/var/run/vgpu"
#define DEFAULT_WAIT_MS 10000
#define POLL_MS 20

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t wait_budget_ms(void)
{
    const char *s = getenv("VGPU_LIMIT_WAIT_MS");
    uint64_t ms;
    if (!s || !*s)
        return DEFAULT_WAIT_MS;
    if (vgpu_parse_u64(s, UINT32_MAX, &ms) == 0)
        return ms;
    vgpu_log_error("ignoring VGPU_LIMIT_WAIT_MS='%s' (not a number of milliseconds); waiting %d ms",
                   s, DEFAULT_WAIT_MS);
    return DEFAULT_WAIT_MS;
}

/* Opens path, waiting up to wait_ms for it to appear. NULL with errno set if
 * it cannot be opened; ENOENT means it never appeared. */
static FILE *open_when_present(const char *path, uint64_t wait_ms)
{
    uint64_t deadline = now_ms() + wait_ms;
    int logged = 0;
    for (;;) {
        FILE *f = fopen(path, "re");
        if (f || errno != ENOENT || now_ms() >= deadline)
            return f;
        if (!logged++)
            vgpu_log_info("waiting for limit file %s (up to %llu ms)", path,
                          (unsigned long long)wait_ms);
        nanosleep(&(struct timespec){.tv_nsec = POLL_MS * 1000000L}, NULL);
    }
}

static int from_file(FILE *f, const char *path, struct vgpu_config *out)
{
    static struct vgpu_limits parsed; /* ~11 KiB; called once, under pthread_once */
    char err[512];
    int rc = vgpu_limits_parse(f, path, &parsed, err, sizeof err);
    fclose(f);
    if (rc != 0) {
        vgpu_log_error("%s", err);
        vgpu_log_error("refusing to run with unknown limits: cuInit returns CUDA_ERROR_INVALID_VALUE");
        return -1;
    }
    out->described_devices = parsed.device_count;
    if (parsed.line_of_context_overhead)
        out->context_overhead_mib = parsed.context_overhead_mib;
    if (parsed.pod[0]) {
        vgpu_log_info("limits from %s for pod %s/%s, container %s", path, parsed.namespace_,
                      parsed.pod, parsed.container);
    } else {
        vgpu_log_info("limits from %s", path);
    }
    for (int i = 0; i < parsed.device_count; i++) {
        out->memory_mib[i] = parsed.devices[i].memory_limit_mib;
        out->cores[i] = parsed.devices[i].cores;
        snprintf(out->uuid[i], sizeof out->uuid[i], "%s", parsed.devices[i].uuid);
        char cores[32] = "no compute limit";
        if (out->cores[i] && out->cores[i] < 100)
            snprintf(cores, sizeof cores, "%u%% of compute", out->cores[i]);
        if (out->memory_mib[i])
            vgpu_log_info("device %d: memory limit %llu MiB, %s", i,
                          (unsigned long long)out->memory_mib[i], cores);
        else
            vgpu_log_info("device %d: memory unlimited, %s", i, cores);
    }
    return 0;
}

static int load_settings(struct vgpu_config *out)
{
    const char *v = getenv("VGPU_CONTEXT_OVERHEAD_MIB");
    if (v && *v && vgpu_parse_u64(v, VGPU_MAX_MEMORY_MIB, &out->context_overhead_mib) != 0) {
        vgpu_log_error("VGPU_CONTEXT_OVERHEAD_MIB='%s' is not a whole number of MiB; refusing to "
                       "run with unknown limits",
                       v);
        return -1;
    }
    v = getenv("VGPU_COMPUTE_POLICY");
    if (!v || !*v || strcmp(v, "share") == 0)
        out->policy = VGPU_COMPUTE_SHARE;
    else if (strcmp(v, "hard") == 0)
        out->policy = VGPU_COMPUTE_HARD;
    else if (strcmp(v, "off") == 0)
        out->policy = VGPU_COMPUTE_OFF;
    else {
        vgpu_log_error("VGPU_COMPUTE_POLICY='%s' is not one of share, hard, off; refusing to run "
                       "with unknown limits",
                       v);
        return -1;
    }
    return 0;
}

int vgpu_load_config(struct vgpu_config *out)
{
    char path[4200];
    memset(out, 0, sizeof *out);
    out->described_devices = -1;

    const char *dir = env_or("VGPU_CONTAINER_DIR", DEFAULT_CONTAINER_DIR);
    if (strlen(dir) >= sizeof out->dir) {
        vgpu_log_error("VGPU_CONTAINER_DIR is too long; refusing to run with unknown limits");
        return -1;
    }
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    snprintf(path, sizeof path, "%s/limits", dir);
    if (load_settings(out) != 0)
        return -1;
    uint64_t wait_ms = wait_budget_ms();
    FILE *f = open_when_present(path, wait_ms);
    if (f)
        return from_file(f, path, out);
    if (errno != ENOENT) {
        vgpu_log_error("cannot open limit file %s: %s; refusing to run with unknown limits", path,
                       strerror(errno));
        return -1;
    }

    const char *env = getenv("VGPU_MEMORY_LIMIT_MIB");
    if (!env || !*env) {
        vgpu_log_error("no limit file at %s and VGPU_MEMORY_LIMIT_MIB unset; running unlimited",
                       path);
        return 0;
    }
    uint64_t mib;
    if (vgpu_parse_u64(env, VGPU_MAX_MEMORY_MIB, &mib) != 0) {
        vgpu_log_error("VGPU_MEMORY_LIMIT_MIB='%s' is not a whole number of MiB; refusing to run "
                       "with unknown limits",
                       env);
        return -1;
    }
    for (int i = 0; i < VGPU_MAX_DEVICES; i++)
        out->memory_mib[i] = mib;
    vgpu_log_info("no limit file at %s after %llu ms; VGPU_MEMORY_LIMIT_MIB=%llu applies to every "
                  "device",
                  path, (unsigned long long)wait_ms, (unsigned long long)mib);
    return 0;
}
