/*
 * Memory family: a per-process device-memory cap, exact to the byte of the
 * requested sizes. The size is reserved against the cap before the driver is
 * called (so concurrent allocations can never overshoot), released if the
 * driver fails, and returned on free, found by pointer (or by handle for
 * cuMemCreate). cuMemGetInfo reports the cap as total memory.
 *
 * Not counted: the driver's own rounding and context overhead, arrays
 * (cuArrayCreate), host memory, and allocations made while a stream captures
 * (the graph owns them).
 */
#include "shim_internal.h"

static struct dilu_ptrmap g_ptrs = {.bits = 20};
static struct dilu_ptrmap g_handles = {.bits = 16};
static _Atomic uint64_t g_mem_used, g_mem_peak, g_mem_allocs, g_mem_refused, g_mem_cap;

void dilu_memory_set_cap(uint64_t cap) { atomic_store(&g_mem_cap, cap); }
uint64_t dilu_memory_cap(void) { return atomic_load(&g_mem_cap); }

void dilu_memory_snapshot(uint64_t *used, uint64_t *peak, uint64_t *allocs, uint64_t *refused) {
    *used = atomic_load(&g_mem_used);
    *peak = atomic_load(&g_mem_peak);
    *allocs = atomic_load(&g_mem_allocs);
    *refused = atomic_load(&g_mem_refused);
}

static bool reserve(uint64_t bytes) {
    uint64_t cap = atomic_load(&g_mem_cap);
    uint64_t cur = atomic_load(&g_mem_used);
    uint64_t nv;
    do {
        if (cap && (bytes > cap || cur > cap - bytes)) return false;
        nv = cur + bytes;
    } while (!atomic_compare_exchange_weak(&g_mem_used, &cur, nv));
    uint64_t peak = atomic_load(&g_mem_peak);
    while (nv > peak && !atomic_compare_exchange_weak(&g_mem_peak, &peak, nv)) {
    }
    return true;
}

static void unreserve(uint64_t bytes) { atomic_fetch_sub(&g_mem_used, bytes); }

static CUresult refuse(uint64_t bytes) {
    atomic_fetch_add(&g_mem_refused, 1);
    DLOG(LOG_DEBUG, "refusing %llu bytes: cap %llu, in use %llu", (unsigned long long)bytes,
         (unsigned long long)atomic_load(&g_mem_cap), (unsigned long long)atomic_load(&g_mem_used));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static void track(struct dilu_ptrmap *m, uintptr_t key, uint64_t bytes) {
    atomic_fetch_add(&g_mem_allocs, 1);
    /* Untrackable: keep it charged (never under-enforce the cap) and say so. */
    if (!dilu_ptrmap_insert(m, key, bytes)) atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_TABLE_FULL);
}

static void untrack(uint64_t bytes) {
    atomic_fetch_sub(&g_mem_allocs, 1);
    unreserve(bytes);
}

/* Free-side bookkeeping: forget the entry before the driver can reuse the
   address, put it back if the driver refuses the free. */
#define FREE_TRACKED(map, key, call)                                   \
    do {                                                               \
        uint64_t sz_ = 0;                                              \
        bool had_ = g_track_memory && dilu_ptrmap_remove((map), (key), &sz_); \
        CUresult r_ = (call);                                          \
        if (had_) {                                                    \
            if (r_ == CUDA_SUCCESS)                                    \
                untrack(sz_);                                          \
            else if (!dilu_ptrmap_insert((map), (key), sz_))           \
                atomic_fetch_or(&g_sticky_flags, DILU_STATS_F_TABLE_FULL); \
        }                                                              \
        return r_;                                                     \
    } while (0)

/* ---- allocations --------------------------------------------------------- */
DILU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    dilu_enter();
    if (!REAL(cuMemAlloc_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!g_track_memory) return REAL(cuMemAlloc_v2)(dptr, bytesize);
    if (!reserve(bytesize)) return refuse(bytesize);
    CUresult r = REAL(cuMemAlloc_v2)(dptr, bytesize);
    if (r != CUDA_SUCCESS || !dptr) {
        unreserve(bytesize);
        return r;
    }
    track(&g_ptrs, (uintptr_t)*dptr, bytesize);
    return r;
}

DILU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    dilu_enter();
    if (!REAL(cuMemAllocManaged)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!g_track_memory) return REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    if (!reserve(bytesize)) return refuse(bytesize);
    CUresult r = REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    if (r != CUDA_SUCCESS || !dptr) {
        unreserve(bytesize);
        return r;
    }
    track(&g_ptrs, (uintptr_t)*dptr, bytesize);
    return r;
}

