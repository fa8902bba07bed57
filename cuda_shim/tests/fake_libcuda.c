/*
 * A fake libcuda.so.1 for testing libdilu_shim.so without a GPU.
 *
 * cuGetProcAddress_v2 follows the real contract (gpu-sharing.md §1.2, §1.3):
 * base names, cudaVersion thresholds, the per-thread-default-stream flag
 * (falling back to the legacy entry only when no per-thread one exists), NULL
 * plus CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT when too old, and the
 * measured quirk that "cuGraphInstantiate" at >= 12000 answers an internal
 * alias of cuGraphInstantiateWithFlags rather than the exported symbol.
 *
 * Built with -Bsymbolic, like the real driver answers with its own entry
 * points: otherwise the table below would hold the preloaded shim's wrappers.
 */
#include "fake_libcuda.h"

#include <cudaTypedefs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#undef cuGetProcAddress
#undef cuGraphInstantiate
#undef cuGraphExecUpdate
#undef cuGraphKernelNodeGetParams

#define EXPORT __attribute__((visibility("default")))

/* ---- call recording ------------------------------------------------------ */
#define FAKE_FUNCS(X)                                                                        \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)   \
    X(cuCtxGetDevice) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxPushCurrent_v2)          \
    X(cuCtxPopCurrent_v2) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4)             \
    X(cuDevicePrimaryCtxRetain) X(cuGetProcAddress) X(cuGetProcAddress_v2)                  \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)   \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch)         \
    X(cuGraphLaunch_ptsz) X(cuGraphInstantiate) X(cuGraphInstantiate_v2)                    \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithFlags_alias)                     \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz)                    \
    X(cuGraphExecUpdate) X(cuGraphExecUpdate_v2) X(cuGraphExecDestroy) X(cuGraphGetNodes)   \
    X(cuGraphNodeGetType) X(cuGraphKernelNodeGetParams) X(cuGraphKernelNodeGetParams_v2)    \
    X(cuGraphChildGraphNodeGetGraph) X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz)     \
    X(cuThreadExchangeStreamCaptureMode) X(cuEventCreate) X(cuEventRecord)                  \
    X(cuEventRecord_ptsz) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy_v2)        \
    X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemAllocAsync)          \
    X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz)      \
    X(cuMemCreate) X(cuMemFree_v2) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemRelease) \
    X(cuMemGetInfo_v2) X(cuMemcpyHtoD_v2) X(cuCtxSynchronize) X(cuCtxSynchronize_v2)          \
    X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuMemGetAddressRange_v2)             \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle)

enum {
#define X(n) F_##n,
    FAKE_FUNCS(X)
#undef X
    F_COUNT
};
static const char *const fname[F_COUNT] = {
#define X(n) #n,
    FAKE_FUNCS(X)
#undef X
};
static _Atomic long counts[F_COUNT];
static _Atomic int last_call = -1;

static inline void hit(int f) {
    atomic_fetch_add_explicit(&counts[f], 1, memory_order_relaxed);
    atomic_store_explicit(&last_call, f, memory_order_relaxed);
}

EXPORT long fake_count(const char *name) {
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(fname[i], name) == 0) return atomic_load(&counts[i]);
    return -1;
}

EXPORT const char *fake_last(void) {
    int f = atomic_load(&last_call);
    return f < 0 ? "" : fname[f];
}

/* ---- configuration and the virtual GPU timeline ---------------------------- */
static pthread_once_t cfg_once = PTHREAD_ONCE_INIT;
static int cfg_devices = 1;
static uint64_t cfg_block_ns;
static uint64_t cfg_mem_total = 80ull << 30;

