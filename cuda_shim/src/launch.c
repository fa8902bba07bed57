/*
 * Launch family, graph costing, context tracking and the synchronize family.
 *
 * Every launch wrapper is: admit (fast path inlined) -> forward. The _ptsz
 * twins forward to the driver's _ptsz entry points, so per-thread default
 * stream semantics are kept, and tell the slow path that a NULL stream means
 * CU_STREAM_PER_THREAD.
 *
 * A graph costs the blocks of its kernel nodes (child graphs included),
 * computed once when it is instantiated and looked up, lock-free, at launch.
 */
#include "shim_internal.h"

#include <stdlib.h>
#include <string.h>

#define GRID(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))
#define MAX_GRAPH_DEPTH 8

static struct dilu_ptrmap g_graph_cost = {.bits = 16};

/* ---- kernels ------------------------------------------------------------------ */
#define LAUNCH_KERNEL(name, ptsz)                                                               \
    DILU_EXPORT CUresult name(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,        \
                              unsigned int gridDimZ, unsigned int blockDimX,                     \
                              unsigned int blockDimY, unsigned int blockDimZ,                    \
                              unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, \
                              void **extra) {                                                    \
        dilu_admit(GRID(gridDimX, gridDimY, gridDimZ), hStream, ptsz, false);                   \
        __typeof__(&name) real = REAL(name);                                                     \
        if (DILU_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;                             \
        return real(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,            \
                    sharedMemBytes, hStream, kernelParams, extra);                               \
    }
LAUNCH_KERNEL(cuLaunchKernel, false)
LAUNCH_KERNEL(cuLaunchKernel_ptsz, true)

#define LAUNCH_KERNEL_EX(name, ptsz)                                                             \
    DILU_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **kernelParams,   \
                              void **extra) {                                                    \
        if (DILU_LIKELY(config != NULL))                                                         \
            dilu_admit(GRID(config->gridDimX, config->gridDimY, config->gridDimZ),              \
                       config->hStream, ptsz, false);                                            \
        __typeof__(&name) real = REAL(name);                                                     \
        if (DILU_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;                             \
        return real(config, f, kernelParams, extra);                                             \
    }
LAUNCH_KERNEL_EX(cuLaunchKernelEx, false)
LAUNCH_KERNEL_EX(cuLaunchKernelEx_ptsz, true)

#define LAUNCH_COOPERATIVE(name, ptsz)                                                          \
    DILU_EXPORT CUresult name(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,        \
                              unsigned int gridDimZ, unsigned int blockDimX,                     \
                              unsigned int blockDimY, unsigned int blockDimZ,                    \
                              unsigned int sharedMemBytes, CUstream hStream,                     \
                              void **kernelParams) {                                             \
        dilu_admit(GRID(gridDimX, gridDimY, gridDimZ), hStream, ptsz, false);                   \
        __typeof__(&name) real = REAL(name);                                                     \
        if (DILU_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;                             \
        return real(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,            \
                    sharedMemBytes, hStream, kernelParams);                                      \
    }
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel, false)
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel_ptsz, true)

/* ---- graphs ------------------------------------------------------------------- */
static uint64_t kernel_node_blocks(CUgraphNode node) {
    PFN_cuGraphKernelNodeGetParams_v12000 v2 =
        USE(cuGraphKernelNodeGetParams_v2, PFN_cuGraphKernelNodeGetParams_v12000);
    /* v1 is a prefix of v2 (same grid fields, same offsets), so one buffer serves both. */
    PFN_cuGraphKernelNodeGetParams_v12000 v1 =
        (PFN_cuGraphKernelNodeGetParams_v12000)g_use[USE_cuGraphKernelNodeGetParams];
    CUDA_KERNEL_NODE_PARAMS_v2 p;
    memset(&p, 0, sizeof p);
    if (v2 && v2(node, &p) == CUDA_SUCCESS) return GRID(p.gridDimX, p.gridDimY, p.gridDimZ);
    memset(&p, 0, sizeof p);
    if (v1 && v1(node, &p) == CUDA_SUCCESS) return GRID(p.gridDimX, p.gridDimY, p.gridDimZ);
    return 0;
}

