/* The real CUDA driver functions behind the interposers, generated from
 * cuda_functions.def and resolved on first use (thread-safe). */
#ifndef VGPU_REAL_CUDA_H
#define VGPU_REAL_CUDA_H

#include "cuda_types.h"

enum vgpu_real_id {
#define CUDA_HOOK(name, ret, params) VGPU_REAL_##name,
#include "cuda_functions.def"
    VGPU_REAL_COUNT
};

/* vgpu_<name>_fn: pointer type of the real <name>. */
#define CUDA_HOOK(name, ret, params) typedef ret(*vgpu_##name##_fn) params;
#include "cuda_functions.def"

/* The real function, or NULL if the driver does not provide it (already
 * logged once, at resolution). */
void *vgpu_real(enum vgpu_real_id id);

/* Typed access: REAL(cuMemAlloc_v2) has type vgpu_cuMemAlloc_v2_fn. */
#define REAL(name) ((vgpu_##name##_fn)vgpu_real(VGPU_REAL_##name))

#endif
