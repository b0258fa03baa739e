/* Unit tests of the compute limiter's policy (src/limiter.c) and the relay
 * messages (src/relay_msg.c), no interception, no clock. */
#include <string.h>

#include "check.h"
#include "limiter.h"
#include "relay_msg.h"

#define MS 1000000ull

/* A container launching as fast as it may: over 10 s of virtual time, kernels
 * of 1 ms at a 30% share run 3000 times, give or take the burst. */
static void test_gcra_holds_the_share(void)
{
    _Atomic uint64_t tat = 0;
    uint64_t now = 1000 * MS, end = now + 10000 * MS, launches = 0;
    uint64_t charge = vgpu_launch_charge(1 * MS, 30);
    CHECK(charge == 3333333);
    while (now < end) {
        now += vgpu_gcra_admit(&tat, now, charge, 10 * MS);
        launches++;
    }
    CHECK(launches >= 3000 && launches <= 3005);

    /* Idle for a while: no credit piles up beyond the burst. */
    now += 5000 * MS;
    int free_launches = 0;
    while (vgpu_gcra_admit(&tat, now, charge, 10 * MS) == 0)
        free_launches++;
    CHECK(free_launches == 4); /* 0, 3.3, 6.7 and 10 ms ahead are within the 10 ms burst */
}

static void test_cost_estimates(void)
{
    CHECK(vgpu_launch_charge(5 * MS, 100) == 5 * MS);
    CHECK(vgpu_launch_charge(5 * MS, 0) == 5 * MS);
    CHECK(vgpu_launch_charge(UINT64_MAX / 10, 50) > 0); /* saturates, no wrap */
    CHECK(vgpu_cost_average(0, 800) == 800);
    CHECK(vgpu_cost_average(800, 400) == 700);
    /* 30% of 500 ms in 150 launches: 1 ms each. */
    CHECK(vgpu_cost_from_util(30, 500 * MS, 150) == 1 * MS);
    CHECK(vgpu_cost_from_util(0, 500 * MS, 150) == 0);
    CHECK(vgpu_cost_from_util(-1, 500 * MS, 150) == 0);
    CHECK(vgpu_cost_from_util(30, 500 * MS, 0) == 0);
    CHECK(vgpu_cost_from_util(130, 500 * MS, 10) == 0);
}

static void test_messages(void)
{
    char buf[VGPU_RELAY_MAX_LINE];
    struct vgpu_hello_device hd[2] = {{0, "GPU-a", 1024, 30}, {1, "GPU-\"b\"", 0, 0}};
    int n = vgpu_msg_hello(buf, sizeof buf, 42, "py\tthon", hd, 2);
    CHECK(n > 0 && buf[n - 1] == '\n');
    CHECK(strcmp(buf, "{\"v\":1,\"type\":\"hello\",\"pid\":42,\"comm\":\"py\\u0009thon\","
                      "\"devices\":[{\"index\":0,\"uuid\":\"GPU-a\",\"limit_mib\":1024,"
                      "\"cores\":30},{\"index\":1,\"uuid\":\"GPU-\\\"b\\\"\",\"limit_mib\":0,"
                      "\"cores\":0}]}\n") == 0);
    struct vgpu_usage_device ud[1] = {{0, 700, 300}};
    n = vgpu_msg_usage(buf, sizeof buf, 42, 123456, ud, 1, 99, 7);
    CHECK(strcmp(buf, "{\"v\":1,\"type\":\"usage\",\"pid\":42,\"ts_ms\":123456,\"devices\":"
                      "[{\"index\":0,\"used_mib\":700,\"process_used_mib\":300}],"
                      "\"launches\":99,\"throttled_ms\":7}\n") == 0);
    n = vgpu_msg_exit(buf, sizeof buf, 42);
    CHECK(n > 0 && strcmp(buf, "{\"v\":1,\"type\":\"exit\",\"pid\":42}\n") == 0);
    CHECK(vgpu_msg_exit(buf, 10, 42) == -1); /* does not fit */
}

static int parse(const char *line, struct vgpu_util *u, int max)
{
    return vgpu_msg_parse_util(line, strlen(line), u, max);
}

static void test_util_parsing(void)
{
    struct vgpu_util u[4];
    /* As the agent encodes it (msgspec): type first, floats. */
    CHECK(parse("{\"type\":\"util\",\"v\":1,\"devices\":[{\"index\":0,\"sm_util_percent\":80.5,"
                "\"container_sm_util_percent\":30.0},{\"index\":1,\"sm_util_percent\":0,"
                "\"container_sm_util_percent\":-1}]}",
                u, 4) == 2);
    CHECK(u[0].index == 0 && u[0].sm_util == 80.5 && u[0].container_sm_util == 30.0);
    CHECK(u[1].index == 1 && u[1].container_sm_util == -1);
    /* Whitespace, unknown fields of any shape, escaped strings. */
    CHECK(parse(" { \"v\" : 1 , \"x\" : {\"a\":[1,{\"b\":null}],\"s\":\"}\\\"\"}, \"type\":\"util\","
                "\"devices\":[ {\"new\":true,\"index\":2,\"sm_util_percent\":1e1,"
                "\"container_sm_util_percent\":5} ] } ",
                u, 4) == 1);
    CHECK(u[0].index == 2 && u[0].sm_util == 10);
    CHECK(parse("{\"v\":1,\"type\":\"util\",\"devices\":[]}", u, 4) == 0);
    /* Not util, wrong version, missing fields, broken JSON, trailing junk. */
    CHECK(parse("{\"v\":1,\"type\":\"hello\",\"devices\":[]}", u, 4) == -1);
    CHECK(parse("{\"v\":2,\"type\":\"util\",\"devices\":[]}", u, 4) == -1);
    CHECK(parse("{\"v\":1,\"type\":\"util\"}", u, 4) == -1);
    CHECK(parse("{\"v\":1,\"type\":\"util\",\"devices\":[{\"index\":0}]}", u, 4) == -1);
    CHECK(parse("{\"v\":1,\"type\":\"util\",\"devices\":[", u, 4) == -1);
    CHECK(parse("{\"v\":1,\"type\":\"util\",\"devices\":[]} x", u, 4) == -1);
    CHECK(parse("", u, 4) == -1);
}

int main(void)
{
    test_gcra_holds_the_share();
    test_cost_estimates();
    test_messages();
    test_util_parsing();
    return check_report("policy_test");
}
