/* Unit tests of the compute limiter's policy (src/limiter.c) and the relay
 * messages (src/relay_msg.c), no interception, no clock. */
#include <string.h>

#include "check.h"
#include "limiter.h"
#include "relay_msg.h"

#define MS 1000000ull

#define BURST (10 * MS)
#define DEBT (2000 * MS)

/* A container launching as fast as it may: over 10 s of virtual time, kernels
 * of 1 ms at a 30% share run 3000 times, give or take the burst. */
static void test_clock_holds_the_share(void)
{
    _Atomic uint64_t tat = 0;
    uint64_t now = 1000 * MS, end = now + 10000 * MS, launches = 0;
    uint64_t charge = vgpu_launch_charge(1 * MS, 30);
    CHECK(charge == 3333333);
    while (now < end) {
        now += vgpu_clock_take(&tat, now, charge, 0, BURST, DEBT);
        launches++;
    }
    CHECK(launches >= 3000 && launches <= 3005);

    /* Idle for a while: no credit piles up beyond the burst. */
    now += 5000 * MS;
    int free_launches = 0;
    while (vgpu_clock_take(&tat, now, charge, 0, BURST, DEBT) == 0)
        free_launches++;
    CHECK(free_launches == 4); /* 0, 3.3, 6.7 and 10 ms ahead are within the 10 ms burst */
}

/* A long kernel costs its own time and no more: the next launch waits what the
 * long one owes, and short kernels then run at their own rate again. */
static void test_long_kernel_neither_banks_nor_starves(void)
{
    _Atomic uint64_t tat = 0;
    uint64_t now = 1000 * MS;
    CHECK(vgpu_clock_take(&tat, now, vgpu_launch_charge(100 * MS, 30), 0, BURST, DEBT) == 0);
    uint64_t wait = vgpu_clock_take(&tat, now, vgpu_launch_charge(1 * MS, 30), 0, BURST, DEBT);
    CHECK(wait == 333333333 - BURST);
    now += wait;
    uint64_t start = now, gpu = 0;
    while (now < start + 3000 * MS) {
        now += vgpu_clock_take(&tat, now, vgpu_launch_charge(1 * MS, 30), 0, BURST, DEBT);
        gpu += 1 * MS;
    }
    CHECK(gpu >= 895 * MS && gpu <= 905 * MS); /* 30% of 3 s */

    /* A kernel longer than the debt bound is charged up to the bound only: no
     * launch ever waits more than max_debt - burst. */
    now += 10000 * MS;
    CHECK(vgpu_clock_take(&tat, now, vgpu_launch_charge(5000 * MS, 30), 0, BURST, DEBT) == 0);
    CHECK(atomic_load(&tat) == now + DEBT);
    CHECK(vgpu_clock_take(&tat, now, 1 * MS, 0, BURST, DEBT) == DEBT - BURST);
    CHECK(atomic_load(&tat) == now + DEBT); /* still capped */
}

/* Settling: an overcharge given back never puts the clock behind now (no
 * credit), an undercharge is added (up to the debt bound). */
static void test_refunds_and_extra_charges(void)
{
    _Atomic uint64_t tat = 0;
    uint64_t now = 1000 * MS;
    vgpu_clock_take(&tat, now, 50 * MS, 0, BURST, DEBT);
    vgpu_clock_take(&tat, now, 0, 30 * MS, BURST, DEBT);
    CHECK(atomic_load(&tat) == now + 20 * MS);
    vgpu_clock_take(&tat, now, 0, 500 * MS, BURST, DEBT);
    CHECK(atomic_load(&tat) == now);
    CHECK(vgpu_clock_take(&tat, now, 0, 0, BURST, DEBT) == 0);
    vgpu_clock_take(&tat, now, 40 * MS, 0, BURST, DEBT);
    CHECK(vgpu_clock_take(&tat, now, 0, 0, BURST, DEBT) == 30 * MS);
    /* A clock left far ahead (older hook, corrupt region) is pulled back to the bound. */
    atomic_store(&tat, now + 100000 * MS);
    CHECK(vgpu_clock_take(&tat, now, 1 * MS, 0, BURST, DEBT) == DEBT - BURST);
}

