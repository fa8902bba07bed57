/*
 * dilu_shim_abi.h: the shared-memory contract between the per-GPU manager
 * (writes the control block, reads the stats block) and libdilu_shim.so inside
 * a GPU container (reads the control block, writes the stats block).
 *
 * Each instance has two small files, mapped with mmap(MAP_SHARED):
 *   control  written only by the manager; the container mounts it read-only.
 *   stats    written only by the shim; the manager reads it.
 * Paths reach the shim through DILU_SHIM_CONTROL and DILU_SHIM_STATS.
 *
 * Layout rules: fixed size, native little-endian x86-64 layout, every field
 * naturally aligned, explicit reserved words instead of compiler padding, no
 * pointers. A reader accepts a block whose magic matches, whose major version
 * equals its own and whose size is at least the size it knows. New fields go
 * into the reserved words and bump the minor version.
 *
 * Consistency: multi-field updates use a sequence counter (seqlock). The
 * writer makes the counter odd, writes the fields, then makes it even again;
 * a reader copies the fields between two reads of an even, unchanged counter.
 * Single 8-byte aligned fields (the heartbeats) are written on their own.
 * Times are CLOCK_MONOTONIC nanoseconds of the host (containers share it).
 *
 * The Python mirror lives in dilu_invoker/gpu/abi.py; a test compares it with
 * this header field by field (names, offsets, sizes).
 */
#ifndef DILU_SHIM_ABI_H
#define DILU_SHIM_ABI_H

#include <stddef.h>
#include <stdint.h>

#define DILU_SHIM_ABI_MAJOR 1u
#define DILU_SHIM_ABI_MINOR 1u
#define DILU_SHIM_ABI_VERSION ((DILU_SHIM_ABI_MAJOR << 16) | DILU_SHIM_ABI_MINOR)

/* Bytes "DCTL" and "DSTS" when the little-endian word is dumped. */
#define DILU_SHIM_CONTROL_MAGIC 0x4C544344u
#define DILU_SHIM_STATS_MAGIC 0x53545344u

#define DILU_SHIM_CONTROL_SIZE 256u
#define DILU_SHIM_STATS_SIZE 512u

/* Refill period of the shim's token buckets and the control re-read period. */
#define DILU_SHIM_TICK_NS 1000000ull
/* Launch windows for kernel-launch-cycle detection: 5 ticks = 5 ms. */
#define DILU_SHIM_WINDOW_TICKS 5u
/* Completed cycle lengths kept in the stats ring. */
#define DILU_SHIM_CYCLE_RING 16u
/* Completed request-span lengths kept in the stats ring (minor version 1). */
#define DILU_SHIM_SPAN_RING 24u
/* When burst_blocks is 0 the shim uses this many milliseconds of rate. */
#define DILU_SHIM_DEFAULT_BURST_MS 5.0

/*
 * Control block: written by the manager only.
 *
 * rate_blocks_per_ms  thread blocks admitted per millisecond, per device.
 *                     0, negative, NaN or infinity mean unlimited (no
 *                     throttling). The manager computes share * capacity.
 * burst_blocks        bucket ceiling in blocks; 0 = DEFAULT_BURST_MS of rate.
 * share, capacity_blocks_per_ms
 *                     what the manager decided and the capacity estimate it
 *                     used; the shim only copies them for observability.
 * mem_cap_bytes       device-memory cap for the process; 0 = no cap.
 * epoch               seqlock counter (odd while the manager writes).
 * manager_heartbeat_ns
 *                     bumped by the manager on every write and periodically.
 * stale_after_ns      heartbeat age after which the shim stops following the
 *                     block and keeps the last accepted quota (fail-static);
 *                     0 = never stale.
 */
typedef struct dilu_shim_control {
    uint32_t magic;
    uint32_t version;
    uint32_t size;
    uint32_t flags; /* reserved, write 0 */
    uint64_t epoch;
    double rate_blocks_per_ms;
    uint64_t burst_blocks;
    double share;
    double capacity_blocks_per_ms;
    uint64_t mem_cap_bytes;
    uint64_t manager_heartbeat_ns;
    uint64_t stale_after_ns;
    uint64_t reserved[22];
} dilu_shim_control_t;

/* Stats flags. */
#define DILU_STATS_F_PASSTHROUGH (1ull << 0)   /* not enforcing anything */
#define DILU_STATS_F_CONTROL_BAD (1ull << 1)   /* control file missing, unreadable or wrong magic/version/size */
#define DILU_STATS_F_STALE (1ull << 2)         /* manager heartbeat stale: last quota kept (fail-static) */
#define DILU_STATS_F_LIMITED (1ull << 3)       /* a finite rate is in force */
#define DILU_STATS_F_CAPTURE_SEEN (1ull << 4)  /* a launch found its stream capturing and was not throttled */
#define DILU_STATS_F_TABLE_FULL (1ull << 5)    /* an allocation or graph could not be tracked */
#define DILU_STATS_F_SHARED (1ull << 6)        /* another process uses CUDA with this stats file; it is not counted here */
#define DILU_STATS_F_NO_DRIVER (1ull << 7)     /* the real libcuda could not be loaded */

