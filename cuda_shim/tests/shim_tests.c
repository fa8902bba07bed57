/*
 * C tests of libdilu_shim.so against the fake libcuda.so.1.
 *
 *   LD_LIBRARY_PATH=build/fake LD_PRELOAD=build/libdilu_shim.so build/tests/shim_tests <test>
 *   build/tests/shim_tests --list          names of the tests
 *   build/tests/shim_tests --list-hooks    exported names the tests cover
 *
 * Each test configures itself (control/stats files, environment) before its
 * first CUDA call, because the shim reads its configuration once, lazily. It
 * prints FAIL lines and exits non-zero on failure. Every test also fails
 * without LD_PRELOAD (the negative control run by run_tests.sh), which shows
 * that it detects a missing shim.
 *
 * Time bounds here are one-sided where they can be (a token bucket cannot
 * admit faster than burst + rate x elapsed) and generous where they cannot.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dilu_shim_abi.h"
#include "fake_libcuda.h"

#undef cuGetProcAddress
#undef cuGraphInstantiate
#undef cuGraphExecUpdate

/* Exported driver names that cuda.h declares only under other macros. */
extern __typeof__(cuLaunchKernel) cuLaunchKernel_ptsz;
extern __typeof__(cuLaunchKernelEx) cuLaunchKernelEx_ptsz;
extern __typeof__(cuGraphLaunch) cuGraphLaunch_ptsz;
extern __typeof__(cuMemAllocAsync) cuMemAllocAsync_ptsz;
extern __typeof__(cuStreamSynchronize) cuStreamSynchronize_ptsz;
CUresult cuGraphInstantiate_v2(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, CUgraphExecUpdateResultInfo *);
typedef CUresult (*legacy_instantiate_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);

/* ======================================================================= */
/* harness                                                                  */
/* ======================================================================= */
static int g_failures;
#define CHECK(cond, ...)                                                            \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __func__, __LINE__, #cond);         \
            fprintf(stderr, __VA_ARGS__);                                           \
            fputc('\n', stderr);                                                    \
            g_failures++;                                                           \
        }                                                                           \
    } while (0)
#define REQUIRE(cond, ...)                  \
    do {                                    \
        bool ok_ = (cond);                  \
        CHECK(ok_ && #cond, __VA_ARGS__);   \
        if (!ok_) return;                   \
    } while (0)

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static void sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1e3), (long)((ms - (double)(time_t)(ms / 1e3) * 1e3) * 1e6)};
    while (nanosleep(&ts, &ts) == EINTR) {
    }
}

/* ---- the manager's side: control and stats files ----------------------- */
static char g_dir[64], g_ctl_path[96], g_st_path[96];
static dilu_shim_control_t *g_ctl;
static dilu_shim_stats_t *g_st;
static pid_t g_owner_pid;

static void cleanup(void) {
    if (getpid() != g_owner_pid || !g_dir[0]) return;
    unlink(g_ctl_path);
    unlink(g_st_path);
    rmdir(g_dir);
}

static void *map_rw(const char *path, size_t size) {
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) abort();
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) abort();
    return p;
}

static void ctl_write(double rate, uint64_t burst, uint64_t mem_cap, bool bump_heartbeat) {
    dilu_shim_control_t *c = g_ctl;
    __atomic_store_n(&c->epoch, c->epoch + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    c->rate_blocks_per_ms = rate;
    c->burst_blocks = burst;
    c->mem_cap_bytes = mem_cap;
    c->share = 0.5;
    c->capacity_blocks_per_ms = rate * 2;
    if (bump_heartbeat) __atomic_store_n(&c->manager_heartbeat_ns, now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&c->epoch, c->epoch + 1, __ATOMIC_RELEASE);
}

static void ctl_heartbeat(void) { __atomic_store_n(&g_ctl->manager_heartbeat_ns, now_ns(), __ATOMIC_RELEASE); }

/* Create both files, point the shim at them. magic = 0 writes a bad header. */
static void setup_blocks_magic(double rate, uint64_t burst, uint64_t mem_cap, uint64_t stale_after_ns,
                               uint32_t magic) {
    g_owner_pid = getpid();
    snprintf(g_dir, sizeof g_dir, "/tmp/dilu-shim-test-XXXXXX");
    if (!mkdtemp(g_dir)) abort();
    snprintf(g_ctl_path, sizeof g_ctl_path, "%s/control", g_dir);
    snprintf(g_st_path, sizeof g_st_path, "%s/stats", g_dir);
    atexit(cleanup);
    g_ctl = map_rw(g_ctl_path, sizeof *g_ctl);
    g_st = map_rw(g_st_path, sizeof *g_st);
    g_ctl->magic = magic;
    g_ctl->version = DILU_SHIM_ABI_VERSION;
    g_ctl->size = sizeof *g_ctl;
    g_ctl->stale_after_ns = stale_after_ns;
    ctl_write(rate, burst, mem_cap, true);
    g_st->magic = DILU_SHIM_STATS_MAGIC;
    g_st->version = DILU_SHIM_ABI_VERSION;
    g_st->size = sizeof *g_st;
    setenv("DILU_SHIM_CONTROL", g_ctl_path, 1);
    setenv("DILU_SHIM_STATS", g_st_path, 1);
}
static void setup_blocks(double rate, uint64_t burst, uint64_t mem_cap, uint64_t stale_after_ns) {
    setup_blocks_magic(rate, burst, mem_cap, stale_after_ns, DILU_SHIM_CONTROL_MAGIC);
}

static void stats_read(dilu_shim_stats_t *out) {
    for (;;) {
        uint64_t s1 = __atomic_load_n(&g_st->seq, __ATOMIC_ACQUIRE);
        if (!(s1 & 1)) {
            memcpy(out, g_st, sizeof *out);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&g_st->seq, __ATOMIC_RELAXED) == s1) return;
        }
        sched_yield();
    }
}

/* Poll the stats block until pred holds (or timeout); returns the last snapshot. */
typedef bool (*stats_pred)(const dilu_shim_stats_t *, const void *);
static bool shim_loaded(void) { return dlsym(RTLD_DEFAULT, "dilu_shim_query") != NULL; }

static bool wait_stats(stats_pred pred, const void *arg, double timeout_ms, dilu_shim_stats_t *out) {
    /* Without the shim nothing will ever publish: fail fast (negative control). */
    if (!shim_loaded()) timeout_ms = 0;
    double end = now_ms() + timeout_ms;
    do {
        stats_read(out);
        if (pred(out, arg)) return true;
        sleep_ms(0.2);
    } while (now_ms() < end);
    return false;
}
static bool pred_ticks_at_least(const dilu_shim_stats_t *s, const void *a) { return s->ticks >= *(const uint64_t *)a; }
static bool pred_rate_is(const dilu_shim_stats_t *s, const void *a) { return s->rate_blocks_per_ms == *(const double *)a; }
static bool pred_flag_set(const dilu_shim_stats_t *s, const void *a) { return (s->flags & *(const uint64_t *)a) != 0; }
static bool pred_flag_clear(const dilu_shim_stats_t *s, const void *a) { return (s->flags & *(const uint64_t *)a) == 0; }
static bool pred_blocks_at_least(const dilu_shim_stats_t *s, const void *a) { return s->blocks >= *(const uint64_t *)a; }

static void wait_ticks(uint64_t n) {
    dilu_shim_stats_t s;
    stats_read(&s);
    uint64_t target = s.ticks + n;
    wait_stats(pred_ticks_at_least, &target, 5000, &s);
}

/* ---- the shim's introspection ------------------------------------------------ */
static bool shim_info(dilu_shim_info_t *info) {
    dilu_shim_query_fn q = (dilu_shim_query_fn)dlsym(RTLD_DEFAULT, "dilu_shim_query");
    if (!q) {
        fprintf(stderr, "dilu_shim_query not found: is the shim preloaded?\n");
        return false;
    }
    return q(info, sizeof *info) == 0;
}

static bool in_object(const void *p, const char *needle, const char **sname) {
    Dl_info di;
    if (!p || !dladdr(p, &di) || !di.dli_fname) return false;
    if (sname) *sname = di.dli_sname ? di.dli_sname : "";
    return strstr(di.dli_fname, needle) != NULL;
}
static bool in_shim(const void *p, const char **sname) { return in_object(p, "libdilu_shim", sname); }

