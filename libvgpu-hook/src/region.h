/* The container's shared accounting region: one file in the container's
 * state directory (/var/run/vgpu-state/hook.region in a container,
 * $VGPU_CONTAINER_DIR/hook.region on a bare host), mapped by every process of
 * the container, so that they all draw on one budget per device.
 *
 * - The node agent creates the file with just the 16-byte header (magic,
 *   layout 0, size 0: "grow me"); the first process that opens it grows it to
 *   this hook's layout, creates the lock and writes layout and size, under
 *   flock. (The agent never needs to know the hook's layout.) A file that is not that header
 *   or this layout (zeroed, foreign, another size) is refused: in a container
 *   CUDA then fails to initialise (state.c). The container's processes must
 *   write the region, so they can also corrupt it: the agent never trusts its
 *   figures (docs/nodeagent.md, "The container's directory").
 *
 * - A robust, process-shared mutex guards the memory figures. A process that
 *   dies holding it (SIGKILL) does not block the others: the next locker gets
 *   EOWNERDEAD, recomputes the totals from the per-process slots (each slot
 *   value is written in one store, so slots are always whole) and marks the
 *   mutex consistent.
 * - Each process has a slot: its pid, PID namespace and start time and what
 *   it holds per device. Slots of dead processes are reaped when a process
 *   attaches and before an allocation is refused, and what they held is given
 *   back. Whether an owner is dead is proven by a file lock it holds while it
 *   lives, valid across PID namespaces (liveness.h); a slot whose owner cannot
 *   be proven dead is never reaped.
 * - Launch counters and the compute limiter's state are atomics, outside the
 *   lock.
 * - IPC exports of the container's processes are listed, so that importing
 *   memory another process of the same container already counts is not
 *   counted twice.
 * - Shared VMM allocations (exported with cuMemExportToShareableHandle) are
 *   listed with every process that holds them: the allocation is charged
 *   once, to one holder, and the charge moves to another holder when that
 *   one lets go or dies; it is given back when the last holder lets go.
 *
 * Pure policy over a mapped struct: no CUDA, testable directly. */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "limits.h"

#define VGPU_REGION_FILE "hook.region"
#define VGPU_REGION_MAGIC 0x3147455255504756ull /* "VGPUREG1" */
#define VGPU_REGION_LAYOUT 4
#define VGPU_REGION_SLOTS 256
#define VGPU_REGION_EXPORTS 256
#define VGPU_REGION_SHARED 64
#define VGPU_SHARED_KEYS 4
#define VGPU_REGION_HEADER_BYTES 16 /* magic, layout, size: what the agent writes */

struct vgpu_slot {
    int32_t pid;         /* 0 = free; as the owner's PID namespace numbers it */
    uint32_t pidns;      /* inode of that PID namespace; 0 if unknown */
    uint64_t start_time; /* /proc/<pid>/stat field 22; 0 if unknown */
    uint32_t locked;     /* 1: the owner holds its slot's file lock (liveness.h) */
    uint32_t unused;
    uint64_t used[VGPU_MAX_DEVICES]; /* bytes this process holds */
    _Atomic uint64_t launches[VGPU_MAX_DEVICES];
    uint64_t spilled[VGPU_MAX_DEVICES]; /* of used: given as managed memory (card full) */
};

struct vgpu_export {
    uint64_t hash; /* of the CUipcMemHandle; 0 = free */
    int32_t slot;
    int32_t unused;
};

struct vgpu_shared {
    uint64_t keys[VGPU_SHARED_KEYS]; /* its shareable handles' keys; keys[0] == 0: free */
    uint64_t bytes;
    int32_t dev, owner;              /* owner: the slot charged for it */
    uint16_t holds[VGPU_REGION_SLOTS]; /* references each process holds */
};

struct vgpu_region {
    uint64_t magic;
    uint32_t layout, size;
    pthread_mutex_t lock;
    uint64_t used[VGPU_MAX_DEVICES];          /* sum of the slots (under lock) */
    uint64_t spilled[VGPU_MAX_DEVICES];       /* likewise, of their spilled bytes */
    _Atomic uint64_t limiter_tat[VGPU_MAX_DEVICES]; /* limiter.h */
    struct vgpu_export exports[VGPU_REGION_EXPORTS];
    struct vgpu_shared shared[VGPU_REGION_SHARED];
    struct vgpu_slot slots[VGPU_REGION_SLOTS];
};

