/* Tables generated from the function lists, and resolution of the real
 * functions: dlsym(RTLD_NEXT) first (the library the process linked or
 * dlopen'ed globally), else dlopen of the library by its soname. */
#include "functions.h"

#include <dlfcn.h>
#include <string.h>

#include "log.h"

/* Each entry of the lists must have the signature cuda.h / nvml.h gives it. */
#define CUDA_HOOK(name, since, ret, params)                                              \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), vgpu_##name##_fn),     \
                   #name " in the function lists does not match include/cuda_api.h");
#define NVML_HOOK(name, ret, params)                                                     \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), vgpu_##name##_fn),     \
                   #name " in nvml_functions.def does not match include/nvml_api.h");
#include "functions.def"

enum library { CUDA, NVML };

static const struct {
    const char *name;
    int since;
    enum library lib;
    void *hook;
} table[VGPU_FN_COUNT] = {
#define CUDA_HOOK(name, since, ret, params) [VGPU_FN_##name] = {#name, since, CUDA, (void *)name},
#define CUDA_CALL(name, since, ret, params) [VGPU_FN_##name] = {#name, since, CUDA, NULL},
#define NVML_HOOK(name, ret, params) [VGPU_FN_##name] = {#name, 0, NVML, (void *)name},
#define NVML_CALL(name, ret, params) [VGPU_FN_##name] = {#name, 0, NVML, NULL},
#include "functions.def"
};

static const char *const sonames[] = {[CUDA] = "libcuda.so.1", [NVML] = "libnvidia-ml.so.1"};
static void *functions[VGPU_FN_COUNT];
/* Per library: set (release) once functions[] holds its entries. */
static int resolved[2];
/* Set while this thread resolves: a library's constructors may call dlsym,
 * which then answers without interception instead of recursing. Initial-exec:
 * the hook is preloaded, so its TLS is static and never allocated lazily. */
static _Thread_local int resolving __attribute__((tls_model("initial-exec")));

/* Loader safety (README, "Loader and fork safety"): this runs from dlsym,
 * possibly inside a library constructor while the loader holds its lock, so
 * there is no once-lock: a thread that finds the library unresolved resolves
 * it itself. Concurrent resolutions find the same functions (the loader
 * serialises them and a soname is loaded once), so the stores agree. */
static void resolve(enum library lib)
{
    void *handle = NULL;
    int tried = 0;
    resolving = 1;
    for (int i = 0; i < VGPU_FN_COUNT; i++) {
        if (table[i].lib != lib)
            continue;
        void *fn = vgpu_real_dlsym(RTLD_NEXT, table[i].name);
        if (!fn && !tried++) {
            handle = dlopen(sonames[lib], RTLD_NOW | RTLD_LOCAL);
            if (!handle)
                vgpu_log_error("cannot load %s: %s", sonames[lib], dlerror());
        }
        if (!fn && handle)
            fn = vgpu_real_dlsym(handle, table[i].name);
        /* NULL: an older driver without this entry point */
        __atomic_store_n(&functions[i], fn, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&resolved[lib], 1, __ATOMIC_RELEASE);
    resolving = 0;
}

void *vgpu_real(enum vgpu_fn id)
{
    if (resolving)
        return NULL;
    enum library lib = table[id].lib;
    if (!__atomic_load_n(&resolved[lib], __ATOMIC_ACQUIRE))
        resolve(lib);
    return __atomic_load_n(&functions[id], __ATOMIC_RELAXED);
}

int vgpu_fn_by_name(const char *name)
{
    for (int i = 0; i < VGPU_FN_COUNT; i++)
        if (strcmp(table[i].name, name) == 0)
            return i;
    return -1;
}

const char *vgpu_fn_name(enum vgpu_fn id)
{
    return table[id].name;
}

int vgpu_fn_since(enum vgpu_fn id)
{
    return table[id].since;
}

void *vgpu_fn_hook(enum vgpu_fn id)
{
    return table[id].hook;
}
