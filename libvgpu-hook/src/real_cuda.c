/* Resolves the real driver functions: dlsym(RTLD_NEXT) first (the libcuda the
 * process linked or dlopen'ed globally), else dlopen("libcuda.so.1"). */
#include "real_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "cuda_api.h"
#include "log.h"

/* Each entry of the list must have the signature cuda.h gives it. */
#define CUDA_HOOK(name, ret, params)                                            \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), vgpu_##name##_fn), \
                   #name " in cuda_functions.def does not match cuda_api.h");
#include "cuda_functions.def"

static const char *const names[VGPU_REAL_COUNT] = {
#define CUDA_HOOK(name, ret, params) [VGPU_REAL_##name] = #name,
#include "cuda_functions.def"
};

static void *functions[VGPU_REAL_COUNT];
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;

static void resolve_all(void)
{
    void *driver = NULL;
    char why[256] = ""; /* why dlopen failed; dlerror()'s buffer does not last */

    for (int i = 0; i < VGPU_REAL_COUNT; i++) {
        void *fn = dlsym(RTLD_NEXT, names[i]);
        if (!fn && !driver && !why[0]) {
            driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
            if (!driver)
                snprintf(why, sizeof why, "%s", dlerror());
        }
        if (!fn && driver)
            fn = dlsym(driver, names[i]);
        if (!fn)
            vgpu_log_error("cannot find the real %s: %s", names[i],
                           why[0] ? why : "not exported by libcuda.so.1");
        functions[i] = fn;
    }
}

void *vgpu_real(enum vgpu_real_id id)
{
    pthread_once(&resolve_once, resolve_all);
    return functions[id];
}
