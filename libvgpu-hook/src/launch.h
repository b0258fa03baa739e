/* Launch interposers' shared state: which devices are limited, the per-launch
 * cost estimates, and what the relay reports and feeds back. */
#ifndef VGPU_LAUNCH_H
#define VGPU_LAUNCH_H

#include <stdint.h>

/* After the first successful cuInit: decides which devices are limited. */
void vgpu_launch_init(void);

/* Utilisation from the node agent for device dev (relay `util` message):
 * whole-GPU and this container's SM utilisation in percent (container < 0:
 * unknown), measured up to now_ns. */
void vgpu_launch_feedback(int dev, double sm_util, double container_util, uint64_t now_ns);

/* This process's cumulative launches and time held back, for usage reports. */
uint64_t vgpu_launch_count(void);
uint64_t vgpu_throttled_ns(void);

#endif