/* Maps the region file at path: a regular file, never through a symlink,
 * holding the agent's header or this hook's layout. With create, a missing
 * file is created with the header first (a bare host, where no agent made
 * it). NULL with err set ("<path>: <problem>") if it cannot. */
struct vgpu_region *vgpu_region_open(const char *path, int create, char *err, size_t errlen);

/* Whether the mapped region still carries this hook's header (a process of
 * the container may have overwritten it since it was opened). */
int vgpu_region_intact(const struct vgpu_region *r);

/* A region only this process sees (when the shared one cannot be had). */
struct vgpu_region *vgpu_region_private(void);

/* Takes a slot for pid (reaping dead ones first). Slot index, or -1 if all
 * are taken by live processes. For the calling process (pid == getpid()) the
 * slot's liveness lock is taken; any other pid must be one of the caller's
 * PID namespace, and its slot is judged by pid from that namespace only. */
int vgpu_region_attach(struct vgpu_region *r, pid_t pid);

/* Gives back everything the slot holds and frees it. */
void vgpu_region_detach(struct vgpu_region *r, int slot);

/* Charges bytes on dev to slot if the container's total stays <= limit
 * (0 = unlimited); check and charge are one step under the lock. Before
 * refusing, reaps dead processes and checks again. Returns 0, or -1 when over
 * the limit. *used_before (may be NULL) gets the container's total before. */
int vgpu_region_reserve(struct vgpu_region *r, int slot, int dev, uint64_t bytes, uint64_t limit,
                        uint64_t *used_before);

/* Gives back bytes on dev from slot (never below zero). */
void vgpu_region_release(struct vgpu_region *r, int slot, int dev, uint64_t bytes);

/* Virtual device memory: of what slot holds on dev, bytes were given as managed memory
 * because the card was full. spill records them if the container's spilled bytes on all
 * devices stay <= host_limit (the host memory they may take; 0 = none may spill): 0, or -1.
 * unspill gives them back (they stay charged in `used` until released as usual). */
int vgpu_region_spill(struct vgpu_region *r, int slot, int dev, uint64_t bytes,
                      uint64_t host_limit);
void vgpu_region_unspill(struct vgpu_region *r, int slot, int dev, uint64_t bytes);
uint64_t vgpu_region_spilled(struct vgpu_region *r, int dev);

/* The container's total on dev, and one slot's part of it. */
uint64_t vgpu_region_used(struct vgpu_region *r, int dev);
uint64_t vgpu_region_slot_used(struct vgpu_region *r, int slot, int dev);

/* 1 if a live slot belongs to the process numbered pid in the PID namespace
 * with inode pidns (the caller's, for pids NVML gives it): is it one of the
 * container's processes? */
int vgpu_region_has_process(struct vgpu_region *r, int32_t pid, uint32_t pidns);

/* Frees the slots of dead processes; returns how many. */
int vgpu_region_reap(struct vgpu_region *r);

/* IPC exports: remember that slot exported the handle with this hash; ask
 * whether any live process of the container did; forget it. */
void vgpu_region_export_add(struct vgpu_region *r, int slot, uint64_t hash);
int vgpu_region_export_known(struct vgpu_region *r, uint64_t hash);
void vgpu_region_export_remove(struct vgpu_region *r, uint64_t hash);

/* Shared allocations. share_add: slot, which is charged bytes on dev for the
 * allocation, lists it under key (or, if key is known already, takes one more
 * reference); 0, or -1 if the table is full (importers then charge it again:
 * counted twice, never zero times). share_alias: another key for the same
 * allocation. share_join: if key is listed, slot takes a reference and 1 is
 * returned (with its dev and bytes), else 0. share_leave: slot drops a
 * reference; when it held the charge and holds no more, the charge moves to
 * another holder, or is given back if there is none. */
int vgpu_region_share_add(struct vgpu_region *r, int slot, uint64_t key, int dev, uint64_t bytes);
int vgpu_region_share_alias(struct vgpu_region *r, uint64_t key, uint64_t alias);
int vgpu_region_share_join(struct vgpu_region *r, int slot, uint64_t key, int *dev,
                           uint64_t *bytes);
void vgpu_region_share_leave(struct vgpu_region *r, int slot, uint64_t key);

/* Locks the region, recovering it if the last owner died (logged). For tests
 * and for code that reads several figures at once. */
void vgpu_region_lock(struct vgpu_region *r);
void vgpu_region_unlock(struct vgpu_region *r);

/* Start time of pid from /proc (0 if unknown). */
uint64_t vgpu_process_start_time(pid_t pid);

#endif