static void read_cfg(void) {
    const char *s;
    if ((s = getenv("FAKE_CUDA_DEVICES"))) cfg_devices = atoi(s);
    if ((s = getenv("FAKE_CUDA_BLOCK_NS"))) cfg_block_ns = strtoull(s, NULL, 10);
    if ((s = getenv("FAKE_CUDA_MEM_TOTAL"))) cfg_mem_total = strtoull(s, NULL, 10);
}
static void cfg(void) { pthread_once(&cfg_once, read_cfg); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static _Atomic uint64_t busy_until;
static _Atomic uint64_t total_blocks;

static void run_blocks(uint64_t blocks) {
    cfg();
    atomic_fetch_add(&total_blocks, blocks);
    if (!cfg_block_ns) return;
    uint64_t cur = atomic_load(&busy_until), nv;
    do {
        uint64_t now = now_ns();
        nv = (cur > now ? cur : now) + blocks * cfg_block_ns;
    } while (!atomic_compare_exchange_weak(&busy_until, &cur, nv));
}

EXPORT uint64_t fake_total_blocks(void) { return atomic_load(&total_blocks); }

EXPORT uint64_t fake_pending_ns(void) {
    uint64_t b = atomic_load(&busy_until), now = now_ns();
    return b > now ? b - now : 0;
}

/* ---- devices and contexts ------------------------------------------------------ */
static __thread int cur_dev = -1;

EXPORT CUresult cuInit(unsigned int flags) { hit(F_cuInit); cfg(); return CUDA_SUCCESS; }
EXPORT CUresult cuDriverGetVersion(int *v) { hit(F_cuDriverGetVersion); if (!v) return CUDA_ERROR_INVALID_VALUE; *v = 13000; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int *n) { hit(F_cuDeviceGetCount); cfg(); if (!n) return CUDA_ERROR_INVALID_VALUE; *n = cfg_devices; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    hit(F_cuDeviceGet);
    cfg();
    if (!d || ordinal < 0 || ordinal >= cfg_devices) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    hit(F_cuDeviceGetName);
    if (!name || len < 1) return CUDA_ERROR_INVALID_VALUE;
    strncpy(name, "Fake GPU", (size_t)len - 1);
    name[len - 1] = 0;
    return CUDA_SUCCESS;
}

static int ctx_dev(CUcontext c) {
    uintptr_t v = (uintptr_t)c;
    cfg();
    if (v < 0x1000 || v >= 0x1000 + (uintptr_t)cfg_devices) return -1;
    return (int)(v - 0x1000);
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    hit(F_cuCtxGetDevice);
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (cur_dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *d = cur_dev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) {
    hit(F_cuCtxGetCurrent);
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = cur_dev < 0 ? NULL : FAKE_CONTEXT(cur_dev);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
    hit(F_cuCtxSetCurrent);
    if (c == NULL) { cur_dev = -1; return CUDA_SUCCESS; }
    int d = ctx_dev(c);
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    cur_dev = d;
    return CUDA_SUCCESS;
}
static __thread int ctx_stack[8];
static __thread int ctx_depth;
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c) {
    hit(F_cuCtxPushCurrent_v2);
    int d = ctx_dev(c);
    if (d < 0 || ctx_depth >= 8) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack[ctx_depth++] = cur_dev;
    cur_dev = d;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pc) {
    hit(F_cuCtxPopCurrent_v2);
    if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (pc) *pc = cur_dev < 0 ? NULL : FAKE_CONTEXT(cur_dev);
    cur_dev = ctx_stack[--ctx_depth];
    return CUDA_SUCCESS;
}
static CUresult ctx_create(CUcontext *pc, CUdevice dev) {
    cfg();
    if (!pc || dev < 0 || dev >= cfg_devices) return CUDA_ERROR_INVALID_DEVICE;
    *pc = FAKE_CONTEXT(dev);
    cur_dev = dev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *pc, unsigned int flags, CUdevice dev) { hit(F_cuCtxCreate_v2); return ctx_create(pc, dev); }
EXPORT CUresult cuCtxCreate_v3(CUcontext *pc, CUexecAffinityParam *p, int n, unsigned int flags, CUdevice dev) { hit(F_cuCtxCreate_v3); return ctx_create(pc, dev); }
EXPORT CUresult cuCtxCreate_v4(CUcontext *pc, CUctxCreateParams *p, unsigned int flags, CUdevice dev) { hit(F_cuCtxCreate_v4); return ctx_create(pc, dev); }
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pc, CUdevice dev) {
    hit(F_cuDevicePrimaryCtxRetain);
    cfg();
    if (!pc || dev < 0 || dev >= cfg_devices) return CUDA_ERROR_INVALID_DEVICE;
    *pc = FAKE_CONTEXT(dev);
    return CUDA_SUCCESS;
}