static CUresult launch(unsigned blocks, CUstream s) {
    return cuLaunchKernel(NULL, blocks, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
}

/* ======================================================================= */
/* every hooked entry point: how to call it harmlessly                      */
/* ======================================================================= */
#define S0 ((CUstream)0x100)
static CUgraph small_graph(void) {
    CUgraph g = fake_graph_create();
    fake_graph_add_kernel(g, 2, 1, 1);
    return g;
}
static void inv_gpa(void *f) { void *p; ((PFN_cuGetProcAddress_v11030)f)("cuInit", &p, 2000, 0); }
static void inv_gpa2(void *f) {
    void *p;
    CUdriverProcAddressQueryResult st;
    ((PFN_cuGetProcAddress_v12000)f)("cuInit", &p, 2000, 0, &st);
}
static void inv_launch(void *f) { ((PFN_cuLaunchKernel_v4000)f)(NULL, 1, 1, 1, 1, 1, 1, 0, S0, NULL, NULL); }
static void inv_launch_ex(void *f) {
    CUlaunchConfig c;
    memset(&c, 0, sizeof c);
    c.gridDimX = c.gridDimY = c.gridDimZ = 1;
    c.blockDimX = c.blockDimY = c.blockDimZ = 1;
    c.hStream = S0;
    ((PFN_cuLaunchKernelEx_v11060)f)(&c, NULL, NULL, NULL);
}
static void inv_coop(void *f) { ((PFN_cuLaunchCooperativeKernel_v9000)f)(NULL, 1, 1, 1, 1, 1, 1, 0, S0, NULL); }
static void inv_graph_launch(void *f) { ((PFN_cuGraphLaunch_v10000)f)(NULL, S0); }
static void inv_inst_legacy(void *f) { CUgraphExec e; ((legacy_instantiate_fn)f)(&e, small_graph(), NULL, NULL, 0); }
static void inv_inst_flags(void *f) { CUgraphExec e; ((PFN_cuGraphInstantiateWithFlags_v11040)f)(&e, small_graph(), 0); }
static void inv_inst_params(void *f) {
    CUgraphExec e;
    CUDA_GRAPH_INSTANTIATE_PARAMS p;
    memset(&p, 0, sizeof p);
    ((PFN_cuGraphInstantiateWithParams_v12000)f)(&e, small_graph(), &p);
}
static void inv_exec_update(void *f) { ((PFN_cuGraphExecUpdate_v10020)f)(NULL, NULL, NULL, NULL); }
static void inv_exec_update2(void *f) { ((PFN_cuGraphExecUpdate_v12000)f)(NULL, NULL, NULL); }
static void inv_exec_destroy(void *f) { ((PFN_cuGraphExecDestroy_v10000)f)(NULL); }
static void inv_alloc(void *f) { CUdeviceptr p; ((PFN_cuMemAlloc_v3020)f)(&p, 64); }
static void inv_pitch(void *f) { CUdeviceptr p; size_t pitch; ((PFN_cuMemAllocPitch_v3020)f)(&p, &pitch, 64, 2, 4); }
static void inv_managed(void *f) { CUdeviceptr p; ((PFN_cuMemAllocManaged_v6000)f)(&p, 64, 1); }
static void inv_async(void *f) { CUdeviceptr p; ((PFN_cuMemAllocAsync_v11020)f)(&p, 64, S0); }
static void inv_pool(void *f) { CUdeviceptr p; ((PFN_cuMemAllocFromPoolAsync_v11020)f)(&p, 64, NULL, S0); }
static void inv_create(void *f) { CUmemGenericAllocationHandle h; ((PFN_cuMemCreate_v10020)f)(&h, 64, NULL, 0); }
static void inv_free(void *f) { ((PFN_cuMemFree_v3020)f)(0); }
static void inv_free_async(void *f) { ((PFN_cuMemFreeAsync_v11020)f)(0, S0); }
static void inv_release(void *f) { ((PFN_cuMemRelease_v10020)f)(0); }
static void inv_getinfo(void *f) { size_t a, b; ((PFN_cuMemGetInfo_v3020)f)(&a, &b); }
static void inv_set_current(void *f) { ((PFN_cuCtxSetCurrent_v4000)f)(FAKE_CONTEXT(0)); }
static void inv_push(void *f) { ((PFN_cuCtxPushCurrent_v4000)f)(FAKE_CONTEXT(0)); }
static void inv_pop(void *f) { CUcontext c; ((PFN_cuCtxPopCurrent_v4000)f)(&c); }
static void inv_create_v2(void *f) { CUcontext c; ((PFN_cuCtxCreate_v3020)f)(&c, 0, 0); }
static void inv_create_v3(void *f) { CUcontext c; ((PFN_cuCtxCreate_v11040)f)(&c, NULL, 0, 0, 0); }
static void inv_create_v4(void *f) { CUcontext c; ((PFN_cuCtxCreate_v12050)f)(&c, NULL, 0, 0); }
static void inv_ctx_sync(void *f) { ((PFN_cuCtxSynchronize_v2000)f)(); }
static void inv_ctx_sync2(void *f) { ((PFN_cuCtxSynchronize_v13000)f)(FAKE_CONTEXT(0)); }
static void inv_stream_sync(void *f) { ((PFN_cuStreamSynchronize_v2000)f)(S0); }
static void inv_event_sync(void *f) {
    CUevent e = NULL;
    cuEventCreate(&e, 0);
    ((PFN_cuEventSynchronize_v2000)f)(e);
    cuEventDestroy(e);
}

struct hook_case {
    const char *name;
    void (*invoke)(void *);
};
static const struct hook_case hooks[] = {
    {"cuGetProcAddress", inv_gpa}, {"cuGetProcAddress_v2", inv_gpa2},
    {"cuLaunchKernel", inv_launch}, {"cuLaunchKernel_ptsz", inv_launch},
    {"cuLaunchKernelEx", inv_launch_ex}, {"cuLaunchKernelEx_ptsz", inv_launch_ex},
    {"cuLaunchCooperativeKernel", inv_coop}, {"cuLaunchCooperativeKernel_ptsz", inv_coop},
    {"cuGraphLaunch", inv_graph_launch}, {"cuGraphLaunch_ptsz", inv_graph_launch},
    {"cuGraphInstantiate", inv_inst_legacy}, {"cuGraphInstantiate_v2", inv_inst_legacy},
    {"cuGraphInstantiateWithFlags", inv_inst_flags}, {"cuGraphInstantiateWithParams", inv_inst_params},
    {"cuGraphInstantiateWithParams_ptsz", inv_inst_params}, {"cuGraphExecUpdate", inv_exec_update},
    {"cuGraphExecUpdate_v2", inv_exec_update2}, {"cuGraphExecDestroy", inv_exec_destroy},
    {"cuMemAlloc_v2", inv_alloc}, {"cuMemAllocPitch_v2", inv_pitch}, {"cuMemAllocManaged", inv_managed},
    {"cuMemAllocAsync", inv_async}, {"cuMemAllocAsync_ptsz", inv_async},
    {"cuMemAllocFromPoolAsync", inv_pool}, {"cuMemAllocFromPoolAsync_ptsz", inv_pool},
    {"cuMemCreate", inv_create}, {"cuMemFree_v2", inv_free}, {"cuMemFreeAsync", inv_free_async},
    {"cuMemFreeAsync_ptsz", inv_free_async}, {"cuMemRelease", inv_release}, {"cuMemGetInfo_v2", inv_getinfo},
    {"cuCtxSetCurrent", inv_set_current}, {"cuCtxPushCurrent_v2", inv_push}, {"cuCtxPopCurrent_v2", inv_pop},
    {"cuCtxCreate_v2", inv_create_v2}, {"cuCtxCreate_v3", inv_create_v3}, {"cuCtxCreate_v4", inv_create_v4},
    {"cuCtxSynchronize", inv_ctx_sync}, {"cuCtxSynchronize_v2", inv_ctx_sync2},
    {"cuStreamSynchronize", inv_stream_sync}, {"cuStreamSynchronize_ptsz", inv_stream_sync},
    {"cuEventSynchronize", inv_event_sync},
};
#define N_HOOKS (sizeof hooks / sizeof *hooks)

static const struct hook_case *hook_named(const char *name) {
    for (size_t i = 0; i < N_HOOKS; i++)
        if (strcmp(hooks[i].name, name) == 0) return &hooks[i];
    return NULL;
}

/* Calling p must reach the fake's entry point of that exact name once. */
static void check_reaches(void *p, const char *name, const char *how) {
    const struct hook_case *h = hook_named(name);
    REQUIRE(h, "no invoker for %s", name);
    long before = fake_count(name);
    h->invoke(p);
    CHECK(fake_count(name) == before + 1, "%s: calling %s did not reach the driver's %s (%ld -> %ld)",
          how, name, name, before, fake_count(name));
}

/* cuGetProcAddress requests: base name, version, and the exported entry point
   expected for flags 0 (legacy) and flags 2 (per-thread default stream). */
struct gpa_case {
    const char *base;
    int ver;
    const char *legacy, *ptds;
};
static const struct gpa_case gpa_cases[] = {
    {"cuGetProcAddress", 11030, "cuGetProcAddress", NULL},
    {"cuGetProcAddress", 12000, "cuGetProcAddress_v2", NULL},
    {"cuLaunchKernel", 7000, "cuLaunchKernel", "cuLaunchKernel_ptsz"},
    {"cuLaunchKernel", 12000, "cuLaunchKernel", "cuLaunchKernel_ptsz"},
    {"cuLaunchKernelEx", 11060, "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"},
    {"cuLaunchCooperativeKernel", 9000, "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz"},
    {"cuGraphLaunch", 10000, "cuGraphLaunch", "cuGraphLaunch_ptsz"},
    {"cuGraphInstantiate", 10000, "cuGraphInstantiate", NULL},
    {"cuGraphInstantiate", 11000, "cuGraphInstantiate_v2", NULL},
    /* the driver's internal alias, mapped by name */
    {"cuGraphInstantiate", 12000, "cuGraphInstantiateWithFlags", NULL},
    {"cuGraphInstantiateWithFlags", 11040, "cuGraphInstantiateWithFlags", NULL},
    {"cuGraphInstantiateWithParams", 12000, "cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz"},
    {"cuGraphExecUpdate", 10020, "cuGraphExecUpdate", NULL},
    {"cuGraphExecUpdate", 12000, "cuGraphExecUpdate_v2", NULL},
    {"cuGraphExecDestroy", 10000, "cuGraphExecDestroy", NULL},
    {"cuMemAlloc", 3020, "cuMemAlloc_v2", NULL},
    {"cuMemAllocPitch", 3020, "cuMemAllocPitch_v2", NULL},
    {"cuMemAllocManaged", 6000, "cuMemAllocManaged", NULL},
    {"cuMemAllocAsync", 11020, "cuMemAllocAsync", "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz"},
    {"cuMemCreate", 10020, "cuMemCreate", NULL},
    {"cuMemFree", 3020, "cuMemFree_v2", NULL},
    {"cuMemFreeAsync", 11020, "cuMemFreeAsync", "cuMemFreeAsync_ptsz"},
    {"cuMemRelease", 10020, "cuMemRelease", NULL},
    {"cuMemGetInfo", 3020, "cuMemGetInfo_v2", NULL},
    {"cuCtxSetCurrent", 4000, "cuCtxSetCurrent", NULL},
    {"cuCtxPushCurrent", 4000, "cuCtxPushCurrent_v2", NULL},
    {"cuCtxPopCurrent", 4000, "cuCtxPopCurrent_v2", NULL},
    {"cuCtxCreate", 3020, "cuCtxCreate_v2", NULL},
    {"cuCtxCreate", 11040, "cuCtxCreate_v3", NULL},
    {"cuCtxCreate", 12050, "cuCtxCreate_v4", NULL},
    {"cuCtxSynchronize", 2000, "cuCtxSynchronize", NULL},
    {"cuCtxSynchronize", 13000, "cuCtxSynchronize_v2", NULL},
    {"cuStreamSynchronize", 7000, "cuStreamSynchronize", "cuStreamSynchronize_ptsz"},
    {"cuEventSynchronize", 2000, "cuEventSynchronize", NULL},
};
#define N_GPA (sizeof gpa_cases / sizeof *gpa_cases)

/* ======================================================================= */
/* tests                                                                    */
/* ======================================================================= */

/* cudart's way in: dlopen + dlsym("cuGetProcAddress_v2") + lookups with both flags. */
static void test_gpa(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    REQUIRE(h, "dlopen libcuda.so.1: %s", dlerror());
    PFN_cuGetProcAddress_v12000 gpa = (PFN_cuGetProcAddress_v12000)dlsym(h, "cuGetProcAddress_v2");
    const char *sname = NULL;
    REQUIRE(in_shim((void *)gpa, &sname), "dlsym(libcuda, cuGetProcAddress_v2) is not the shim's");

    for (size_t i = 0; i < N_HOOKS; i++) {
        bool covered = false;
        for (size_t j = 0; j < N_GPA; j++)
            covered |= !strcmp(gpa_cases[j].legacy, hooks[i].name) ||
                       (gpa_cases[j].ptds && !strcmp(gpa_cases[j].ptds, hooks[i].name));
        CHECK(covered, "%s has no cuGetProcAddress case", hooks[i].name);
    }
    for (size_t j = 0; j < N_GPA; j++) {
        const struct gpa_case *c = &gpa_cases[j];
        for (int flags = 0; flags <= 2; flags += 2) {
            const char *want = flags && c->ptds ? c->ptds : c->legacy;
            void *p = NULL;
            CUdriverProcAddressQueryResult st = 99;
            CUresult r = gpa(c->base, &p, c->ver, (cuuint64_t)flags, &st);
            CHECK(r == CUDA_SUCCESS && st == CU_GET_PROC_ADDRESS_SUCCESS && p, "GPA(%s, %d, %d): r=%d st=%d",
                  c->base, c->ver, flags, (int)r, (int)st);
            if (!p) continue;
            CHECK(in_shim(p, &sname) && !strcmp(sname, want), "GPA(%s, %d, %d) = %s, want the shim's %s",
                  c->base, c->ver, flags, sname ? sname : "?", want);
            check_reaches(p, want, "GPA");
        }
    }

    /* NULL answers stay NULL, with the driver's status. */
    void *p = (void *)1;
    CUdriverProcAddressQueryResult st = 99;
    CHECK(gpa("cuLaunchKernelEx", &p, 11000, 0, &st) == CUDA_SUCCESS && !p &&
              st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "cuLaunchKernelEx@11000: p=%p st=%d", p, (int)st);
    p = (void *)1;
    CHECK(gpa("cuLaunchKernel", &p, 4000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS &&
              !p && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "cuLaunchKernel@4000 PTDS: p=%p st=%d", p, (int)st);
    CHECK(gpa("cuNoSuchEntryPoint", &p, 12000, 0, &st) == CUDA_ERROR_NOT_FOUND && !p &&
              st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "unknown symbol: st=%d", (int)st);
    /* Entry points the shim does not wrap come from the driver untouched. */
    CHECK(gpa("cuMemcpyHtoD", &p, 3020, 0, &st) == CUDA_SUCCESS && in_object(p, "fake/libcuda", NULL),
          "cuMemcpyHtoD should be the driver's own");

    /* The legacy 4-argument cuGetProcAddress substitutes too. */
    PFN_cuGetProcAddress_v11030 gpa1 = (PFN_cuGetProcAddress_v11030)dlsym(h, "cuGetProcAddress");
    CHECK(in_shim((void *)gpa1, NULL), "dlsym(libcuda, cuGetProcAddress) is not the shim's");
    p = NULL;
    if (gpa1) gpa1("cuLaunchKernel", &p, 4000, 0);
    CHECK(in_shim(p, &sname) && !strcmp(sname, "cuLaunchKernel"), "legacy GPA(cuLaunchKernel) = %s", sname);

    dilu_shim_info_t info;
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.gpa_unmatched == 0, "gpa_unmatched = %llu", (unsigned long long)info.gpa_unmatched);
    CHECK(info.gpa_lookups >= 2 * N_GPA, "gpa_lookups = %llu", (unsigned long long)info.gpa_lookups);
}

/* Triton's way in: dlsym on the driver handle; and RTLD_NEXT must keep working. */
static void test_dlsym(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    REQUIRE(h, "dlopen libcuda.so.1: %s", dlerror());
    const char *sname = NULL;
    for (size_t i = 0; i < N_HOOKS; i++) {
        void *p = dlsym(h, hooks[i].name);
        CHECK(in_shim(p, &sname) && !strcmp(sname, hooks[i].name), "dlsym(libcuda, %s) is not the shim's",
              hooks[i].name);
        if (p) check_reaches(p, hooks[i].name, "dlsym");
    }
    CHECK(in_object(dlsym(h, "cuMemcpyHtoD_v2"), "fake/libcuda", NULL), "unwrapped symbol was replaced");
    CHECK(dlsym(h, "fake_count") == (void *)fake_count, "non-CUDA lookups must pass through");
    CHECK(in_shim(dlsym(RTLD_DEFAULT, "cuLaunchKernelEx"), NULL), "RTLD_DEFAULT lookup");
    /* Only if the override tail-calls glibc is RTLD_NEXT relative to this program,
       which puts the preloaded shim after it. */
    CHECK(dlsym(RTLD_NEXT, "dilu_shim_query") != NULL, "RTLD_NEXT resolved relative to the wrong object");
    CHECK(dlsym(RTLD_NEXT, "malloc") != NULL, "RTLD_NEXT malloc");
}

/* -lcuda callers bind through the global scope. */
static void test_lcuda(void) {
    CHECK(in_shim((void *)&cuLaunchKernel, NULL), "&cuLaunchKernel is not the shim's");
    /* what a PLT reference to each hooked name resolves to */
    const char *sname = NULL;
    for (size_t i = 0; i < N_HOOKS; i++) {
        void *p = dlsym(RTLD_DEFAULT, hooks[i].name);
        CHECK(in_shim(p, &sname) && !strcmp(sname, hooks[i].name), "global %s is not the shim's", hooks[i].name);
        if (p) check_reaches(p, hooks[i].name, "global scope");
    }
    dilu_shim_info_t a, b;
    REQUIRE(shim_info(&a), "no shim");
    long before = fake_count("cuLaunchKernel");
    CHECK(launch(7, S0) == CUDA_SUCCESS, "launch");
    CHECK(cuGraphLaunch_ptsz(NULL, NULL) != CUDA_SUCCESS, "graph launch of NULL must fail in the driver");
    REQUIRE(shim_info(&b), "no shim");
    CHECK(b.launches == a.launches + 1 && b.blocks >= a.blocks + 7, "shim did not count: %llu -> %llu",
          (unsigned long long)a.launches, (unsigned long long)b.launches);
    CHECK(b.graph_launches == a.graph_launches + 1, "graph launch not counted");
    CHECK(fake_count("cuLaunchKernel") == before + 1, "driver not reached");
}

/* No control file: pass-through, never blocks, no cap. */
static void test_passthrough(void) {
    unsetenv("DILU_SHIM_CONTROL");
    unsetenv("DILU_SHIM_STATS");
    double t0 = now_ms();
    for (int i = 0; i < 2000; i++) launch(100000, S0);
    double dt = now_ms() - t0;
    dilu_shim_info_t info;
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.mode == DILU_SHIM_MODE_PASSTHROUGH, "mode %u", info.mode);
    CHECK(info.launches == 2000 && info.blocks == 200000000ull, "counters %llu %llu",
          (unsigned long long)info.launches, (unsigned long long)info.blocks);
    CHECK(info.waits == 0 && info.refill_running == 0, "pass-through waited or runs a thread");
    CHECK(dt < 2000, "2000 launches took %.1f ms", dt);
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 10ull << 30) == CUDA_SUCCESS, "10 GiB allocation without a cap");
    size_t fr, tot;
    CHECK(cuMemGetInfo_v2(&fr, &tot) == CUDA_SUCCESS && tot == (80ull << 30), "total %zu", tot);
    CHECK(info.mem_used_bytes == 0, "pass-through tracked memory");
}

