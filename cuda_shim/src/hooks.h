/*
 * The one list of driver entry points the shim hooks, and the one list of
 * driver entry points it only calls. Everything else (enum, real-pointer
 * table, exported prototypes, the name -> wrapper table used by dlsym and
 * cuGetProcAddress) is generated from these lists.
 *
 * DILU_HOOKS(X): X(name, pfn_type, base)
 *   name      exact exported driver symbol; the shim exports a wrapper of the
 *             same name and resolves the real one by this name.
 *   pfn_type  the cudaTypedefs.h function-pointer type of that ABI version.
 *   base      the base name cuGetProcAddress is asked for.
 *
 * DILU_USES(X): X(name, pfn_type)   real entry points the shim calls itself.
 *   A name may be in both lists (cuEventSynchronize): HOOK_ and USE_ enums do
 *   not clash, and USE() always reaches the driver's own entry point, so the
 *   shim's internal waits bypass its wrapper (they must not close request spans).
 */
#ifndef DILU_SHIM_HOOKS_H
#define DILU_SHIM_HOOKS_H

/* cudaTypedefs.h declares the legacy instantiate ABI (v10000 and v11000, the
   same prototype) only for the driver's own build. */
typedef CUresult(CUDAAPI *DILU_PFN_cuGraphInstantiate_legacy)(CUgraphExec *phGraphExec,
                                                               CUgraph hGraph,
                                                               CUgraphNode *phErrorNode,
                                                               char *logBuffer, size_t bufferSize);