/* ---- streams, capture, events --------------------------------------------------- */
static __thread int ptds_capturing;
EXPORT void fake_set_per_thread_capturing(int on) { ptds_capturing = on; }

static CUresult is_capturing(CUstream s, CUstreamCaptureStatus *st, int ptsz) {
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    int per_thread = s == CU_STREAM_PER_THREAD || (ptsz && s == NULL);
    *st = (s == FAKE_CAPTURE_STREAM || (per_thread && ptds_capturing)) ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                                                        : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) { hit(F_cuStreamIsCapturing); return is_capturing(s, st, 0); }
EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *st) { hit(F_cuStreamIsCapturing_ptsz); return is_capturing(s, st, 1); }

static __thread CUstreamCaptureMode thread_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    hit(F_cuThreadExchangeStreamCaptureMode);
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---- synchronize ------------------------------------------------------------------ */
static _Atomic CUresult sync_result = CUDA_SUCCESS;
static void (*_Atomic sync_during)(void);

EXPORT void fake_set_sync(CUresult result, void (*during)(void)) {
    atomic_store(&sync_result, result);
    atomic_store(&sync_during, during);
}

static void sleep_until(uint64_t t) {
    uint64_t now;
    while ((now = now_ns()) < t) {
        uint64_t d = t - now;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* Wait for the timeline to reach `until`, running the one-shot hook midway; the set result. */
static CUresult sync_common(uint64_t until) {
    void (*during)(void) = atomic_exchange(&sync_during, NULL);
    if (during) during();
    sleep_until(until);
    return atomic_load(&sync_result);
}

EXPORT CUresult cuCtxSynchronize(void) { hit(F_cuCtxSynchronize); return sync_common(atomic_load(&busy_until)); }
EXPORT CUresult cuCtxSynchronize_v2(CUcontext c) {
    hit(F_cuCtxSynchronize_v2);
    if (c != NULL && ctx_dev(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return sync_common(atomic_load(&busy_until));
}
static CUresult stream_sync(CUstream s) {
    if (s == FAKE_CAPTURE_STREAM) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return sync_common(atomic_load(&busy_until));
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { hit(F_cuStreamSynchronize); return stream_sync(s); }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { hit(F_cuStreamSynchronize_ptsz); return stream_sync(s); }

struct fake_event { uint64_t done_at; int recorded; };
EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags) {
    hit(F_cuEventCreate);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    *e = (CUevent)calloc(1, sizeof(struct fake_event));
    return *e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
static CUresult record(CUevent e, CUstream s) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (s == FAKE_CAPTURE_STREAM) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct fake_event *fe = (struct fake_event *)e;
    fe->done_at = atomic_load(&busy_until);
    fe->recorded = 1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { hit(F_cuEventRecord); return record(e, s); }
EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream s) { hit(F_cuEventRecord_ptsz); return record(e, s); }
EXPORT CUresult cuEventQuery(CUevent e) {
    hit(F_cuEventQuery);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    return now_ns() >= ((struct fake_event *)e)->done_at ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
EXPORT CUresult cuEventSynchronize(CUevent e) {
    hit(F_cuEventSynchronize);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    return sync_common(((struct fake_event *)e)->done_at);
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) { hit(F_cuEventDestroy_v2); free(e); return CUDA_SUCCESS; }

/* ---- launches ------------------------------------------------------------------------ */
#define GRID(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))
static CUresult launch(uint64_t blocks, CUstream s) {
    if (s != FAKE_CAPTURE_STREAM) run_blocks(blocks);
    return CUDA_SUCCESS;
}
#define FAKE_LAUNCH(name)                                                                     \
    EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,    \
                         unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e) { \
        hit(F_##name);                                                                        \
        return launch(GRID(gx, gy, gz), s);                                                   \
    }
FAKE_LAUNCH(cuLaunchKernel)
FAKE_LAUNCH(cuLaunchKernel_ptsz)
#define FAKE_LAUNCH_EX(name)                                                                   \
    EXPORT CUresult name(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {          \
        hit(F_##name);                                                                         \
        if (!c) return CUDA_ERROR_INVALID_VALUE;                                               \
        return launch(GRID(c->gridDimX, c->gridDimY, c->gridDimZ), c->hStream);               \
    }
FAKE_LAUNCH_EX(cuLaunchKernelEx)
FAKE_LAUNCH_EX(cuLaunchKernelEx_ptsz)
#define FAKE_LAUNCH_COOP(name)                                                                \
    EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,    \
                         unsigned by, unsigned bz, unsigned shm, CUstream s, void **p) {      \
        hit(F_##name);                                                                        \
        return launch(GRID(gx, gy, gz), s);                                                   \
    }
FAKE_LAUNCH_COOP(cuLaunchCooperativeKernel)
FAKE_LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz)

/* ---- a toy graph API ------------------------------------------------------------------- */
#define MAX_NODES 16
struct fake_graph;
struct fake_node {
    CUgraphNodeType type;
    unsigned gx, gy, gz;
    struct fake_graph *child;
};
struct fake_graph {
    int n;
    struct fake_node nodes[MAX_NODES];
};
struct fake_exec { struct fake_graph *g; };

EXPORT CUgraph fake_graph_create(void) { return (CUgraph)calloc(1, sizeof(struct fake_graph)); }
static struct fake_node *add_node(CUgraph g, CUgraphNodeType t) {
    struct fake_graph *fg = (struct fake_graph *)g;
    if (fg->n >= MAX_NODES) abort();
    struct fake_node *n = &fg->nodes[fg->n++];
    n->type = t;
    return n;
}
EXPORT void fake_graph_add_kernel(CUgraph g, unsigned gx, unsigned gy, unsigned gz) {
    struct fake_node *n = add_node(g, CU_GRAPH_NODE_TYPE_KERNEL);
    n->gx = gx, n->gy = gy, n->gz = gz;
}
EXPORT void fake_graph_add_child(CUgraph g, CUgraph child) {
    add_node(g, CU_GRAPH_NODE_TYPE_GRAPH)->child = (struct fake_graph *)child;
}
EXPORT void fake_graph_add_empty(CUgraph g) { add_node(g, CU_GRAPH_NODE_TYPE_EMPTY); }

static uint64_t graph_blocks(const struct fake_graph *g) {
    uint64_t sum = 0;
    for (int i = 0; i < g->n; i++) {
        if (g->nodes[i].type == CU_GRAPH_NODE_TYPE_KERNEL)
            sum += GRID(g->nodes[i].gx, g->nodes[i].gy, g->nodes[i].gz);
        else if (g->nodes[i].type == CU_GRAPH_NODE_TYPE_GRAPH && g->nodes[i].child)
            sum += graph_blocks(g->nodes[i].child);
    }
    return sum;
}

static CUresult instantiate(CUgraphExec *pe, CUgraph g) {
    if (!pe || !g) return CUDA_ERROR_INVALID_VALUE;
    struct fake_exec *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->g = (struct fake_graph *)g;
    *pe = (CUgraphExec)e;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g, CUgraphNode *en, char *log, size_t n) { hit(F_cuGraphInstantiate); return instantiate(pe, g); }
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, CUgraphNode *en, char *log, size_t n) { hit(F_cuGraphInstantiate_v2); return instantiate(pe, g); }
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g, unsigned long long fl) { hit(F_cuGraphInstantiateWithFlags); return instantiate(pe, g); }
/* Not exported: what the real driver hands out for "cuGraphInstantiate" at >= 12000. */
static CUresult instantiate_alias(CUgraphExec *pe, CUgraph g, unsigned long long fl) { hit(F_cuGraphInstantiateWithFlags_alias); return instantiate(pe, g); }
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) { hit(F_cuGraphInstantiateWithParams); return instantiate(pe, g); }
EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *pe, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) { hit(F_cuGraphInstantiateWithParams_ptsz); return instantiate(pe, g); }
EXPORT CUresult cuGraphExecUpdate(CUgraphExec e, CUgraph g, CUgraphNode *en, CUgraphExecUpdateResult *r) {
    hit(F_cuGraphExecUpdate);
    if (!e || !g) return CUDA_ERROR_INVALID_VALUE;
    ((struct fake_exec *)e)->g = (struct fake_graph *)g;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph g, CUgraphExecUpdateResultInfo *r) {
    hit(F_cuGraphExecUpdate_v2);
    if (!e || !g) return CUDA_ERROR_INVALID_VALUE;
    ((struct fake_exec *)e)->g = (struct fake_graph *)g;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) { hit(F_cuGraphExecDestroy); if (!e) return CUDA_ERROR_INVALID_VALUE; free(e); return CUDA_SUCCESS; }
static CUresult graph_launch(CUgraphExec e, CUstream s) {
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    return launch(graph_blocks(((struct fake_exec *)e)->g), s);
}
EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s) { hit(F_cuGraphLaunch); return graph_launch(e, s); }
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s) { hit(F_cuGraphLaunch_ptsz); return graph_launch(e, s); }
EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *n) {
    hit(F_cuGraphGetNodes);
    if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph *fg = (struct fake_graph *)g;
    if (nodes) {
        size_t k = *n < (size_t)fg->n ? *n : (size_t)fg->n;
        for (size_t i = 0; i < k; i++) nodes[i] = (CUgraphNode)&fg->nodes[i];
    }
    *n = (size_t)fg->n;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *t) {
    hit(F_cuGraphNodeGetType);
    if (!node || !t) return CUDA_ERROR_INVALID_VALUE;
    *t = ((struct fake_node *)node)->type;
    return CUDA_SUCCESS;
}
static CUresult kparams(CUgraphNode node, unsigned *grid) {
    struct fake_node *fn = (struct fake_node *)node;
    if (!fn || fn->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
    grid[0] = fn->gx, grid[1] = fn->gy, grid[2] = fn->gz;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS_v1 *p) {
    hit(F_cuGraphKernelNodeGetParams);
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    unsigned g[3];
    CUresult r = kparams(node, g);
    if (r == CUDA_SUCCESS) p->gridDimX = g[0], p->gridDimY = g[1], p->gridDimZ = g[2];
    return r;
}
EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    hit(F_cuGraphKernelNodeGetParams_v2);
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    unsigned g[3];
    CUresult r = kparams(node, g);
    if (r == CUDA_SUCCESS) p->gridDimX = g[0], p->gridDimY = g[1], p->gridDimZ = g[2];
    return r;
}
EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *out) {
    hit(F_cuGraphChildGraphNodeGetGraph);
    struct fake_node *fn = (struct fake_node *)node;
    if (!fn || !out || fn->type != CU_GRAPH_NODE_TYPE_GRAPH) return CUDA_ERROR_INVALID_VALUE;
    *out = (CUgraph)fn->child;
    return CUDA_SUCCESS;
}

