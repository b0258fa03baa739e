/* stderr logging: every line starts with "vgpu-hook: ".
 * VGPU_HOOK_QUIET=1 silences info lines; errors and warnings always print. */
#ifndef VGPU_LOG_H
#define VGPU_LOG_H

void vgpu_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void vgpu_log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
