/* Simulated execution: streams, events, modules, kernel launches and graphs.
 *
 * A kernel takes gridDimX*gridDimY*gridDimZ * VGPU_SIM_NS_PER_BLOCK of GPU
 * time. Every process's kernels on a device queue on that device's shared
 * timeline (sim.h), one after another, first launched first run: two busy
 * processes share a GPU half and half, as with the real driver's time-slicing.
 * An event is stamped when its stream gets to it: right behind the stream's own
 * queued work, when that work ends; behind other streams' or processes' work
 * only, when the device gets there -- or, if the stream queues its next work
 * first, as that work starts. That is the hardware's channel order: a context's
 * commands run in order on its own channel, and an event is stamped only when
 * that context runs, so an event recorded just before a kernel marks the
 * kernel's start, not the moment it was queued behind another tenant.
 * Launches are asynchronous; a launch blocks only when its stream is already
 * VGPU_SIM_QUEUE_US ahead of the clock (a full launch queue). Synchronisation
 * sleeps until the work it waits for has ended. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "sim_cuda.h"

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

struct CUevent_st {
    _Atomic uint64_t t_ns; /* when the device reaches the event; 0 = never recorded */
    _Atomic uint64_t gen;  /* bumped when destroyed: a stream's stale reference is ignored */
    struct CUevent_st *next_free;
};
struct CUmod_st {
    int unused;
};
struct CUfunc_st {
    CUmodule module;
};
struct CUgraph_st {
    uint64_t kernel_ns;             /* GPU time of all its kernel nodes */
    uint64_t mem[SIM_MAX_DEVICES]; /* bytes of its memory-allocation nodes, per device */
};
struct CUgraphNode_st {
    int unused;
};
struct CUgraphExec_st {
    uint64_t kernel_ns;
    uint64_t mem[SIM_MAX_DEVICES];
    int mem_held; /* the graph's memory is taken at its first upload or launch */
};

/* The stream work goes to; NULL and the special handles mean the context's own. */
static CUresult resolve_stream(CUstream s, struct CUstream_st **out)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
        if (!sim_current)
            return CUDA_ERROR_INVALID_CONTEXT;
        s = &sim_current->null_stream;
    }
    *out = s;
    return CUDA_SUCCESS;
}

/* Queues gpu_ns of work on stream s and the shared device timeline. */
static void run_on(struct CUstream_st *s, uint64_t gpu_ns)
{
    uint64_t now = sim_now_ns();
    uint64_t queued_until = atomic_load(&s->last_end_ns);
    if (queued_until > now + sim_cfg.queue_ns) /* launch queue full: wait for room */
        sim_sleep_until(queued_until - sim_cfg.queue_ns), now = sim_now_ns();
    if (gpu_ns == 0)
        return;
    struct sim_timeline *t = sim_timelines[s->ctx->dev];
    uint64_t earliest = queued_until > now ? queued_until : now;
    uint64_t busy = atomic_load(&t->busy_until_ns), end;
    do
        end = (busy > earliest ? busy : earliest) + gpu_ns;
    while (!atomic_compare_exchange_weak(&t->busy_until_ns, &busy, end));
    atomic_fetch_add(&t->busy_ns_total, gpu_ns);
    sim_device_busy(s->ctx->dev, gpu_ns);
    sim_atomic_max(&s->last_end_ns, end);
    sim_atomic_max(&s->ctx->last_end_ns, end);
    /* An event recorded just before, not reached yet: the device reaches it as it starts this. */
    struct CUevent_st *ev = atomic_exchange(&s->waiting_event, NULL);
    if (ev && atomic_load(&ev->gen) == atomic_load(&s->waiting_gen) &&
        atomic_load(&ev->t_ns) > now)
        atomic_store(&ev->t_ns, end - gpu_ns);
}

static uint64_t grid_ns(unsigned gx, unsigned gy, unsigned gz)
{
    return (uint64_t)gx * gy * gz * sim_cfg.ns_per_block;
}

