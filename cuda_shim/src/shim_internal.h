/* Internal declarations shared by the shim's translation units. */
#ifndef DILU_SHIM_INTERNAL_H
#define DILU_SHIM_INTERNAL_H

#include "glibc_compat.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "dilu_shim_abi.h"
#include "hooks.h"

/* cuda.h maps some names to newer ABI versions; the shim needs the exact names. */
#undef cuGetProcAddress
#undef cuGraphInstantiate
#undef cuGraphExecUpdate
#undef cuGraphKernelNodeGetParams

#define DILU_EXPORT __attribute__((visibility("default")))
#define DILU_HIDDEN __attribute__((visibility("hidden")))
#define DILU_LIKELY(x) __builtin_expect(!!(x), 1)
#define DILU_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define DILU_TLS __thread __attribute__((tls_model("initial-exec")))
#define DILU_CACHELINE 64

/* ---- generated from the lists ---------------------------------------- */
enum dilu_hook {
#define X(name, pfn, base) HOOK_##name,
    DILU_HOOKS(X)
#undef X
    HOOK_COUNT
};

enum dilu_use {
#define X(name, pfn) USE_##name,
    DILU_USES(X)
#undef X
    USE_COUNT
};

/* The shim's exported wrappers, with exactly the driver's prototypes. */
#define X(name, pfn, base) extern DILU_EXPORT __typeof__(*(pfn)0) name;
DILU_HOOKS(X)
#undef X

extern void *g_real[HOOK_COUNT];
extern void *g_use[USE_COUNT];
extern void *const g_wrap[HOOK_COUNT];
extern const char *const g_hook_name[HOOK_COUNT];
extern const char *const g_hook_base[HOOK_COUNT];

/* Typed access to the real driver entry points. */
#define REAL(name) ((__typeof__(&name))g_real[HOOK_##name])
#define USE(name, pfn) ((pfn)g_use[USE_##name])

/* ---- global state ------------------------------------------------------ */
/* g_fast is the only word the launch fast path reads: 0 = count and go. */
#define FAST_LIMITED 1u   /* a finite rate is in force: take a token */
#define FAST_REARM 2u     /* after fork: restart the refill thread first */
#define FAST_NEED_INIT 4u /* lazy init has not run yet */
extern _Atomic uint32_t g_fast;

extern int g_log_level; /* DILU_SHIM_LOG_LEVEL, read once at init */
extern bool g_controlled;
extern bool g_track_memory;
extern _Atomic uint64_t g_sticky_flags; /* flags raised outside the refill thread */
extern _Atomic uint64_t g_gpa_lookups;
extern _Atomic uint64_t g_gpa_unmatched;

#define DILU_MAX_DEVICES 16
struct dilu_bucket {
    _Atomic int64_t tokens;
    char pad[DILU_CACHELINE - sizeof(int64_t)];
} __attribute__((aligned(DILU_CACHELINE)));
extern struct dilu_bucket g_bucket[DILU_MAX_DEVICES];

/* Blocks per in-flight chunk (rate x 1 ms); meaningful only while limited. */
extern _Atomic int64_t g_chunk_blocks;

/* Per-thread counters: written only by their thread, summed by the refill thread. */
struct dilu_tstat {
    _Atomic uint64_t launches;
    _Atomic uint64_t graph_launches;
    _Atomic uint64_t blocks;
    _Atomic uint64_t waits;
    _Atomic uint64_t throttled_ns;
    _Atomic uint64_t inflight_waits;
    _Atomic uint64_t inflight_wait_ns;
    uint32_t since_launches; /* in-flight checkpoint counters */
    int64_t since_blocks;
    struct dilu_tstat *next;
    struct dilu_tstat **pprev;
};
extern DILU_TLS struct dilu_tstat *t_stats;
extern DILU_TLS int t_dev;

/* Request spans: CLOCK_MONOTONIC ns when the open span opened; 0 = none open.
   Launches only read it (and CAS it from 0); closing syncs CAS it back to 0. */
extern _Atomic uint64_t g_span_open;

/* ---- functions --------------------------------------------------------- */
void dilu_ensure_init(void);
void dilu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define DLOG(level, ...)                                          \
    do {                                                          \
        if (DILU_UNLIKELY(g_log_level >= (level))) dilu_log((level), __VA_ARGS__); \
    } while (0)
#define LOG_ERROR 1
#define LOG_WARN 2
#define LOG_INFO 3
#define LOG_DEBUG 4

uint64_t dilu_now_ns(void);

