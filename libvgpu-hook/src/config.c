#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

/* The same directory as VGPU_FIXED_DIR where /var/run links to /run: it marks
 * a container too, so that replacing the /var/run link does not hide it. */
#define FIXED_DIR_VIA_RUN "/run/vgpu"
#define POLL_MS 20
#define REFUSE "; refusing to run with unknown limits: cuInit returns CUDA_ERROR_INVALID_VALUE"

/* Environment settings that apply on a bare host only. */
static const char *const bare_host_env[] = {"VGPU_CONTAINER_DIR", "VGPU_LIMIT_WAIT_MS",
                                            "VGPU_MEMORY_LIMIT_MIB", "VGPU_CONTEXT_OVERHEAD_MIB",
                                            "VGPU_COMPUTE_POLICY"};

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

/* Anything but a clean "does not exist" counts as present: an unreadable
 * directory must not turn a container into a bare host. */
static int exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 || errno != ENOENT;
}

static int in_container(void)
{
    return exists(VGPU_FIXED_DIR) || exists(FIXED_DIR_VIA_RUN);
}

static const char *file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISSOCK(mode))
        return "a socket";
    if (S_ISCHR(mode) || S_ISBLK(mode))
        return "a device";
    return "not a regular file";
}

/* Opens a file the node agent wrote, as such a file must be: the last
 * component no symlink (O_NOFOLLOW), a regular file (a FIFO cannot block the
 * open: O_NONBLOCK), and with need_read_only on a read-only mount. Returns the
 * fd, or -1 with errno (ENOENT: not there) and why ("<path>: <problem>"). */
static int open_agent_file(const char *path, int need_read_only, char *why, size_t whylen)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP)
            snprintf(why, whylen, "%s: is a symbolic link (the node agent writes a regular file)",
                     path);
        else
            snprintf(why, whylen, "%s: cannot open: %s", path, strerror(e));
        errno = e;
        return -1;
    }
    struct stat st;
    struct statvfs vfs;
    if (fstat(fd, &st) != 0) {
        snprintf(why, whylen, "%s: cannot stat: %s", path, strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
        snprintf(why, whylen, "%s: is %s, not a regular file", path, file_kind(st.st_mode));
    } else if (need_read_only && (fstatvfs(fd, &vfs) != 0 || !(vfs.f_flag & ST_RDONLY))) {
        snprintf(why, whylen,
                 "%s: is on a writable mount (the node agent mounts it read-only; this copy "
                 "may have been written in the container)",
                 path);
    } else {
        return fd;
    }
    close(fd);
    errno = EINVAL;
    return -1;
}

/* open_agent_file, waiting up to wait_ms for the file to appear. */
static int open_when_present(const char *path, int need_read_only, uint64_t wait_ms, char *why,
                             size_t whylen)
{
    uint64_t deadline = now_ms() + wait_ms;
    int logged = 0;
    for (;;) {
        int fd = open_agent_file(path, need_read_only, why, whylen);
        if (fd >= 0 || errno != ENOENT || now_ms() >= deadline)
            return fd;
        if (!logged++)
            vgpu_log_info("waiting for limit file %s (up to %llu ms)", path,
                          (unsigned long long)wait_ms);
        nanosleep(&(struct timespec){.tv_nsec = POLL_MS * 1000000L}, NULL);
    }
}

static int from_file(int fd, const char *path, int file_overhead_only, struct vgpu_config *out)
{
    static struct vgpu_limits parsed; /* ~11 KiB; called once, under pthread_once */
    char err[512];
    FILE *f = fdopen(fd, "re");
    if (!f) {
        close(fd);
        vgpu_log_error("cannot read limit file %s: %s" REFUSE, path, strerror(errno));
        return -1;
    }
    int rc = vgpu_limits_parse(f, path, &parsed, err, sizeof err);
    fclose(f);
    if (rc != 0) {
        vgpu_log_error("%s", err);
        vgpu_log_error("refusing to run with unknown limits: cuInit returns CUDA_ERROR_INVALID_VALUE");
        return -1;
    }
    out->described_devices = parsed.device_count;
    out->spill_limit_mib = parsed.spill_limit_mib;
    if (parsed.line_of_context_overhead || file_overhead_only)
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
        out->virtual_memory[i] = parsed.devices[i].virtual_memory;
        if (out->virtual_memory[i])
            vgpu_log_info("device %d: virtual device memory: what the card cannot hold spills "
                          "to managed memory (at most %llu MiB of host memory in all)",
                          i, (unsigned long long)out->spill_limit_mib);
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

/* --- inside a container: the node agent's read-only files, nothing else --------------------- */

static void say_environment_is_ignored(void)
{
    char names[256] = "";
    size_t used = 0;
    for (size_t i = 0; i < sizeof bare_host_env / sizeof *bare_host_env; i++) {
        const char *v = getenv(bare_host_env[i]);
        if (v && *v && used < sizeof names) {
            int n = snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "",
                             bare_host_env[i]);
            used += n > 0 ? (size_t)n : 0;
        }
    }
    if (names[0])
        vgpu_log_error("ignoring %s: inside a container (%s exists) limits and settings come only "
                       "from the node agent's read-only files",
                       names, VGPU_FIXED_DIR);
}

