/* What a harness gives the fuzzing engine (engine.c). */
#ifndef VGPU_FUZZ_H
#define VGPU_FUZZ_H

#include <stddef.h>
#include <stdint.h>

/* Runs the code under test on one input; aborts (or trips a sanitizer) on a bug. */
void vgpu_fuzz_one(const uint8_t *data, size_t len);
/* Reports a bug the harness found (the input is saved as for a crash) and aborts. */
void vgpu_fuzz_fail(const char *what) __attribute__((noreturn));
/* NULL-terminated: tokens mutations insert, and inputs the corpus starts from. */
extern const char *const vgpu_fuzz_dictionary[];
extern const char *const vgpu_fuzz_seeds[];

#endif