#define DILU_HOOKS(X)                                                                     \
    X(cuGetProcAddress, PFN_cuGetProcAddress_v11030, "cuGetProcAddress")                  \
    X(cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000, "cuGetProcAddress")               \
    X(cuLaunchKernel, PFN_cuLaunchKernel_v4000, "cuLaunchKernel")                         \
    X(cuLaunchKernel_ptsz, PFN_cuLaunchKernel_v7000_ptsz, "cuLaunchKernel")               \
    X(cuLaunchKernelEx, PFN_cuLaunchKernelEx_v11060, "cuLaunchKernelEx")                  \
    X(cuLaunchKernelEx_ptsz, PFN_cuLaunchKernelEx_v11060_ptsz, "cuLaunchKernelEx")        \
    X(cuLaunchCooperativeKernel, PFN_cuLaunchCooperativeKernel_v9000,                     \
      "cuLaunchCooperativeKernel")                                                        \
    X(cuLaunchCooperativeKernel_ptsz, PFN_cuLaunchCooperativeKernel_v9000_ptsz,           \
      "cuLaunchCooperativeKernel")                                                        \
    X(cuGraphLaunch, PFN_cuGraphLaunch_v10000, "cuGraphLaunch")                           \
    X(cuGraphLaunch_ptsz, PFN_cuGraphLaunch_v10000_ptsz, "cuGraphLaunch")                 \
    X(cuGraphInstantiate, DILU_PFN_cuGraphInstantiate_legacy, "cuGraphInstantiate")            \
    X(cuGraphInstantiate_v2, DILU_PFN_cuGraphInstantiate_legacy, "cuGraphInstantiate")         \
    X(cuGraphInstantiateWithFlags, PFN_cuGraphInstantiateWithFlags_v11040,                \
      "cuGraphInstantiateWithFlags")                                                      \
    X(cuGraphInstantiateWithParams, PFN_cuGraphInstantiateWithParams_v12000,              \
      "cuGraphInstantiateWithParams")                                                     \
    X(cuGraphInstantiateWithParams_ptsz, PFN_cuGraphInstantiateWithParams_v12000_ptsz,    \
      "cuGraphInstantiateWithParams")                                                     \
    X(cuGraphExecUpdate, PFN_cuGraphExecUpdate_v10020, "cuGraphExecUpdate")               \
    X(cuGraphExecUpdate_v2, PFN_cuGraphExecUpdate_v12000, "cuGraphExecUpdate")            \
    X(cuGraphExecDestroy, PFN_cuGraphExecDestroy_v10000, "cuGraphExecDestroy")            \
    X(cuMemAlloc_v2, PFN_cuMemAlloc_v3020, "cuMemAlloc")                                  \
    X(cuMemAllocPitch_v2, PFN_cuMemAllocPitch_v3020, "cuMemAllocPitch")                   \
    X(cuMemAllocManaged, PFN_cuMemAllocManaged_v6000, "cuMemAllocManaged")                \
    X(cuMemAllocAsync, PFN_cuMemAllocAsync_v11020, "cuMemAllocAsync")                     \
    X(cuMemAllocAsync_ptsz, PFN_cuMemAllocAsync_v11020_ptsz, "cuMemAllocAsync")           \
    X(cuMemAllocFromPoolAsync, PFN_cuMemAllocFromPoolAsync_v11020,                        \
      "cuMemAllocFromPoolAsync")                                                          \
    X(cuMemAllocFromPoolAsync_ptsz, PFN_cuMemAllocFromPoolAsync_v11020_ptsz,              \
      "cuMemAllocFromPoolAsync")                                                          \
    X(cuMemCreate, PFN_cuMemCreate_v10020, "cuMemCreate")                                 \
    X(cuMemFree_v2, PFN_cuMemFree_v3020, "cuMemFree")                                     \
    X(cuMemFreeAsync, PFN_cuMemFreeAsync_v11020, "cuMemFreeAsync")                        \
    X(cuMemFreeAsync_ptsz, PFN_cuMemFreeAsync_v11020_ptsz, "cuMemFreeAsync")              \
    X(cuMemRelease, PFN_cuMemRelease_v10020, "cuMemRelease")                              \
    X(cuMemGetInfo_v2, PFN_cuMemGetInfo_v3020, "cuMemGetInfo")                            \
    X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000, "cuCtxSetCurrent")                      \
    X(cuCtxPushCurrent_v2, PFN_cuCtxPushCurrent_v4000, "cuCtxPushCurrent")                \
    X(cuCtxPopCurrent_v2, PFN_cuCtxPopCurrent_v4000, "cuCtxPopCurrent")                   \
    X(cuCtxCreate_v2, PFN_cuCtxCreate_v3020, "cuCtxCreate")                               \
    X(cuCtxCreate_v3, PFN_cuCtxCreate_v11040, "cuCtxCreate")                              \
    X(cuCtxCreate_v4, PFN_cuCtxCreate_v12050, "cuCtxCreate")                              \
    X(cuCtxSynchronize, PFN_cuCtxSynchronize_v2000, "cuCtxSynchronize")                   \
    X(cuCtxSynchronize_v2, PFN_cuCtxSynchronize_v13000, "cuCtxSynchronize")               \
    X(cuStreamSynchronize, PFN_cuStreamSynchronize_v2000, "cuStreamSynchronize")          \
    X(cuStreamSynchronize_ptsz, PFN_cuStreamSynchronize_v7000_ptsz, "cuStreamSynchronize") \
    X(cuEventSynchronize, PFN_cuEventSynchronize_v2000, "cuEventSynchronize")

#define DILU_USES(X)                                                       \
    X(cuCtxGetDevice, PFN_cuCtxGetDevice_v2000)                            \
    X(cuStreamIsCapturing, PFN_cuStreamIsCapturing_v10000)                 \
    X(cuThreadExchangeStreamCaptureMode, PFN_cuThreadExchangeStreamCaptureMode_v10010) \
    X(cuEventCreate, PFN_cuEventCreate_v2000)                              \
    X(cuEventRecord, PFN_cuEventRecord_v2000)                              \
    X(cuEventQuery, PFN_cuEventQuery_v2000)                                \
    X(cuEventSynchronize, PFN_cuEventSynchronize_v2000)                    \
    X(cuGraphGetNodes, PFN_cuGraphGetNodes_v10000)                         \
    X(cuGraphNodeGetType, PFN_cuGraphNodeGetType_v10000)                   \
    X(cuGraphKernelNodeGetParams, PFN_cuGraphKernelNodeGetParams_v10000)   \
    X(cuGraphKernelNodeGetParams_v2, PFN_cuGraphKernelNodeGetParams_v12000) \
    X(cuGraphChildGraphNodeGetGraph, PFN_cuGraphChildGraphNodeGetGraph_v10000)

#endif /* DILU_SHIM_HOOKS_H */