/* A control file with a bad magic: pass-through, and the stats file says why. */
static void test_bad_control(void) {
    setup_blocks_magic(1.0, 1, 1, 0, 0x12345678u);
    for (int i = 0; i < 100; i++) launch(1000, S0);
    dilu_shim_info_t info;
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.mode == DILU_SHIM_MODE_PASSTHROUGH, "mode %u", info.mode);
    CHECK(info.waits == 0, "bad control must not throttle");
    dilu_shim_stats_t s;
    stats_read(&s);
    CHECK(s.pid == (uint32_t)getpid(), "stats pid %u", s.pid);
    CHECK((s.flags & DILU_STATS_F_PASSTHROUGH) && (s.flags & DILU_STATS_F_CONTROL_BAD), "flags %#llx",
          (unsigned long long)s.flags);
}

/* The admitted rate follows the configured rate. */
static void test_rate(void) {
    const double rate = 1000.0;
    const uint64_t burst = 1000;
    setup_blocks(rate, burst, 0, 0);
    CHECK(launch(1, S0) == CUDA_SUCCESS, "first launch");
    /* Phase 1: 10000 blocks in 100-block kernels. From a full bucket it can
       admit at most 2 * burst + rate * t + one launch of debt: the burst, what
       the first refill after t0 credits for time before t0 (capped at burst),
       and the refills during t. */
    sleep_ms(5); /* bucket full again */
    double t0 = now_ms();
    for (int i = 0; i < 100; i++) launch(100, S0);
    double dt = now_ms() - t0;
    double floor_ms = (10000.0 - 2.0 * (double)burst - 100.0) / rate;
    CHECK(dt >= floor_ms, "10000 blocks in %.2f ms, below the bucket's floor %.2f ms", dt, floor_ms);
    CHECK(dt < 20 * floor_ms, "10000 blocks took %.2f ms (expected about %.1f)", dt, floor_ms);

    /* Phase 2: sustained 10-block launches for 200 ms, default burst (5 ms of
       rate), so that a launching thread descheduled for a few ms loses nothing. */
    ctl_write(rate, 0, 0, true);
    wait_ticks(3);
    const double burst2 = rate * DILU_SHIM_DEFAULT_BURST_MS;
    dilu_shim_info_t a, b;
    REQUIRE(shim_info(&a), "no shim");
    t0 = now_ms();
    while (now_ms() - t0 < 200) launch(10, S0);
    dt = now_ms() - t0;
    REQUIRE(shim_info(&b), "no shim");
    double admitted = (double)(b.blocks - a.blocks);
    double ceiling = 2.0 * burst2 + rate * dt + 10;
    printf("rate: %.0f blocks in %.1f ms = %.1f blocks/ms (configured %.0f)\n", admitted, dt, admitted / dt, rate);
    CHECK(admitted <= ceiling, "admitted %.0f > 2*burst + rate*t = %.0f", admitted, ceiling);
    CHECK(admitted >= 0.5 * rate * dt, "admitted %.0f, far below rate*t = %.0f", admitted, rate * dt);
    CHECK(b.waits > a.waits && b.throttled_ns > a.throttled_ns, "no throttling recorded");

    /* Phase 3: a burst below one tick of refill is raised to one tick, so the
       configured rate still holds. */
    ctl_write(rate, 10, 0, true);
    double want = rate;
    dilu_shim_stats_t s;
    wait_ticks(3);
    stats_read(&s);
    CHECK(s.rate_blocks_per_ms == want && s.burst_blocks == (uint64_t)rate, "burst in force %llu, want %.0f",
          (unsigned long long)s.burst_blocks, rate);
    REQUIRE(shim_info(&a), "no shim");
    t0 = now_ms();
    while (now_ms() - t0 < 100) launch(100, S0);
    dt = now_ms() - t0;
    REQUIRE(shim_info(&b), "no shim");
    admitted = (double)(b.blocks - a.blocks);
    /* were the burst not raised, this would be ~burst per tick = 1% of the rate */
    CHECK(admitted >= 0.2 * rate * dt, "small burst: admitted %.0f in %.1f ms at %.0f/ms", admitted, dt, rate);
    CHECK(admitted <= 2.0 * rate + rate * dt + 100, "small burst: admitted %.0f too many", admitted);
}