static void test_cost_table(void)
{
    static struct vgpu_cost_table t;
    int known = 1;
    uint64_t a = vgpu_cost_key(0x1000, 1, 2, 3), b = vgpu_cost_key(0x1000, 1, 2, 4);
    CHECK(a != b && a != 0 && vgpu_cost_key(0, 0, 0, 0) != 0);
    CHECK(vgpu_cost_lookup(&t, a, &known) == 0 && !known);
    CHECK(vgpu_cost_learn(&t, a, 0, 1) == 0); /* a measured 0 is known */
    CHECK(vgpu_cost_lookup(&t, a, &known) == 0 && known);
    vgpu_cost_learn(&t, a, 800, 1); /* suspect: 16 times the average */
    CHECK(vgpu_cost_lookup(&t, a, &known) == 50 && known);
    CHECK(vgpu_cost_learn(&t, a, 50, 1) == 50);
    CHECK(vgpu_cost_learn(&t, a, 250, 1) == 50 + 200 / 16); /* one inflated sample: 1/16 */
    CHECK(vgpu_cost_learn(&t, a, 10, 1) == 62 - 62 / 4 + 10 / 4); /* lower: 1/4 at once */
    /* The kernel really got longer: after VGPU_COST_SUSPECTS high samples in a row, 1/4. */
    uint64_t avg = vgpu_cost_lookup(&t, a, &known);
    for (int i = 1; i < VGPU_COST_SUSPECTS; i++) {
        avg = avg - avg / 16 + 1000 / 16;
        CHECK(vgpu_cost_learn(&t, a, 1000, 1) == avg);
    }
    CHECK(vgpu_cost_learn(&t, a, 1000, 1) == avg - avg / 4 + 1000 / 4);
    for (int i = 0; i < 20; i++)
        vgpu_cost_learn(&t, a, 200, 1);
    CHECK(vgpu_cost_lookup(&t, a, &known) <= 205);
    /* Not exact (bracketed behind queued work): an upper bound, lowers only. */
    uint64_t before = vgpu_cost_lookup(&t, a, &known);
    CHECK(vgpu_cost_learn(&t, a, 10 * before, 0) == before);
    CHECK(vgpu_cost_learn(&t, a, before / 2, 0) == before - (before - before / 2) / 4);
    vgpu_cost_learn(&t, b, 50 * MS, 1);
    CHECK(vgpu_cost_lookup(&t, b, &known) == 50 * MS && known);
    CHECK(vgpu_cost_lookup(&t, a, &known) <= 205 && known); /* short and long kept apart */
    /* More signatures than entries: every one just learned is found. */
    for (uint64_t i = 0; i < 4 * VGPU_COST_ENTRIES; i++) {
        uint64_t k = vgpu_cost_key(i, 7, 7, 7);
        vgpu_cost_learn(&t, k, i + 1, 1);
        CHECK(vgpu_cost_lookup(&t, k, &known) == i + 1 && known);
    }
}

static void test_cost_estimates(void)
{
    CHECK(vgpu_launch_charge(5 * MS, 100) == 5 * MS);
    CHECK(vgpu_launch_charge(5 * MS, 0) == 5 * MS);
    CHECK(vgpu_launch_charge(UINT64_MAX / 10, 50) > 0); /* saturates, no wrap */
    CHECK(vgpu_cost_average(0, 800) == 800);
    CHECK(vgpu_cost_average(800, 400) == 700);
    CHECK(vgpu_sample_cost(5 * MS, 0) == 5 * MS);
    CHECK(vgpu_sample_cost(5 * MS, 1 * MS) == 4 * MS);
    CHECK(vgpu_sample_cost(1 * MS, 5 * MS) == 0);
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
    struct vgpu_usage_device ud[2] = {{0, 700, 300, -1}, {1, 900, 900, 250}};
    n = vgpu_msg_usage(buf, sizeof buf, 42, 123456, ud, 1, 99, 7);
    CHECK(strcmp(buf, "{\"v\":1,\"type\":\"usage\",\"pid\":42,\"ts_ms\":123456,\"devices\":"
                      "[{\"index\":0,\"used_mib\":700,\"process_used_mib\":300}],"
                      "\"launches\":99,\"throttled_ms\":7}\n") == 0);
    /* A device with virtual device memory also says how much of it spilled. */
    n = vgpu_msg_usage(buf, sizeof buf, 42, 123456, ud, 2, 99, 7);
    CHECK(strcmp(buf, "{\"v\":1,\"type\":\"usage\",\"pid\":42,\"ts_ms\":123456,\"devices\":"
                      "[{\"index\":0,\"used_mib\":700,\"process_used_mib\":300},"
                      "{\"index\":1,\"used_mib\":900,\"process_used_mib\":900,"
                      "\"spilled_mib\":250}],\"launches\":99,\"throttled_ms\":7}\n") == 0);
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
    test_clock_holds_the_share();
    test_long_kernel_neither_banks_nor_starves();
    test_refunds_and_extra_charges();
    test_cost_table();
    test_cost_estimates();
    test_messages();
    test_util_parsing();
    return check_report("policy_test");
}