static uint64_t graph_blocks(CUgraph graph, int depth) {
    PFN_cuGraphGetNodes_v10000 get_nodes = USE(cuGraphGetNodes, PFN_cuGraphGetNodes_v10000);
    PFN_cuGraphNodeGetType_v10000 get_type = USE(cuGraphNodeGetType, PFN_cuGraphNodeGetType_v10000);
    PFN_cuGraphChildGraphNodeGetGraph_v10000 get_child =
        USE(cuGraphChildGraphNodeGetGraph, PFN_cuGraphChildGraphNodeGetGraph_v10000);
    if (!get_nodes || !get_type) return 0;
    size_t n = 0;
    if (get_nodes(graph, NULL, &n) != CUDA_SUCCESS || n == 0) return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes) return 0;
    uint64_t sum = 0;
    if (get_nodes(graph, nodes, &n) == CUDA_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            CUgraphNodeType type;
            if (get_type(nodes[i], &type) != CUDA_SUCCESS) continue;
            if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
                sum += kernel_node_blocks(nodes[i]);
            } else if (type == CU_GRAPH_NODE_TYPE_GRAPH && get_child && depth < MAX_GRAPH_DEPTH) {
                CUgraph child;
                if (get_child(nodes[i], &child) == CUDA_SUCCESS) sum += graph_blocks(child, depth + 1);
            }
        }
    }
    free(nodes);
    return sum;
}

static void remember_graph(CUresult r, CUgraphExec exec, CUgraph graph) {
    if (r != CUDA_SUCCESS || !g_controlled || !exec) return;
    uint64_t cost = graph_blocks(graph, 0);
    /* Never 0: a graph of unknown content still pays something per launch. */
    if (cost == 0) cost = 1;
    if (!dilu_ptrmap_upsert(&g_graph_cost, (uintptr_t)exec, cost))
        atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_TABLE_FULL);
    DLOG(LOG_DEBUG, "graph exec %p costs %llu blocks", (void *)exec, (unsigned long long)cost);
}

#define GRAPH_LAUNCH(name, ptsz)                                                \
    DILU_EXPORT CUresult name(CUgraphExec hGraphExec, CUstream hStream) {       \
        uint64_t cost = 1;                                                      \
        dilu_ptrmap_lookup(&g_graph_cost, (uintptr_t)hGraphExec, &cost);        \
        dilu_admit(cost, hStream, ptsz, true);                                  \
        __typeof__(&name) real = REAL(name);                                    \
        if (DILU_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;            \
        return real(hGraphExec, hStream);                                       \
    }
GRAPH_LAUNCH(cuGraphLaunch, false)
GRAPH_LAUNCH(cuGraphLaunch_ptsz, true)

#define GRAPH_INSTANTIATE_LEGACY(name)                                                           \
    DILU_EXPORT CUresult name(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, \
                              char *logBuffer, size_t bufferSize) {                               \
        dilu_enter();                                                                                  \
        if (!REAL(name)) return CUDA_ERROR_NOT_INITIALIZED;                                       \
        CUresult r = REAL(name)(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);         \
        remember_graph(r, phGraphExec ? *phGraphExec : NULL, hGraph);                             \
        return r;                                                                                 \
    }
GRAPH_INSTANTIATE_LEGACY(cuGraphInstantiate)
GRAPH_INSTANTIATE_LEGACY(cuGraphInstantiate_v2)

DILU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 unsigned long long flags) {
    dilu_enter();
    if (!REAL(cuGraphInstantiateWithFlags)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuGraphInstantiateWithFlags)(phGraphExec, hGraph, flags);
    remember_graph(r, phGraphExec ? *phGraphExec : NULL, hGraph);
    return r;
}

#define GRAPH_INSTANTIATE_PARAMS(name)                                                      \
    DILU_EXPORT CUresult name(CUgraphExec *phGraphExec, CUgraph hGraph,                     \
                              CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {           \
        dilu_enter();                                                                            \
        if (!REAL(name)) return CUDA_ERROR_NOT_INITIALIZED;                                 \
        CUresult r = REAL(name)(phGraphExec, hGraph, instantiateParams);                    \
        remember_graph(r, phGraphExec ? *phGraphExec : NULL, hGraph);                       \
        return r;                                                                           \
    }
GRAPH_INSTANTIATE_PARAMS(cuGraphInstantiateWithParams)
GRAPH_INSTANTIATE_PARAMS(cuGraphInstantiateWithParams_ptsz)

/* An update can change the kernels and grids: cost the new graph again. */
DILU_EXPORT CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph,
                                       CUgraphNode *hErrorNode_out,
                                       CUgraphExecUpdateResult *updateResult_out) {
    dilu_enter();
    if (!REAL(cuGraphExecUpdate)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuGraphExecUpdate)(hGraphExec, hGraph, hErrorNode_out, updateResult_out);
    remember_graph(r, hGraphExec, hGraph);
    return r;
}

