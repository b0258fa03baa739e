#include "track.h"

#include <stdlib.h>

struct vgpu_track_entry {
    struct vgpu_object o;
    struct vgpu_track_entry *next;
};

static struct vgpu_track_entry **bucket(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key)
{
    /* Fibonacci hashing: top 12 bits of the product pick one of 4096 buckets. */
    _Static_assert(VGPU_TRACK_BUCKETS == 1 << 12, "hash width must match bucket count");
    return &t->buckets[((key + (uint64_t)kind) * 0x9E3779B97F4A7C15ull) >> 52];
}

int vgpu_track_add(struct vgpu_track *t, const struct vgpu_object *o)
{
    struct vgpu_track_entry *e = malloc(sizeof *e);
    if (!e)
        return -1;
    e->o = *o;
    pthread_mutex_lock(&t->mu);
    struct vgpu_track_entry **head = bucket(t, o->kind, o->key);
    e->next = *head;
    *head = e;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* Caller holds t->mu. */
static struct vgpu_track_entry **link_of(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key)
{
    struct vgpu_track_entry **link = bucket(t, kind, key), *e;
    while ((e = *link) && !(e->o.key == key && e->o.kind == kind))
        link = &e->next;
    return link;
}

int vgpu_track_remove(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                      struct vgpu_object *out)
{
    pthread_mutex_lock(&t->mu);
    struct vgpu_track_entry **link = link_of(t, kind, key), *e = *link;
    if (e)
        *link = e->next;
    pthread_mutex_unlock(&t->mu);
    if (!e)
        return -1;
    *out = e->o;
    free(e);
    return 0;
}

int vgpu_track_find(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                    struct vgpu_object *out)
{
    pthread_mutex_lock(&t->mu);
    struct vgpu_track_entry *e = *link_of(t, kind, key);
    if (e)
        *out = e->o;
    pthread_mutex_unlock(&t->mu);
    return e ? 0 : -1;
}

int vgpu_track_set_export(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                          uint64_t export)
{
    pthread_mutex_lock(&t->mu);
    struct vgpu_track_entry *e = *link_of(t, kind, key);
    if (e)
        e->o.export = export;
    pthread_mutex_unlock(&t->mu);
    return e ? 0 : -1;
}

int vgpu_track_update(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                      int (*change)(struct vgpu_object *o, void *arg), void *arg,
                      struct vgpu_object *out)
{
    pthread_mutex_lock(&t->mu);
    struct vgpu_track_entry **link = link_of(t, kind, key), *e = *link;
    int forget = e ? change(&e->o, arg) != 0 : 0;
    if (e && out)
        *out = e->o;
    if (forget)
        *link = e->next;
    pthread_mutex_unlock(&t->mu);
    if (!e)
        return -1;
    if (forget)
        free(e);
    return forget;
}

static int collect_from(struct vgpu_track_entry *e, enum vgpu_kind kind, uint64_t key, int any_key,
                        struct vgpu_object *out, int max, int n)
{
    for (; e; e = e->next) {
        if (e->o.kind != kind || (!any_key && e->o.key != key))
            continue;
        if (n < max)
            out[n] = e->o;
        n++;
    }
    return n;
}

int vgpu_track_collect(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key, int any_key,
                       struct vgpu_object *out, int max)
{
    int n = 0;
    pthread_mutex_lock(&t->mu);
    if (any_key)
        for (int b = 0; b < VGPU_TRACK_BUCKETS; b++)
            n = collect_from(t->buckets[b], kind, key, 1, out, max, n);
    else
        n = collect_from(*bucket(t, kind, key), kind, key, 0, out, max, 0);
    pthread_mutex_unlock(&t->mu);
    return n;
}

int vgpu_track_drop_context(struct vgpu_track *t, uint64_t ctx,
                            void (*gone)(const struct vgpu_object *o, void *arg), void *arg)
{
    struct vgpu_track_entry *dropped = NULL;
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (int b = 0; b < VGPU_TRACK_BUCKETS; b++) {
        struct vgpu_track_entry **link = &t->buckets[b], *e;
        while ((e = *link)) {
            if (e->o.ctx == ctx && e->o.kind != VGPU_CONTEXT) {
                *link = e->next;
                e->next = dropped;
                dropped = e;
                n++;
            } else {
                link = &e->next;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
    while (dropped) {
        struct vgpu_track_entry *e = dropped;
        dropped = e->next;
        if (gone)
            gone(&e->o, arg);
        free(e);
    }
    return n;
}
