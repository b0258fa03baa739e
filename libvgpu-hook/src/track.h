/* The process's live device-memory objects: what each one is charged, on
 * which device, in which context. Keyed by kind and key (a device pointer, or
 * an array, VMM, graph or context handle); a key may be held more than once
 * (a graph with several allocation nodes). Pure, thread-safe, unit-tested
 * directly. The charges themselves live in the shared region (region.h). */
#ifndef VGPU_TRACK_H
#define VGPU_TRACK_H

#include <pthread.h>
#include <stdint.h>

#define VGPU_TRACK_BUCKETS 4096

enum vgpu_kind {
    VGPU_LINEAR,  /* cuMemAlloc*, managed, pitched, stream-ordered: key = device pointer */
    VGPU_IMPORT,  /* cuIpcOpenMemHandle: key = device pointer */
    VGPU_ARRAY,   /* key = CUarray */
    VGPU_MIPMAP,  /* key = CUmipmappedArray */
    VGPU_VMM,     /* cuMemCreate: key = CUmemGenericAllocationHandle */
    VGPU_GRAPH,   /* a graph's allocation nodes: key = CUgraph */
    VGPU_CONTEXT, /* a context's own overhead: key = CUcontext */
    VGPU_POOL,    /* cuMemPoolCreate: key = pool, dev = its device, bytes = 0 */
};

struct vgpu_object {
    enum vgpu_kind kind;
    uint64_t key, bytes;
    int dev;
    uint64_t ctx;    /* context it was made in; 0 if none or not bound to one */
    uint64_t export; /* hash of its IPC handle once exported; 0 if never */
};

struct vgpu_track_entry;

struct vgpu_track {
    pthread_mutex_t mu;
    struct vgpu_track_entry *buckets[VGPU_TRACK_BUCKETS];
};

#define VGPU_TRACK_INIT {.mu = PTHREAD_MUTEX_INITIALIZER}

/* Remembers o. Returns 0, or -1 if out of host memory (nothing recorded). */
int vgpu_track_add(struct vgpu_track *t, const struct vgpu_object *o);

/* Forgets one object of this kind and key, copying it to *out. 0, or -1 if none. */
int vgpu_track_remove(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                      struct vgpu_object *out);

/* Copies one object of this kind and key to *out without forgetting it. */
int vgpu_track_find(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                    struct vgpu_object *out);

/* Sets the export hash of the object; 0, or -1 if not tracked. */
int vgpu_track_set_export(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                          uint64_t export);

/* Forgets every object made in ctx (not the context itself), calling
 * gone(o, arg) for each after the table is unlocked. Returns how many. */
int vgpu_track_drop_context(struct vgpu_track *t, uint64_t ctx,
                            void (*gone)(const struct vgpu_object *o, void *arg), void *arg);

#endif