static void *lift_limit_later(void *arg) {
    sleep_ms(50);
    *(double *)arg = now_ms();
    ctl_write(0.0, 0, 0, true);
    return NULL;
}

/* A quota change in the control file applies at the next refill tick. */
static void test_quota_change(void) {
    setup_blocks(100.0, 100, 0, 0);
    CHECK(launch(1, S0) == CUDA_SUCCESS, "first launch");
    wait_ticks(2);
    dilu_shim_stats_t s;
    stats_read(&s);
    CHECK(s.rate_blocks_per_ms == 100.0, "initial rate %f", s.rate_blocks_per_ms);
    uint64_t t_write_ns = now_ns();
    ctl_write(5000.0, 5000, 0, true);
    /* Tick M is the last published when we look, after the write. Tick M+1 may
       have read the block just before the write; tick M+2 started after M+1
       published, hence after the write: it must have applied it. (Ticks, not
       time: a loaded machine may delay every thread here.) */
    stats_read(&s);
    uint64_t target = s.ticks + 2;
    CHECK(wait_stats(pred_ticks_at_least, &target, 2000, &s), "ticks stopped");
    CHECK(s.rate_blocks_per_ms == 5000.0, "not applied by tick %llu: rate %f", (unsigned long long)s.ticks,
          s.rate_blocks_per_ms);
    CHECK(s.control_applied_ns >= t_write_ns, "applied_ns %llu before the write %llu",
          (unsigned long long)s.control_applied_ns, (unsigned long long)t_write_ns);
    printf("quota_change: applied %.3f ms after the write\n", (double)(s.control_applied_ns - t_write_ns) / 1e6);
    double want;
    CHECK(s.control_epoch == g_ctl->epoch, "epoch %llu vs %llu", (unsigned long long)s.control_epoch,
          (unsigned long long)g_ctl->epoch);

    /* A thread stuck behind a large debt is released when the limit is lifted. */
    ctl_write(50.0, 50, 0, true);
    want = 50.0;
    CHECK(wait_stats(pred_rate_is, &want, 2000, &s), "rate 50 never applied");
    launch(25000, S0); /* debt of ~25000 blocks = 500 ms at 50/ms */
    double t_write = 0;
    pthread_t writer;
    double t0 = now_ms();
    pthread_create(&writer, NULL, lift_limit_later, &t_write);
    launch(10, S0); /* waits until the limit is lifted */
    double released = now_ms();
    pthread_join(writer, NULL);
    CHECK(released - t0 < 400, "waiter released after %.1f ms; the debt alone lasts 500 ms", released - t0);
    CHECK(released >= t_write, "released before the write?");
    printf("quota_change: waiter released %.2f ms after the limit was lifted\n", released - t_write);
}