/* hook.conf: the wait and the compute policy. Absent: the defaults (an agent
 * that predates it). Present but unusable: the limits are unknown. */
static int load_hook_conf(struct vgpu_hook_conf *conf)
{
    const char *path = VGPU_FIXED_DIR "/" VGPU_HOOK_CONF_FILE;
    char why[4400], err[512];
    *conf = (struct vgpu_hook_conf){.limit_wait_ms = VGPU_DEFAULT_WAIT_MS,
                                    .policy = VGPU_COMPUTE_SHARE};
    int fd = open_agent_file(path, 1, why, sizeof why);
    if (fd < 0 && errno == ENOENT) {
        vgpu_log_info("no %s; waiting %d ms for the limit file, compute policy share", path,
                      VGPU_DEFAULT_WAIT_MS);
        return 0;
    }
    if (fd < 0) {
        vgpu_log_error("%s" REFUSE, why);
        return -1;
    }
    FILE *f = fdopen(fd, "re");
    if (!f) {
        close(fd);
        vgpu_log_error("cannot read %s: %s" REFUSE, path, strerror(errno));
        return -1;
    }
    int rc = vgpu_hook_conf_parse(f, path, conf, err, sizeof err);
    fclose(f);
    if (rc != 0) {
        vgpu_log_error("%s" REFUSE, err);
        return -1;
    }
    return 0;
}

static int load_in_container(struct vgpu_config *out)
{
    const char *path = VGPU_FIXED_DIR "/limits";
    char why[4400];
    struct vgpu_hook_conf conf;
    out->in_container = 1;
    snprintf(out->dir, sizeof out->dir, "%s", VGPU_FIXED_DIR);
    snprintf(out->state_dir, sizeof out->state_dir, "%s", VGPU_FIXED_STATE_DIR);
    say_environment_is_ignored();
    if (load_hook_conf(&conf) != 0)
        return -1;
    out->policy = conf.policy;
    int fd = open_when_present(path, 1, conf.limit_wait_ms, why, sizeof why);
    if (fd >= 0)
        return from_file(fd, path, 1, out);
    if (errno == ENOENT)
        vgpu_log_error("no limit file at %s after %llu ms (the node agent has not written this "
                       "container's limits)" REFUSE,
                       path, (unsigned long long)conf.limit_wait_ms);
    else
        vgpu_log_error("%s" REFUSE, why);
    return -1;
}

/* --- on a bare host (development, tests): the environment decides ------------------------- */

static uint64_t wait_budget_ms(void)
{
    const char *s = getenv("VGPU_LIMIT_WAIT_MS");
    uint64_t ms;
    if (!s || !*s)
        return VGPU_DEFAULT_WAIT_MS;
    if (vgpu_parse_u64(s, UINT32_MAX, &ms) == 0)
        return ms;
    vgpu_log_error("ignoring VGPU_LIMIT_WAIT_MS='%s' (not a number of milliseconds); waiting %d ms",
                   s, VGPU_DEFAULT_WAIT_MS);
    return VGPU_DEFAULT_WAIT_MS;
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
    out->policy = VGPU_COMPUTE_SHARE;
    if (v && *v && vgpu_parse_policy(v, &out->policy) != 0) {
        vgpu_log_error("VGPU_COMPUTE_POLICY='%s' is not one of share, hard, off; refusing to run "
                       "with unknown limits",
                       v);
        return -1;
    }
    return 0;
}

static int load_on_bare_host(struct vgpu_config *out)
{
    char path[4200], why[4400];
    const char *dir = env_or("VGPU_CONTAINER_DIR", VGPU_FIXED_DIR);
    if (strlen(dir) >= sizeof out->dir) {
        vgpu_log_error("VGPU_CONTAINER_DIR is too long; refusing to run with unknown limits");
        return -1;
    }
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    snprintf(out->state_dir, sizeof out->state_dir, "%s", dir);
    snprintf(path, sizeof path, "%s/limits", dir);
    if (load_settings(out) != 0)
        return -1;
    uint64_t wait_ms = wait_budget_ms();
    int fd = open_when_present(path, 0, wait_ms, why, sizeof why);
    if (fd >= 0)
        return from_file(fd, path, 0, out);
    if (errno != ENOENT) {
        vgpu_log_error("%s; refusing to run with unknown limits", why);
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

int vgpu_load_config(struct vgpu_config *out)
{
    memset(out, 0, sizeof *out);
    out->described_devices = -1;
    return in_container() ? load_in_container(out) : load_on_bare_host(out);
}
