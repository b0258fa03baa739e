/* How long memory stays charged: memory that outlives the call that took it
 * (VMM mappings and handle references, pools, executable graphs, context
 * limits, allocations on another device's stream), step by step.
 *
 *   mem_life <scenario> [resolve=link] [args]
 *
 * Every scenario prints one line of key=value pairs: used_* values are the
 * container's use of device 0 in MiB as cuMemGetInfo reports it (total - free),
 * rc_* values are CUresults. Run with a 1000 MiB limit per device.
 *
 *   vmm                   create 512, map, release, try another 600, retain, unmap, release
 *   pool                  a pool that keeps what is freed (release threshold: max)
 *   async                 cuMemAllocAsync on the default pool (release threshold 0)
 *   pool_destroy          a pool destroyed while an allocation is still out
 *   async_device          a stream of device 1 while device 0's context is current
 *   graph <instantiate>   allocation nodes, executable graphs (WithFlags, Instantiate,
 *                         WithParams, clone)
 *   limits                cuCtxSetLimit: malloc heap, printf FIFO, stack
 *   capture               cuMemAllocAsync / cuMemFreeAsync captured into a graph
 *   vmm_export <socket>   create 600, map, export (POSIX fd) to the first process that
 *                         connects; on stdin "release": unmap and release; then wait for EOF
 *   vmm_import <socket>   import it, map; on stdin "create": try to create 600; then unmap,
 *                         release
 * Exit 2 on an unexpected driver error (named on stderr). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "api.h"

#define MIB (1024ull * 1024ull)

static unsigned long long used_mib(void)
{
    size_t free_b, total_b;
    api_check(api.cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo_v2");
    return (unsigned long long)((total_b - free_b) / MIB);
}

static void wait_for_line(const char *word)
{
    char line[64];
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin) || strncmp(line, word, strlen(word)) != 0) {
        fprintf(stderr, "expected '%s' on stdin\n", word);
        exit(2);
    }
}

static CUmemGenericAllocationHandle vmm_create(size_t mib, CUresult *rc)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h = 0;
    *rc = api.cuMemCreate(&h, mib * MIB, &prop, 0);
    return h;
}

static CUdeviceptr vmm_map(CUmemGenericAllocationHandle h, size_t mib)
{
    CUdeviceptr va;
    api_check(api.cuMemAddressReserve(&va, mib * MIB, 0, 0, 0), "cuMemAddressReserve");
    api_check(api.cuMemMap(va, mib * MIB, 0, h, 0), "cuMemMap");
    return va;
}

static int vmm(void)
{
    CUresult rc, second;
    CUmemGenericAllocationHandle h = vmm_create(512, &rc), h2;
    api_check(rc, "cuMemCreate");
    unsigned long long created = used_mib();
    CUdeviceptr va = vmm_map(h, 512);
    api_check(api.cuMemRelease(h), "cuMemRelease");
    unsigned long long released = used_mib(); /* still mapped */
    CUmemGenericAllocationHandle other = vmm_create(600, &second);
    if (second == CUDA_SUCCESS)
        api_check(api.cuMemRelease(other), "cuMemRelease");
    api_check(api.cuMemRetainAllocationHandle(&h2, (void *)(uintptr_t)va), "cuMemRetain");
    api_check(api.cuMemUnmap(va, 512 * MIB), "cuMemUnmap");
    unsigned long long unmapped = used_mib(); /* still referenced */
    api_check(api.cuMemRelease(h2), "cuMemRelease");
    api_check(api.cuMemAddressFree(va, 512 * MIB), "cuMemAddressFree");
    printf("used_created=%llu used_released_mapped=%llu rc_second=%d used_unmapped_retained=%llu "
           "same_handle=%d used_end=%llu\n",
           created, released, second, unmapped, h2 == h, used_mib());
    return 0;
}

