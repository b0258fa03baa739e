/* stderr logging: every line starts with "vgpu-hook: ".
 * VGPU_HOOK_QUIET=1 silences info lines; errors and warnings always print.
 *
 * Lines a program can repeat without bound (an allocation refused over the
 * limit, in a loop that retries) go through a per-call-site rate limit: the
 * first VGPU_LOG_BURST lines print, then at most one a second, which says how
 * many were suppressed since the last one; at exit, a last line counts what
 * was suppressed after it. Lock-free (atomics only), so a fork or a signal
 * at any point leaves nothing held. */
#ifndef VGPU_LOG_H
#define VGPU_LOG_H

#include <stdint.h>

#define VGPU_LOG_BURST 10
#define VGPU_LOG_EVERY_NS 1000000000ull

struct vgpu_log_limit {
    const char *what; /* names the lines in the suppressed counts */
    _Atomic uint64_t lines, next_ns, suppressed;
    _Atomic int listed;
    struct vgpu_log_limit *_Atomic next; /* of those listed for the exit count */
};

/* static struct vgpu_log_limit oom_lines = VGPU_LOG_LIMIT("out of memory"); */
#define VGPU_LOG_LIMIT(what_) {.what = (what_)}

void vgpu_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void vgpu_log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* vgpu_log_error under the rate limit l. */
void vgpu_log_error_limited(struct vgpu_log_limit *l, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* In a forked child: the parent's suppressed counts are the parent's to report. */
void vgpu_log_after_fork_in_child(void);

#endif
