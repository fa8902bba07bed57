/*
 * Cost of the shim's launch path, measured against the fake driver (whose
 * cuLaunchKernel only counts), so GPU and driver noise stay out of it.
 *
 *   fastpath_bench <label> [--limited] [--sync] [calls]
 *
 * Run it without LD_PRELOAD (baseline), with the shim and no control file
 * (pass-through), and with --limited (a control block whose rate is finite but
 * so high that nothing ever waits). --sync follows every launch with a
 * cuCtxSynchronize, the path where the shim opens and closes a request span
 * each time. Prints one JSON object: nanoseconds per call (launch, or launch +
 * sync), min and median over 9 repetitions.
 */
#include <cuda.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "dilu_shim_abi.h"

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A control block with a finite, never-binding rate. */
static char path[] = "/tmp/dilu-fastpath-XXXXXX";

static void make_limited_control(void) {
    int fd = mkstemp(path);
    if (fd < 0 || ftruncate(fd, sizeof(dilu_shim_control_t)) != 0) exit(2);
    dilu_shim_control_t *c = mmap(NULL, sizeof *c, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (c == MAP_FAILED) exit(2);
    c->magic = DILU_SHIM_CONTROL_MAGIC;
    c->version = DILU_SHIM_ABI_VERSION;
    c->size = sizeof *c;
    c->rate_blocks_per_ms = 1e12;
    c->burst_blocks = 1ull << 60;
    c->epoch = 2;
    close(fd);
    setenv("DILU_SHIM_CONTROL", path, 1);
    unsetenv("DILU_SHIM_STATS");
}

int main(int argc, char **argv) {
    const char *label = argc > 1 ? argv[1] : "run";
    long calls = 5000000;
    int limited = 0, sync = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--limited")) limited = 1;
        else if (!strcmp(argv[i], "--sync")) sync = 1;
        else calls = atol(argv[i]);
    }
    if (limited) make_limited_control();
    CUstream s = (CUstream)0x100;
    cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL); /* lazy init outside the timing */
    if (limited) unlink(path); /* mapped by now */
    enum { REPS = 9 };
    double per[REPS];
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (long i = 0; i < calls; i++) {
            cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
            if (sync) cuCtxSynchronize();
        }
        per[r] = (now_ns() - t0) / (double)calls;
    }
    qsort(per, REPS, sizeof *per, cmp);
    printf("{\"label\": \"%s\", \"limited\": %s, \"sync\": %s, \"calls\": %ld, \"ns_per_call_min\": %.3f, "
           "\"ns_per_call_median\": %.3f}\n",
           label, limited ? "true" : "false", sync ? "true" : "false", calls, per[0], per[REPS / 2]);
    return 0;
}