DILU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                        size_t Height, unsigned int ElementSizeBytes) {
    dilu_enter();
    PFN_cuMemAllocPitch_v3020 real = REAL(cuMemAllocPitch_v2);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    uint64_t want;
    if (!g_track_memory || __builtin_mul_overflow((uint64_t)WidthInBytes, (uint64_t)Height, &want))
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* The pitch is known only afterwards: reserve the lower bound, then the rest. */
    if (!reserve(want)) return refuse(want);
    CUresult r = real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS || !dptr || !pPitch) {
        unreserve(want);
        return r;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > want && !reserve(actual - want)) {
        if (REAL(cuMemFree_v2)) REAL(cuMemFree_v2)(*dptr);
        unreserve(want);
        *dptr = 0;
        return refuse(actual);
    }
    if (actual < want) unreserve(want - actual);
    track(&g_ptrs, (uintptr_t)*dptr, actual);
    return r;
}

#define ALLOC_ASYNC(real, ptsz, stream, ...)                                  \
    do {                                                                      \
        dilu_enter();                                                              \
        if (!(real)) return CUDA_ERROR_NOT_INITIALIZED;                       \
        if (!g_track_memory || dilu_stream_capturing((stream), (ptsz)))       \
            return (real)(__VA_ARGS__);                                       \
        if (!reserve(bytesize)) return refuse(bytesize);                      \
        CUresult r_ = (real)(__VA_ARGS__);                                    \
        if (r_ != CUDA_SUCCESS || !dptr) {                                    \
            unreserve(bytesize);                                              \
            return r_;                                                        \
        }                                                                     \
        track(&g_ptrs, (uintptr_t)*dptr, bytesize);                           \
        return r_;                                                            \
    } while (0)

DILU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ALLOC_ASYNC(REAL(cuMemAllocAsync), false, hStream, dptr, bytesize, hStream);
}

DILU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ALLOC_ASYNC(REAL(cuMemAllocAsync_ptsz), true, hStream, dptr, bytesize, hStream);
}

DILU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream) {
    ALLOC_ASYNC(REAL(cuMemAllocFromPoolAsync), false, hStream, dptr, bytesize, pool, hStream);
}

DILU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                  CUmemoryPool pool, CUstream hStream) {
    ALLOC_ASYNC(REAL(cuMemAllocFromPoolAsync_ptsz), true, hStream, dptr, bytesize, pool, hStream);
}

DILU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    dilu_enter();
    if (!REAL(cuMemCreate)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!g_track_memory) return REAL(cuMemCreate)(handle, size, prop, flags);
    if (!reserve(size)) return refuse(size);
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
    if (r != CUDA_SUCCESS || !handle) {
        unreserve(size);
        return r;
    }
    track(&g_handles, (uintptr_t)*handle, size);
    return r;
}

/* ---- frees ------------------------------------------------------------------- */
DILU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    dilu_enter();
    if (!REAL(cuMemFree_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_TRACKED(&g_ptrs, (uintptr_t)dptr, REAL(cuMemFree_v2)(dptr));
}

DILU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    dilu_enter();
    if (!REAL(cuMemFreeAsync)) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_TRACKED(&g_ptrs, (uintptr_t)dptr, REAL(cuMemFreeAsync)(dptr, hStream));
}

DILU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    dilu_enter();
    if (!REAL(cuMemFreeAsync_ptsz)) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_TRACKED(&g_ptrs, (uintptr_t)dptr, REAL(cuMemFreeAsync_ptsz)(dptr, hStream));
}

DILU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    dilu_enter();
    if (!REAL(cuMemRelease)) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_TRACKED(&g_handles, (uintptr_t)handle, REAL(cuMemRelease)(handle));
}

/* ---- what the process sees --------------------------------------------------- */
DILU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    dilu_enter();
    if (!REAL(cuMemGetInfo_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuMemGetInfo_v2)(free_bytes, total_bytes);
    uint64_t cap = atomic_load(&g_mem_cap);
    if (r != CUDA_SUCCESS || !g_track_memory || cap == 0) return r;
    uint64_t used = atomic_load(&g_mem_used);
    uint64_t avail = used >= cap ? 0 : cap - used;
    if (total_bytes && *total_bytes > cap) *total_bytes = (size_t)cap;
    if (free_bytes && *free_bytes > avail) *free_bytes = (size_t)avail;
    return r;
}