/* ---- device memory ------------------------------------------------------------------- */
#define MAX_ALLOCS 65536
static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t key, size; } allocs[MAX_ALLOCS];
static uint64_t mem_used, next_addr = 0x7f0000000000ull, next_handle = 0x10000;

static CUresult mem_get(uint64_t *key, uint64_t size, int handle) {
    cfg();
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mem_mu);
    if (mem_used + size <= cfg_mem_total) {
        for (int i = 0; i < MAX_ALLOCS; i++) {
            if (allocs[i].key) continue;
            uint64_t k = handle ? next_handle++ : next_addr;
            if (!handle) next_addr += (size + 511) & ~511ull;
            if (!handle && size == 0) next_addr += 512;
            allocs[i].key = k;
            allocs[i].size = size;
            mem_used += size;
            *key = k;
            r = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mem_mu);
    return r;
}
static CUresult mem_put(uint64_t key) {
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_mu);
    for (int i = 0; i < MAX_ALLOCS && key; i++) {
        if (allocs[i].key != key) continue;
        mem_used -= allocs[i].size;
        allocs[i].key = 0;
        r = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&mem_mu);
    return r;
}
EXPORT uint64_t fake_mem_used(void) {
    pthread_mutex_lock(&mem_mu);
    uint64_t u = mem_used;
    pthread_mutex_unlock(&mem_mu);
    return u;
}

