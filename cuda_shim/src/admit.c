/*
 * Admission: token buckets (one per device), the refill thread that follows
 * the control block, the stats block it publishes, Dilu-style launch windows
 * and cycles, and the in-flight bound.
 *
 * Tokens are thread blocks. A launch is admitted while its device's bucket
 * holds more than zero tokens and then pays its full cost (debt model): a
 * kernel larger than the bucket is never starved, and the debt is repaid by
 * later refills, so the long-run admitted rate equals the configured rate.
 *
 * Only the refill thread reads the control block and writes the stats block;
 * launching threads touch process-private atomics only.
 */
#include "shim_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct dilu_bucket g_bucket[DILU_MAX_DEVICES];
_Atomic int64_t g_chunk_blocks = INT64_MAX;
DILU_TLS struct dilu_tstat *t_stats;
DILU_TLS int t_dev;

/* Waiting for tokens: a generation word bumped by every refill. */
static _Atomic uint32_t g_gen;
static _Atomic uint32_t g_waiters;

/* Spin this many pause loops before sleeping on the futex. */
#define SPIN_LOOPS 64
/* Longest single futex sleep; the refill tick normally wakes us first. */
#define MAX_SLEEP_NS 2000000L
/* In-flight bound: events per stream ring (at most this many checkpoints queued). */
#define INFLIGHT_EVENTS 3
#define INFLIGHT_STREAMS 64
#define INFLIGHT_MAX_FAILURES 3

/* ---- the mapped blocks ---------------------------------------------------- */
static const dilu_shim_control_t *g_ctl; /* read-only mapping */
static dilu_shim_stats_t *g_st;          /* read-write mapping, may be NULL */
static bool g_control_bad_at_init;
static _Atomic bool g_stats_owner;

/* ---- quota in force (refill thread only, except where atomic) ---------- */
struct quota {
    uint64_t epoch;
    double rate;
    uint64_t burst;
    double share;
    double capacity;
    uint64_t mem_cap;
    uint64_t stale_after;
};
static struct quota g_q;         /* last accepted control snapshot */
static bool g_applied;           /* g_q holds a snapshot */
static uint64_t g_applied_ns;    /* when it was applied */
static double g_rate;            /* 0 = unlimited */
static int64_t g_burst;
static double g_carry[DILU_MAX_DEVICES];
static uint64_t g_last_refill_ns;
static bool g_stale;
static bool g_control_bad_now;

/* ---- per-thread counters ---------------------------------------------------- */
struct totals {
    uint64_t launches, graph_launches, blocks, waits, throttled_ns, inflight_waits, inflight_wait_ns;
    uint64_t spans; /* copied from the span state, not summed */
    uint32_t span_ring_us[DILU_SHIM_SPAN_RING];
};
static pthread_mutex_t g_tlist_mu = PTHREAD_MUTEX_INITIALIZER;
static struct dilu_tstat *g_tlist;
static struct totals g_retired;
static pthread_key_t g_tkey;
static pthread_once_t g_tkey_once = PTHREAD_ONCE_INIT;

/* ---- refill thread and windows ---------------------------------------------- */
static pthread_mutex_t g_rearm_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int g_refill_running;
static uint64_t g_ticks;
static uint64_t g_win_prev_blocks;
static uint64_t g_windows, g_window_blocks_last, g_cycles, g_cycle_cur, g_cycle_min;
static double g_window_ema;
static uint64_t g_cycle_ring[DILU_SHIM_CYCLE_RING];

/* ---- in-flight rings ----------------------------------------------------------- */
struct inflight {
    bool used;
    bool disabled;
    CUstream stream;
    unsigned next;
    unsigned failures;
    CUevent ev[INFLIGHT_EVENTS];
    bool recorded[INFLIGHT_EVENTS];
};
static pthread_mutex_t g_inflight_mu = PTHREAD_MUTEX_INITIALIZER;
static struct inflight g_inflight[INFLIGHT_STREAMS];

/* ---- request spans (completed ones: under g_tlist_mu) ----------------------------- */
_Atomic uint64_t g_span_open;
static uint64_t g_spans;
static uint32_t g_span_ring[DILU_SHIM_SPAN_RING];

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static inline double load_double(const double *p) {
    double v;
    __atomic_load(p, &v, __ATOMIC_RELAXED);
    return v;
}

static inline void store_double(double *p, double v) { __atomic_store(p, &v, __ATOMIC_RELAXED); }

static inline void bump(_Atomic uint64_t *c, uint64_t d) {
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + d,
                          memory_order_relaxed);
}