/* --- streams ----------------------------------------------------------------------------- */

SIM_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    (void)flags;
    CUresult rc = sim_check_init();
    if (rc || !phStream)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUstream s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->ctx = sim_current;
    *phStream = s;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CUresult rc = sim_check_init();
    if (rc || !hStream || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    free(hStream);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc == CUDA_SUCCESS)
        sim_sleep_until(atomic_load(&s->last_end_ns));
    if (rc == CUDA_SUCCESS)
        sim_pools_sync();
    return rc;
}

SIM_EXPORT CUresult cuStreamQuery(CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc)
        return rc;
    return sim_now_ns() >= atomic_load(&s->last_end_ns) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* Capture (sim_reserve.c) records stream-ordered allocations and frees only; kernels
 * launched into a capturing stream still run. */
SIM_EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *status)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc || !status)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *status = s->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_sleep_until(atomic_load(&sim_current->last_end_ns));
    sim_pools_sync();
    return CUDA_SUCCESS;
}

/* --- events ------------------------------------------------------------------------------ */

/* Destroyed events are kept for reuse, never freed: a stream may still point at one. */
static pthread_mutex_t free_events_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUevent_st *free_events;

SIM_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int flags)
{
    (void)flags;
    CUresult rc = sim_check_init();
    if (rc || !phEvent)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&free_events_mu);
    struct CUevent_st *ev = free_events;
    if (ev)
        free_events = ev->next_free;
    pthread_mutex_unlock(&free_events_mu);
    if (!ev && !(ev = calloc(1, sizeof *ev)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    atomic_store(&ev->t_ns, 0);
    *phEvent = ev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc || !hEvent)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    /* The event is a command in the device's queue like a kernel: it is reached
     * after all work queued before it, by any stream or process. */
    /* Right behind its stream's own work, it is reached when that work ends.
     * Behind other work only, it waits for the device: stamped when the device
     * gets there, or as the stream's next work starts if that is queued first. */
    uint64_t now = sim_now_ns(), own = atomic_load(&s->last_end_ns);
    uint64_t busy = atomic_load(&sim_timelines[s->ctx->dev]->busy_until_ns);
    int waits = busy > own && busy > now;
    atomic_store(&hEvent->t_ns, waits ? busy : own > now ? own : now);
    atomic_store(&s->waiting_gen, atomic_load(&hEvent->gen));
    atomic_store(&s->waiting_event, waits ? hEvent : NULL);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    CUresult rc = sim_check_init();
    if (rc || !hEvent)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    return sim_now_ns() >= atomic_load(&hEvent->t_ns) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    CUresult rc = sim_check_init();
    if (rc || !hEvent)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    sim_sleep_until(atomic_load(&hEvent->t_ns));
    sim_pools_sync();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent hStart, CUevent hEnd)
{
    CUresult rc = sim_check_init();
    if (rc || !ms || !hStart || !hEnd)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    uint64_t start = atomic_load(&hStart->t_ns), end = atomic_load(&hEnd->t_ns);
    if (!start || !end)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = sim_now_ns();
    if (now < start || now < end)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)((int64_t)(end - start)) / 1e6);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CUresult rc = sim_check_init();
    if (rc || !hEvent)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    atomic_fetch_add(&hEvent->gen, 1);
    pthread_mutex_lock(&free_events_mu);
    hEvent->next_free = free_events;
    free_events = hEvent;
    pthread_mutex_unlock(&free_events_mu);
    return CUDA_SUCCESS;
}

/* --- modules: any image loads; every function is the "spin for its grid" kernel ---------- */

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    CUresult rc = sim_check_init();
    if (rc || !module || !image)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!sim_current)
        return CUDA_ERROR_INVALID_CONTEXT;
    return (*module = calloc(1, sizeof **module)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CUresult rc = sim_check_init();
    if (rc || !hfunc || !hmod || !name)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!(*hfunc = calloc(1, sizeof **hfunc)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    (*hfunc)->module = hmod;
    return CUDA_SUCCESS;
}

/* Functions stay valid (leaked) after unloading; using them is the caller's bug. */
SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    CUresult rc = sim_check_init();
    if (rc || !hmod)
        return rc ? rc : CUDA_ERROR_INVALID_HANDLE;
    free(hmod);
    return CUDA_SUCCESS;
}

