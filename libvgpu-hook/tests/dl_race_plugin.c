/* A plugin whose constructor looks symbols up, as many real ones do (CUDA
 * runtime stubs, Python extension helpers, profilers). Its constructor runs
 * inside dlopen, while the loader holds its lock: any dlsym interposer it
 * reaches must not wait for another thread that is itself waiting for the
 * loader. Built by build.sh for dl_race. */
#include <dlfcn.h>
#include <stdint.h>
#include <time.h>

static volatile uintptr_t found;

__attribute__((constructor)) static void plugin_init(void)
{
    /* Some start-up work first: the other threads' first lookups land inside it. */
    struct timespec t = {0, 200000};
    nanosleep(&t, NULL);
    found += (uintptr_t)dlsym(RTLD_DEFAULT, "getpid");
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda) {
        found += (uintptr_t)dlsym(cuda, "cuMemAlloc_v2");
        found += (uintptr_t)dlsym(cuda, "cuMemFree_v2");
        dlclose(cuda);
    }
}

__attribute__((visibility("default"))) uintptr_t dl_race_plugin_found(void)
{
    return found;
}