/* ======================================================================= */
/* per-thread counters                                                      */
/* ======================================================================= */
static void add_totals(struct totals *t, struct dilu_tstat *s) {
    t->launches += atomic_load_explicit(&s->launches, memory_order_relaxed);
    t->graph_launches += atomic_load_explicit(&s->graph_launches, memory_order_relaxed);
    t->blocks += atomic_load_explicit(&s->blocks, memory_order_relaxed);
    t->waits += atomic_load_explicit(&s->waits, memory_order_relaxed);
    t->throttled_ns += atomic_load_explicit(&s->throttled_ns, memory_order_relaxed);
    t->inflight_waits += atomic_load_explicit(&s->inflight_waits, memory_order_relaxed);
    t->inflight_wait_ns += atomic_load_explicit(&s->inflight_wait_ns, memory_order_relaxed);
}

static void tstat_destroy(void *p) {
    struct dilu_tstat *s = p;
    pthread_mutex_lock(&g_tlist_mu);
    add_totals(&g_retired, s);
    *s->pprev = s->next;
    if (s->next) s->next->pprev = s->pprev;
    pthread_mutex_unlock(&g_tlist_mu);
    if (t_stats == s) t_stats = NULL;
    free(s);
}

static void tkey_init(void) {
    if (pthread_key_create(&g_tkey, tstat_destroy) != 0) g_tkey = (pthread_key_t)-1;
}

struct dilu_tstat *dilu_tstat_register(void) {
    pthread_once(&g_tkey_once, tkey_init);
    struct dilu_tstat *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_lock(&g_tlist_mu);
    s->next = g_tlist;
    s->pprev = &g_tlist;
    if (g_tlist) g_tlist->pprev = &s->next;
    g_tlist = s;
    pthread_mutex_unlock(&g_tlist_mu);
    if (g_tkey != (pthread_key_t)-1) pthread_setspecific(g_tkey, s);
    t_stats = s;
    return s;
}

static struct totals sum_totals(void) {
    pthread_mutex_lock(&g_tlist_mu);
    struct totals t = g_retired;
    for (struct dilu_tstat *s = g_tlist; s; s = s->next) add_totals(&t, s);
    t.spans = g_spans;
    memcpy(t.span_ring_us, g_span_ring, sizeof g_span_ring);
    pthread_mutex_unlock(&g_tlist_mu);
    return t;
}

/* Kernel and graph launches of the process so far; caller holds g_tlist_mu. */
static uint64_t launch_count_locked(void) {
    uint64_t n = g_retired.launches + g_retired.graph_launches;
    for (struct dilu_tstat *s = g_tlist; s; s = s->next)
        n += atomic_load_explicit(&s->launches, memory_order_relaxed) +
             atomic_load_explicit(&s->graph_launches, memory_order_relaxed);
    return n;
}

/* ======================================================================= */
/* request spans                                                            */
/* ======================================================================= */
/*
 * A span runs from the first launch while none is open to the return of a
 * successful application sync during which nothing was launched: the time the
 * process's queued work took, request by request (docs/shim.md).
 *
 * "Nothing was launched during the sync" compares the per-thread launch
 * counters summed at the sync's entry and at its return. That costs a mutex
 * and a walk of the thread list per sync, paid only while a span is open;
 * syncs are rare (hundreds to a few thousand per second), launches are not,
 * and a shared launch sequence would put a contended atomic write on every
 * launch instead. A launch that has been counted but not yet submitted when
 * the sync starts can still end up outside the span (the sync did not wait for
 * it); its work then belongs to the next span.
 */
void dilu_span_open(void) {
    uint64_t expected = 0, now = dilu_now_ns();
    /* Two threads opening at once: the first one's time wins. */
    atomic_compare_exchange_strong_explicit(&g_span_open, &expected, now ? now : 1, memory_order_relaxed,
                                            memory_order_relaxed);
}

void dilu_span_sync_enter(struct dilu_span_mark *m) {
    m->open_ns = atomic_load_explicit(&g_span_open, memory_order_relaxed);
    m->launches = 0;
    /* No span open: one opened during the sync means a launch during the sync. */
    if (!m->open_ns) return;
    int saved = errno;
    pthread_mutex_lock(&g_tlist_mu);
    m->launches = launch_count_locked();
    pthread_mutex_unlock(&g_tlist_mu);
    errno = saved;
}