/* --- launches ---------------------------------------------------------------------------- */

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc)
        return rc;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    sim_managed_page_in(); /* a kernel's accesses page managed memory back in */
    run_on(s, grid_ns(gx, gy, gz));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                   unsigned int gz, unsigned int bx, unsigned int by,
                                   unsigned int bz, unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gx, gy, gz, bx, by, bz, hStream);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                        unsigned int gz, unsigned int bx, unsigned int by,
                                        unsigned int bz, unsigned int sharedMemBytes,
                                        CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gx, gy, gz, bx, by, bz, hStream);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **kernelParams,
                                     void **extra)
{
    (void)kernelParams, (void)extra;
    if (!c)
        return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                  c->blockDimZ, c->hStream);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f,
                                          void **kernelParams, void **extra)
{
    return cuLaunchKernelEx(c, f, kernelParams, extra);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                              unsigned int gz, unsigned int bx, unsigned int by,
                                              unsigned int bz, unsigned int sharedMemBytes,
                                              CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gx, gy, gz, bx, by, bz, hStream);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
                                                   unsigned int gy, unsigned int gz,
                                                   unsigned int bx, unsigned int by,
                                                   unsigned int bz, unsigned int sharedMemBytes,
                                                   CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes, (void)kernelParams;
    return launch(f, gx, gy, gz, bx, by, bz, hStream);
}

/* --- graphs ------------------------------------------------------------------------------ */

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    CUresult rc = sim_check_init();
    if (rc || !phGraph || flags)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    return (*phGraph = calloc(1, sizeof **phGraph)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    CUresult rc = sim_check_init();
    if (rc || !hGraph)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    free(hGraph);
    return CUDA_SUCCESS;
}

static CUresult new_node(CUgraphNode *out, CUgraph g)
{
    static struct CUgraphNode_st node; /* nodes carry no state here */
    CUresult rc = sim_check_init();
    if (rc || !out || !g)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    *out = &node;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                         const CUgraphNode *deps, size_t numDeps,
                                         const CUDA_KERNEL_NODE_PARAMS *p)
{
    (void)deps, (void)numDeps;
    CUresult rc = new_node(phGraphNode, hGraph);
    if (rc || !p || !p->func || !p->gridDimX || !p->gridDimY || !p->gridDimZ)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    hGraph->kernel_ns += grid_ns(p->gridDimX, p->gridDimY, p->gridDimZ);
    return CUDA_SUCCESS;
}

/* The graph's memory is taken when an executable graph made from it is first
 * uploaded or launched (graph_memory_hold); adding the node takes nothing. */
SIM_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                           const CUgraphNode *deps, size_t numDeps,
                                           CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    (void)deps, (void)numDeps;
    static _Atomic uint64_t next = 0x7e0000000000ull;
    CUresult rc = new_node(phGraphNode, hGraph);
    if (rc || !p || p->bytesize == 0 || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if ((rc = sim_check_device(p->poolProps.location.id)))
        return rc;
    p->dptr = atomic_fetch_add(&next, (p->bytesize + 0xfffff) & ~0xfffffull);
    hGraph->mem[p->poolProps.location.id] += p->bytesize;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                   const CUgraphNode *deps, size_t numDeps, CUgraphNodeParams *p)
{
    if (!p)
        return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return cuGraphAddMemAllocNode(phGraphNode, hGraph, deps, numDeps, &p->alloc);
    if (p->type == CU_GRAPH_NODE_TYPE_KERNEL) /* the v3 kernel params start like v1's */
        return cuGraphAddKernelNode(phGraphNode, hGraph, deps, numDeps,
                                    (const CUDA_KERNEL_NODE_PARAMS *)(void *)&p->alloc);
    return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                      const CUgraphNode *deps, const CUgraphEdgeData *edges,
                                      size_t numDeps, CUgraphNodeParams *p)
{
    (void)edges;
    return cuGraphAddNode(phGraphNode, hGraph, deps, numDeps, p);
}

