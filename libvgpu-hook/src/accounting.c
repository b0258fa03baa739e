#include "accounting.h"

#include <stdlib.h>

struct vgpu_acct_entry {
    uint64_t ptr, bytes;
    int dev;
    struct vgpu_acct_entry *next;
};

static int valid_dev(int dev)
{
    return dev >= 0 && dev < VGPU_MAX_DEVICES;
}

static struct vgpu_acct_entry **bucket(struct vgpu_acct *a, uint64_t ptr)
{
    /* Fibonacci hashing: top 12 bits of the product pick one of 4096 buckets. */
    _Static_assert(VGPU_ACCT_BUCKETS == 1 << 12, "hash width must match bucket count");
    return &a->buckets[(ptr * 0x9E3779B97F4A7C15ull) >> 52];
}

int vgpu_acct_reserve(struct vgpu_acct *a, int dev, uint64_t bytes, uint64_t limit,
                      uint64_t *used_before)
{
    if (!valid_dev(dev)) {
        if (used_before)
            *used_before = 0;
        return -1;
    }
    pthread_mutex_lock(&a->mu);
    uint64_t used = a->used[dev];
    int fits = limit == 0 || (bytes <= limit && used <= limit - bytes);
    if (fits)
        a->used[dev] = used + bytes;
    pthread_mutex_unlock(&a->mu);
    if (used_before)
        *used_before = used;
    return fits ? 0 : -1;
}

/* Caller holds a->mu. */
static void give_back(struct vgpu_acct *a, int dev, uint64_t bytes)
{
    a->used[dev] = a->used[dev] > bytes ? a->used[dev] - bytes : 0;
}

void vgpu_acct_unreserve(struct vgpu_acct *a, int dev, uint64_t bytes)
{
    if (!valid_dev(dev))
        return;
    pthread_mutex_lock(&a->mu);
    give_back(a, dev, bytes);
    pthread_mutex_unlock(&a->mu);
}

int vgpu_acct_track(struct vgpu_acct *a, uint64_t ptr, int dev, uint64_t bytes)
{
    struct vgpu_acct_entry *e = malloc(sizeof *e);
    if (!e || !valid_dev(dev)) {
        free(e);
        return -1;
    }
    e->ptr = ptr;
    e->bytes = bytes;
    e->dev = dev;
    pthread_mutex_lock(&a->mu);
    struct vgpu_acct_entry **head = bucket(a, ptr);
    e->next = *head;
    *head = e;
    pthread_mutex_unlock(&a->mu);
    return 0;
}

int vgpu_acct_untrack(struct vgpu_acct *a, uint64_t ptr, int *dev, uint64_t *bytes)
{
    pthread_mutex_lock(&a->mu);
    struct vgpu_acct_entry **link = bucket(a, ptr), *e;
    while ((e = *link) && e->ptr != ptr)
        link = &e->next;
    if (e) {
        *link = e->next;
        give_back(a, e->dev, e->bytes);
    }
    pthread_mutex_unlock(&a->mu);
    if (!e)
        return -1;
    *dev = e->dev;
    *bytes = e->bytes;
    free(e);
    return 0;
}

uint64_t vgpu_acct_used(struct vgpu_acct *a, int dev)
{
    if (!valid_dev(dev))
        return 0;
    pthread_mutex_lock(&a->mu);
    uint64_t used = a->used[dev];
    pthread_mutex_unlock(&a->mu);
    return used;
}
