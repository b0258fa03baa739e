/* The hook's process-wide state and the helpers every interposer uses:
 * configuration, the shared region and this process's slot in it, the table
 * of live objects, and charging with the out-of-memory log line. */
#ifndef VGPU_STATE_H
#define VGPU_STATE_H

#include "config.h"
#include "cuda_types.h"
#include "region.h"
#include "track.h"

extern struct vgpu_config vgpu_cfg;
extern struct vgpu_region *vgpu_region; /* never NULL once vgpu_ready() returned */
extern struct vgpu_track vgpu_objects;

/* Loads the configuration and joins the region, once per process (the first
 * interposer called does it; it may wait for the limit file). Returns 1, or 0
 * if the limits are unknown: the interposers then refuse to run. */
int vgpu_ready(void);

/* This process's slot (re-taken in a child after fork). */
int vgpu_slot(void);

/* The calling thread's current context and its device. 0, or -1 without one. */
int vgpu_current(CUcontext *ctx, CUdevice *dev);

/* The memory limit of dev in bytes; 0 = unlimited. */
uint64_t vgpu_limit_bytes(int dev);

/* Charges bytes on dev to this process, within the container's limit.
 * CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY after logging (rate-limited, log.h)
 * "out of memory on device <d>: used <u> + asked <a> > limit <l>". */
CUresult vgpu_charge(int dev, uint64_t bytes);
void vgpu_uncharge(int dev, uint64_t bytes);

/* Gives back what an object was charged and withdraws its IPC export
 * (signature fits vgpu_track_drop_context). */
void vgpu_release_object(const struct vgpu_object *o, void *unused);

/* Human-readable size: "<n> MiB" when whole MiB, else "<n> bytes". */
const char *vgpu_format_size(char *buf, size_t len, uint64_t bytes);

uint64_t vgpu_now_ns(void);

#endif
