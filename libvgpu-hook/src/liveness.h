/* Proof that the owner of a slot of the shared region is alive, valid across
 * PID namespaces (issue 13: a process in a nested PID namespace reaped live
 * slots, because kill(pid, 0) of a pid number recorded in another namespace
 * asks about some other process, or none).
 *
 * The owner of a slot holds an open-file-description lock (F_OFD_SETLK) on
 * the first byte of its slot in the region file, through a descriptor of its
 * own, for as long as it holds the slot. The kernel drops the lock when the
 * last descriptor of that open file goes: when the process exits or is
 * killed, however it dies, or when it execs (the descriptor is close-on-exec:
 * a new program is a new process to the driver too). Anyone can test the lock
 * (F_OFD_GETLK) from any PID namespace: a slot whose lock is held is alive.
 * A forked child closes its copy of its parent's descriptor (fork handler) and
 * opens its own when it takes a slot.
 *
 * A slot taken without that lock (no region file: the private region; or the
 * lock could not be had) is judged by pid only from the PID namespace it was
 * recorded in (kill(pid, 0) and its start time); from any other namespace its
 * owner cannot be proven dead, and it is never reaped.
 *
 * Per-process state (the descriptors, which slots this process holds),
 * changed only under the region's lock. */
#ifndef VGPU_LIVENESS_H
#define VGPU_LIVENESS_H

#include <stdint.h>
#include <sys/stat.h>

struct vgpu_region;

/* Remembers the file behind a shared mapping (at open; path and identity). */
void vgpu_liveness_register(struct vgpu_region *r, const char *path, const struct stat *st);

/* Takes the lock of slot for this process: 1, or 0 if it cannot (not a
 * registered mapping, or the file cannot be reopened or locked). */
int vgpu_liveness_claim(struct vgpu_region *r, int slot);

/* Drops the lock of slot, if this process holds it. */
void vgpu_liveness_release(struct vgpu_region *r, int slot);

/* 1 if this process holds the lock of slot. */
int vgpu_liveness_mine(struct vgpu_region *r, int slot);

/* Whether the owner of a slot is alive: 1 (alive, or not provably dead) or 0.
 * `locked`: the slot was claimed with the lock; pid, pidns, start_time as
 * recorded; my_pidns: the caller's vgpu_pidns(). */
int vgpu_liveness_alive(struct vgpu_region *r, int slot, int locked, int32_t pid, uint32_t pidns,
                        uint64_t start_time, uint32_t my_pidns);

/* Inode of the calling process's PID namespace (/proc/self/ns/pid); 0 if unknown. */
uint32_t vgpu_pidns(void);

/* In a forked child: close the parent's descriptors (fork.c). */
void vgpu_liveness_after_fork_in_child(void);

#endif