void dilu_span_sync_exit(const struct dilu_span_mark *m, uint64_t returned_ns) {
    if (!m->open_ns) return;
    int saved = errno;
    pthread_mutex_lock(&g_tlist_mu);
    uint64_t open = m->open_ns;
    /* The CAS on the span seen at entry: of two syncs closing one span, one records it. */
    if (launch_count_locked() == m->launches &&
        atomic_compare_exchange_strong(&g_span_open, &open, 0)) {
        if (launch_count_locked() != m->launches) {
            /* A launch slipped in between the check and the CAS, and may have seen the span still
               open: give it back (unless that launch already opened a new one). */
            uint64_t zero = 0;
            atomic_compare_exchange_strong(&g_span_open, &zero, m->open_ns);
        } else {
            uint64_t us = returned_ns > m->open_ns ? (returned_ns - m->open_ns) / 1000 : 0;
            g_span_ring[g_spans % DILU_SHIM_SPAN_RING] = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
            g_spans++;
        }
    }
    pthread_mutex_unlock(&g_tlist_mu);
    errno = saved;
}

/* ======================================================================= */
/* control and stats blocks                                                 */
/* ======================================================================= */
static bool control_header_ok(const dilu_shim_control_t *c) {
    return LOAD(&c->magic) == DILU_SHIM_CONTROL_MAGIC &&
           (LOAD(&c->version) >> 16) == DILU_SHIM_ABI_MAJOR &&
           LOAD(&c->size) >= sizeof(dilu_shim_control_t);
}

static void *map_file(const char *path, size_t size, bool writable, bool *too_small) {
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) return NULL;
    /* lseek, not fstat: fstat is a GLIBC_2.33 symbol (see glibc_compat.h). */
    off_t len = lseek(fd, 0, SEEK_END);
    void *p = NULL;
    *too_small = false;
    if (len >= 0) {
        if ((size_t)len < size && writable && len == 0 && ftruncate(fd, (off_t)size) == 0)
            len = (off_t)size;
        if ((size_t)len >= size) {
            p = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
            if (p == MAP_FAILED) p = NULL;
        } else {
            *too_small = true;
        }
    }
    close(fd);
    return p;
}

static bool pid_alive(uint32_t pid) {
    if (pid == 0) return false;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* Become the stats block's writer when nobody (alive) holds it. */
static void try_claim_stats(void) {
    if (!g_st || g_stats_owner) return;
    uint32_t me = (uint32_t)getpid();
    uint32_t cur = __atomic_load_n(&g_st->pid, __ATOMIC_ACQUIRE);
    uint64_t hb = __atomic_load_n(&g_st->heartbeat_ns, __ATOMIC_RELAXED);
    uint64_t now = dilu_now_ns();
    bool dead = cur == 0 || cur == me || !pid_alive(cur) || (hb != 0 && now > hb && now - hb > 1000000000ull);
    if (dead && __atomic_compare_exchange_n(&g_st->pid, &cur, me, false, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
        g_stats_owner = true;
        DLOG(LOG_INFO, "stats block claimed");
        return;
    }
    /* Someone else publishes: say that this process is not counted there. */
    __atomic_fetch_or(&g_st->flags, DILU_STATS_F_SHARED, __ATOMIC_RELAXED);
}

static void open_stats(void) {
    const char *path = getenv("DILU_SHIM_STATS");
    if (!path || !*path) return;
    bool small;
    dilu_shim_stats_t *st = map_file(path, sizeof *st, true, &small);
    if (!st) {
        DLOG(LOG_WARN, "cannot map stats file %s%s", path, small ? " (too small)" : "");
        return;
    }
    uint32_t magic = LOAD(&st->magic);
    if (magic == 0) {
        /* A fresh zero file: initialise the header ourselves. */
        STORE(&st->version, DILU_SHIM_ABI_VERSION);
        STORE(&st->size, (uint32_t)sizeof *st);
        __atomic_store_n(&st->magic, DILU_SHIM_STATS_MAGIC, __ATOMIC_RELEASE);
    } else if (magic != DILU_SHIM_STATS_MAGIC || (LOAD(&st->version) >> 16) != DILU_SHIM_ABI_MAJOR ||
               LOAD(&st->size) < sizeof *st) {
        DLOG(LOG_WARN, "stats file %s has a foreign header; not publishing", path);
        munmap(st, sizeof *st);
        return;
    }
    g_st = st;
    try_claim_stats();
}

int dilu_open_blocks(void) {
    open_stats();
    const char *path = getenv("DILU_SHIM_CONTROL");
    if (!path || !*path) return -1;
    bool small;
    const dilu_shim_control_t *c = map_file(path, sizeof *c, false, &small);
    if (!c || !control_header_ok(c)) {
        DLOG(LOG_WARN, "control file %s is %s; pass-through", path,
             !c ? (small ? "too small" : "unreadable") : "not a v1 control block");
        if (c) munmap((void *)c, sizeof *c);
        g_control_bad_at_init = true;
        return -1;
    }
    g_ctl = c;
    return 0;
}

/* Copy a consistent snapshot of the control block; false if the writer is busy. */
static bool read_control(struct quota *q) {
    const dilu_shim_control_t *c = g_ctl;
    for (int tries = 0; tries < 16; tries++) {
        uint64_t e1 = __atomic_load_n(&c->epoch, __ATOMIC_ACQUIRE);
        if (e1 & 1) {
            cpu_relax();
            continue;
        }
        q->rate = load_double(&c->rate_blocks_per_ms);
        q->burst = LOAD(&c->burst_blocks);
        q->share = load_double(&c->share);
        q->capacity = load_double(&c->capacity_blocks_per_ms);
        q->mem_cap = LOAD(&c->mem_cap_bytes);
        q->stale_after = LOAD(&c->stale_after_ns);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&c->epoch, __ATOMIC_RELAXED) == e1) {
            q->epoch = e1;
            return true;
        }
    }
    return false;
}