/*
 * Stats block: written by the shim (the owning process's refill thread) once
 * per tick under the seqlock `seq`. Counters are cumulative since the owning
 * process started; consumers take differences.
 *
 * version                the ABI of the block's writer: whoever created the
 *                        block writes its own, and the publishing shim writes
 *                        its own on every publish (a reader reads fields of a
 *                        newer minor version only when the minor says so).
 * pid                    owning process, claimed at its init (when 0 or dead).
 * heartbeat_ns, ticks    time of the last publish (0 = never published) and
 *                        the number of refill ticks so far.
 * control_epoch          epoch of the last control block the shim applied.
 * control_applied_ns     when it applied it (compare with the manager's write).
 * rate_blocks_per_ms, burst_blocks, mem_cap_bytes
 *                        the quota in force (rate 0 = unlimited).
 * launches               cuLaunchKernel/Ex/CooperativeKernel calls (+_ptsz).
 * graph_launches         cuGraphLaunch calls (+_ptsz).
 * blocks                 thread blocks admitted (a graph counts the blocks of
 *                        its kernel nodes, child graphs included).
 * waits, throttled_ns    launches that waited for tokens, and the sum of
 *                        their waiting time over all threads.
 * inflight_waits, inflight_wait_ns
 *                        waits caused by the in-flight bound (too much work
 *                        queued on a stream while limited).
 * waiting_threads        threads waiting for tokens right now.
 * tokens                 token level of device 0's bucket (negative = debt).
 * mem_used_bytes, mem_peak_bytes, mem_allocs
 *                        device memory held through the memory family, its
 *                        peak, the number of live allocations.
 * mem_refused            allocations refused with CUDA_ERROR_OUT_OF_MEMORY.
 * gpa_lookups            cuGetProcAddress calls.
 * gpa_unmatched          lookups of a hooked name whose answer could not be
 *                        substituted (should stay 0; non-zero means a driver
 *                        hands out entry points the shim does not know).
 * window_ns, windows     window length and completed windows.
 * window_blocks_last     blocks launched in the last window.
 * window_blocks_ema      exponential moving average (1/8) of that.
 * cycles                 completed kernel-launch cycles (a cycle is a run of
 *                        consecutive windows with launches).
 * cycle_current_windows  length of the cycle in progress (0 when idle).
 * cycle_min_windows      shortest completed cycle (0 before the first).
 * cycle_ring             last cycle lengths in windows; cycle number n is at
 *                        index n % DILU_SHIM_CYCLE_RING (n counts from 0).
 *
 * Request spans (minor version 1; a minor-0 shim leaves these words 0). A span
 * opens at the process's first kernel or graph launch while none is open and
 * closes when a hooked synchronize (cuCtxSynchronize(_v2),
 * cuStreamSynchronize(_ptsz), cuEventSynchronize) called by the application
 * returns CUDA_SUCCESS with no launch in the process between its entry and its
 * return: the queued work is done. The shim's own waits never close a span.
 * spans                  completed spans.
 * span_open_ns           when the span in progress opened (0 = none).
 * span_ring_us           last span lengths in microseconds, saturating at
 *                        UINT32_MAX; span number n is at index
 *                        n % DILU_SHIM_SPAN_RING (n counts from 0).
 */
typedef struct dilu_shim_stats {
    uint32_t magic;
    uint32_t version;
    uint32_t size;
    uint32_t pid;
    uint64_t seq;
    uint64_t flags;
    uint64_t heartbeat_ns;
    uint64_t ticks;
    uint64_t control_epoch;
    uint64_t control_applied_ns;
    double rate_blocks_per_ms;
    uint64_t burst_blocks;
    uint64_t mem_cap_bytes;
    uint64_t launches;
    uint64_t graph_launches;
    uint64_t blocks;
    uint64_t waits;
    uint64_t throttled_ns;
    uint64_t inflight_waits;
    uint64_t inflight_wait_ns;
    uint64_t waiting_threads;
    int64_t tokens;
    uint64_t mem_used_bytes;
    uint64_t mem_peak_bytes;
    uint64_t mem_allocs;
    uint64_t mem_refused;
    uint64_t gpa_lookups;
    uint64_t gpa_unmatched;
    uint64_t window_ns;
    uint64_t windows;
    uint64_t window_blocks_last;
    double window_blocks_ema;
    uint64_t cycles;
    uint64_t cycle_current_windows;
    uint64_t cycle_min_windows;
    uint64_t cycle_ring[DILU_SHIM_CYCLE_RING];
    uint64_t spans;
    uint64_t span_open_ns;
    uint32_t span_ring_us[DILU_SHIM_SPAN_RING];
    uint64_t reserved[1];
} dilu_shim_stats_t;

