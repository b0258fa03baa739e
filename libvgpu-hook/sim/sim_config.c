#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sim.h"

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    if (!s || !isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno)
        return -1;
    *out = v;
    return 0;
}

/* "<count>x<MiB>" */
static int parse_gpus(const char *spec, int *count, unsigned long long *mib)
{
    char *end;
    if (!isdigit((unsigned char)spec[0]))
        return -1;
    unsigned long n = strtoul(spec, &end, 10);
    if (*end != 'x' || n < 1 || n > SIM_MAX_DEVICES || !isdigit((unsigned char)end[1]))
        return -1;
    *mib = strtoull(end + 1, &end, 10);
    if (*end || *mib == 0 || *mib > (1ull << 24))
        return -1;
    *count = (int)n;
    return 0;
}

int sim_load_config(struct sim_config *out)
{
    memset(out, 0, sizeof *out);
    const char *spec = getenv("VGPU_SIM_GPUS");
    if (!spec || !*spec)
        spec = "1x40960";
    if (parse_gpus(spec, &out->device_count, &out->mib) != 0) {
        fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_GPUS='%s' (want <count>x<MiB>, e.g. 2x40960)\n",
                spec);
        return -1;
    }
    for (int i = 0; i < out->device_count; i++)
        snprintf(out->uuid[i], SIM_UUID_LEN, "GPU-5e4c0000-0000-4000-8000-%012x", i);
    const char *uuids = getenv("VGPU_SIM_UUIDS");
    if (uuids && *uuids) {
        int i = 0;
        for (const char *p = uuids; *p && i < out->device_count; i++) {
            size_t n = strcspn(p, ",");
            if (n == 0 || n >= SIM_UUID_LEN) {
                fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_UUIDS='%s' (want uuid,uuid,...)\n",
                        uuids);
                return -1;
            }
            memcpy(out->uuid[i], p, n);
            out->uuid[i][n] = '\0';
            p += n + (p[n] == ',');
        }
    }
    out->ns_per_block = 1000;
    out->queue_ns = 20000ull * 1000;
    const char *v;
    if ((v = getenv("VGPU_SIM_NS_PER_BLOCK")) && *v && parse_u64(v, &out->ns_per_block) != 0) {
        fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_NS_PER_BLOCK='%s'\n", v);
        return -1;
    }
    uint64_t us;
    if ((v = getenv("VGPU_SIM_QUEUE_US")) && *v) {
        if (parse_u64(v, &us) != 0) {
            fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_QUEUE_US='%s'\n", v);
            return -1;
        }
        out->queue_ns = us * 1000;
    }
    out->private_memory = (v = getenv("VGPU_SIM_PRIVATE_MEMORY")) && strcmp(v, "1") == 0;
    if ((v = getenv("VGPU_SIM_HOST_MIB")) && *v) {
        if (parse_u64(v, &out->host_mib) != 0 || out->host_mib > (UINT64_MAX >> 20)) {
            fprintf(stderr, "vgpu-sim: invalid VGPU_SIM_HOST_MIB='%s'\n", v);
            return -1;
        }
    }
    if ((v = getenv("VGPU_SIM_STATE_DIR")) && *v)
        snprintf(out->state_dir, sizeof out->state_dir, "%s", v);
    else
        snprintf(out->state_dir, sizeof out->state_dir, "/tmp/vgpu-sim-%u", (unsigned)getuid());
    return 0;
}

struct sim_timeline *sim_timeline_open(const struct sim_config *cfg, int dev)
{
    char path[640];
    struct sim_timeline *t = MAP_FAILED;
    (void)mkdir(cfg->state_dir, 0777);
    snprintf(path, sizeof path, "%s/gpu%d.timeline", cfg->state_dir, dev);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    /* A fresh file reads as zeros: an idle GPU. Extending it is idempotent. */
    if (fd >= 0 && ftruncate(fd, 4096) == 0)
        t = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0)
        close(fd);
    if (t != MAP_FAILED)
        return t;
    fprintf(stderr, "vgpu-sim: cannot share %s (%s); device %d is private to this process\n",
            path, strerror(errno), dev);
    t = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return t == MAP_FAILED ? NULL : t;
}

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sim_sleep_until(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull),
                          .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}
