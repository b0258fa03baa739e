/* Unit tests of the limit-file parser (src/limits.c), no interception. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "limits.h"

static struct vgpu_limits limits;
static char err[512];

static int parse(const char *text)
{
    err[0] = '\0';
    FILE *f = fmemopen((void *)text, strlen(text), "r");
    if (!f)
        return -2;
    int rc = vgpu_limits_parse(f, "/run/limits", &limits, err, sizeof err);
    fclose(f);
    return rc;
}

/* Parsing text fails with exactly the message want. */
static void expect_error(const char *text, const char *want)
{
    int rc = parse(text);
    if (rc != -1 || strcmp(err, want) != 0) {
        fprintf(stderr, "expected error \"%s\"\n     got rc=%d \"%s\"\n  for: %s\n", want, rc, err,
                text);
        check_failures++;
    }
}

#define HEAD "version=1\ndevice_count=1\n"

static void test_good_file(void)
{
    CHECK(parse("# written by the node agent\n"
                "version=1\n"
                "namespace=default\n"
                "pod=half-gpu\n"
                "container=main\n"
                "\n"
                "device_count=2\n"
                "device.0.uuid=GPU-6a1c\n"
                "device.0.memory_limit_mib=20480\n"
                "device.0.cores=50\n"
                "  device.1.memory_limit_mib = 0 \r\n"
                "device.1.future_field=x\n"
                "future_key=anything=goes\n") == 0);
    CHECK(limits.version == 1);
    CHECK(limits.device_count == 2);
    CHECK(strcmp(limits.namespace_, "default") == 0);
    CHECK(strcmp(limits.pod, "half-gpu") == 0);
    CHECK(strcmp(limits.container, "main") == 0);
    CHECK(strcmp(limits.devices[0].uuid, "GPU-6a1c") == 0);
    CHECK(limits.devices[0].memory_limit_mib == 20480);
    CHECK(limits.devices[0].cores == 50);
    CHECK(limits.devices[1].memory_limit_mib == 0); /* unlimited */
    CHECK(limits.devices[1].cores == 0);
    CHECK(limits.devices[1].uuid[0] == '\0');
}

static void test_minimal_files(void)
{
    CHECK(parse("version=1\ndevice_count=0\n") == 0 && limits.device_count == 0);
    CHECK(parse(HEAD "device.0.memory_limit_mib=1") == 0); /* no final newline */
    CHECK(limits.devices[0].memory_limit_mib == 1);
    CHECK(parse("device.0.memory_limit_mib=17592186044415\ndevice_count=1\nversion=1\n") == 0);
    CHECK(limits.devices[0].memory_limit_mib == VGPU_MAX_MEMORY_MIB);
    CHECK(limits.line_of_context_overhead == 0);
    CHECK(parse(HEAD "device.0.memory_limit_mib=1\ncontext_overhead_mib=300\n") == 0);
    CHECK(limits.context_overhead_mib == 300 && limits.line_of_context_overhead == 4);
    /* Virtual device memory: off unless the agent says so, with a host bound. */
    CHECK(limits.devices[0].virtual_memory == 0 && limits.line_of_spill_limit == 0);
    CHECK(parse(HEAD "device.0.memory_limit_mib=1\ndevice.0.virtual_memory=1\n"
                     "spill_limit_mib=16384\n") == 0);
    CHECK(limits.devices[0].virtual_memory == 1 && limits.spill_limit_mib == 16384);
    expect_error(HEAD "device.0.memory_limit_mib=1\ndevice.0.virtual_memory=2\n",
                 "/run/limits:4: device.0.virtual_memory: '2' is not 0 or 1");
    expect_error(HEAD "device.0.memory_limit_mib=1\nspill_limit_mib=-1\n",
                 "/run/limits:4: spill_limit_mib: '-1' is not a whole number of MiB");
    expect_error(HEAD "device.0.memory_limit_mib=1\ndevice.0.virtual_memory=1\n"
                      "device.0.virtual_memory=0\n",
                 "/run/limits:5: duplicate key 'device.0.virtual_memory' (first set on line 4)");
}