/*
 * Field lists, in layout order, for tools that need to enumerate the blocks
 * (the layout test). X(type, name, count): count > 0 for arrays.
 */
#define DILU_SHIM_CONTROL_FIELDS(X)          \
    X(uint32_t, magic, 0)                    \
    X(uint32_t, version, 0)                  \
    X(uint32_t, size, 0)                     \
    X(uint32_t, flags, 0)                    \
    X(uint64_t, epoch, 0)                    \
    X(double, rate_blocks_per_ms, 0)         \
    X(uint64_t, burst_blocks, 0)             \
    X(double, share, 0)                      \
    X(double, capacity_blocks_per_ms, 0)     \
    X(uint64_t, mem_cap_bytes, 0)            \
    X(uint64_t, manager_heartbeat_ns, 0)     \
    X(uint64_t, stale_after_ns, 0)           \
    X(uint64_t, reserved, 22)

#define DILU_SHIM_STATS_FIELDS(X)                      \
    X(uint32_t, magic, 0)                              \
    X(uint32_t, version, 0)                            \
    X(uint32_t, size, 0)                               \
    X(uint32_t, pid, 0)                                \
    X(uint64_t, seq, 0)                                \
    X(uint64_t, flags, 0)                              \
    X(uint64_t, heartbeat_ns, 0)                       \
    X(uint64_t, ticks, 0)                              \
    X(uint64_t, control_epoch, 0)                      \
    X(uint64_t, control_applied_ns, 0)                 \
    X(double, rate_blocks_per_ms, 0)                   \
    X(uint64_t, burst_blocks, 0)                       \
    X(uint64_t, mem_cap_bytes, 0)                      \
    X(uint64_t, launches, 0)                           \
    X(uint64_t, graph_launches, 0)                     \
    X(uint64_t, blocks, 0)                             \
    X(uint64_t, waits, 0)                              \
    X(uint64_t, throttled_ns, 0)                       \
    X(uint64_t, inflight_waits, 0)                     \
    X(uint64_t, inflight_wait_ns, 0)                   \
    X(uint64_t, waiting_threads, 0)                    \
    X(int64_t, tokens, 0)                              \
    X(uint64_t, mem_used_bytes, 0)                     \
    X(uint64_t, mem_peak_bytes, 0)                     \
    X(uint64_t, mem_allocs, 0)                         \
    X(uint64_t, mem_refused, 0)                        \
    X(uint64_t, gpa_lookups, 0)                        \
    X(uint64_t, gpa_unmatched, 0)                      \
    X(uint64_t, window_ns, 0)                          \
    X(uint64_t, windows, 0)                            \
    X(uint64_t, window_blocks_last, 0)                 \
    X(double, window_blocks_ema, 0)                    \
    X(uint64_t, cycles, 0)                             \
    X(uint64_t, cycle_current_windows, 0)              \
    X(uint64_t, cycle_min_windows, 0)                  \
    X(uint64_t, cycle_ring, DILU_SHIM_CYCLE_RING)      \
    X(uint64_t, spans, 0)                              \
    X(uint64_t, span_open_ns, 0)                       \
    X(uint32_t, span_ring_us, DILU_SHIM_SPAN_RING)     \
    X(uint64_t, reserved, 1)

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(dilu_shim_control_t) == DILU_SHIM_CONTROL_SIZE, "control block size");
_Static_assert(sizeof(dilu_shim_stats_t) == DILU_SHIM_STATS_SIZE, "stats block size");
_Static_assert(offsetof(dilu_shim_control_t, epoch) == 16, "control epoch offset");
_Static_assert(offsetof(dilu_shim_stats_t, seq) == 16, "stats seq offset");
#endif

/*
 * Introspection exported by libdilu_shim.so (for tests and benchmarks; the
 * manager reads the stats file instead). Returns 0 and fills *out, or -1 when
 * out_size is too small.
 */
#define DILU_SHIM_MODE_PASSTHROUGH 0u
#define DILU_SHIM_MODE_CONTROLLED 1u

typedef struct dilu_shim_info {
    uint32_t abi_version;
    uint32_t mode;
    uint32_t stats_owner; /* 1 when this process publishes the stats block */
    uint32_t refill_running;
    uint64_t launches;
    uint64_t graph_launches;
    uint64_t blocks;
    uint64_t waits;
    uint64_t throttled_ns;
    uint64_t mem_used_bytes;
    uint64_t gpa_lookups;
    uint64_t gpa_unmatched;
    uint64_t flags;
} dilu_shim_info_t;

typedef int (*dilu_shim_query_fn)(dilu_shim_info_t *out, size_t out_size);

#endif /* DILU_SHIM_ABI_H */
