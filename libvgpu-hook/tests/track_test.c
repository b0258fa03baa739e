/* Unit tests of the per-process object table (src/track.c), no interception. */
#include <pthread.h>

#include "check.h"
#include "track.h"

static struct vgpu_track t = VGPU_TRACK_INIT;

static struct vgpu_object obj(enum vgpu_kind kind, uint64_t key, int dev, uint64_t bytes,
                              uint64_t ctx)
{
    return (struct vgpu_object){.kind = kind, .key = key, .dev = dev, .bytes = bytes, .ctx = ctx};
}

static void test_add_remove(void)
{
    struct vgpu_object o;
    /* Many keys, so that buckets hold chains. */
    for (uint64_t i = 0; i < 10000; i++) {
        struct vgpu_object a = obj(VGPU_LINEAR, (1ull << 40) + i * 512, (int)(i % 3), 512, 7);
        CHECK(vgpu_track_add(&t, &a) == 0);
    }
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, (1ull << 40) + 7 * 512, &o) == 0);
    CHECK(o.dev == 1 && o.bytes == 512 && o.ctx == 7);
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, (1ull << 40) + 7 * 512, &o) == -1); /* gone */
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, 12345, &o) == -1);                  /* never */
    /* Same key, other kind: a different object. */
    CHECK(vgpu_track_remove(&t, VGPU_ARRAY, (1ull << 40), &o) == -1);
    for (uint64_t i = 0; i < 10000; i++)
        if (i != 7)
            CHECK(vgpu_track_remove(&t, VGPU_LINEAR, (1ull << 40) + i * 512, &o) == 0);
}

static void test_duplicates_and_export(void)
{
    struct vgpu_object o, g1 = obj(VGPU_GRAPH, 99, 0, 100, 0), g2 = obj(VGPU_GRAPH, 99, 0, 200, 0);
    CHECK(vgpu_track_add(&t, &g1) == 0 && vgpu_track_add(&t, &g2) == 0);
    uint64_t total = 0;
    while (vgpu_track_remove(&t, VGPU_GRAPH, 99, &o) == 0)
        total += o.bytes;
    CHECK(total == 300);

    struct vgpu_object a = obj(VGPU_LINEAR, 5, 0, 10, 0);
    CHECK(vgpu_track_add(&t, &a) == 0);
    CHECK(vgpu_track_set_export(&t, VGPU_LINEAR, 5, 0xabc) == 0);
    CHECK(vgpu_track_set_export(&t, VGPU_LINEAR, 6, 0xabc) == -1);
    CHECK(vgpu_track_find(&t, VGPU_LINEAR, 5, &o) == 0 && o.export == 0xabc);
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, 5, &o) == 0 && o.export == 0xabc);
}

static uint64_t dropped_bytes;

static void count_dropped(const struct vgpu_object *o, void *arg)
{
    (void)arg;
    dropped_bytes += o->bytes;
}

static void test_drop_context(void)
{
    struct vgpu_object a = obj(VGPU_LINEAR, 1, 0, 10, 1), b = obj(VGPU_ARRAY, 2, 0, 20, 1),
                       c = obj(VGPU_LINEAR, 3, 0, 40, 2), ctx = obj(VGPU_CONTEXT, 1, 0, 80, 1);
    CHECK(vgpu_track_add(&t, &a) == 0 && vgpu_track_add(&t, &b) == 0);
    CHECK(vgpu_track_add(&t, &c) == 0 && vgpu_track_add(&t, &ctx) == 0);
    CHECK(vgpu_track_drop_context(&t, 1, count_dropped, NULL) == 2);
    CHECK(dropped_bytes == 30);
    struct vgpu_object o;
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, 3, &o) == 0);  /* other context: kept */
    CHECK(vgpu_track_remove(&t, VGPU_CONTEXT, 1, &o) == 0); /* the context itself: kept */
    CHECK(vgpu_track_remove(&t, VGPU_LINEAR, 1, &o) == -1);
}

static void *churn(void *arg)
{
    uint64_t base = (uint64_t)(uintptr_t)arg << 32;
    struct vgpu_object o;
    for (uint64_t i = 0; i < 20000; i++) {
        struct vgpu_object a = obj(VGPU_LINEAR, base + i, 0, 1, 0);
        if (vgpu_track_add(&t, &a) != 0 || vgpu_track_remove(&t, VGPU_LINEAR, base + i, &o) != 0)
            return (void *)1;
    }
    return NULL;
}

static void test_threads(void)
{
    pthread_t th[4];
    for (uintptr_t i = 0; i < 4; i++)
        CHECK(pthread_create(&th[i], NULL, churn, (void *)(i + 1)) == 0);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        CHECK(r == NULL);
    }
}

static int add_refs(struct vgpu_object *o, void *arg)
{
    o->refs += *(int *)arg;
    return o->refs <= 0;
}

static void test_update_and_collect(void)
{
    struct vgpu_object o, all[4], v = obj(VGPU_VMM, 42, 1, 2048, 0);
    int up = 1, down = -1;
    v.refs = 1;
    CHECK(vgpu_track_add(&t, &v) == 0);
    CHECK(vgpu_track_update(&t, VGPU_VMM, 42, add_refs, &up, &o) == 0 && o.refs == 2);
    CHECK(vgpu_track_update(&t, VGPU_VMM, 43, add_refs, &up, &o) == -1); /* none */
    CHECK(vgpu_track_update(&t, VGPU_VMM, 42, add_refs, &down, &o) == 0 && o.refs == 1);
    CHECK(vgpu_track_update(&t, VGPU_VMM, 42, add_refs, &down, &o) == 1 && o.refs == 0);
    CHECK(vgpu_track_find(&t, VGPU_VMM, 42, &o) == -1); /* forgotten */
    for (uint64_t k = 1; k <= 6; k++) {
        struct vgpu_object m = obj(VGPU_MAPPING, k << 21, 0, 0, 0);
        CHECK(vgpu_track_add(&t, &m) == 0);
    }
    CHECK(vgpu_track_collect(&t, VGPU_MAPPING, 0, 1, all, 4) == 6); /* counts past max */
    CHECK(vgpu_track_collect(&t, VGPU_MAPPING, 3 << 21, 0, all, 4) == 1 && all[0].key == 3 << 21);
    CHECK(vgpu_track_collect(&t, VGPU_POOL, 0, 1, NULL, 0) == 0);
    for (uint64_t k = 1; k <= 6; k++)
        CHECK(vgpu_track_remove(&t, VGPU_MAPPING, k << 21, &o) == 0);
}

int main(void)
{
    test_update_and_collect();
    test_add_remove();
    test_duplicates_and_export();
    test_drop_context();
    test_threads();
    return check_report("track_test");
}