static CUresult alloc_ptr(CUdeviceptr *p, size_t n) {
    if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t k;
    CUresult r = mem_get(&k, n, 0);
    if (r == CUDA_SUCCESS) *p = (CUdeviceptr)k;
    return r;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { hit(F_cuMemAlloc_v2); return alloc_ptr(p, n); }
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int fl) { hit(F_cuMemAllocManaged); return alloc_ptr(p, n); }
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int es) {
    hit(F_cuMemAllocPitch_v2);
    if (!pitch || w == 0 || h == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t pt = (w + 511) & ~(size_t)511;
    CUresult r = alloc_ptr(p, pt * h);
    if (r == CUDA_SUCCESS) *pitch = pt;
    return r;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { hit(F_cuMemAllocAsync); return alloc_ptr(p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { hit(F_cuMemAllocAsync_ptsz); return alloc_ptr(p, n); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) { hit(F_cuMemAllocFromPoolAsync); return alloc_ptr(p, n); }
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) { hit(F_cuMemAllocFromPoolAsync_ptsz); return alloc_ptr(p, n); }
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop, unsigned long long fl) {
    hit(F_cuMemCreate);
    if (!h || n == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t k;
    CUresult r = mem_get(&k, n, 1);
    if (r == CUDA_SUCCESS) *h = k;
    return r;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { hit(F_cuMemFree_v2); return mem_put((uint64_t)p); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { hit(F_cuMemFreeAsync); return mem_put((uint64_t)p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { hit(F_cuMemFreeAsync_ptsz); return mem_put((uint64_t)p); }
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { hit(F_cuMemRelease); return mem_put((uint64_t)h); }
EXPORT CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
    hit(F_cuMemGetInfo_v2);
    cfg();
    if (!f || !t) return CUDA_ERROR_INVALID_VALUE;
    uint64_t used = fake_mem_used();
    *t = (size_t)cfg_mem_total;
    *f = (size_t)(cfg_mem_total - used);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *src, size_t n) { hit(F_cuMemcpyHtoD_v2); return CUDA_SUCCESS; }

/* ---- CUDA IPC (dilu_invoker/actions/models.py) -------------------------------------------
 * A handle names the exporter's pid and the allocation's base and size. Like the driver: it covers the whole
 * allocation (an interior pointer exports its base), it cannot be opened in the exporting process, and a
 * handle whose exporter is gone does not open. An opened handle maps at an address of its own. */
#include <errno.h>
#include <signal.h>
#include <unistd.h>
#define FAKE_IPC_MAGIC 0x31435049454b4146ull /* "FAKEIPC1" */
struct fake_ipc { uint64_t magic, pid, base, size; };
#define MAX_OPENED 64
static struct { uint64_t ptr, base; } opened[MAX_OPENED];
static uint64_t next_mapped = 0x7e0000000000ull;

static int find_alloc(uint64_t p, uint64_t *base, uint64_t *size) {
    int found = 0;
    pthread_mutex_lock(&mem_mu);
    for (int i = 0; i < MAX_ALLOCS && !found; i++) {
        if (allocs[i].key && p >= allocs[i].key && p < allocs[i].key + allocs[i].size) {
            *base = allocs[i].key;
            *size = allocs[i].size;
            found = 1;
        }
    }
    pthread_mutex_unlock(&mem_mu);
    return found;
}
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr p) {
    hit(F_cuMemGetAddressRange_v2);
    uint64_t b, n;
    if (!find_alloc((uint64_t)p, &b, &n)) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = (CUdeviceptr)b;
    if (psize) *psize = (size_t)n;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    hit(F_cuIpcGetMemHandle);
    uint64_t b, n;
    if (!h) return CUDA_ERROR_INVALID_VALUE;
    if (cur_dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!find_alloc((uint64_t)p, &b, &n)) return CUDA_ERROR_INVALID_VALUE;
    struct fake_ipc f = {FAKE_IPC_MAGIC, (uint64_t)getpid(), b, n};
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &f, sizeof f);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
    hit(F_cuIpcOpenMemHandle_v2);
    struct fake_ipc f;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (cur_dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    memcpy(&f, h.reserved, sizeof f);
    if (f.magic != FAKE_IPC_MAGIC || !f.size) return CUDA_ERROR_INVALID_VALUE;
    if (f.pid == (uint64_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT;
    if (kill((pid_t)f.pid, 0) != 0 && errno == ESRCH) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = CUDA_ERROR_TOO_MANY_PEERS;
    pthread_mutex_lock(&mem_mu);
    for (int i = 0; i < MAX_OPENED; i++) {
        if (opened[i].ptr) continue;
        opened[i].ptr = next_mapped;
        opened[i].base = f.base;
        next_mapped += (f.size + 511) & ~511ull;
        *p = (CUdeviceptr)opened[i].ptr;
        r = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&mem_mu);
    return r;
}
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    hit(F_cuIpcCloseMemHandle);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_mu);
    for (int i = 0; i < MAX_OPENED; i++) {
        if (opened[i].ptr && opened[i].ptr == (uint64_t)p) { opened[i].ptr = 0; r = CUDA_SUCCESS; break; }
    }
    pthread_mutex_unlock(&mem_mu);
    return r;
}

/* ---- cuGetProcAddress ------------------------------------------------------------------- */
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult *);
EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);

struct gpa_entry {
    const char *base;
    int min_ver;
    int ptds;
    void *fn;
};
#define E(base, ver, ptds, fn) {base, ver, ptds, (void *)(fn)}
static const struct gpa_entry table[] = {
    E("cuGetProcAddress", 11030, 0, cuGetProcAddress), E("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2),
    E("cuInit", 2000, 0, cuInit), E("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
    E("cuDeviceGet", 2000, 0, cuDeviceGet), E("cuDeviceGetCount", 2000, 0, cuDeviceGetCount),
    E("cuDeviceGetName", 2000, 0, cuDeviceGetName), E("cuCtxGetDevice", 2000, 0, cuCtxGetDevice),
    E("cuCtxGetCurrent", 4000, 0, cuCtxGetCurrent), E("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent),
    E("cuCtxPushCurrent", 4000, 0, cuCtxPushCurrent_v2), E("cuCtxPopCurrent", 4000, 0, cuCtxPopCurrent_v2),
    E("cuCtxCreate", 3020, 0, cuCtxCreate_v2), E("cuCtxCreate", 11040, 0, cuCtxCreate_v3),
    E("cuCtxCreate", 12050, 0, cuCtxCreate_v4), E("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
    E("cuLaunchKernel", 4000, 0, cuLaunchKernel), E("cuLaunchKernel", 7000, 1, cuLaunchKernel_ptsz),
    E("cuLaunchKernelEx", 11060, 0, cuLaunchKernelEx), E("cuLaunchKernelEx", 11060, 1, cuLaunchKernelEx_ptsz),
    E("cuLaunchCooperativeKernel", 9000, 0, cuLaunchCooperativeKernel),
    E("cuLaunchCooperativeKernel", 9000, 1, cuLaunchCooperativeKernel_ptsz),
    E("cuGraphLaunch", 10000, 0, cuGraphLaunch), E("cuGraphLaunch", 10000, 1, cuGraphLaunch_ptsz),
    E("cuGraphInstantiate", 10000, 0, cuGraphInstantiate), E("cuGraphInstantiate", 11000, 0, cuGraphInstantiate_v2),
    E("cuGraphInstantiate", 12000, 0, instantiate_alias),
    E("cuGraphInstantiateWithFlags", 11040, 0, cuGraphInstantiateWithFlags),
    E("cuGraphInstantiateWithParams", 12000, 0, cuGraphInstantiateWithParams),
    E("cuGraphInstantiateWithParams", 12000, 1, cuGraphInstantiateWithParams_ptsz),
    E("cuGraphExecUpdate", 10020, 0, cuGraphExecUpdate), E("cuGraphExecUpdate", 12000, 0, cuGraphExecUpdate_v2),
    E("cuGraphExecDestroy", 10000, 0, cuGraphExecDestroy), E("cuGraphGetNodes", 10000, 0, cuGraphGetNodes),
    E("cuGraphNodeGetType", 10000, 0, cuGraphNodeGetType),
    E("cuGraphKernelNodeGetParams", 10000, 0, cuGraphKernelNodeGetParams),
    E("cuGraphKernelNodeGetParams", 12000, 0, cuGraphKernelNodeGetParams_v2),
    E("cuGraphChildGraphNodeGetGraph", 10000, 0, cuGraphChildGraphNodeGetGraph),
    E("cuStreamIsCapturing", 10000, 0, cuStreamIsCapturing), E("cuStreamIsCapturing", 10000, 1, cuStreamIsCapturing_ptsz),
    E("cuThreadExchangeStreamCaptureMode", 10010, 0, cuThreadExchangeStreamCaptureMode),
    E("cuEventCreate", 2000, 0, cuEventCreate), E("cuEventRecord", 2000, 0, cuEventRecord),
    E("cuEventRecord", 7000, 1, cuEventRecord_ptsz), E("cuEventQuery", 2000, 0, cuEventQuery),
    E("cuEventSynchronize", 2000, 0, cuEventSynchronize), E("cuEventDestroy", 4000, 0, cuEventDestroy_v2),
    E("cuMemAlloc", 3020, 0, cuMemAlloc_v2), E("cuMemAllocPitch", 3020, 0, cuMemAllocPitch_v2),
    E("cuMemAllocManaged", 6000, 0, cuMemAllocManaged), E("cuMemAllocAsync", 11020, 0, cuMemAllocAsync),
    E("cuMemAllocAsync", 11020, 1, cuMemAllocAsync_ptsz), E("cuMemAllocFromPoolAsync", 11020, 0, cuMemAllocFromPoolAsync),
    E("cuMemAllocFromPoolAsync", 11020, 1, cuMemAllocFromPoolAsync_ptsz), E("cuMemCreate", 10020, 0, cuMemCreate),
    E("cuMemFree", 3020, 0, cuMemFree_v2), E("cuMemFreeAsync", 11020, 0, cuMemFreeAsync),
    E("cuMemFreeAsync", 11020, 1, cuMemFreeAsync_ptsz), E("cuMemRelease", 10020, 0, cuMemRelease),
    E("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2), E("cuMemcpyHtoD", 3020, 0, cuMemcpyHtoD_v2),
    E("cuCtxSynchronize", 2000, 0, cuCtxSynchronize), E("cuCtxSynchronize", 13000, 0, cuCtxSynchronize_v2),
    E("cuStreamSynchronize", 2000, 0, cuStreamSynchronize),
    E("cuStreamSynchronize", 7000, 1, cuStreamSynchronize_ptsz),
};
#define TABLE_LEN (sizeof table / sizeof *table)

static CUresult gpa(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                   CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (ver > 13000) return CUDA_ERROR_INVALID_VALUE;
    int known = 0, has_ptds = 0;
    for (size_t i = 0; i < TABLE_LEN; i++)
        if (strcmp(table[i].base, symbol) == 0) known = 1, has_ptds |= table[i].ptds;
    if (!known) {
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    /* flags == 0 means legacy stream at the ABI (see cuda.h's _ptsz inline). */
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && has_ptds;
    const struct gpa_entry *best = NULL;
    for (size_t i = 0; i < TABLE_LEN; i++) {
        const struct gpa_entry *e = &table[i];
        if (strcmp(e->base, symbol) || e->ptds != want_ptds || e->min_ver > ver) continue;
        if (!best || e->min_ver > best->min_ver) best = e;
    }
    if (!best) {
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_SUCCESS;
    }
    *pfn = best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    hit(F_cuGetProcAddress_v2);
    return gpa(symbol, pfn, ver, flags, status);
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags) {
    hit(F_cuGetProcAddress);
    return gpa(symbol, pfn, ver, flags, NULL);
}