static void test_malformed_lines(void)
{
    expect_error("version=1\ndevice_count\n", "/run/limits:2: expected key=value, got 'device_count'");
    expect_error("version=1\n=1\n", "/run/limits:2: empty key before '='");
    expect_error("version=2\n", "/run/limits:1: unsupported version 2 (this hook reads version=1)");
    expect_error("version=one\n", "/run/limits:1: version: 'one' is not a number");
    expect_error("version=1\ndevice_count=65\n",
                 "/run/limits:2: device_count: '65' is not a number from 0 to 64");
    expect_error("version=1\ndevice_count=-1\n",
                 "/run/limits:2: device_count: '-1' is not a number from 0 to 64");
    expect_error(HEAD "device.0.memory_limit_mib=-5\n",
                 "/run/limits:3: device.0.memory_limit_mib: '-5' is not a whole number of MiB");
    expect_error(HEAD "device.0.memory_limit_mib=20 GiB\n",
                 "/run/limits:3: device.0.memory_limit_mib: '20 GiB' is not a whole number of MiB");
    expect_error(HEAD "device.0.memory_limit_mib=17592186044416\n",
                 "/run/limits:3: device.0.memory_limit_mib: '17592186044416' is not a whole number of MiB");
    expect_error(HEAD "device.0.memory_limit_mib=1\ndevice.0.cores=101\n",
                 "/run/limits:4: device.0.cores: '101' is not a number from 0 to 100");
    expect_error(HEAD "device.x.memory_limit_mib=1\n",
                 "/run/limits:3: invalid device index 'x' in key 'device.x.memory_limit_mib'");
    expect_error(HEAD "device.01.memory_limit_mib=1\n",
                 "/run/limits:3: invalid device index '01' in key 'device.01.memory_limit_mib'");
    expect_error(HEAD "device.64.memory_limit_mib=1\n",
                 "/run/limits:3: device index 64 out of range (at most 64 devices)");
    expect_error(HEAD "device.0.memory_limit_mib=1\ndevice.0.memory_limit_mib=2\n",
                 "/run/limits:4: duplicate key 'device.0.memory_limit_mib' (first set on line 3)");
    expect_error(HEAD "device.0.memory_limit_mib=1\ncontext_overhead_mib=lots\n",
                 "/run/limits:4: context_overhead_mib: 'lots' is not a whole number of MiB");
    expect_error("version=1\nversion=1\n",
                 "/run/limits:2: duplicate key 'version' (first set on line 1)");
}

static void test_missing_or_inconsistent(void)
{
    expect_error("", "/run/limits: missing required key 'version'");
    expect_error("device_count=0\n", "/run/limits: missing required key 'version'");
    expect_error("version=1\n", "/run/limits: missing required key 'device_count'");
    expect_error("version=1\ndevice_count=2\ndevice.0.memory_limit_mib=1\ndevice.1.cores=5\n",
                 "/run/limits: missing required key 'device.1.memory_limit_mib'");
    expect_error(HEAD "device.0.memory_limit_mib=1\n# second device\ndevice.1.memory_limit_mib=1\n",
                 "/run/limits:5: device index 1 out of range: device_count is 1");
}

static void test_parse_u64(void)
{
    uint64_t v = 7;
    CHECK(vgpu_parse_u64("0", 10, &v) == 0 && v == 0);
    CHECK(vgpu_parse_u64("18446744073709551615", UINT64_MAX, &v) == 0 && v == UINT64_MAX);
    CHECK(vgpu_parse_u64("18446744073709551616", UINT64_MAX, &v) == -1);
    CHECK(vgpu_parse_u64("101", 100, &v) == -1);
    CHECK(vgpu_parse_u64("100", 100, &v) == 0 && v == 100);
    CHECK(vgpu_parse_u64("", 10, &v) == -1);
    CHECK(vgpu_parse_u64("+1", 10, &v) == -1);
    CHECK(vgpu_parse_u64(" 1", 10, &v) == -1);
    CHECK(vgpu_parse_u64("1a", 10, &v) == -1);
}

static struct vgpu_hook_conf conf;

static int parse_conf(const char *text)
{
    err[0] = '\0';
    conf = (struct vgpu_hook_conf){.limit_wait_ms = 10000, .policy = VGPU_COMPUTE_SHARE};
    FILE *f = fmemopen((void *)text, strlen(text), "r");
    if (!f)
        return -2;
    int rc = vgpu_hook_conf_parse(f, "/run/hook.conf", &conf, err, sizeof err);
    fclose(f);
    return rc;
}

static void test_hook_conf(void)
{
    CHECK(parse_conf("version=1\nlimit_wait_ms=2500\ncompute_policy=hard\nfuture=1\n") == 0);
    CHECK(conf.limit_wait_ms == 2500 && conf.policy == VGPU_COMPUTE_HARD);
    CHECK(parse_conf("version=1\n") == 0); /* absent keys keep the defaults */
    CHECK(conf.limit_wait_ms == 10000 && conf.policy == VGPU_COMPUTE_SHARE);
    CHECK(parse_conf("limit_wait_ms=1\n") == -1);
    CHECK(strcmp(err, "/run/hook.conf: missing required key 'version'") == 0);
    CHECK(parse_conf("version=1\ncompute_policy=fair\n") == -1);
    CHECK(strcmp(err, "/run/hook.conf:2: compute_policy: 'fair' is not one of share, hard, off") ==
          0);
    CHECK(parse_conf("version=1\nlimit_wait_ms=600001\n") == -1);
    CHECK(strstr(err, "from 0 to 600000") != NULL);
    CHECK(parse_conf("version=1\nlimit_wait_ms=1\nlimit_wait_ms=2\n") == -1);
    CHECK(strstr(err, "duplicate key 'limit_wait_ms'") != NULL);
    CHECK(parse_conf("version=2\n") == -1);
}

int main(void)
{
    test_hook_conf();
    test_good_file();
    test_minimal_files();
    test_malformed_lines();
    test_missing_or_inconsistent();
    test_parse_u64();
    return check_report("limits_parse");
}