DILU_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
                                          CUgraphExecUpdateResultInfo *resultInfo) {
    dilu_enter();
    if (!REAL(cuGraphExecUpdate_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuGraphExecUpdate_v2)(hGraphExec, hGraph, resultInfo);
    remember_graph(r, hGraphExec, hGraph);
    return r;
}

DILU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    dilu_enter();
    if (!REAL(cuGraphExecDestroy)) return CUDA_ERROR_NOT_INITIALIZED;
    /* Forget first: the driver may reuse the handle as soon as it is destroyed. */
    uint64_t cost = 0;
    bool had = dilu_ptrmap_remove(&g_graph_cost, (uintptr_t)hGraphExec, &cost);
    CUresult r = REAL(cuGraphExecDestroy)(hGraphExec);
    if (r != CUDA_SUCCESS && had) dilu_ptrmap_insert(&g_graph_cost, (uintptr_t)hGraphExec, cost);
    return r;
}

/* ---- contexts: which device's bucket this thread's launches pay into ------------ */
#define CTX_SWITCH(name, arg_t, arg)                                            \
    DILU_EXPORT CUresult name(arg_t arg) {                                      \
        dilu_enter();                                                                \
        if (!REAL(name)) return CUDA_ERROR_NOT_INITIALIZED;                     \
        CUresult r = REAL(name)(arg);                                           \
        if (r == CUDA_SUCCESS) dilu_set_device_from_current();                  \
        return r;                                                               \
    }
CTX_SWITCH(cuCtxSetCurrent, CUcontext, ctx)
CTX_SWITCH(cuCtxPushCurrent_v2, CUcontext, ctx)
CTX_SWITCH(cuCtxPopCurrent_v2, CUcontext *, pctx)

static void set_device(CUresult r, CUdevice dev) {
    if (r == CUDA_SUCCESS) t_dev = dev < 0 ? 0 : dev < DILU_MAX_DEVICES ? dev : DILU_MAX_DEVICES - 1;
}

DILU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    dilu_enter();
    if (!REAL(cuCtxCreate_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuCtxCreate_v2)(pctx, flags, dev);
    set_device(r, dev);
    return r;
}

DILU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray,
                                    int numParams, unsigned int flags, CUdevice dev) {
    dilu_enter();
    if (!REAL(cuCtxCreate_v3)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuCtxCreate_v3)(pctx, paramsArray, numParams, flags, dev);
    set_device(r, dev);
    return r;
}

DILU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                                    unsigned int flags, CUdevice dev) {
    dilu_enter();
    if (!REAL(cuCtxCreate_v4)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuCtxCreate_v4)(pctx, ctxCreateParams, flags, dev);
    set_device(r, dev);
    return r;
}

/* ---- synchronize: where request spans close ----------------------------------------- */
/*
 * The application's own waits. The driver's result comes back unchanged; a
 * successful one with no launch in the process since its entry closes the open
 * span. The shim's in-flight waits call the driver directly (USE), so they
 * never get here.
 */
#define SYNC_WRAP(name, params, args)                                           \
    DILU_EXPORT CUresult name params {                                          \
        dilu_enter();                                                           \
        __typeof__(&name) real = REAL(name);                                    \
        if (DILU_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;            \
        struct dilu_span_mark mark;                                             \
        dilu_span_sync_enter(&mark);                                            \
        CUresult r = real args;                                                 \
        if (r == CUDA_SUCCESS && mark.open_ns) dilu_span_sync_exit(&mark, dilu_now_ns()); \
        return r;                                                               \
    }
SYNC_WRAP(cuCtxSynchronize, (void), ())
SYNC_WRAP(cuCtxSynchronize_v2, (CUcontext ctx), (ctx))
SYNC_WRAP(cuStreamSynchronize, (CUstream hStream), (hStream))
SYNC_WRAP(cuStreamSynchronize_ptsz, (CUstream hStream), (hStream))
SYNC_WRAP(cuEventSynchronize, (CUevent hEvent), (hEvent))
