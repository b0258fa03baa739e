/* Interposers of graph memory (cuda_memory.def).
 *
 * A graph's memory-allocation nodes take device memory when an executable
 * graph made from it is uploaded or launched, and the driver keeps it for
 * that executable graph. The hook charges it earlier, when the executable
 * graph is instantiated (every variant), so nothing an upload or launch does
 * can pass the limit, and gives it back when the executable graph is
 * destroyed (or its context). Stream-ordered allocations and frees made while
 * a stream captures a graph are such nodes too (pool.c records them). The
 * template graph is never charged: adding
 * nodes only records them, and destroying it does not free an executable
 * graph's memory. Each executable graph is charged all its allocation nodes
 * (the driver may reuse memory between them; counting it again errs on the
 * safe side). An allocation with no free node in its graph outlives a launch:
 * if, when its executable graph is destroyed, the driver still knows its
 * address as an allocation (cuMemGetAddressRange), its charge stays until the
 * application frees the address (cuMemFree / cuMemFreeAsync) or destroys the
 * context. */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "memory.h"

static uint64_t key_of(const void *handle)
{
    return (uint64_t)(uintptr_t)handle;
}

/* All objects of kind and key, in a malloc'ed array (NULL with *n = 0 if none). */
static struct vgpu_object *collect(enum vgpu_kind kind, uint64_t key, int *n)
{
    *n = vgpu_track_collect(&vgpu_objects, kind, key, 0, NULL, 0);
    struct vgpu_object *all = *n > 0 ? malloc((size_t)*n * sizeof *all) : NULL;
    if (!all)
        *n = 0;
    else
        *n = vgpu_track_collect(&vgpu_objects, kind, key, 0, all, *n);
    return all;
}

static void forget_all(enum vgpu_kind kind, uint64_t key)
{
    struct vgpu_object o;
    while (vgpu_track_remove(&vgpu_objects, kind, key, &o) == 0)
        vgpu_release_object(&o, NULL);
}

/* --- template graphs: recorded, not charged ------------------------------------------------ */

void vgpu_graph_record_alloc(CUgraph graph, int dev, uint64_t size, CUdeviceptr dptr)
{
    if (size == 0 || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return;
    struct vgpu_object o = {.kind = VGPU_GRAPH, .key = key_of(graph), .dev = dev, .size = size,
                            .parent = dptr};
    if (vgpu_track_add(&vgpu_objects, &o) != 0) {
        /* Unrecorded, it would never be charged: tell, the instantiation will be refused. */
        vgpu_log_error("out of host memory recording a graph allocation node on device %d", o.dev);
        o.kind = VGPU_GRAPH_FREE, o.parent = 0; /* a marker instantiate refuses */
        vgpu_track_add(&vgpu_objects, &o);
    }
}

void vgpu_graph_record_free(CUgraph graph, CUdeviceptr dptr)
{
    struct vgpu_object o = {.kind = VGPU_GRAPH_FREE, .key = key_of(graph), .parent = dptr};
    if (dptr && vgpu_track_add(&vgpu_objects, &o) != 0)
        /* Without it the allocation counts as outliving its graph: kept longer, safe. */
        vgpu_log_error("out of host memory recording a graph free node");
}

static void record_alloc_node(CUgraph graph, const CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    if (p && p->poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        vgpu_graph_record_alloc(graph, p->poolProps.location.id, p->bytesize, p->dptr);
}

CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                const CUgraphNode *deps, size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    REAL_OR_RETURN(cuGraphAddMemAllocNode);
    READY_OR_RETURN();
    CUresult rc = real(phGraphNode, hGraph, deps, n, p);
    if (rc == CUDA_SUCCESS)
        record_alloc_node(hGraph, p);
    return rc;
}

static void record_node(CUgraph graph, const CUgraphNodeParams *p)
{
    if (p && p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        record_alloc_node(graph, &p->alloc);
}

CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                        size_t n, CUgraphNodeParams *p)
{
    REAL_OR_RETURN(cuGraphAddNode);
    READY_OR_RETURN();
    CUresult rc = real(phGraphNode, hGraph, deps, n, p);
    if (rc == CUDA_SUCCESS)
        record_node(hGraph, p);
    return rc;
}

CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                           const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p)
{
    REAL_OR_RETURN(cuGraphAddNode_v2);
    READY_OR_RETURN();
    CUresult rc = real(phGraphNode, hGraph, deps, edges, n, p);
    if (rc == CUDA_SUCCESS)
        record_node(hGraph, p);
    return rc;
}

CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                               size_t n, CUdeviceptr dptr)
{
    REAL_OR_RETURN(cuGraphAddMemFreeNode);
    CUresult rc = real(phGraphNode, hGraph, deps, n, dptr);
    if (rc == CUDA_SUCCESS)
        vgpu_graph_record_free(hGraph, dptr);
    return rc;
}

CUresult cuGraphClone(CUgraph *phGraphClone, CUgraph originalGraph)
{
    REAL_OR_RETURN(cuGraphClone);
    CUresult rc = real(phGraphClone, originalGraph);
    if (rc != CUDA_SUCCESS || !phGraphClone)
        return rc;
    static const enum vgpu_kind kinds[] = {VGPU_GRAPH, VGPU_GRAPH_FREE};
    for (int k = 0; k < 2; k++) {
        int n;
        struct vgpu_object *nodes = collect(kinds[k], key_of(originalGraph), &n);
        for (int i = 0; i < n; i++) {
            nodes[i].key = key_of(*phGraphClone);
            if (vgpu_track_add(&vgpu_objects, &nodes[i]) != 0)
                vgpu_log_error("out of host memory recording a cloned graph's memory nodes");
        }
        free(nodes);
    }
    return rc;
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    REAL_OR_RETURN(cuGraphDestroy);
    CUresult rc = real(hGraph);
    if (rc == CUDA_SUCCESS) {
        forget_all(VGPU_GRAPH, key_of(hGraph)); /* nothing charged: executables keep theirs */
        forget_all(VGPU_GRAPH_FREE, key_of(hGraph));
    }
    return rc;
}

/* --- executable graphs: charged ----------------------------------------------------------- */

static int freed_in(const struct vgpu_object *frees, int n, uint64_t dptr)
{
    for (int i = 0; i < n; i++)
        if (frees[i].parent == dptr)
            return 1;
    return 0;
}

/* Charges the graph's allocation nodes, instantiates through call, and records
 * them for the new executable graph. */
static CUresult instantiate(CUgraphExec *pexec, CUgraph graph, CUresult (*call)(void *),
                            void *args)
{
    READY_OR_RETURN();
    int n, nf;
    struct vgpu_object *nodes = collect(VGPU_GRAPH, key_of(graph), &n);
    struct vgpu_object *frees = collect(VGPU_GRAPH_FREE, key_of(graph), &nf);
    uint64_t per_dev[VGPU_MAX_DEVICES] = {0};
    CUresult rc = pexec && freed_in(frees, nf, 0) ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    for (int i = 0; pexec && i < n; i++)
        per_dev[nodes[i].dev] += nodes[i].size;
    int d = 0;
    for (; rc == CUDA_SUCCESS && d < VGPU_MAX_DEVICES; d++)
        if (per_dev[d])
            rc = vgpu_mem_charge(d, per_dev[d]);
    if (rc == CUDA_SUCCESS)
        rc = call(args);
    else
        d--; /* the device that refused is not charged */
    if (rc != CUDA_SUCCESS) {
        for (int i = 0; i < d; i++)
            vgpu_uncharge(i, per_dev[i]);
    } else if (pexec) {
        CUcontext ctx = NULL;
        CUdevice cur;
        vgpu_current(&ctx, &cur);
        for (int i = 0; i < n; i++) {
            struct vgpu_object o = {.kind = VGPU_GRAPH_EXEC, .key = key_of(*pexec),
                                    .bytes = nodes[i].size, .dev = nodes[i].dev,
                                    .ctx = key_of(ctx), .parent = nodes[i].parent,
                                    .flags = freed_in(frees, nf, nodes[i].parent) ? 0
                                                                                  : VGPU_PERSISTS};
            if (vgpu_track_add(&vgpu_objects, &o) != 0) /* charged for the life of the process */
                vgpu_log_error("out of host memory tracking graph memory on device %d", o.dev);
        }
    }
    free(nodes);
    free(frees);
    return rc;
}

