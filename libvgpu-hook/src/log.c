#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PREFIX "vgpu-hook: "

/* One write(2) per line so lines of concurrent threads do not interleave. */
static void vlog(const char *fmt, va_list ap)
{
    char line[1024] = PREFIX;
    size_t len = strlen(PREFIX);
    int n = vsnprintf(line + len, sizeof line - len - 1, fmt, ap);
    if (n > 0)
        len += (size_t)n < sizeof line - len - 1 ? (size_t)n : sizeof line - len - 2;
    line[len++] = '\n';
    if (write(STDERR_FILENO, line, len) < 0) {
        /* nowhere left to report it */
    }
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
    vlog(fmt, ap);
    va_end(ap);
}

void vgpu_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}