static CUmemoryPool new_pool(void)
{
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = 1;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemoryPool pool;
    api_check(api.cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
    return pool;
}

static int pool(void)
{
    CUmemoryPool p = new_pool();
    cuuint64_t keep_all = UINT64_MAX;
    api_check(api.cuMemPoolSetAttribute(p, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all),
              "cuMemPoolSetAttribute");
    CUdeviceptr a, b, c;
    api_check(api.cuMemAllocFromPoolAsync(&a, 600 * MIB, p, NULL), "cuMemAllocFromPoolAsync");
    api_check(api.cuMemFreeAsync(a, NULL), "cuMemFreeAsync");
    api_check(api.cuCtxSynchronize(), "cuCtxSynchronize");
    unsigned long long kept = used_mib();
    CUresult outside = api.cuMemAlloc_v2(&c, 600 * MIB); /* the pool still holds 600 */
    if (outside == CUDA_SUCCESS)
        api_check(api.cuMemFree_v2(c), "cuMemFree_v2");
    CUresult reuse = api.cuMemAllocFromPoolAsync(&b, 600 * MIB, p, NULL); /* from what it holds */
    unsigned long long reused = used_mib();
    if (reuse == CUDA_SUCCESS)
        api_check(api.cuMemFreeAsync(b, NULL), "cuMemFreeAsync");
    api_check(api.cuMemPoolTrimTo(p, 100 * MIB), "cuMemPoolTrimTo");
    unsigned long long trimmed_to_100 = used_mib();
    api_check(api.cuMemPoolTrimTo(p, 0), "cuMemPoolTrimTo");
    unsigned long long trimmed = used_mib();
    api_check(api.cuMemPoolDestroy(p), "cuMemPoolDestroy");
    printf("used_kept=%llu rc_outside=%d rc_reuse=%d used_reused=%llu used_trimmed_100=%llu "
           "used_trimmed=%llu used_end=%llu\n",
           kept, outside, reuse, reused, trimmed_to_100, trimmed, used_mib());
    return 0;
}

static int async(void)
{
    CUdeviceptr a, c;
    api_check(api.cuMemAllocAsync(&a, 600 * MIB, NULL), "cuMemAllocAsync");
    api_check(api.cuMemFreeAsync(a, NULL), "cuMemFreeAsync");
    unsigned long long before_sync = used_mib();
    CUresult outside = api.cuMemAlloc_v2(&c, 600 * MIB); /* the pool still holds 600 */
    if (outside == CUDA_SUCCESS)
        api_check(api.cuMemFree_v2(c), "cuMemFree_v2");
    api_check(api.cuCtxSynchronize(), "cuCtxSynchronize"); /* release threshold 0: given back */
    unsigned long long after_sync = used_mib();
    CUresult after = api.cuMemAlloc_v2(&c, 600 * MIB);
    if (after == CUDA_SUCCESS)
        api_check(api.cuMemFree_v2(c), "cuMemFree_v2");
    printf("used_freed=%llu rc_outside=%d used_synced=%llu rc_after_sync=%d\n", before_sync,
           outside, after_sync, after);
    return 0;
}

static int pool_destroy(void)
{
    CUmemoryPool p = new_pool();
    CUdeviceptr a;
    api_check(api.cuMemAllocFromPoolAsync(&a, 600 * MIB, p, NULL), "cuMemAllocFromPoolAsync");
    api_check(api.cuMemPoolDestroy(p), "cuMemPoolDestroy");
    unsigned long long destroyed = used_mib(); /* its allocation is still out */
    api_check(api.cuMemFreeAsync(a, NULL), "cuMemFreeAsync");
    printf("used_destroyed=%llu used_end=%llu\n", destroyed, used_mib());
    return 0;
}

static int async_device(CUcontext ctx0)
{
    CUdevice dev1;
    CUcontext ctx1;
    CUstream s1;
    CUdeviceptr a, b, c;
    api_check(api.cuDeviceGet(&dev1, 1), "cuDeviceGet(1)");
    api_check(api.cuCtxCreate_v2(&ctx1, 0, dev1), "cuCtxCreate_v2(1)");
    api_check(api.cuStreamCreate(&s1, 0), "cuStreamCreate");
    api_check(api.cuCtxSetCurrent(ctx0), "cuCtxSetCurrent(0)");
    CUresult first = api.cuMemAllocAsync(&a, 600 * MIB, s1);
    CUresult second = api.cuMemAllocAsync(&b, 600 * MIB, s1); /* device 1 is full */
    unsigned long long used0 = used_mib();
    CUresult on0 = api.cuMemAlloc_v2(&c, 600 * MIB); /* device 0 is not */
    api_check(api.cuCtxSetCurrent(ctx1), "cuCtxSetCurrent(1)");
    unsigned long long used1 = used_mib();
    printf("rc_first=%d rc_second=%d rc_device0=%d used_device0=%llu used_device1=%llu\n", first,
           second, on0, used0, used1);
    return 0;
}

/* A graph with one allocation node of mib (and a free node of it when `freed`). */
static CUgraph alloc_graph(size_t mib, int freed)
{
    CUgraph g;
    CUgraphNode node, free_node;
    CUDA_MEM_ALLOC_NODE_PARAMS a;
    memset(&a, 0, sizeof a);
    a.poolProps.allocType = 1;
    a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.bytesize = mib * MIB;
    api_check(api.cuGraphCreate(&g, 0), "cuGraphCreate");
    api_check(api.cuGraphAddMemAllocNode(&node, g, NULL, 0, &a), "cuGraphAddMemAllocNode");
    if (freed)
        api_check(api.cuGraphAddMemFreeNode(&free_node, g, &node, 1, a.dptr),
                  "cuGraphAddMemFreeNode");
    return g;
}

static CUresult instantiate(const char *how, CUgraphExec *e, CUgraph g)
{
    if (strcmp(how, "instantiate") == 0) /* cuda.h's cuGraphInstantiate from CUDA 12 */
        return api.cuGraphInstantiate(e, g, 0);
    if (strcmp(how, "params") == 0) {
        CUDA_GRAPH_INSTANTIATE_PARAMS p = {0};
        return api.cuGraphInstantiateWithParams(e, g, &p);
    }
    if (strcmp(how, "clone") == 0) {
        CUgraph c;
        api_check(api.cuGraphClone(&c, g), "cuGraphClone");
        CUresult rc = api.cuGraphInstantiateWithFlags(e, c, 0);
        api_check(api.cuGraphDestroy(c), "cuGraphDestroy");
        return rc;
    }
    return api.cuGraphInstantiateWithFlags(e, g, 0);
}

static int graph(const char *how)
{
    CUgraph g = alloc_graph(600, 1), g2 = alloc_graph(600, 1);
    CUgraphExec e, e2;
    unsigned long long nodes = used_mib(); /* a template takes nothing */
    api_check(instantiate(how, &e, g), "instantiate");
    unsigned long long instantiated = used_mib();
    api_check(api.cuGraphDestroy(g), "cuGraphDestroy");
    unsigned long long template_gone = used_mib(); /* the executable graph keeps it */
    CUresult second = instantiate(how, &e2, g2);
    api_check(api.cuGraphUpload(e, NULL), "cuGraphUpload");
    api_check(api.cuGraphLaunch(e, NULL), "cuGraphLaunch");
    api_check(api.cuCtxSynchronize(), "cuCtxSynchronize");
    unsigned long long launched = used_mib();
    api_check(api.cuGraphExecDestroy(e), "cuGraphExecDestroy");
    unsigned long long destroyed = used_mib();
    CUresult third = instantiate(how, &e2, g2);
    if (third == CUDA_SUCCESS)
        api_check(api.cuGraphExecDestroy(e2), "cuGraphExecDestroy");
    api_check(api.cuGraphDestroy(g2), "cuGraphDestroy");
    printf("used_nodes=%llu used_instantiated=%llu used_template_destroyed=%llu rc_second=%d "
           "used_launched=%llu used_exec_destroyed=%llu rc_third=%d used_end=%llu\n",
           nodes, instantiated, template_gone, second, launched, destroyed, third, used_mib());
    return 0;
}

/* A graph captured from a stream: an allocation of mib, and its free. */
static CUgraph capture(CUstream s, size_t mib)
{
    CUgraph g;
    CUdeviceptr p;
    api_check(api.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
              "cuStreamBeginCapture");
    api_check(api.cuMemAllocAsync(&p, mib * MIB, s), "cuMemAllocAsync (captured)");
    api_check(api.cuMemFreeAsync(p, s), "cuMemFreeAsync (captured)");
    api_check(api.cuStreamEndCapture(s, &g), "cuStreamEndCapture");
    return g;
}

static int captured(void)
{
    CUstream s;
    CUgraphExec e, e2;
    api_check(api.cuStreamCreate(&s, 0), "cuStreamCreate");
    CUgraph g = capture(s, 600);
    unsigned long long after_capture = used_mib(); /* capturing takes nothing */
    api_check(api.cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiateWithFlags");
    unsigned long long instantiated = used_mib();
    api_check(api.cuGraphDestroy(g), "cuGraphDestroy");
    CUgraph g2 = capture(s, 600);
    CUresult second = api.cuGraphInstantiateWithFlags(&e2, g2, 0);
    api_check(api.cuGraphLaunch(e, s), "cuGraphLaunch");
    api_check(api.cuStreamSynchronize(s), "cuStreamSynchronize");
    unsigned long long launched = used_mib();
    api_check(api.cuGraphExecDestroy(e), "cuGraphExecDestroy");
    unsigned long long destroyed = used_mib();
    CUresult third = api.cuGraphInstantiateWithFlags(&e2, g2, 0);
    if (third == CUDA_SUCCESS)
        api_check(api.cuGraphExecDestroy(e2), "cuGraphExecDestroy");
    api_check(api.cuGraphDestroy(g2), "cuGraphDestroy");
    printf("used_captured=%llu used_instantiated=%llu rc_second=%d used_launched=%llu "
           "used_exec_destroyed=%llu rc_third=%d used_end=%llu\n",
           after_capture, instantiated, second, launched, destroyed, third, used_mib());
    return 0;
}

static int limits(CUdevice dev)
{
    size_t heap;
    CUresult rc_heap = api.cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 600 * MIB);
    api_check(api.cuCtxGetLimit(&heap, CU_LIMIT_MALLOC_HEAP_SIZE), "cuCtxGetLimit");
    unsigned long long used_heap = used_mib();
    CUresult rc_fifo = api.cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 600 * MIB);
    unsigned long long used_fifo = used_mib();
    api_check(api.cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 8 * MIB), "cuCtxSetLimit(heap)");
    unsigned long long used_default = used_mib();
    CUresult rc_stack = api.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 2048);
    unsigned long long used_stack = used_mib();
    CUresult rc_big_stack = api.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 8192);
    CUcontext ctx, fresh;
    api_check(api.cuCtxCreate_v2(&fresh, 0, dev), "cuCtxCreate_v2");
    api_check(api.cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 108 * MIB), "cuCtxSetLimit(fresh)");
    unsigned long long used_two = used_mib();
    api_check(api.cuCtxDestroy_v2(fresh), "cuCtxDestroy_v2");
    api_check(api.cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    printf("rc_heap=%d heap_mib=%llu used_heap=%llu rc_fifo=%d used_fifo=%llu used_default=%llu "
           "rc_stack=%d used_stack=%llu rc_big_stack=%d used_two_contexts=%llu "
           "used_context_destroyed=%llu\n",
           rc_heap, (unsigned long long)(heap / MIB), used_heap, rc_fifo, used_fifo, used_default,
           rc_stack, used_stack, rc_big_stack, used_two, used_mib());
    return 0;
}

