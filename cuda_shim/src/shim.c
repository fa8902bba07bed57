/*
 * libdilu_shim.so: interception core.
 *
 * How programs reach the driver, and therefore what this file must catch:
 *  - cudart 12/13 dlopen("libcuda.so.1"), dlsym(h, "cuGetProcAddress_v2") and
 *    then resolves every entry point through it, with flags 0 and 2 (per-thread
 *    default stream). So the shim exports cuGetProcAddress(_v2) and swaps the
 *    pointers it hands back.
 *  - Triton and others dlsym(libcuda_handle, "cuLaunchKernelEx"). dlsym on a
 *    handle ignores LD_PRELOAD, so the shim overrides dlsym itself.
 *  - -lcuda programs bind through the global scope, where the preloaded
 *    definitions of the same names win.
 * Real entry points are resolved once, lazily, from the exact exported names.
 */
#include "shim_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void *g_real[HOOK_COUNT];
void *g_use[USE_COUNT];

void *const g_wrap[HOOK_COUNT] = {
#define X(name, pfn, base) (void *)&name,
    DILU_HOOKS(X)
#undef X
};
const char *const g_hook_name[HOOK_COUNT] = {
#define X(name, pfn, base) #name,
    DILU_HOOKS(X)
#undef X
};
const char *const g_hook_base[HOOK_COUNT] = {
#define X(name, pfn, base) base,
    DILU_HOOKS(X)
#undef X
};
static const char *const g_use_name[USE_COUNT] = {
#define X(name, pfn) #name,
    DILU_USES(X)
#undef X
};

_Atomic uint32_t g_fast = FAST_NEED_INIT;
int g_log_level;
bool g_controlled;
bool g_track_memory;
_Atomic uint64_t g_sticky_flags;
_Atomic uint64_t g_gpa_lookups;
_Atomic uint64_t g_gpa_unmatched;

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) g_real_dlsym;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static DILU_TLS int t_in_init;
static _Atomic int g_init_done;

uint64_t dilu_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void dilu_log(int level, const char *fmt, ...) {
    static const char *const names[] = {"", "error", "warn", "info", "debug", "trace"};
    int saved = errno;
    char buf[512];
    int n = snprintf(buf, sizeof buf, "[dilu-shim %d %s] ", (int)getpid(),
                     names[level < 0 ? 0 : level > 5 ? 5 : level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof buf) n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    if (n > 0) {
        buf[n++] = '\n';
        ssize_t w = write(2, buf, (size_t)n);
        (void)w;
    }
    errno = saved;
}

/* ---- the real dlsym ------------------------------------------------------ */
static dlsym_fn real_dlsym(void) {
    dlsym_fn fn = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    if (DILU_LIKELY(fn != NULL)) return fn;
    /* Newest first: binaries built on glibc >= 2.34 bind dlsym@GLIBC_2.34. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof *versions && fn == NULL; i++)
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&g_real_dlsym, fn, memory_order_release);
    return fn;
}

/* ---- lazy initialisation --------------------------------------------------- */
static void fork_prepare(void) { dilu_admission_fork_prepare(); }
static void fork_parent(void) { dilu_admission_fork_parent(); }
static void fork_child(void) { dilu_admission_fork_child(); }

static void *open_driver(void) {
    const char *path = getenv("DILU_SHIM_REAL_LIBCUDA");
    void *h = NULL;
    if (path && *path) {
        h = dlopen(path, RTLD_NOW | RTLD_NODELETE);
        if (!h) DLOG(LOG_ERROR, "cannot open DILU_SHIM_REAL_LIBCUDA=%s: %s", path, dlerror());
    }
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NODELETE);
    if (!h) DLOG(LOG_ERROR, "cannot open libcuda.so.1: %s; every CUDA call will fail", dlerror());
    return h;
}

static void do_init(void) {
    int saved = errno;
    t_in_init = 1;
    const char *lvl = getenv("DILU_SHIM_LOG_LEVEL");
    g_log_level = lvl ? atoi(lvl) : 0;

    dlsym_fn rdlsym = real_dlsym();
    void *h = open_driver();
    if (h && rdlsym) {
        for (int i = 0; i < HOOK_COUNT; i++) g_real[i] = rdlsym(h, g_hook_name[i]);
        for (int i = 0; i < USE_COUNT; i++) g_use[i] = rdlsym(h, g_use_name[i]);
        for (int i = 0; i < HOOK_COUNT; i++)
            if (!g_real[i]) DLOG(LOG_DEBUG, "driver does not export %s", g_hook_name[i]);
    } else {
        atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_NO_DRIVER);
    }
    pthread_atfork(fork_prepare, fork_parent, fork_child);

    if (dilu_open_blocks() == 0) {
        g_controlled = true;
        g_track_memory = true;
        dilu_admission_start();
    } else {
        dilu_publish_passthrough();
    }
    DLOG(LOG_INFO, "initialised: %s, driver %s", g_controlled ? "controlled" : "pass-through",
         h ? "loaded" : "missing");
    /* The refill thread may already have changed FAST_LIMITED: clear only our bit. */
    atomic_fetch_and_explicit(&g_fast, ~FAST_NEED_INIT, memory_order_release);
    atomic_store_explicit(&g_init_done, 1, memory_order_release);
    t_in_init = 0;
    errno = saved;
}

