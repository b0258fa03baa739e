/* The functions of every list (functions.def): ids, typed pointers to the
 * real functions, and name/version/hook tables for lookups by name (dlsym,
 * cuGetProcAddress). The real functions are resolved on first use, per
 * library (thread-safe). */
#ifndef VGPU_FUNCTIONS_H
#define VGPU_FUNCTIONS_H

#include "cuda_api.h"
#include "nvml_api.h"

#define VGPU_EXPORT __attribute__((visibility("default")))

enum vgpu_fn {
#define CUDA_HOOK(name, since, ret, params) VGPU_FN_##name,
#define NVML_HOOK(name, ret, params) VGPU_FN_##name,
#include "functions.def"
    VGPU_FN_COUNT
};

/* vgpu_<name>_fn: pointer type of the real <name>. */
#define CUDA_HOOK(name, since, ret, params) typedef ret(*vgpu_##name##_fn) params;
#define NVML_HOOK(name, ret, params) typedef ret(*vgpu_##name##_fn) params;
#include "functions.def"

/* Declarations of the interposers: the only symbols libvgpu.so exports,
 * besides dlsym (everything else is -fvisibility=hidden). */
#define CUDA_HOOK(name, since, ret, params) VGPU_EXPORT ret name params;
#define CUDA_CALL(name, since, ret, params)
#define NVML_HOOK(name, ret, params) VGPU_EXPORT ret name params;
#define NVML_CALL(name, ret, params)
#include "functions.def"

/* The real function, or NULL if its library does not provide it. */
void *vgpu_real(enum vgpu_fn id);

/* Typed access: REAL(cuMemAlloc_v2) has type vgpu_cuMemAlloc_v2_fn. */
#define REAL(name) ((vgpu_##name##_fn)vgpu_real(VGPU_FN_##name))

/* Id of an exact name in the lists, or -1. */
int vgpu_fn_by_name(const char *name);
const char *vgpu_fn_name(enum vgpu_fn id);
/* For CUDA functions, the version cuGetProcAddress hands this variant out from; 0 for NVML. */
int vgpu_fn_since(enum vgpu_fn id);
/* The interposer, or NULL for functions that are only called. */
void *vgpu_fn_hook(enum vgpu_fn id);

/* glibc's own dlsym, never the interposed one (interpose.c). */
void *vgpu_real_dlsym(void *handle, const char *name);

#endif
