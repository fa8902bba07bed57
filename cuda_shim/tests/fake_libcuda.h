/*
 * Test-only API of the fake libcuda.so.1 (tests/fake_libcuda.c). The fake
 * implements the driver entry points the shim touches, with the real
 * cuGetProcAddress contract, and records every call by exported name.
 *
 * Environment (read at first use):
 *   FAKE_CUDA_DEVICES    number of devices (default 1)
 *   FAKE_CUDA_BLOCK_NS   simulated GPU time per thread block; kernels then run
 *                        one after another on a virtual timeline, and events
 *                        complete when the timeline reaches them (default 0)
 *   FAKE_CUDA_MEM_TOTAL  device memory in bytes (default 80 GiB)
 */
#ifndef FAKE_LIBCUDA_H
#define FAKE_LIBCUDA_H

#include <cuda.h>
#include <stdint.h>

/* A stream that reports CU_STREAM_CAPTURE_STATUS_ACTIVE. */
#define FAKE_CAPTURE_STREAM ((CUstream)0xCAFE)
/* Context handle of device d. */
#define FAKE_CONTEXT(d) ((CUcontext)(uintptr_t)(0x1000 + (d)))

long fake_count(const char *exported_name);
const char *fake_last(void);
uint64_t fake_total_blocks(void);
uint64_t fake_pending_ns(void);
uint64_t fake_mem_used(void);

CUgraph fake_graph_create(void);
void fake_graph_add_kernel(CUgraph g, unsigned gx, unsigned gy, unsigned gz);
void fake_graph_add_child(CUgraph g, CUgraph child);
void fake_graph_add_empty(CUgraph g);

/* Make CU_STREAM_PER_THREAD (and NULL under _ptsz) of this thread capture. */
void fake_set_per_thread_capturing(int on);

/* Every synchronize (context, stream, event) waits for the virtual timeline,
   then returns `result` (persistent). `during`, if set, runs once inside the
   next synchronize, after its entry and before it returns. */
void fake_set_sync(CUresult result, void (*during)(void));

#endif