/* Memory cap: refused with OUT_OF_MEMORY exactly at the boundary. */
struct memthr {
    int granted;
};
static void *mem_worker(void *a) {
    struct memthr *m = a;
    CUdeviceptr p;
    while (cuMemAlloc_v2(&p, 4096) == CUDA_SUCCESS) m->granted++;
    return NULL;
}
static void test_memcap(void) {
    const uint64_t cap = 1ull << 20;
    setup_blocks(0.0, 0, cap, 0);
    CUdeviceptr a, b, c;
    CHECK(cuMemAlloc_v2(&a, cap - 1) == CUDA_SUCCESS, "cap-1 bytes");
    CHECK(cuMemAlloc_v2(&b, 1) == CUDA_SUCCESS, "the last byte");
    CHECK(cuMemAlloc_v2(&c, 1) == CUDA_ERROR_OUT_OF_MEMORY, "one byte over the cap must be refused");
    CHECK(cuMemAllocManaged(&c, 1, 1) == CUDA_ERROR_OUT_OF_MEMORY, "managed over the cap");
    CHECK(cuMemAllocAsync(&c, 1, S0) == CUDA_ERROR_OUT_OF_MEMORY, "async over the cap");
    CUmemGenericAllocationHandle hnd;
    CHECK(cuMemCreate(&hnd, 1, NULL, 0) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate over the cap");
    /* Captured allocations belong to the graph and are not charged. */
    CHECK(cuMemAllocAsync(&c, 4096, FAKE_CAPTURE_STREAM) == CUDA_SUCCESS, "captured async alloc");
    CHECK(cuMemFreeAsync(c, FAKE_CAPTURE_STREAM) == CUDA_SUCCESS, "captured async free");
    CHECK(cuMemFree_v2(b) == CUDA_SUCCESS, "free");
    CHECK(cuMemFree_v2(b) != CUDA_SUCCESS, "double free must reach the driver and fail");
    CHECK(cuMemAlloc_v2(&b, 1) == CUDA_SUCCESS, "byte available again after free (double free not counted twice)");
    CHECK(cuMemAlloc_v2(&c, 1) == CUDA_ERROR_OUT_OF_MEMORY, "still exact after the double free");
    CHECK(cuMemFree_v2(a) == CUDA_SUCCESS && cuMemFree_v2(b) == CUDA_SUCCESS, "free all");

    /* Every family member charges and refunds. */
    size_t pitch = 0;
    CHECK(cuMemAllocPitch_v2(&a, &pitch, 1000, 10, 4) == CUDA_SUCCESS && pitch == 1024, "pitch %zu", pitch);
    dilu_shim_info_t info;
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.mem_used_bytes == 10240, "pitch allocation charged %llu, want pitch*height",
          (unsigned long long)info.mem_used_bytes);
    CHECK(cuMemFree_v2(a) == CUDA_SUCCESS, "free pitch");
    CHECK(cuMemAllocManaged(&a, 100, 1) == CUDA_SUCCESS && cuMemAllocAsync_ptsz(&b, 200, NULL) == CUDA_SUCCESS &&
              cuMemAllocFromPoolAsync(&c, 300, NULL, S0) == CUDA_SUCCESS && cuMemCreate(&hnd, 400, NULL, 0) == CUDA_SUCCESS,
          "family allocations");
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.mem_used_bytes == 1000, "family charged %llu, want 1000", (unsigned long long)info.mem_used_bytes);
    CHECK(cuMemFree_v2(a) == CUDA_SUCCESS && cuMemFreeAsync(b, S0) == CUDA_SUCCESS &&
              cuMemFreeAsync(c, S0) == CUDA_SUCCESS && cuMemRelease(hnd) == CUDA_SUCCESS, "family frees");
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.mem_used_bytes == 0, "after frees %llu", (unsigned long long)info.mem_used_bytes);

    /* Racing threads never overshoot: exactly cap / 4096 grants. */
    pthread_t t[8];
    struct memthr m[8];
    memset(m, 0, sizeof m);
    for (int i = 0; i < 8; i++) pthread_create(&t[i], NULL, mem_worker, &m[i]);
    int granted = 0;
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL), granted += m[i].granted;
    CHECK(granted == (int)(cap / 4096), "granted %d chunks of 4096 under a %llu cap", granted,
          (unsigned long long)cap);

    /* Lowering the cap below the current use refuses new allocations. */
    ctl_write(0.0, 0, 4096, true);
    wait_ticks(3);
    CHECK(cuMemAlloc_v2(&a, 1) == CUDA_ERROR_OUT_OF_MEMORY, "cap below use");
    dilu_shim_stats_t s;
    wait_ticks(2);
    stats_read(&s);
    CHECK(s.mem_used_bytes == cap && s.mem_peak_bytes == cap && s.mem_cap_bytes == 4096, "stats used %llu peak %llu cap %llu",
          (unsigned long long)s.mem_used_bytes, (unsigned long long)s.mem_peak_bytes, (unsigned long long)s.mem_cap_bytes);
    CHECK(s.mem_refused >= 8 + 6, "refusals %llu", (unsigned long long)s.mem_refused);
    CHECK(s.mem_allocs == cap / 4096, "live allocations %llu", (unsigned long long)s.mem_allocs);
}

/* cuMemGetInfo shows the cap as total memory and cap - used as free. */
static void test_meminfo(void) {
    const uint64_t cap = 1ull << 30;
    setup_blocks(0.0, 0, cap, 0);
    CUdeviceptr p;
    REQUIRE(cuMemAlloc_v2(&p, 256ull << 20) == CUDA_SUCCESS, "alloc");
    size_t fr = 0, tot = 0;
    CHECK(cuMemGetInfo_v2(&fr, &tot) == CUDA_SUCCESS, "GetInfo");
    CHECK(tot == cap, "total %zu, want the cap %llu", tot, (unsigned long long)cap);
    CHECK(fr == cap - (256ull << 20), "free %zu, want %llu", fr, (unsigned long long)(cap - (256ull << 20)));
    /* Without a cap the driver's numbers come through. */
    ctl_write(0.0, 0, 0, true);
    wait_ticks(3);
    CHECK(cuMemGetInfo_v2(&fr, &tot) == CUDA_SUCCESS && tot == (80ull << 30) && fr == tot - fake_mem_used(),
          "uncapped: free %zu total %zu", fr, tot);
}