void dilu_ensure_init(void) {
    if (DILU_LIKELY(atomic_load_explicit(&g_init_done, memory_order_acquire))) return;
    /* A driver constructor calling back into the shim during init must not
       re-enter pthread_once on the same thread (that deadlocks). */
    if (t_in_init) return;
    pthread_once(&g_once, do_init);
}

/* ---- substitution --------------------------------------------------------- */
static int hook_by_real(const void *p) {
    if (!p) return -1;
    for (int i = 0; i < HOOK_COUNT; i++)
        if (g_real[i] == p) return i;
    return -1;
}

static bool is_hooked_base(const char *sym) {
    for (int i = 0; i < HOOK_COUNT; i++)
        if (strcmp(sym, g_hook_base[i]) == 0) return true;
    return false;
}

/*
 * Swap a driver answer for the shim's wrapper. Only pointers identical to a
 * real exported entry point are swapped, so another interposer's function is
 * never replaced. One known alias is mapped by name: at cudaVersion >= 12000
 * "cuGraphInstantiate" answers an internal alias of cuGraphInstantiateWithFlags.
 */
static void *substitute_gpa(void *p, const char *sym, int ver) {
    int i = hook_by_real(p);
    if (i >= 0) return g_wrap[i];
    if (p && sym && ver >= 12000 && strcmp(sym, "cuGraphInstantiate") == 0 &&
        g_real[HOOK_cuGraphInstantiateWithFlags])
        return g_wrap[HOOK_cuGraphInstantiateWithFlags];
    if (p && sym && is_hooked_base(sym)) {
        atomic_fetch_add_explicit(&g_gpa_unmatched, 1, memory_order_relaxed);
        DLOG(LOG_WARN, "cuGetProcAddress(%s, %d) returned an unknown entry point; not metered", sym,
             ver);
    }
    return p;
}

DILU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    dilu_ensure_init();
    PFN_cuGetProcAddress_v12000 real = REAL(cuGetProcAddress_v2);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    atomic_fetch_add_explicit(&g_gpa_lookups, 1, memory_order_relaxed);
    CUresult r = real(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS && pfn && *pfn) *pfn = substitute_gpa(*pfn, symbol, cudaVersion);
    DLOG(5, "cuGetProcAddress_v2(%s, %d, %llu) -> %d", symbol ? symbol : "(null)", cudaVersion,
         (unsigned long long)flags, (int)r);
    return r;
}

DILU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags) {
    dilu_ensure_init();
    CUresult r;
    if (REAL(cuGetProcAddress))
        r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    else if (REAL(cuGetProcAddress_v2))
        r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, NULL);
    else
        return CUDA_ERROR_NOT_INITIALIZED;
    atomic_fetch_add_explicit(&g_gpa_lookups, 1, memory_order_relaxed);
    if (r == CUDA_SUCCESS && pfn && *pfn) *pfn = substitute_gpa(*pfn, symbol, cudaVersion);
    return r;
}

/* ---- dlsym override --------------------------------------------------------- */
static bool hooked_name(const char *s) {
    /* Cheap reject first: hooked names are "cu" + capital letter. */
    if (s[0] != 'c' || s[1] != 'u' || s[2] < 'A' || s[2] > 'Z') return false;
    for (int i = 0; i < HOOK_COUNT; i++)
        if (strcmp(s, g_hook_name[i]) == 0) return true;
    return false;
}

static __attribute__((noinline)) void *dlsym_hooked(void *handle, const char *symbol) {
    void *p = real_dlsym()(handle, symbol);
    dilu_ensure_init();
    int i = hook_by_real(p);
    return i >= 0 ? g_wrap[i] : p;
}

/*
 * The pass-through path must stay a tail call: glibc resolves RTLD_NEXT from
 * the caller's return address, and a normal call would make the caller's
 * RTLD_NEXT mean "after the shim" (a test checks this behaviour).
 */
DILU_EXPORT void *dlsym(void *handle, const char *symbol) {
    dlsym_fn real = real_dlsym();
    if (DILU_UNLIKELY(real == NULL)) return NULL;
    if (!t_in_init && hooked_name(symbol)) return dlsym_hooked(handle, symbol);
    return real(handle, symbol);
}

/* ---- introspection ----------------------------------------------------------- */
DILU_EXPORT int dilu_shim_query(dilu_shim_info_t *out, size_t out_size) {
    if (!out || out_size < sizeof *out) return -1;
    dilu_ensure_init();
    memset(out, 0, sizeof *out);
    out->abi_version = DILU_SHIM_ABI_VERSION;
    out->mode = g_controlled ? DILU_SHIM_MODE_CONTROLLED : DILU_SHIM_MODE_PASSTHROUGH;
    out->gpa_lookups = atomic_load(&g_gpa_lookups);
    out->gpa_unmatched = atomic_load(&g_gpa_unmatched);
    dilu_fill_info(out);
    return 0;
}