/* Takes an executable graph's memory at its first upload or launch; it is held
 * until the executable graph is destroyed (as the real driver's graph memory
 * pool holds it until trimmed). */
static CUresult graph_memory_hold(CUgraphExec e)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    int d = 0;
    for (; !e->mem_held && d < SIM_MAX_DEVICES && rc == CUDA_SUCCESS; d++)
        if (e->mem[d])
            rc = sim_reserve(d, e->mem[d]);
    if (rc) /* give back what the devices before the failing one took */
        for (int i = 0; i < d - 1; i++)
            sim_unreserve(i, e->mem[i]);
    else
        e->mem_held = 1;
    pthread_mutex_unlock(&mu);
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                unsigned long long flags)
{
    (void)flags;
    CUresult rc = sim_check_init();
    if (rc || !phGraphExec || !hGraph)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!(*phGraphExec = calloc(1, sizeof **phGraphExec)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    (*phGraphExec)->kernel_ns = hGraph->kernel_ns;
    memcpy((*phGraphExec)->mem, hGraph->mem, sizeof hGraph->mem);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CUresult rc = sim_check_init();
    if (rc || !hGraphExec)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (hGraphExec->mem_held)
        for (int d = 0; d < SIM_MAX_DEVICES; d++)
            sim_unreserve(d, hGraphExec->mem[d]);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc || !hGraphExec)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if ((rc = graph_memory_hold(hGraphExec)))
        return rc;
    run_on(s, hGraphExec->kernel_ns);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return cuGraphLaunch(hGraphExec, hStream);
}

/* --- more graph entry points: instantiation variants, upload, clone, free nodes ----------- */

SIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph,
                                       CUgraphNode *phErrorNode, char *logBuffer,
                                       size_t bufferSize)
{
    (void)phErrorNode;
    if (logBuffer && bufferSize)
        logBuffer[0] = '\0';
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                          CUgraphNode *phErrorNode, char *logBuffer,
                                          size_t bufferSize)
{
    return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SIM_EXPORT CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_stream(hStream, &s);
    if (rc || !hGraphExec)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    return graph_memory_hold(hGraphExec);
}

SIM_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return cuGraphUpload(hGraphExec, hStream);
}

/* With an upload stream in the parameters, the graph is uploaded as well. */
SIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    if (!params)
        return sim_check_init() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuGraphInstantiateWithFlags(phGraphExec, hGraph, params->flags);
    if (rc == CUDA_SUCCESS && params->hUploadStream &&
        (rc = cuGraphUpload(*phGraphExec, params->hUploadStream)) != CUDA_SUCCESS)
        cuGraphExecDestroy(*phGraphExec);
    params->hErrNode_out = NULL;
    params->result_out = rc ? CUDA_GRAPH_INSTANTIATE_ERROR : CUDA_GRAPH_INSTANTIATE_SUCCESS;
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return cuGraphInstantiateWithParams(phGraphExec, hGraph, params);
}

SIM_EXPORT CUresult cuGraphClone(CUgraph *phGraphClone, CUgraph originalGraph)
{
    CUresult rc = sim_check_init();
    if (rc || !phGraphClone || !originalGraph)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    if (!(*phGraphClone = malloc(sizeof **phGraphClone)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    **phGraphClone = *originalGraph;
    return CUDA_SUCCESS;
}

/* Frees, when the graph runs, what an allocation node gave; the simulated graph keeps
 * its allocation nodes' memory whole (an upper bound: the real driver may reuse it). */
SIM_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                          const CUgraphNode *deps, size_t numDeps,
                                          CUdeviceptr dptr)
{
    (void)deps, (void)numDeps;
    CUresult rc = new_node(phGraphNode, hGraph);
    return rc ? rc : dptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