/* Counters, windows and kernel-launch cycles in the stats block. */
static void test_stats(void) {
    setup_blocks(500.0, 500, 0, 0);
    CHECK(launch(1, S0) == CUDA_SUCCESS, "first launch");
    dilu_shim_info_t a;
    REQUIRE(shim_info(&a), "no shim");
    const int bursts = 3;
    uint64_t blocks = 1;
    for (int k = 0; k < bursts; k++) {
        double t0 = now_ms();
        while (now_ms() - t0 < 20) {
            launch(10, S0);
            blocks += 10;
            sleep_ms(0.5);
        }
        sleep_ms(60); /* idle: ends the cycle */
    }
    CUgraph g = fake_graph_create();
    fake_graph_add_kernel(g, 5, 1, 1);
    CUgraphExec e;
    REQUIRE(cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS, "instantiate");
    CHECK(cuGraphLaunch(e, S0) == CUDA_SUCCESS, "graph launch");
    blocks += 5;
    /* Throttled: 2000 blocks at 500/ms must wait. */
    for (int i = 0; i < 20; i++) launch(100, S0);
    blocks += 2000;
    dilu_shim_stats_t s;
    CHECK(wait_stats(pred_blocks_at_least, &blocks, 2000, &s), "blocks never published");
    dilu_shim_info_t b;
    REQUIRE(shim_info(&b), "no shim");
    CHECK(s.magic == DILU_SHIM_STATS_MAGIC && s.version == DILU_SHIM_ABI_VERSION && s.size == sizeof s, "header");
    CHECK(s.pid == (uint32_t)getpid(), "pid %u", s.pid);
    CHECK(s.blocks == blocks && s.launches == b.launches && s.graph_launches == 1, "blocks %llu (want %llu) launches %llu graphs %llu",
          (unsigned long long)s.blocks, (unsigned long long)blocks, (unsigned long long)s.launches,
          (unsigned long long)s.graph_launches);
    CHECK(s.waits > 0 && s.throttled_ns > 0, "waits %llu throttled %llu", (unsigned long long)s.waits,
          (unsigned long long)s.throttled_ns);
    CHECK(s.rate_blocks_per_ms == 500.0 && s.burst_blocks == 500 && (s.flags & DILU_STATS_F_LIMITED), "quota in force");
    CHECK(s.control_epoch == g_ctl->epoch, "epoch");
    CHECK(s.window_ns == DILU_SHIM_TICK_NS * DILU_SHIM_WINDOW_TICKS && s.windows > 0, "windows");
    CHECK(s.cycles >= 2, "cycles %llu after %d bursts", (unsigned long long)s.cycles, bursts);
    CHECK(s.cycle_min_windows >= 1 && s.cycle_ring[0] >= s.cycle_min_windows, "cycle min %llu ring0 %llu",
          (unsigned long long)s.cycle_min_windows, (unsigned long long)s.cycle_ring[0]);
    for (uint64_t n = 0; n < s.cycles && n < DILU_SHIM_CYCLE_RING; n++)
        CHECK(s.cycle_ring[n] >= s.cycle_min_windows, "ring[%llu] = %llu below the minimum",
              (unsigned long long)n, (unsigned long long)s.cycle_ring[n]);
    uint64_t hb = s.heartbeat_ns;
    wait_ticks(3);
    stats_read(&s);
    CHECK(s.heartbeat_ns > hb, "heartbeat does not advance");
    CHECK(s.window_blocks_ema >= 0.0, "ema");
}

/* A stale manager heartbeat: keep the last quota, say so, resume on a fresh one. */
static void test_stale(void) {
    const uint64_t stale_after = 30 * 1000000ull;
    setup_blocks(1000.0, 1000, 0, stale_after);
    CHECK(launch(1, S0) == CUDA_SUCCESS, "first launch");
    dilu_shim_stats_t s;
    double want = 1000.0;
    CHECK(wait_stats(pred_rate_is, &want, 2000, &s), "initial rate");
    uint64_t stale = DILU_STATS_F_STALE;
    CHECK(wait_stats(pred_flag_set, &stale, 2000, &s), "stale flag never set");
    /* Writes without a heartbeat are ignored while stale. */
    ctl_write(50.0, 50, 0, false);
    wait_ticks(20);
    stats_read(&s);
    CHECK(s.rate_blocks_per_ms == 1000.0 && (s.flags & DILU_STATS_F_STALE), "fail-static broken: rate %f flags %#llx",
          s.rate_blocks_per_ms, (unsigned long long)s.flags);
    CHECK(s.flags & DILU_STATS_F_LIMITED, "still limited");
    /* Launches keep working under the kept quota. */
    for (int i = 0; i < 10; i++) CHECK(launch(10, S0) == CUDA_SUCCESS, "launch while stale");
    ctl_heartbeat();
    want = 50.0;
    CHECK(wait_stats(pred_rate_is, &want, 2000, &s), "fresh heartbeat did not resume");
    CHECK(wait_stats(pred_flag_clear, &stale, 2000, &s), "stale flag not cleared");
}

