/* Fuzz harness of the parsers of what the node agent writes for the hook: the
 * limit file, hook.conf (src/limits.c) and the relay's `util` lines
 * (src/relay_msg.c). Each input goes to all three. Besides the sanitizers'
 * findings, a parse that succeeds must describe a slice the hook can enforce,
 * and a failed one must say why: anything else aborts.
 *
 * Built with -DVGPU_FUZZ_PLANTED, it also aborts on a limit file that names a
 * device beyond its device_count, which no seed does: the test that the engine
 * finds and saves a failing input (tests/hook/test_fuzz.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "limits.h"
#include "relay_msg.h"

#define PATH "/var/run/vgpu/limits"

static void check_error(const char *err, size_t size)
{
    if (strnlen(err, size) == size)
        vgpu_fuzz_fail("error message not terminated");
    if (strncmp(err, PATH, strlen(PATH)) != 0 || strlen(err) <= strlen(PATH) + 2)
        vgpu_fuzz_fail("error message does not name the file and the problem");
}

static void check_limits(const struct vgpu_limits *l)
{
    if (l->version != VGPU_LIMITS_VERSION)
        vgpu_fuzz_fail("accepted a limit file of another version");
    if (l->device_count < 0 || l->device_count > VGPU_MAX_DEVICES)
        vgpu_fuzz_fail("accepted a device count the hook cannot hold");
    if (strnlen(l->namespace_, sizeof l->namespace_) == sizeof l->namespace_ ||
        strnlen(l->pod, sizeof l->pod) == sizeof l->pod ||
        strnlen(l->container, sizeof l->container) == sizeof l->container)
        vgpu_fuzz_fail("a name is not terminated");
    if (l->context_overhead_mib > VGPU_MAX_MEMORY_MIB)
        vgpu_fuzz_fail("context overhead would overflow in bytes");
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        const struct vgpu_device_limits *dev = &l->devices[d];
        if (strnlen(dev->uuid, sizeof dev->uuid) == sizeof dev->uuid)
            vgpu_fuzz_fail("a device UUID is not terminated");
        if (dev->memory_limit_mib > VGPU_MAX_MEMORY_MIB)
            vgpu_fuzz_fail("a memory limit would overflow in bytes");
        if (dev->cores > 100)
            vgpu_fuzz_fail("a compute share above 100%");
        if (d >= l->device_count && (dev->memory_limit_mib || dev->cores || dev->uuid[0]))
            vgpu_fuzz_fail("limits for a device beyond device_count");
    }
}

void vgpu_fuzz_one(const uint8_t *data, size_t len)
{
    char err[512];
    /* fmemopen cannot open an empty buffer; an empty file is one byte short of "\n". */
    FILE *f = fmemopen(len ? (void *)data : (void *)"\n", len ? len : 1, "r");
    if (f) {
        static struct vgpu_limits limits;
        memset(&limits, 0xa5, sizeof limits); /* what the parser leaves unset shows */
        err[0] = '\0';
        int rc = vgpu_limits_parse(f, PATH, &limits, err, sizeof err);
        fclose(f);
        if (rc == 0)
            check_limits(&limits);
        else if (rc == -1)
            check_error(err, sizeof err);
        else
            vgpu_fuzz_fail("the limit parser returned neither 0 nor -1");
#ifdef VGPU_FUZZ_PLANTED
        if (rc == -1 && strstr(err, "out of range: device_count is"))
            vgpu_fuzz_fail("planted bug: a device beyond device_count");
#endif
    }
    f = fmemopen(len ? (void *)data : (void *)"\n", len ? len : 1, "r");
    if (f) {
        struct vgpu_hook_conf conf = {.limit_wait_ms = 5000, .policy = VGPU_COMPUTE_SHARE};
        err[0] = '\0';
        int rc = vgpu_hook_conf_parse(f, PATH, &conf, err, sizeof err);
        fclose(f);
        if (rc == 0 && (conf.limit_wait_ms > VGPU_MAX_WAIT_MS || conf.policy > VGPU_COMPUTE_OFF))
            vgpu_fuzz_fail("hook.conf accepted out of range");
        if (rc == -1)
            check_error(err, sizeof err);
    }
    /* A util line: the bytes up to the first newline, as the relay client reads them. */
    const uint8_t *newline = memchr(data, '\n', len);
    size_t line_len = newline ? (size_t)(newline - data) : len;
    char *line = malloc(line_len + 1); /* exactly its size: overreads show */
    if (!line)
        return;
    memcpy(line, data, line_len);
    line[line_len] = '\0';
    struct vgpu_util util[4];
    int n = vgpu_msg_parse_util(line, line_len, util, 4);
    if (n < -1 || n > 4)
        vgpu_fuzz_fail("util parse returned more devices than it was given room for");
    free(line);
}

const char *const vgpu_fuzz_dictionary[] = {
    "version=", "1", "device_count=", "device.", ".uuid=", ".memory_limit_mib=", ".cores=",
    "namespace=", "pod=", "container=", "context_overhead_mib=", "limit_wait_ms=",
    "compute_policy=", "share", "hard", "off", "GPU-", "MIG-", "18446744073709551615",
    "17592186044415", "17592186044416", "4294967296", "100", "101", "64", "65", "-1", "0x10",
    "\n", "\r\n", " = ", "#", "{", "}", "[", "]", ",", ":", "\"", "\\u0000", "null", "true",
    "\"v\":1", "\"type\":\"util\"", "\"devices\":", "\"index\":", "\"sm_util_percent\":",
    "\"container_sm_util_percent\":", "-1", "1e308", "1e-400", "2147483648", NULL,
};

const char *const vgpu_fuzz_seeds[] = {
    "version=1\ndevice_count=1\ndevice.0.memory_limit_mib=1024\ndevice.0.cores=30\n",
    "# written by the node agent\nversion=1\nnamespace=ml\npod=p\ncontainer=c\n"
    "context_overhead_mib=300\ndevice_count=2\ndevice.0.uuid=GPU-6a1c\n"
    "device.0.memory_limit_mib=20480\ndevice.0.cores=50\ndevice.1.memory_limit_mib=0\n",
    "limit_wait_ms=5000\ncompute_policy=hard\n",
    "{\"v\":1,\"type\":\"util\",\"devices\":[{\"index\":0,\"sm_util_percent\":37.5,"
    "\"container_sm_util_percent\":12.0},{\"index\":1,\"sm_util_percent\":0,"
    "\"container_sm_util_percent\":-1}],\"future\":{\"a\":[null,\"}\"]}}\n",
    NULL,
};