static int unix_socket(const char *path, struct sockaddr_un *addr)
{
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    snprintf(addr->sun_path, sizeof addr->sun_path, "%s", path);
    if (s < 0) {
        perror("socket");
        exit(2);
    }
    return s;
}

static int vmm_export(const char *path)
{
    struct sockaddr_un addr;
    int s = unix_socket(path, &addr);
    if (bind(s, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(s, 1) != 0) {
        perror("bind");
        return 2;
    }
    CUresult rc;
    CUmemGenericAllocationHandle h = vmm_create(600, &rc);
    api_check(rc, "cuMemCreate");
    CUdeviceptr va = vmm_map(h, 600);
    int fd;
    api_check(api.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle");
    printf("ready used=%llu\n", used_mib());
    fflush(stdout);
    int c = accept(s, NULL, NULL);
    char byte = 'x', control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET, cm->cmsg_type = SCM_RIGHTS, cm->cmsg_len = CMSG_LEN(sizeof fd);
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    if (c < 0 || sendmsg(c, &msg, 0) != 1) {
        perror("sendmsg");
        return 2;
    }
    close(c);
    close(fd);
    wait_for_line("release");
    api_check(api.cuMemUnmap(va, 600 * MIB), "cuMemUnmap");
    api_check(api.cuMemRelease(h), "cuMemRelease");
    printf("released used=%llu\n", used_mib());
    fflush(stdout);
    char buf[64];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
    return 0;
}

static int vmm_import(const char *path)
{
    struct sockaddr_un addr;
    int s = unix_socket(path, &addr), fd;
    char byte, control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) != 0 || recvmsg(s, &msg, 0) != 1 ||
        !CMSG_FIRSTHDR(&msg)) {
        perror("receiving the handle");
        return 2;
    }
    memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof fd);
    unsigned long long before = used_mib();
    CUmemGenericAllocationHandle h;
    api_check(api.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "cuMemImportFromShareableHandle");
    close(fd);
    CUdeviceptr va = vmm_map(h, 600);
    printf("imported used_before=%llu used_mapped=%llu\n", before, used_mib());
    wait_for_line("create");
    CUresult more;
    CUmemGenericAllocationHandle other = vmm_create(600, &more);
    if (more == CUDA_SUCCESS)
        api_check(api.cuMemRelease(other), "cuMemRelease");
    unsigned long long holding = used_mib();
    api_check(api.cuMemUnmap(va, 600 * MIB), "cuMemUnmap");
    api_check(api.cuMemRelease(h), "cuMemRelease");
    printf("rc_create=%d used_holding=%llu used_end=%llu\n", more, holding, used_mib());
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: mem_life <scenario> [resolve] [args]\n");
        return 2;
    }
    const char *scenario = argv[1], *arg = argc > 3 ? argv[3] : "flags";
    api_load(argc > 2 ? argv[2] : "link");
    api_check(api.cuInit(0), "cuInit");
    CUdevice dev;
    CUcontext ctx;
    api_check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    api_check(api.cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    if (strcmp(scenario, "vmm") == 0)
        return vmm();
    if (strcmp(scenario, "pool") == 0)
        return pool();
    if (strcmp(scenario, "async") == 0)
        return async();
    if (strcmp(scenario, "pool_destroy") == 0)
        return pool_destroy();
    if (strcmp(scenario, "async_device") == 0)
        return async_device(ctx);
    if (strcmp(scenario, "graph") == 0)
        return graph(arg);
    if (strcmp(scenario, "limits") == 0)
        return limits(dev);
    if (strcmp(scenario, "capture") == 0)
        return captured();
    if (strcmp(scenario, "vmm_export") == 0)
        return vmm_export(arg);
    if (strcmp(scenario, "vmm_import") == 0)
        return vmm_import(arg);
    fprintf(stderr, "unknown scenario '%s'\n", scenario);
    return 2;
}