/* 64 threads launching concurrently through a limited bucket: no deadlock, exact counts. */
#define NTHREADS 64
#define PER_THREAD 100
static void *launcher(void *arg) {
    intptr_t id = (intptr_t)arg;
    CUstream s = (CUstream)(0x1000 + id);
    for (int i = 0; i < PER_THREAD; i++) {
        if (id % 3 == 0) {
            launch(10, s);
        } else if (id % 3 == 1) {
            CUlaunchConfig c;
            memset(&c, 0, sizeof c);
            c.gridDimX = 10, c.gridDimY = c.gridDimZ = 1, c.hStream = s;
            cuLaunchKernelEx_ptsz(&c, NULL, NULL, NULL);
        } else {
            cuLaunchKernel_ptsz(NULL, 5, 2, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        }
    }
    return NULL;
}
static void test_threads64(void) {
    /* 64000 blocks at 500/ms: at least ~125 ms, so threads must wait even on a
       loaded machine */
    setup_blocks(500.0, 100, 0, 0);
    alarm(60); /* a deadlock ends the test with SIGALRM */
    dilu_shim_info_t a, b;
    REQUIRE(shim_info(&a), "no shim");
    long fake_before = fake_count("cuLaunchKernel") + fake_count("cuLaunchKernelEx_ptsz") + fake_count("cuLaunchKernel_ptsz");
    pthread_t t[NTHREADS];
    double t0 = now_ms();
    for (intptr_t i = 0; i < NTHREADS; i++) pthread_create(&t[i], NULL, launcher, (void *)i);
    for (int i = 0; i < NTHREADS; i++) pthread_join(t[i], NULL);
    double dt = now_ms() - t0;
    REQUIRE(shim_info(&b), "no shim");
    long fake_after = fake_count("cuLaunchKernel") + fake_count("cuLaunchKernelEx_ptsz") + fake_count("cuLaunchKernel_ptsz");
    uint64_t want = (uint64_t)NTHREADS * PER_THREAD * 10;
    CHECK(b.launches - a.launches == NTHREADS * PER_THREAD, "launches %llu", (unsigned long long)(b.launches - a.launches));
    CHECK(b.blocks - a.blocks == want, "blocks %llu want %llu", (unsigned long long)(b.blocks - a.blocks),
          (unsigned long long)want);
    CHECK(fake_after - fake_before == NTHREADS * PER_THREAD, "driver saw %ld", fake_after - fake_before);
    /* burst 100 is below one tick (500 blocks), so the bucket holds 500; each
       thread may overdraw once */
    double floor_ms = ((double)want - 2 * 500.0 - NTHREADS * 10.0) / 500.0;
    CHECK(dt >= floor_ms, "64 threads admitted %llu blocks in %.1f ms, faster than the bucket allows (%.1f)",
          (unsigned long long)want, dt, floor_ms);
    CHECK(b.waits > a.waits, "nobody waited");
    alarm(0);
}

/* After fork the child's launches still go through a refilled bucket. */
static void test_fork(void) {
    setup_blocks(1000.0, 100, 0, 0);
    alarm(60);
    for (int i = 0; i < 10; i++) launch(100, S0);
    dilu_shim_info_t info;
    REQUIRE(shim_info(&info), "no shim");
    CHECK(info.stats_owner == 1 && info.refill_running == 1, "parent owner %u refill %u", info.stats_owner,
          info.refill_running);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        double t0 = now_ms();
        for (int i = 0; i < 100; i++) launch(100, S0); /* 10000 blocks at 1000/ms */
        double dt = now_ms() - t0;
        dilu_shim_info_t ci;
        int bad = 0;
        if (!shim_info(&ci)) bad |= 1;
        if (ci.refill_running != 1) bad |= 2;
        if (ci.stats_owner != 0) bad |= 4;
        /* the child is throttled too: at most 2 x burst (1000, one tick) + rate x t + one launch */
        if (dt < (10000.0 - 2 * 1000 - 100) / 1000.0) bad |= 8;
        if (bad) fprintf(stderr, "FAIL fork child: bad=%d dt=%.2f refill=%u owner=%u\n", bad, dt,
                         ci.refill_running, ci.stats_owner);
        _exit(bad ? 1 : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %#x", status);
    for (int i = 0; i < 10; i++) CHECK(launch(100, S0) == CUDA_SUCCESS, "parent after fork");
    dilu_shim_stats_t s;
    wait_ticks(2);
    stats_read(&s);
    CHECK(s.pid == (uint32_t)getpid(), "stats owner changed to %u", s.pid);
    alarm(0);
}

/* Capture is never throttled; graphs cost their kernel nodes. */
static void test_capture(void) {
    setup_blocks(0.001, 1, 0, 0); /* one token per second */
    CHECK(launch(1, S0) == CUDA_SUCCESS, "first launch"); /* takes the only token */
    double t0 = now_ms();
    for (int i = 0; i < 1000; i++) launch(1000, FAKE_CAPTURE_STREAM);
    fake_set_per_thread_capturing(1);
    for (int i = 0; i < 100; i++) cuLaunchKernel_ptsz(NULL, 1000, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    fake_set_per_thread_capturing(0);
    double dt = now_ms() - t0;
    CHECK(dt < 500, "captured launches were throttled (%.1f ms)", dt);
    dilu_shim_info_t a, b;
    REQUIRE(shim_info(&a), "no shim");
    CHECK(a.flags & DILU_STATS_F_CAPTURE_SEEN, "capture flag");

    /* 100 + 200 + child(50) + an empty node = 350 blocks per launch. */
    ctl_write(0.0, 0, 0, true);
    wait_ticks(3);
    CUgraph child = fake_graph_create(), g = fake_graph_create();
    fake_graph_add_kernel(child, 5, 10, 1);
    fake_graph_add_kernel(g, 100, 1, 1);
    fake_graph_add_kernel(g, 10, 10, 2);
    fake_graph_add_child(g, child);
    fake_graph_add_empty(g);
    CUgraphExec e1, e2, e3, e4;
    REQUIRE(cuGraphInstantiateWithFlags(&e1, g, 0) == CUDA_SUCCESS, "WithFlags");
    CUDA_GRAPH_INSTANTIATE_PARAMS ip;
    memset(&ip, 0, sizeof ip);
    REQUIRE(cuGraphInstantiateWithParams(&e2, g, &ip) == CUDA_SUCCESS, "WithParams");
    REQUIRE(cuGraphInstantiate_v2(&e3, g, NULL, NULL, 0) == CUDA_SUCCESS, "legacy v2");
    /* through the driver's alias, as cudart 12+ resolves cudaGraphInstantiate */
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    PFN_cuGetProcAddress_v12000 gpa = (PFN_cuGetProcAddress_v12000)dlsym(h, "cuGetProcAddress_v2");
    PFN_cuGraphInstantiateWithFlags_v11040 alias = NULL;
    CUdriverProcAddressQueryResult st;
    REQUIRE(gpa && gpa("cuGraphInstantiate", (void **)&alias, 12000, 0, &st) == CUDA_SUCCESS && alias, "alias");
    REQUIRE(alias(&e4, g, 0) == CUDA_SUCCESS, "alias instantiate");
    CUgraphExec execs[] = {e1, e2, e3, e4};
    for (int i = 0; i < 4; i++) {
        REQUIRE(shim_info(&a), "no shim");
        CHECK(cuGraphLaunch(execs[i], S0) == CUDA_SUCCESS, "launch");
        REQUIRE(shim_info(&b), "no shim");
        CHECK(b.blocks - a.blocks == 350 && b.graph_launches == a.graph_launches + 1, "exec %d cost %llu, want 350", i,
              (unsigned long long)(b.blocks - a.blocks));
    }
    /* An update re-costs the exec. */
    CUgraph g2 = fake_graph_create();
    fake_graph_add_kernel(g2, 7, 1, 1);
    CUgraphExecUpdateResultInfo ri;
    REQUIRE(cuGraphExecUpdate_v2(e1, g2, &ri) == CUDA_SUCCESS, "update");
    REQUIRE(shim_info(&a), "no shim");
    cuGraphLaunch_ptsz(e1, NULL);
    REQUIRE(shim_info(&b), "no shim");
    CHECK(b.blocks - a.blocks == 7, "after update cost %llu, want 7", (unsigned long long)(b.blocks - a.blocks));
    CHECK(fake_total_blocks() >= 4 * 350 + 7, "driver ran the graphs");
    for (int i = 0; i < 4; i++) CHECK(cuGraphExecDestroy(execs[i]) == CUDA_SUCCESS, "destroy");
}

/* Bounded in-flight work: the queue on a slow (simulated) GPU stays short. */
static void test_inflight(void) {
    setenv("FAKE_CUDA_BLOCK_NS", "1000", 1); /* fake GPU: 1000 blocks per ms */
    /* Admission (4000 blocks/ms) outruns the GPU, as under contention. */
    setup_blocks(4000.0, 4000, 0, 0);
    CUstream s = (CUstream)0x4242;
    CHECK(launch(1, s) == CUDA_SUCCESS, "first launch");
    uint64_t max_pending = 0;
    for (int i = 0; i < 1000; i++) { /* 100 ms of GPU work */
        launch(100, s);
        uint64_t p = fake_pending_ns();
        if (p > max_pending) max_pending = p;
    }
    /* Checkpoints every ~4000 blocks (1 ms of quota), at most 3 outstanding:
       about 4 chunks = 16 ms of this GPU's time. Unbounded it would reach ~75 ms. */
    printf("inflight: max queued GPU time %.1f ms\n", (double)max_pending / 1e6);
    CHECK(max_pending <= 25 * 1000000ull, "queued %.1f ms of GPU work", (double)max_pending / 1e6);
    dilu_shim_stats_t st;
    wait_ticks(2);
    stats_read(&st);
    CHECK(st.inflight_waits > 0 && st.inflight_wait_ns > 0, "in-flight waits %llu", (unsigned long long)st.inflight_waits);
    /* Those waits were the shim's own cuEventSynchronize calls: they close no request span. */
    CHECK(st.spans == 0 && st.span_open_ns != 0, "in-flight waits touched the span: spans %llu open %llu",
          (unsigned long long)st.spans, (unsigned long long)st.span_open_ns);
    CHECK(fake_count("cuEventRecord") > 0, "no events recorded");
}

/* One bucket per device: draining device 0 does not stall device 1. */
static void test_devices(void) {
    setenv("FAKE_CUDA_DEVICES", "2", 1);
    setup_blocks(0.01, 1000, 0, 0); /* 1 token per 100 ms after the burst */
    REQUIRE(cuCtxSetCurrent(FAKE_CONTEXT(0)) == CUDA_SUCCESS, "ctx 0");
    CHECK(launch(1000, S0) == CUDA_SUCCESS, "drain device 0");
    REQUIRE(cuCtxSetCurrent(FAKE_CONTEXT(1)) == CUDA_SUCCESS, "ctx 1");
    double t0 = now_ms();
    CHECK(launch(1000, S0) == CUDA_SUCCESS, "device 1");
    double dev1 = now_ms() - t0;
    REQUIRE(cuCtxSetCurrent(FAKE_CONTEXT(0)) == CUDA_SUCCESS, "ctx 0 again");
    t0 = now_ms();
    CHECK(launch(1, S0) == CUDA_SUCCESS, "device 0 again");
    double dev0 = now_ms() - t0;
    CHECK(dev1 < 50, "device 1 launch waited %.1f ms on device 0's bucket", dev1);
    CHECK(dev0 >= 50, "device 0 launch did not wait (%.1f ms) although its bucket is empty", dev0);
    /* push/pop switch too */
    REQUIRE(cuCtxPushCurrent_v2(FAKE_CONTEXT(1)) == CUDA_SUCCESS, "push");
    t0 = now_ms();
    launch(1, S0);
    CHECK(now_ms() - t0 < 50, "pushed device 1 context not used");
    CUcontext c;
    REQUIRE(cuCtxPopCurrent_v2(&c) == CUDA_SUCCESS, "pop");
}

/* Request spans: opened by a launch, closed by an application sync that saw no launch during it. */
static bool pred_spans_at_least(const dilu_shim_stats_t *s, const void *a) { return s->spans >= *(const uint64_t *)a; }
static bool spans_published(uint64_t n, dilu_shim_stats_t *s) { return wait_stats(pred_spans_at_least, &n, 2000, s); }
static void settled(dilu_shim_stats_t *s) {
    wait_ticks(2);
    stats_read(s);
}
static void *launch_one(void *arg) {
    (void)arg;
    launch(1, S0);
    return NULL;
}
static void *sync_ctx(void *arg) {
    (void)arg;
    cuCtxSynchronize();
    return NULL;
}
/* fake_set_sync hooks: run inside a sync, on another thread, before the sync returns. */
static void launch_on_other_thread(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, launch_one, NULL) == 0) pthread_join(t, NULL);
}
static void sync_on_other_thread(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, sync_ctx, NULL) == 0) pthread_join(t, NULL);
}

