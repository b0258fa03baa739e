/* Looks symbols up from several threads while another thread dlopens a
 * plugin whose constructor looks symbols up too: the pattern that deadlocks a
 * dlsym interposer which, on its first call, takes a lock of its own and then
 * calls into the loader (issue 13).
 *
 *   dl_race cuda|nocuda [threads=8]
 *
 * cuda: libcuda.so.1 is dlopen'ed first (RTLD_LOCAL, as the CUDA runtime and
 * ctypes do) and the threads look up driver functions on its handle, which
 * the hook answers; nocuda: only libc names, as any program in a container.
 * The plugin (libdl_race_plugin.so) is found next to the program. Prints
 * "ok lookups=<n>" and exits 0; a deadlock shows as a hang (the caller's
 * timeout). */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64
#define LOOKUPS 200

static pthread_barrier_t start;
static void *cuda;
static char plugin_path[PATH_MAX];
static unsigned long lookups[MAX_THREADS];

static void *look_up(void *arg)
{
    unsigned long *n = arg;
    static const char *const libc_names[] = {"malloc", "getpid", "strlen", "no_such_symbol"};
    static const char *const cuda_names[] = {"cuMemAlloc_v2", "cuInit", "cuMemFree_v2",
                                             "cuGetProcAddress_v2", "cuNoSuchFunction"};
    pthread_barrier_wait(&start);
    for (int i = 0; i < LOOKUPS; i++) {
        if (cuda)
            *n += dlsym(cuda, cuda_names[i % 5]) != NULL;
        *n += dlsym(RTLD_DEFAULT, libc_names[i % 4]) != NULL;
    }
    return NULL;
}

static void *open_plugin(void *arg)
{
    (void)arg;
    pthread_barrier_wait(&start);
    void *h = dlopen(plugin_path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dl_race: dlopen %s: %s\n", plugin_path, dlerror());
        exit(2);
    }
    return h;
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "cuda") != 0 && strcmp(argv[1], "nocuda") != 0)) {
        fprintf(stderr, "usage: dl_race cuda|nocuda [threads]\n");
        return 2;
    }
    int threads = argc > 2 ? atoi(argv[2]) : 8;
    if (threads < 1 || threads > MAX_THREADS)
        return fprintf(stderr, "dl_race: threads must be 1..%d\n", MAX_THREADS), 2;
    const char *slash = strrchr(argv[0], '/');
    snprintf(plugin_path, sizeof plugin_path, "%.*slibdl_race_plugin.so",
             slash ? (int)(slash - argv[0] + 1) : 0, argv[0]);
    if (strcmp(argv[1], "cuda") == 0 && !(cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)))
        return fprintf(stderr, "dl_race: dlopen libcuda.so.1: %s\n", dlerror()), 2;

    pthread_t t[MAX_THREADS + 1];
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, look_up, &lookups[i]);
    pthread_create(&t[threads], NULL, open_plugin, NULL);
    unsigned long total = 0;
    for (int i = 0; i <= threads; i++) {
        pthread_join(t[i], NULL);
        total += i < threads ? lookups[i] : 0;
    }
    printf("ok lookups=%lu\n", total);
    return 0;
}
