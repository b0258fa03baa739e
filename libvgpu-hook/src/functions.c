/* Tables generated from the function lists, and resolution of the real
 * functions: dlsym(RTLD_NEXT) first (the library the process linked or
 * dlopen'ed globally), else dlopen of the library by its soname. */
#include "functions.h"

#include <dlfcn.h>
#include <pthread.h>
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
static pthread_once_t resolve_once[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};
/* Set while this thread resolves: a library's constructors may call dlsym,
 * which must then not wait for the resolution it is part of. */
static _Thread_local int resolving;

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
        functions[i] = fn; /* NULL: an older driver without this entry point */
    }
    resolving = 0;
}

static void resolve_cuda(void)
{
    resolve(CUDA);
}

static void resolve_nvml(void)
{
    resolve(NVML);
}

void *vgpu_real(enum vgpu_fn id)
{
    if (resolving)
        return NULL;
    pthread_once(&resolve_once[table[id].lib], table[id].lib == CUDA ? resolve_cuda : resolve_nvml);
    return functions[id];
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