/* admission (admit.c) */
struct dilu_tstat *dilu_tstat_register(void);
void dilu_admit_slow(uint64_t cost, CUstream stream, bool ptsz, bool graph, bool counted);
void dilu_inflight_checkpoint(CUstream stream, bool ptsz, struct dilu_tstat *ts);
bool dilu_stream_capturing(CUstream stream, bool ptsz);
void dilu_admission_start(void); /* called by init when a control block is valid */
void dilu_admission_fork_prepare(void);
void dilu_admission_fork_parent(void);
void dilu_admission_fork_child(void);
void dilu_rearm(void);
void dilu_fill_info(dilu_shim_info_t *info);
void dilu_publish_passthrough(void);
void dilu_set_device_from_current(void);
int dilu_open_blocks(void); /* 0 = controlled; -1 = pass-through */

/* request spans (admit.c) */
struct dilu_span_mark {
    uint64_t open_ns;  /* the span open at the sync's entry; 0 = none */
    uint64_t launches; /* the process's launches at the sync's entry */
};
void dilu_span_open(void);
void dilu_span_sync_enter(struct dilu_span_mark *m);
void dilu_span_sync_exit(const struct dilu_span_mark *m, uint64_t returned_ns);

/* Entry of every non-launch wrapper: lazy init, and the refill thread after fork. */
static inline void dilu_enter(void) {
    uint32_t fast = atomic_load_explicit(&g_fast, memory_order_acquire);
    if (DILU_UNLIKELY(fast & FAST_NEED_INIT)) dilu_ensure_init();
    if (DILU_UNLIKELY(fast & FAST_REARM)) dilu_rearm();
}

/*
 * The launch fast path, inlined into every launch wrapper: count, open a
 * request span if none is open, and when a finite rate is in force take
 * tokens. Anything unusual goes to the slow path. Costs a TLS read, two
 * relaxed loads, two single-writer increments and, when limited, one load and
 * one fetch_sub. Only the launch that opens a span pays for a clock read and a
 * CAS (once per request, not per kernel).
 */
static inline __attribute__((always_inline)) void dilu_admit(uint64_t cost, CUstream stream,
                                                              bool ptsz, bool graph) {
    uint32_t fast = atomic_load_explicit(&g_fast, memory_order_acquire);
    struct dilu_tstat *ts = t_stats;
    if (DILU_UNLIKELY(ts == NULL || (fast & ~FAST_LIMITED) != 0)) {
        dilu_admit_slow(cost, stream, ptsz, graph, false);
        return;
    }
    if (graph)
        atomic_store_explicit(&ts->graph_launches,
                              atomic_load_explicit(&ts->graph_launches, memory_order_relaxed) + 1,
                              memory_order_relaxed);
    else
        atomic_store_explicit(&ts->launches,
                              atomic_load_explicit(&ts->launches, memory_order_relaxed) + 1,
                              memory_order_relaxed);
    atomic_store_explicit(&ts->blocks,
                          atomic_load_explicit(&ts->blocks, memory_order_relaxed) + cost,
                          memory_order_relaxed);
    /* After the count: a closing sync that sees no new launch may close the span. */
    if (DILU_UNLIKELY(atomic_load_explicit(&g_span_open, memory_order_relaxed) == 0))
        dilu_span_open();
    if (DILU_LIKELY(fast == 0)) return;
    struct dilu_bucket *b = &g_bucket[t_dev];
    if (DILU_UNLIKELY(atomic_load_explicit(&b->tokens, memory_order_relaxed) <= 0)) {
        dilu_admit_slow(cost, stream, ptsz, graph, true);
        return;
    }
    atomic_fetch_sub_explicit(&b->tokens, (int64_t)cost, memory_order_relaxed);
    ts->since_launches++;
    ts->since_blocks += (int64_t)cost;
    if (DILU_UNLIKELY(ts->since_launches >= 256 ||
                      ts->since_blocks >= atomic_load_explicit(&g_chunk_blocks, memory_order_relaxed)))
        dilu_inflight_checkpoint(stream, ptsz, ts);
}

/* memory (memory.c) */
void dilu_memory_set_cap(uint64_t cap);
uint64_t dilu_memory_cap(void);
void dilu_memory_snapshot(uint64_t *used, uint64_t *peak, uint64_t *allocs, uint64_t *refused);

/* lock-free pointer -> value map (ptrmap.c) */
struct dilu_ptrmap {
    struct dilu_ptrmap_slot *slots;
    uint64_t mask;
    unsigned bits;
    _Atomic int ready; /* 0 = not allocated, 1 = allocating, 2 = ready, 3 = failed */
};
bool dilu_ptrmap_insert(struct dilu_ptrmap *m, uintptr_t key, uint64_t value);
bool dilu_ptrmap_remove(struct dilu_ptrmap *m, uintptr_t key, uint64_t *value);
bool dilu_ptrmap_lookup(struct dilu_ptrmap *m, uintptr_t key, uint64_t *value);
bool dilu_ptrmap_upsert(struct dilu_ptrmap *m, uintptr_t key, uint64_t value);

#endif /* DILU_SHIM_INTERNAL_H */
