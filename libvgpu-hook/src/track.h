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
    VGPU_LINEAR,     /* cuMemAlloc*, managed, pitched, stream-ordered: key = device pointer;
                        from a pool: bytes = 0 (the pool is charged), size, parent = the pool */
    VGPU_IMPORT,     /* cuIpcOpenMemHandle: key = device pointer */
    VGPU_ARRAY,      /* key = CUarray */
    VGPU_MIPMAP,     /* key = CUmipmappedArray */
    VGPU_VMM,        /* cuMemCreate / import: key = CUmemGenericAllocationHandle; refs, maps */
    VGPU_GRAPH,      /* a template graph's allocation node (not charged): key = CUgraph,
                        size, parent = the node's address */
    VGPU_CONTEXT,    /* a context's own overhead: key = CUcontext */
    VGPU_POOL,       /* a memory pool: key = pool, bytes = charged (its reservation),
                        size = bytes of its live allocations */
    VGPU_MAPPING,    /* cuMemMap: key = address, size, parent = the allocation handle;
                        bytes charged only for memory imported from outside the container */
    VGPU_GRAPH_FREE, /* a template graph's free node: key = CUgraph, parent = the address */
    VGPU_GRAPH_EXEC, /* an executable graph's allocation: key = CUgraphExec, parent = address */
    VGPU_CTX_LIMIT,  /* memory a context limit takes: key = vgpu_limit_key(ctx, limit) */
};

/* VGPU_VMM: memory imported from outside the container, charged when mapped. */
#define VGPU_CHARGE_ON_MAP 1
/* VGPU_POOL: destroyed, given back when its last allocation is freed. */
#define VGPU_POOL_DESTROYED 2
/* VGPU_GRAPH_EXEC: no free node in its graph: the allocation outlives a launch. */
#define VGPU_PERSISTS 4
/* VGPU_LINEAR: virtual device memory: managed memory given because the card was full
 * (charged as usual, and counted as spilled in the region). */
#define VGPU_SPILLED 8

struct vgpu_object {
    enum vgpu_kind kind;
    uint64_t key, bytes; /* bytes: what it is charged */
    int dev;
    uint64_t ctx;    /* context it was made in; 0 if none or not bound to one */
    uint64_t export; /* hash of its IPC handle once exported; 0 if never */
    uint64_t size;   /* its own size, where that differs from bytes (see the kinds) */
    uint64_t parent; /* the object it belongs to (see the kinds) */
    uint64_t shared; /* VGPU_VMM: its key in the region's shared table once exported, else 0 */
    int32_t refs, maps; /* VGPU_VMM: handle references and mappings */
    int32_t flags;      /* VGPU_CHARGE_ON_MAP, VGPU_POOL_DESTROYED, VGPU_PERSISTS */
};

/* Key of a context's limit (user addresses fit in 48 bits). */
static inline uint64_t vgpu_limit_key(uint64_t ctx, int limit)
{
    return ctx << 4 | (uint64_t)(limit & 15);
}

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

/* Runs change(o, arg) on one object of this kind and key under the table's
 * lock; if it returns nonzero the object is forgotten. *out (may be NULL)
 * gets the object as it is afterwards. -1 if there is none, 1 if forgotten, else 0. */
int vgpu_track_update(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key,
                      int (*change)(struct vgpu_object *o, void *arg), void *arg,
                      struct vgpu_object *out);

/* Copies up to max objects of this kind (and key, unless any_key) to out.
 * Returns how many there are, which may be more than max. */
int vgpu_track_collect(struct vgpu_track *t, enum vgpu_kind kind, uint64_t key, int any_key,
                       struct vgpu_object *out, int max);

/* Forgets every object made in ctx (not the context itself), calling
 * gone(o, arg) for each after the table is unlocked. Returns how many. */
int vgpu_track_drop_context(struct vgpu_track *t, uint64_t ctx,
                            void (*gone)(const struct vgpu_object *o, void *arg), void *arg);

#endif