static bool rate_is_limited(double rate) { return isfinite(rate) && rate > 0.0; }

static void wake_waiters(void) {
    atomic_fetch_add(&g_gen, 1);
    if (atomic_load(&g_waiters) > 0)
        syscall(SYS_futex, &g_gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void apply_quota(const struct quota *q) {
    bool was_limited = g_rate > 0.0;
    bool limited = rate_is_limited(q->rate);
    g_q = *q;
    g_applied = true;
    g_applied_ns = dilu_now_ns();
    if (limited) {
        double tick = ceil(q->rate * (double)DILU_SHIM_TICK_NS / 1e6);
        double burst = q->burst ? (double)q->burst : ceil(q->rate * DILU_SHIM_DEFAULT_BURST_MS);
        /* A bucket that cannot hold one tick of refill would cap the rate at burst per tick. */
        if (burst < tick) burst = tick;
        if (burst < 1.0) burst = 1.0;
        if (burst > (double)(INT64_MAX / 4)) burst = (double)(INT64_MAX / 4);
        g_burst = (int64_t)burst;
        g_rate = q->rate;
        double chunk = tick < 1.0 ? 1.0 : tick;
        if (chunk > (double)(INT64_MAX / 4)) chunk = (double)(INT64_MAX / 4);
        atomic_store(&g_chunk_blocks, (int64_t)chunk);
        if (!was_limited) {
            /* Start full: a quota that appears mid-run must not stall the app. */
            for (int d = 0; d < DILU_MAX_DEVICES; d++) {
                atomic_store(&g_bucket[d].tokens, g_burst);
                g_carry[d] = 0.0;
            }
            g_last_refill_ns = dilu_now_ns();
            atomic_fetch_or(&g_fast, FAST_LIMITED);
        }
    } else {
        g_rate = 0.0;
        g_burst = 0;
        atomic_store(&g_chunk_blocks, INT64_MAX);
        if (was_limited) {
            atomic_fetch_and(&g_fast, ~FAST_LIMITED);
            wake_waiters();
        }
    }
    dilu_memory_set_cap(q->mem_cap);
    DLOG(LOG_INFO, "quota epoch %llu: rate %.3f blocks/ms, burst %lld, mem cap %llu",
         (unsigned long long)q->epoch, g_rate, (long long)g_burst, (unsigned long long)q->mem_cap);
}

/* Follow the control block unless the manager's heartbeat is stale. */
static void control_tick(uint64_t now) {
    const dilu_shim_control_t *c = g_ctl;
    if (!control_header_ok(c)) {
        g_control_bad_now = true; /* garbage in the file: keep the last quota */
        return;
    }
    g_control_bad_now = false;
    uint64_t hb = __atomic_load_n(&c->manager_heartbeat_ns, __ATOMIC_RELAXED);
    g_stale = g_q.stale_after != 0 && now > hb && now - hb > g_q.stale_after;
    if (g_stale) return;
    if (g_applied && __atomic_load_n(&c->epoch, __ATOMIC_ACQUIRE) == g_q.epoch) return;
    struct quota q;
    if (read_control(&q)) apply_quota(&q);
}

static void refill(uint64_t now) {
    if (g_rate <= 0.0) {
        g_last_refill_ns = now;
        return;
    }
    double ms = (double)(now - g_last_refill_ns) / 1e6;
    g_last_refill_ns = now;
    if (ms > 1000.0) ms = 1000.0;
    for (int d = 0; d < DILU_MAX_DEVICES; d++) {
        double add = g_rate * ms + g_carry[d];
        double whole = floor(add);
        g_carry[d] = add - whole;
        /* bounded only against overflow: a deep debt must get the whole refill */
        int64_t inc = whole > (double)(INT64_MAX / 4) ? INT64_MAX / 4 : (int64_t)whole;
        int64_t cur = atomic_load(&g_bucket[d].tokens);
        int64_t nv;
        do {
            nv = cur + inc;
            if (nv > g_burst) nv = g_burst;
        } while (!atomic_compare_exchange_weak(&g_bucket[d].tokens, &cur, nv));
        if (nv == g_burst) g_carry[d] = 0.0;
    }
}

static void window_tick(uint64_t blocks_now) {
    uint64_t wb = blocks_now - g_win_prev_blocks;
    g_win_prev_blocks = blocks_now;
    g_windows++;
    g_window_blocks_last = wb;
    g_window_ema += ((double)wb - g_window_ema) / 8.0;
    if (wb > 0) {
        g_cycle_cur++;
    } else if (g_cycle_cur > 0) {
        g_cycle_ring[g_cycles % DILU_SHIM_CYCLE_RING] = g_cycle_cur;
        g_cycles++;
        if (g_cycle_min == 0 || g_cycle_cur < g_cycle_min) g_cycle_min = g_cycle_cur;
        g_cycle_cur = 0;
    }
}

static uint64_t current_flags(void) {
    uint64_t f = atomic_load(&g_sticky_flags);
    if (!g_controlled) f |= DILU_STATS_F_PASSTHROUGH;
    if (g_control_bad_at_init || g_control_bad_now) f |= DILU_STATS_F_CONTROL_BAD;
    if (g_stale) f |= DILU_STATS_F_STALE;
    if (atomic_load(&g_fast) & FAST_LIMITED) f |= DILU_STATS_F_LIMITED;
    return f;
}

/* One writer at a time: the refill thread, or the exit handler. */
static pthread_mutex_t g_publish_mu = PTHREAD_MUTEX_INITIALIZER;

static void publish(uint64_t now, const struct totals *t) {
    dilu_shim_stats_t *st = g_st;
    if (!st || !g_stats_owner) return;
    uint64_t used, peak, allocs, refused;
    dilu_memory_snapshot(&used, &peak, &allocs, &refused);
    uint64_t seq = LOAD(&st->seq);
    if (seq & 1) seq++; /* a previous owner died mid-publish */
    STORE(&st->seq, seq + 1);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    STORE(&st->pid, (uint32_t)getpid());
    /* Say which layout the words below follow: a block created for an older minor
       version holds this shim's newer fields from now on. */
    STORE(&st->version, DILU_SHIM_ABI_VERSION);
    uint64_t shared = LOAD(&st->flags) & DILU_STATS_F_SHARED;
    STORE(&st->flags, current_flags() | shared);
    STORE(&st->heartbeat_ns, now);
    STORE(&st->ticks, g_ticks);
    STORE(&st->control_epoch, g_q.epoch);
    STORE(&st->control_applied_ns, g_applied_ns);
    store_double(&st->rate_blocks_per_ms, g_rate);
    STORE(&st->burst_blocks, (uint64_t)g_burst);
    STORE(&st->mem_cap_bytes, dilu_memory_cap());
    STORE(&st->launches, t->launches);
    STORE(&st->graph_launches, t->graph_launches);
    STORE(&st->blocks, t->blocks);
    STORE(&st->waits, t->waits);
    STORE(&st->throttled_ns, t->throttled_ns);
    STORE(&st->inflight_waits, t->inflight_waits);
    STORE(&st->inflight_wait_ns, t->inflight_wait_ns);
    STORE(&st->waiting_threads, (uint64_t)atomic_load(&g_waiters));
    STORE(&st->tokens, (int64_t)atomic_load(&g_bucket[0].tokens));
    STORE(&st->mem_used_bytes, used);
    STORE(&st->mem_peak_bytes, peak);
    STORE(&st->mem_allocs, allocs);
    STORE(&st->mem_refused, refused);
    STORE(&st->gpa_lookups, (uint64_t)atomic_load(&g_gpa_lookups));
    STORE(&st->gpa_unmatched, (uint64_t)atomic_load(&g_gpa_unmatched));
    STORE(&st->window_ns, DILU_SHIM_TICK_NS * DILU_SHIM_WINDOW_TICKS);
    STORE(&st->windows, g_windows);
    STORE(&st->window_blocks_last, g_window_blocks_last);
    store_double(&st->window_blocks_ema, g_window_ema);
    STORE(&st->cycles, g_cycles);
    STORE(&st->cycle_current_windows, g_cycle_cur);
    STORE(&st->cycle_min_windows, g_cycle_min);
    for (unsigned i = 0; i < DILU_SHIM_CYCLE_RING; i++) STORE(&st->cycle_ring[i], g_cycle_ring[i]);
    STORE(&st->spans, t->spans);
    STORE(&st->span_open_ns, (uint64_t)atomic_load_explicit(&g_span_open, memory_order_relaxed));
    for (unsigned i = 0; i < DILU_SHIM_SPAN_RING; i++) STORE(&st->span_ring_us[i], t->span_ring_us[i]);
    __atomic_store_n(&st->seq, seq + 2, __ATOMIC_RELEASE);
}

/* Pass-through with a stats file: say so once (no thread runs). */
void dilu_publish_passthrough(void) {
    if (!g_st || !g_stats_owner) return;
    struct totals t = {0};
    publish(dilu_now_ns(), &t);
}

/*
 * A short-lived process should not lose its last millisecond of counts: publish
 * once more at exit. trylock, because exit() may run while the refill thread is
 * mid-publish (it then finishes its own, nearly as fresh, copy).
 */
__attribute__((destructor)) static void publish_at_exit(void) {
    if (!g_st || !g_stats_owner || !atomic_load(&g_refill_running)) return;
    int saved = errno;
    for (int i = 0; i < 20; i++) {
        if (pthread_mutex_trylock(&g_publish_mu) == 0) {
            struct totals t = sum_totals();
            publish(dilu_now_ns(), &t);
            pthread_mutex_unlock(&g_publish_mu);
            break;
        }
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    errno = saved;
}

static void *refill_main(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "dilu-refill", 0, 0, 0);
    uint64_t next = dilu_now_ns() + DILU_SHIM_TICK_NS;
    for (;;) {
        struct timespec ts = {(time_t)(next / 1000000000ull), (long)(next % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        uint64_t now = dilu_now_ns();
        /* After a long stall (suspend, debugger), restart the schedule. */
        next = now > next + 50 * DILU_SHIM_TICK_NS ? now + DILU_SHIM_TICK_NS : next + DILU_SHIM_TICK_NS;
        g_ticks++;
        control_tick(now);
        refill(now);
        wake_waiters();
        if (!g_stats_owner && g_st && g_ticks % 1000 == 0) try_claim_stats();
        struct totals t = sum_totals();
        if (g_ticks % DILU_SHIM_WINDOW_TICKS == 0) window_tick(t.blocks);
        pthread_mutex_lock(&g_publish_mu);
        publish(now, &t);
        pthread_mutex_unlock(&g_publish_mu);
    }
    return NULL;
}

static void start_refill_thread(void) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    /* The app's signals must never land on the shim's thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t tid;
    int rc = pthread_create(&tid, &attr, refill_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        /* Without a refill thread a limited bucket would never refill. */
        DLOG(LOG_ERROR, "cannot start the refill thread (%d); not throttling", rc);
        atomic_fetch_and(&g_fast, ~FAST_LIMITED);
        g_rate = 0.0;
        return;
    }
    atomic_store(&g_refill_running, 1);
}

void dilu_admission_start(void) {
    /* The manager may be mid-write: retry for up to 10 ticks, then start
       unlimited and let the refill thread pick the quota up. */
    struct quota q = {0};
    uint64_t deadline = dilu_now_ns() + 10 * DILU_SHIM_TICK_NS;
    bool ok;
    while (!(ok = read_control(&q)) && dilu_now_ns() < deadline) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (ok) apply_quota(&q);
    uint64_t now = dilu_now_ns();
    uint64_t hb = __atomic_load_n(&g_ctl->manager_heartbeat_ns, __ATOMIC_RELAXED);
    g_stale = g_q.stale_after != 0 && now > hb && now - hb > g_q.stale_after;
    g_last_refill_ns = now;
    start_refill_thread();
}

void dilu_rearm(void) {
    pthread_mutex_lock(&g_rearm_mu);
    if (atomic_load(&g_fast) & FAST_REARM) {
        try_claim_stats();
        start_refill_thread();
        atomic_fetch_and(&g_fast, ~FAST_REARM);
    }
    pthread_mutex_unlock(&g_rearm_mu);
}

void dilu_admission_fork_prepare(void) {
    pthread_mutex_lock(&g_rearm_mu);
    pthread_mutex_lock(&g_tlist_mu);
    pthread_mutex_lock(&g_inflight_mu);
}

void dilu_admission_fork_parent(void) {
    pthread_mutex_unlock(&g_inflight_mu);
    pthread_mutex_unlock(&g_tlist_mu);
    pthread_mutex_unlock(&g_rearm_mu);
}

void dilu_admission_fork_child(void) {
    pthread_mutex_unlock(&g_inflight_mu);
    pthread_mutex_unlock(&g_tlist_mu);
    pthread_mutex_unlock(&g_rearm_mu);
    atomic_store(&g_waiters, 0);
    /* The child has no queued GPU work of its own (contexts do not survive fork). */
    atomic_store(&g_span_open, 0);
    if (atomic_load(&g_refill_running)) {
        /* Threads do not survive fork: restart the refill thread lazily, on the
           child's next launch, outside the restricted post-fork context. */
        atomic_store(&g_refill_running, 0);
        g_stats_owner = false;
        atomic_fetch_or(&g_fast, FAST_REARM);
    }
}

/* ======================================================================= */
/* slow path                                                                 */
/* ======================================================================= */
bool dilu_stream_capturing(CUstream stream, bool ptsz) {
    PFN_cuStreamIsCapturing_v10000 fn = USE(cuStreamIsCapturing, PFN_cuStreamIsCapturing_v10000);
    if (!fn) return false;
    CUstream s = (ptsz && stream == NULL) ? CU_STREAM_PER_THREAD : stream;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = fn(s, &st);
    /* The legacy stream while another stream captures: do not block either. */
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
    return r == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

static void futex_wait_gen(uint32_t gen) {
    struct timespec ts = {0, MAX_SLEEP_NS};
    syscall(SYS_futex, &g_gen, FUTEX_WAIT_PRIVATE, gen, &ts, NULL, 0);
}

static void wait_for_tokens(struct dilu_bucket *b) {
    atomic_fetch_add(&g_waiters, 1);
    for (int spins = 0;; spins++) {
        if (!(atomic_load(&g_fast) & FAST_LIMITED)) break;
        if (atomic_load(&b->tokens) > 0) break;
        if (spins < SPIN_LOOPS) {
            cpu_relax();
            continue;
        }
        uint32_t gen = atomic_load(&g_gen);
        if (atomic_load(&b->tokens) > 0 || !(atomic_load(&g_fast) & FAST_LIMITED)) break;
        futex_wait_gen(gen);
    }
    atomic_fetch_sub(&g_waiters, 1);
}

void dilu_admit_slow(uint64_t cost, CUstream stream, bool ptsz, bool graph, bool counted) {
    int saved = errno;
    if (atomic_load(&g_fast) & FAST_NEED_INIT) dilu_ensure_init();
    if (atomic_load(&g_fast) & FAST_REARM) dilu_rearm();
    struct dilu_tstat *ts = t_stats ? t_stats : dilu_tstat_register();
    if (!counted) {
        if (ts) {
            bump(graph ? &ts->graph_launches : &ts->launches, 1);
            bump(&ts->blocks, cost);
        }
        if (atomic_load_explicit(&g_span_open, memory_order_relaxed) == 0) dilu_span_open();
    }
    if (!(atomic_load(&g_fast) & FAST_LIMITED)) goto out;
    struct dilu_bucket *b = &g_bucket[t_dev];
    if (atomic_load_explicit(&b->tokens, memory_order_relaxed) <= 0) {
        /* Captured work does not run now; the graph pays when it is launched. */
        if (dilu_stream_capturing(stream, ptsz)) {
            atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_CAPTURE_SEEN);
            goto out;
        }
        uint64_t t0 = dilu_now_ns();
        wait_for_tokens(b);
        if (ts) {
            bump(&ts->waits, 1);
            bump(&ts->throttled_ns, dilu_now_ns() - t0);
        }
        if (!(atomic_load(&g_fast) & FAST_LIMITED)) goto out;
    }
    atomic_fetch_sub_explicit(&b->tokens, (int64_t)cost, memory_order_relaxed);
    if (ts) {
        ts->since_launches++;
        ts->since_blocks += (int64_t)cost;
        if (ts->since_launches >= 256 || ts->since_blocks >= atomic_load(&g_chunk_blocks))
            dilu_inflight_checkpoint(stream, ptsz, ts);
    }
out:
    errno = saved;
}

/* ======================================================================= */
/* in-flight bound                                                          */
/* ======================================================================= */
static struct inflight *inflight_entry(CUstream s) {
    struct inflight *free_slot = NULL;
    for (int i = 0; i < INFLIGHT_STREAMS; i++) {
        struct inflight *e = &g_inflight[i];
        if (e->used && e->stream == s) return e;
        if (!e->used && !free_slot) free_slot = e;
    }
    if (free_slot) {
        memset(free_slot, 0, sizeof *free_slot);
        free_slot->used = true;
        free_slot->stream = s;
    }
    return free_slot;
}

/*
 * Tokens meter submission, not execution: without a bound a thread could queue
 * seconds of work before its quota bites, and that work would keep running
 * after a quota cut. Every chunk (about one millisecond of quota, or 256
 * launches) record an event on the stream, and first wait for the event
 * recorded INFLIGHT_EVENTS checkpoints ago. Never during capture.
 */
void dilu_inflight_checkpoint(CUstream stream, bool ptsz, struct dilu_tstat *ts) {
    ts->since_launches = 0;
    ts->since_blocks = 0;
    PFN_cuEventCreate_v2000 create = USE(cuEventCreate, PFN_cuEventCreate_v2000);
    PFN_cuEventRecord_v2000 record = USE(cuEventRecord, PFN_cuEventRecord_v2000);
    PFN_cuEventQuery_v2000 query = USE(cuEventQuery, PFN_cuEventQuery_v2000);
    PFN_cuEventSynchronize_v2000 sync = USE(cuEventSynchronize, PFN_cuEventSynchronize_v2000);
    PFN_cuThreadExchangeStreamCaptureMode_v10010 xmode =
        USE(cuThreadExchangeStreamCaptureMode, PFN_cuThreadExchangeStreamCaptureMode_v10010);
    if (!create || !record || !query || !sync) return;
    CUstream s = (ptsz && stream == NULL) ? CU_STREAM_PER_THREAD : stream;

    /* Relaxed capture mode for this thread, so that our event calls can never
       invalidate another thread's global-mode capture. */
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bool exchanged = xmode && xmode(&mode) == CUDA_SUCCESS;
    if (dilu_stream_capturing(stream, ptsz)) {
        atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_CAPTURE_SEEN);
        goto restore;
    }

    pthread_mutex_lock(&g_inflight_mu);
    struct inflight *e = inflight_entry(s);
    if (!e || e->disabled) {
        pthread_mutex_unlock(&g_inflight_mu);
        goto restore;
    }
    unsigned idx = e->next;
    e->next = (idx + 1) % INFLIGHT_EVENTS;
    bool was_recorded = e->recorded[idx];
    e->recorded[idx] = false;
    CUevent ev = e->ev[idx];
    if (!ev) {
        if (create(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC) != CUDA_SUCCESS) ev = NULL;
        e->ev[idx] = ev;
        was_recorded = false;
    }
    pthread_mutex_unlock(&g_inflight_mu);
    if (!ev) goto restore;

    if (was_recorded && query(ev) == CUDA_ERROR_NOT_READY) {
        uint64_t t0 = dilu_now_ns();
        sync(ev);
        bump(&ts->inflight_waits, 1);
        bump(&ts->inflight_wait_ns, dilu_now_ns() - t0);
    }
    CUresult r = record(ev, s);

    pthread_mutex_lock(&g_inflight_mu);
    if (r == CUDA_SUCCESS) {
        e->recorded[idx] = true;
        e->failures = 0;
    } else if (++e->failures >= INFLIGHT_MAX_FAILURES) {
        /* e.g. a stream of another context: stop trying on this stream */
        e->disabled = true;
        DLOG(LOG_DEBUG, "in-flight bound disabled for stream %p (error %d)", (void *)s, (int)r);
    }
    pthread_mutex_unlock(&g_inflight_mu);
restore:
    if (exchanged) xmode(&mode);
}

/* ======================================================================= */
/* contexts and introspection                                                */
/* ======================================================================= */
void dilu_set_device_from_current(void) {
    PFN_cuCtxGetDevice_v2000 fn = USE(cuCtxGetDevice, PFN_cuCtxGetDevice_v2000);
    CUdevice d = 0;
    if (!fn || fn(&d) != CUDA_SUCCESS || d < 0) d = 0;
    t_dev = d < DILU_MAX_DEVICES ? d : DILU_MAX_DEVICES - 1;
}

void dilu_fill_info(dilu_shim_info_t *info) {
    struct totals t = sum_totals();
    info->stats_owner = g_stats_owner;
    info->refill_running = (uint32_t)atomic_load(&g_refill_running);
    info->launches = t.launches;
    info->graph_launches = t.graph_launches;
    info->blocks = t.blocks;
    info->waits = t.waits;
    info->throttled_ns = t.throttled_ns;
    uint64_t used, peak, allocs, refused;
    dilu_memory_snapshot(&used, &peak, &allocs, &refused);
    info->mem_used_bytes = used;
    info->flags = current_flags();
}
