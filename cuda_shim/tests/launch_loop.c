/*
 * A workload for tests driven from Python: launch <count> kernels of <blocks>
 * blocks through the fake driver, sleeping <gap_us> between launches, then
 * print what the shim counted (one JSON object) and exit.
 *
 *   launch_loop <blocks> <count> [gap_us]
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "dilu_shim_abi.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <blocks> <count> [gap_us]\n", argv[0]);
        return 2;
    }
    unsigned blocks = (unsigned)strtoul(argv[1], NULL, 10);
    long count = atol(argv[2]);
    long gap_us = argc > 3 ? atol(argv[3]) : 0;
    struct timespec gap = {gap_us / 1000000, (gap_us % 1000000) * 1000};
    for (long i = 0; i < count; i++) {
        if (cuLaunchKernel(NULL, blocks, 1, 1, 1, 1, 1, 0, (CUstream)0x100, NULL, NULL) != CUDA_SUCCESS)
            return 1;
        if (gap_us) nanosleep(&gap, NULL);
    }
    dilu_shim_query_fn q = (dilu_shim_query_fn)dlsym(RTLD_DEFAULT, "dilu_shim_query");
    dilu_shim_info_t info = {0};
    if (!q || q(&info, sizeof info) != 0) {
        printf("{\"shim\": false}\n");
        return 0;
    }
    printf("{\"shim\": true, \"mode\": %u, \"launches\": %llu, \"blocks\": %llu, \"waits\": %llu}\n", info.mode,
           (unsigned long long)info.launches, (unsigned long long)info.blocks, (unsigned long long)info.waits);
    return 0;
}