struct inst_args {
    void *real;
    int variant; /* 0: (exec, graph, error node, log, size); 1: flags; 2: params */
    CUgraphExec *pexec;
    CUgraph graph;
    CUgraphNode *err_node;
    char *log;
    size_t log_size;
    unsigned long long flags;
    CUDA_GRAPH_INSTANTIATE_PARAMS *params;
};

static CUresult call_instantiate(void *p)
{
    struct inst_args *a = p;
    switch (a->variant) {
    case 0:
        return ((vgpu_cuGraphInstantiate_v2_fn)a->real)(a->pexec, a->graph, a->err_node, a->log,
                                                         a->log_size);
    case 1:
        return ((vgpu_cuGraphInstantiateWithFlags_fn)a->real)(a->pexec, a->graph, a->flags);
    default:
        return ((vgpu_cuGraphInstantiateWithParams_fn)a->real)(a->pexec, a->graph, a->params);
    }
}

CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize)
{
    REAL_OR_RETURN(cuGraphInstantiate);
    struct inst_args a = {.real = (void *)real, .variant = 0, .pexec = phGraphExec,
                          .graph = hGraph, .err_node = phErrorNode, .log = logBuffer,
                          .log_size = bufferSize};
    return instantiate(phGraphExec, hGraph, call_instantiate, &a);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize)
{
    REAL_OR_RETURN(cuGraphInstantiate_v2);
    struct inst_args a = {.real = (void *)real, .variant = 0, .pexec = phGraphExec,
                          .graph = hGraph, .err_node = phErrorNode, .log = logBuffer,
                          .log_size = bufferSize};
    return instantiate(phGraphExec, hGraph, call_instantiate, &a);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags)
{
    REAL_OR_RETURN(cuGraphInstantiateWithFlags);
    struct inst_args a = {.real = (void *)real, .variant = 1, .pexec = phGraphExec,
                          .graph = hGraph, .flags = flags};
    return instantiate(phGraphExec, hGraph, call_instantiate, &a);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    REAL_OR_RETURN(cuGraphInstantiateWithParams);
    struct inst_args a = {.real = (void *)real, .variant = 2, .pexec = phGraphExec,
                          .graph = hGraph, .params = instantiateParams};
    return instantiate(phGraphExec, hGraph, call_instantiate, &a);
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    REAL_OR_RETURN(cuGraphInstantiateWithParams_ptsz);
    struct inst_args a = {.real = (void *)real, .variant = 2, .pexec = phGraphExec,
                          .graph = hGraph, .params = instantiateParams};
    return instantiate(phGraphExec, hGraph, call_instantiate, &a);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    REAL_OR_RETURN(cuGraphExecDestroy);
    CUresult rc = real(hGraphExec);
    struct vgpu_object o;
    while (rc == CUDA_SUCCESS &&
           vgpu_track_remove(&vgpu_objects, VGPU_GRAPH_EXEC, key_of(hGraphExec), &o) == 0) {
        CUdeviceptr base;
        size_t size;
        vgpu_cuMemGetAddressRange_v2_fn range = REAL(cuMemGetAddressRange_v2);
        if (!(o.flags & VGPU_PERSISTS) ||
            (range && range(&base, &size, o.parent) != CUDA_SUCCESS)) {
            vgpu_release_object(&o, NULL);
            continue;
        }
        /* Its allocation is live (or the driver cannot say): charged until it is freed. */
        o.kind = VGPU_LINEAR, o.key = o.parent, o.parent = 0, o.flags = 0;
        if (vgpu_track_add(&vgpu_objects, &o) != 0)
            vgpu_log_error("out of host memory tracking graph memory on device %d", o.dev);
    }
    return rc;
}
