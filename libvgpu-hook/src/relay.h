/* The relay client: a background thread that reports this process's usage to
 * the node agent over relay.sock in the state directory (config.h) and feeds the agent's
 * utilisation figures to the compute limiter (PROTOCOL.md). It never blocks
 * the application: non-blocking socket, reports dropped when they do not fit,
 * reconnection at most once a second while the agent is away. */
#ifndef VGPU_RELAY_H
#define VGPU_RELAY_H

/* Starts the thread (once per process); at exit it sends `exit`. */
void vgpu_relay_start(void);

#endif
