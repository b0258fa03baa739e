/* Unit tests of the per-process accounting (src/accounting.c), no interception. */
#include <pthread.h>

#include "accounting.h"
#include "check.h"

static struct vgpu_acct acct = VGPU_ACCT_INIT;

static void test_reserve_and_limit(void)
{
    uint64_t used = 99;
    CHECK(vgpu_acct_reserve(&acct, 0, 600, 1000, &used) == 0 && used == 0);
    CHECK(vgpu_acct_reserve(&acct, 0, 400, 1000, &used) == 0 && used == 600); /* exactly full */
    CHECK(vgpu_acct_reserve(&acct, 0, 1, 1000, &used) == -1 && used == 1000);
    CHECK(vgpu_acct_used(&acct, 0) == 1000);
    CHECK(vgpu_acct_used(&acct, 1) == 0); /* devices are separate */
    CHECK(vgpu_acct_reserve(&acct, 1, 5000, 0, NULL) == 0); /* 0 = unlimited */
    CHECK(vgpu_acct_reserve(&acct, 2, UINT64_MAX, 1000, NULL) == -1); /* no wrap-around */
    CHECK(vgpu_acct_reserve(&acct, VGPU_MAX_DEVICES, 1, 0, NULL) == -1);
    CHECK(vgpu_acct_reserve(&acct, -1, 1, 0, NULL) == -1);
    vgpu_acct_unreserve(&acct, 0, 1000);
    vgpu_acct_unreserve(&acct, 1, 5000);
    CHECK(vgpu_acct_used(&acct, 0) == 0 && vgpu_acct_used(&acct, 1) == 0);
}

static void test_track_untrack(void)
{
    int dev = -1;
    uint64_t bytes = 0;
    /* Many pointers, so that buckets hold chains. */
    for (uint64_t i = 0; i < 10000; i++) {
        CHECK(vgpu_acct_reserve(&acct, (int)(i % 3), 512, 0, NULL) == 0);
        CHECK(vgpu_acct_track(&acct, (1ull << 40) + i * 512, (int)(i % 3), 512) == 0);
    }
    CHECK(vgpu_acct_used(&acct, 0) == 3334 * 512);
    CHECK(vgpu_acct_untrack(&acct, (1ull << 40) + 7 * 512, &dev, &bytes) == 0);
    CHECK(dev == 1 && bytes == 512);
    CHECK(vgpu_acct_untrack(&acct, (1ull << 40) + 7 * 512, &dev, &bytes) == -1); /* gone */
    CHECK(vgpu_acct_untrack(&acct, 12345, &dev, &bytes) == -1); /* never tracked */
    for (uint64_t i = 0; i < 10000; i++)
        if (i != 7)
            CHECK(vgpu_acct_untrack(&acct, (1ull << 40) + i * 512, &dev, &bytes) == 0);
    for (int d = 0; d < 3; d++)
        CHECK(vgpu_acct_used(&acct, d) == 0);
}

/* Concurrent reservations never exceed the limit, and fill it exactly. */
static void *reserve_until_full(void *arg)
{
    long *granted = arg;
    while (vgpu_acct_reserve(&acct, 5, 10, 100000, NULL) == 0)
        ++*granted;
    return NULL;
}

static void test_concurrent_reserve(void)
{
    pthread_t threads[8];
    long granted[8] = {0}, total = 0;
    for (int i = 0; i < 8; i++)
        CHECK(pthread_create(&threads[i], NULL, reserve_until_full, &granted[i]) == 0);
    for (int i = 0; i < 8; i++) {
        pthread_join(threads[i], NULL);
        total += granted[i];
    }
    CHECK(total == 10000);
    CHECK(vgpu_acct_used(&acct, 5) == 100000);
}

int main(void)
{
    test_reserve_and_limit();
    test_track_untrack();
    test_concurrent_reserve();
    return check_report("accounting_test");
}
