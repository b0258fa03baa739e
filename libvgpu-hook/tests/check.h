/* Minimal assertion helpers for the C unit tests. */
#ifndef VGPU_TEST_CHECK_H
#define VGPU_TEST_CHECK_H

#include <stdio.h>

static int check_failures;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            check_failures++;                                                  \
        }                                                                      \
    } while (0)

/* Prints the verdict; use as main's return value. */
static int check_report(const char *name)
{
    printf("%s: %s\n", name, check_failures ? "FAILED" : "ok");
    return check_failures ? 1 : 0;
}

#endif
