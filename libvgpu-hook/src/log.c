#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PREFIX "vgpu-hook: "

/* One write(2) per line so lines of concurrent threads do not interleave.
 * suffix (may be NULL) is appended to the formatted text. */
static void vlog(const char *suffix, const char *fmt, va_list ap)
{
    char line[1024] = PREFIX;
    size_t len = strlen(PREFIX), room = sizeof line - 1; /* 1: the newline */
    int n = vsnprintf(line + len, room - len, fmt, ap);
    if (n > 0)
        len += (size_t)n < room - len ? (size_t)n : room - len - 1;
    if (suffix) {
        n = snprintf(line + len, room - len, "%s", suffix);
        if (n > 0)
            len += (size_t)n < room - len ? (size_t)n : room - len - 1;
    }
    line[len++] = '\n';
    if (write(STDERR_FILENO, line, len) < 0) {
        /* nowhere left to report it */
    }
}

static void log_line(const char *suffix, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(suffix, fmt, ap);
    va_end(ap);
}

static int quiet(void)
{
    const char *q = getenv("VGPU_HOOK_QUIET");
    return q && *q && strcmp(q, "0") != 0;
}

void vgpu_log_info(const char *fmt, ...)
{
    if (quiet())
        return;
    va_list ap;
    va_start(ap, fmt);
    vlog(NULL, fmt, ap);
    va_end(ap);
}

void vgpu_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(NULL, fmt, ap);
    va_end(ap);
}

/* --- rate-limited lines -------------------------------------------------------------------- */

/* Limits that suppressed something, for the count at exit (a lock-free stack). */
static struct vgpu_log_limit *_Atomic listed;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void list_once(struct vgpu_log_limit *l)
{
    if (__atomic_exchange_n(&l->listed, 1, __ATOMIC_ACQ_REL))
        return;
    struct vgpu_log_limit *head = __atomic_load_n(&listed, __ATOMIC_ACQUIRE);
    do
        __atomic_store_n(&l->next, head, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&listed, &head, l, 1, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE));
}

void vgpu_log_error_limited(struct vgpu_log_limit *l, const char *fmt, ...)
{
    uint64_t now = now_ns(), index = __atomic_fetch_add(&l->lines, 1, __ATOMIC_RELAXED);
    char suffix[96] = "";
    if (index < VGPU_LOG_BURST) {
        if (index == VGPU_LOG_BURST - 1) {
            __atomic_store_n(&l->next_ns, now + VGPU_LOG_EVERY_NS, __ATOMIC_RELAXED);
            snprintf(suffix, sizeof suffix, " (more of these: at most one a second)");
        }
    } else {
        /* Past the burst: the first line once a second has passed since the last
         * printed one prints (the thread that wins the exchange); others count. */
        uint64_t next = __atomic_load_n(&l->next_ns, __ATOMIC_RELAXED);
        if (now < next || !__atomic_compare_exchange_n(&l->next_ns, &next,
                                                        now + VGPU_LOG_EVERY_NS, 0,
                                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            __atomic_fetch_add(&l->suppressed, 1, __ATOMIC_RELAXED);
            list_once(l);
            return;
        }
        uint64_t n = __atomic_exchange_n(&l->suppressed, 0, __ATOMIC_RELAXED);
        if (n)
            snprintf(suffix, sizeof suffix, " (%llu more suppressed since the last one)",
                     (unsigned long long)n);
    }
    va_list ap;
    va_start(ap, fmt);
    vlog(suffix, fmt, ap);
    va_end(ap);
}

void vgpu_log_after_fork_in_child(void)
{
    for (struct vgpu_log_limit *l = __atomic_load_n(&listed, __ATOMIC_ACQUIRE); l;
         l = __atomic_load_n(&l->next, __ATOMIC_RELAXED))
        __atomic_store_n(&l->suppressed, 0, __ATOMIC_RELAXED); /* the parent reports them */
}

/* At exit (or when the hook is unloaded): what was suppressed after the last line. */
__attribute__((destructor)) static void count_suppressed(void)
{
    for (struct vgpu_log_limit *l = __atomic_load_n(&listed, __ATOMIC_ACQUIRE); l;
         l = __atomic_load_n(&l->next, __ATOMIC_RELAXED)) {
        uint64_t n = __atomic_exchange_n(&l->suppressed, 0, __ATOMIC_RELAXED);
        if (n)
            log_line(NULL, "%llu more \"%s\" lines suppressed", (unsigned long long)n, l->what);
    }
}