static void test_spans(void) {
    setenv("FAKE_CUDA_BLOCK_NS", "10000", 1); /* fake GPU: 100 blocks per ms */
    setup_blocks(0.0, 0, 0, 0);               /* unlimited: nothing waits for tokens */
    g_st->version = DILU_SHIM_ABI_MAJOR << 16; /* created by a minor-0 manager */
    dilu_shim_stats_t s;
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS, "idle sync");
    settled(&s);
    CHECK(s.version == DILU_SHIM_ABI_VERSION, "the shim did not stamp its version: %#x", s.version);
    CHECK(s.spans == 0 && s.span_open_ns == 0, "a sync with nothing launched: spans %llu open %llu",
          (unsigned long long)s.spans, (unsigned long long)s.span_open_ns);

    /* 10 ms of fake GPU work, then a sync: one span at least that long, at most the time we measured. */
    uint64_t t0 = now_ns();
    for (int i = 0; i < 10; i++) launch(100, S0);
    uint64_t t_launched = now_ns();
    settled(&s);
    CHECK(s.span_open_ns >= t0 && s.span_open_ns <= t_launched && s.spans == 0, "open span: %llu not in [%llu, %llu]",
          (unsigned long long)s.span_open_ns, (unsigned long long)t0, (unsigned long long)t_launched);
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS, "sync");
    uint64_t t1 = now_ns();
    REQUIRE(spans_published(1, &s), "no span after launches and a sync");
    CHECK(s.spans == 1 && s.span_open_ns == 0, "spans %llu open %llu", (unsigned long long)s.spans,
          (unsigned long long)s.span_open_ns);
    CHECK(s.span_ring_us[0] >= 10000 && s.span_ring_us[0] <= (t1 - t0) / 1000, "span %u us, measured %llu us",
          s.span_ring_us[0], (unsigned long long)((t1 - t0) / 1000));

    /* Failed syncs close nothing, and their errors come back unchanged. */
    launch(100, S0);
    CHECK(cuStreamSynchronize(FAKE_CAPTURE_STREAM) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "capture sync");
    CHECK(cuCtxSynchronize_v2(FAKE_CONTEXT(7)) == CUDA_ERROR_INVALID_CONTEXT, "bad context");
    fake_set_sync(CUDA_ERROR_LAUNCH_FAILED, NULL);
    CHECK(cuCtxSynchronize() == CUDA_ERROR_LAUNCH_FAILED, "the driver's error must come back");
    fake_set_sync(CUDA_SUCCESS, NULL);
    settled(&s);
    CHECK(s.spans == 1 && s.span_open_ns != 0, "a failed sync closed the span: spans %llu open %llu",
          (unsigned long long)s.spans, (unsigned long long)s.span_open_ns);

    /* A launch from another thread during the sync keeps the span open, until a quiet sync. */
    fake_set_sync(CUDA_SUCCESS, launch_on_other_thread);
    long launched = fake_count("cuLaunchKernel");
    CHECK(cuStreamSynchronize_ptsz(NULL) == CUDA_SUCCESS, "sync with a launch inside");
    CHECK(fake_count("cuLaunchKernel") == launched + 1, "the hook did not launch");
    settled(&s);
    CHECK(s.spans == 1 && s.span_open_ns != 0, "closed despite a launch during the sync: spans %llu",
          (unsigned long long)s.spans);
    CHECK(cuStreamSynchronize(S0) == CUDA_SUCCESS, "quiet sync");
    REQUIRE(spans_published(2, &s), "quiet sync did not close the span");
    CHECK(s.span_ring_us[1] >= 1000 + 10, "the second span covers 101 blocks (1.01 ms): %u us", s.span_ring_us[1]);

    /* A span opened during a sync that started with none open stays open; an event sync closes it. */
    fake_set_sync(CUDA_SUCCESS, launch_on_other_thread);
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS, "sync");
    settled(&s);
    CHECK(s.spans == 2 && s.span_open_ns != 0, "span opened during a sync: spans %llu open %llu",
          (unsigned long long)s.spans, (unsigned long long)s.span_open_ns);
    CUevent ev = NULL;
    REQUIRE(cuEventCreate(&ev, 0) == CUDA_SUCCESS && cuEventRecord(ev, S0) == CUDA_SUCCESS, "event");
    CHECK(cuEventSynchronize(ev) == CUDA_SUCCESS, "event sync");
    REQUIRE(spans_published(3, &s), "event sync did not close the span");

    /* Two syncs ending after the same span: one records it. */
    launch(1, S0);
    fake_set_sync(CUDA_SUCCESS, sync_on_other_thread);
    CHECK(cuCtxSynchronize_v2(FAKE_CONTEXT(0)) == CUDA_SUCCESS, "outer sync");
    settled(&s);
    CHECK(s.spans == 4 && s.span_open_ns == 0, "two closing syncs: spans %llu (want 4) open %llu",
          (unsigned long long)s.spans, (unsigned long long)s.span_open_ns);

    /* A graph launch opens a span too. */
    CUgraph g = fake_graph_create();
    fake_graph_add_kernel(g, 5, 1, 1);
    CUgraphExec e;
    REQUIRE(cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS, "instantiate");
    CHECK(cuGraphLaunch(e, S0) == CUDA_SUCCESS, "graph launch");
    settled(&s);
    CHECK(s.span_open_ns != 0, "graph launch opened no span");
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS, "sync");
    REQUIRE(spans_published(5, &s), "graph span not closed");

    /* 30 more: the ring keeps the last 24, span n at n % 24. */
    uint64_t took_us[35];
    for (int n = 5; n < 35; n++) {
        uint64_t a = now_ns();
        launch(1, S0);
        cuStreamSynchronize(S0);
        took_us[n] = (now_ns() - a) / 1000;
    }
    REQUIRE(spans_published(35, &s), "ring spans");
    CHECK(s.spans == 35, "spans %llu", (unsigned long long)s.spans);
    for (int n = 11; n < 35; n++)
        CHECK(s.span_ring_us[n % DILU_SHIM_SPAN_RING] >= 10 && s.span_ring_us[n % DILU_SHIM_SPAN_RING] <= took_us[n],
              "span %d at %d: %u us, measured %llu", n, n % DILU_SHIM_SPAN_RING,
              s.span_ring_us[n % DILU_SHIM_SPAN_RING], (unsigned long long)took_us[n]);
}

/* ======================================================================= */
struct test {
    const char *name;
    void (*fn)(void);
};
static const struct test tests[] = {
    {"gpa", test_gpa},
    {"dlsym", test_dlsym},
    {"lcuda", test_lcuda},
    {"passthrough", test_passthrough},
    {"bad_control", test_bad_control},
    {"rate", test_rate},
    {"quota_change", test_quota_change},
    {"memcap", test_memcap},
    {"meminfo", test_meminfo},
    {"stats", test_stats},
    {"stale", test_stale},
    {"threads64", test_threads64},
    {"fork", test_fork},
    {"capture", test_capture},
    {"inflight", test_inflight},
    {"devices", test_devices},
    {"spans", test_spans},
};

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <test> | --list | --list-hooks\n", argv[0]);
        return 2;
    }
    if (!strcmp(argv[1], "--list")) {
        for (size_t i = 0; i < sizeof tests / sizeof *tests; i++) printf("%s\n", tests[i].name);
        return 0;
    }
    if (!strcmp(argv[1], "--list-hooks")) {
        for (size_t i = 0; i < N_HOOKS; i++) printf("%s\n", hooks[i].name);
        return 0;
    }
    for (size_t i = 0; i < sizeof tests / sizeof *tests; i++) {
        if (strcmp(argv[1], tests[i].name)) continue;
        tests[i].fn();
        if (g_failures) {
            fprintf(stderr, "%s: %d check(s) failed\n", tests[i].name, g_failures);
            return 1;
        }
        printf("%s: ok\n", tests[i].name);
        return 0;
    }
    fprintf(stderr, "unknown test %s\n", argv[1]);
    return 2;
}
