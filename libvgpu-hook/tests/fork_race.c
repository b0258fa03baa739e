/* Forks from a parent whose threads are busy inside the hook, the pattern
 * that hung children of the old hook (issue 13): a lock some other thread
 * held at the fork stayed locked forever in the child.
 *
 *   fork_race [forks=200] [threads=4] [child=cuda|lookup]
 *
 * The parent initialises CUDA (linked against libcuda), then its threads loop
 * allocating, freeing, asking past the limit (the out-of-memory log line),
 * looking driver functions up on libcuda's handle and reading NVML memory
 * info, while the main thread forks. Each child looks functions up, reads
 * NVML and (child=cuda, the default) allocates and frees on the context it
 * inherited, then exits through exit() (the hook's exit handlers). The parent
 * waits for each child at most 10 s, then kills it and counts it hung, and
 * stops forking after the first hung child. Prints "forks=<n> hung=<h>
 * failed=<f>" (n: forks made); exits 0 only if neither. */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "nvml_api.h"

#define MIB (1024ull * 1024ull)
#define MAX_THREADS 32
#define CHILD_WAIT_MS 10000

static CUcontext ctx;
static void *cuda_handle;
static nvmlReturn_t (*nvml_memory)(nvmlDevice_t, nvmlMemory_t *);
static nvmlDevice_t nvml_device;
static atomic_int stop;
static int child_uses_cuda = 1;

static void sleep_us(long us)
{
    struct timespec t = {0, us * 1000};
    nanosleep(&t, NULL);
}

static int look_up(void)
{
    return dlsym(cuda_handle, "cuMemAlloc_v2") && dlsym(RTLD_DEFAULT, "getpid");
}

static int read_nvml(void)
{
    nvmlMemory_t m;
    return !nvml_memory || nvml_memory(nvml_device, &m) == NVML_SUCCESS;
}

/* Thread 0 looks up, reads NVML and asks past the limit (logged, refused);
 * the others allocate and free, which is where the hook's locks are held. */
static void *busy(void *arg)
{
    long id = (long)arg;
    cuCtxSetCurrent(ctx);
    CUdeviceptr held[8] = {0};
    for (unsigned long i = 0; !atomic_load(&stop); i++) {
        CUdeviceptr *p = &held[i % 8];
        if (*p && cuMemFree_v2(*p) == CUDA_SUCCESS)
            *p = 0;
        if (cuMemAlloc_v2(p, MIB) != CUDA_SUCCESS)
            *p = 0;
        if (id == 0) {
            CUdeviceptr big;
            if (cuMemAlloc_v2(&big, 1ull << 40) == CUDA_SUCCESS)
                cuMemFree_v2(big);
            look_up();
            read_nvml();
        }
    }
    for (int k = 0; k < 8; k++)
        if (held[k])
            cuMemFree_v2(held[k]);
    return NULL;
}

static void init_nvml(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    nvmlReturn_t (*init)(void) = h ? (nvmlReturn_t(*)(void))dlsym(h, "nvmlInit_v2") : NULL;
    nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) =
        h ? (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2")
          : NULL;
    if (init && by_index && init() == NVML_SUCCESS && by_index(0, &nvml_device) == NVML_SUCCESS)
        nvml_memory = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))dlsym(
            h, "nvmlDeviceGetMemoryInfo");
}

/* What a forked worker does before exiting: 0 when all went as expected. */
static int child(void)
{
    if (!look_up() || !read_nvml())
        return 3;
    if (child_uses_cuda) {
        CUdeviceptr p;
        size_t free_b, total_b;
        if (cuMemAlloc_v2(&p, MIB) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS ||
            cuMemGetInfo_v2(&free_b, &total_b) != CUDA_SUCCESS)
            return 4;
    }
    return 0;
}

/* Waits for pid up to CHILD_WAIT_MS: its exit status, or -1 if it hung (killed). */
static int reap(pid_t pid)
{
    int status;
    for (int waited_us = 0; waited_us < CHILD_WAIT_MS * 1000; waited_us += 500) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        sleep_us(500);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

int main(int argc, char **argv)
{
    int forks = argc > 1 ? atoi(argv[1]) : 200;
    int threads = argc > 2 ? atoi(argv[2]) : 4;
    if (argc > 3)
        child_uses_cuda = strcmp(argv[3], "lookup") != 0;
    if (forks < 1 || threads < 1 || threads > MAX_THREADS)
        return fprintf(stderr, "usage: fork_race [forks] [threads 1..%d] [cuda|lookup]\n",
                       MAX_THREADS), 2;
    CUresult rc = cuInit(0);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxCreate_v2(&ctx, 0, 0);
    if (rc != CUDA_SUCCESS)
        return fprintf(stderr, "fork_race: CUDA set-up failed: %d\n", rc), 2;
    cuda_handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    init_nvml();

    pthread_t t[MAX_THREADS];
    for (long i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, busy, (void *)i);
    int hung = 0, failed = 0, made = 0;
    for (int i = 0; i < forks && !hung; i++, made++) {
        sleep_us(200 + rand() % 800); /* land the forks at varied points of the threads' work */
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0)
            exit(child());
        if (pid < 0) {
            perror("fork_race: fork");
            failed++;
            continue;
        }
        int status = reap(pid);
        if (status < 0)
            hung++;
        else if (status != 0)
            failed++, fprintf(stderr, "fork_race: child %d exited %d\n", i, status);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    printf("forks=%d hung=%d failed=%d\n", made, hung, failed);
    return hung || failed;
}
