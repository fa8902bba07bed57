// GPU side of the shim benchmarks (issue 3, (a)-(e)); driven by bench/shim/h200.py.
//
//   gpu_bench enqueue  --grid G --batches N            host enqueue time of empty kernels
//   gpu_bench burn     --blocks B --iters I --seconds S [--start-at NS] [--bin-ms M]
//                      [--control PATH --flip T_MS:RATE ...]
//                                                      compute-bound loop, GPU completion times
//   gpu_bench threads  --threads T --launches N        T threads launching on their own streams
//   gpu_bench memcap                                   exact memory cap through cudart
//
// Every mode prints one JSON object on stdout. Build: nvcc -O2 -arch=sm_90 -I cuda_shim/include.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dilu_shim_abi.h"

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(3);                                                                            \
        }                                                                                       \
    } while (0)

static uint64_t mono_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
    timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) != 0) {
    }
}

struct Args {
    std::vector<std::string> v;
    const char *get(const char *name, const char *def) const {
        for (size_t i = 0; i + 1 < v.size(); i++)
            if (v[i] == name) return v[i + 1].c_str();
        return def;
    }
    std::vector<std::string> all(const char *name) const {
        std::vector<std::string> out;
        for (size_t i = 0; i + 1 < v.size(); i++)
            if (v[i] == name) out.push_back(v[i + 1]);
        return out;
    }
};

static double pct(std::vector<double> x, double p) {
    if (x.empty()) return 0;
    std::sort(x.begin(), x.end());
    size_t i = (size_t)(p * (double)(x.size() - 1) + 0.5);
    return x[std::min(i, x.size() - 1)];
}

// ---- kernels ------------------------------------------------------------------------
__global__ void empty_kernel() {}

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void read_timer(unsigned long long *out) { *out = globaltimer(); }

// Eight independent FMA chains per thread keep the FP32 pipes busy; the last
// block to finish stamps the kernel's completion time.
__global__ void burn_kernel(int iters, unsigned *done, unsigned long long *stamps, unsigned seq, float *sink) {
    float a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5, a6 = a0 + 6, a7 = a0 + 7;
    for (int i = 0; i < iters; i++) {
        a0 = fmaf(a0, 0.999999f, 0.5f); a1 = fmaf(a1, 0.999999f, 0.5f);
        a2 = fmaf(a2, 0.999999f, 0.5f); a3 = fmaf(a3, 0.999999f, 0.5f);
        a4 = fmaf(a4, 0.999999f, 0.5f); a5 = fmaf(a5, 0.999999f, 0.5f);
        a6 = fmaf(a6, 0.999999f, 0.5f); a7 = fmaf(a7, 0.999999f, 0.5f);
    }
    float s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    if (s == -1.0f) *sink = s; // never true; keeps the loop alive
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned nblocks = gridDim.x * gridDim.y * gridDim.z;
        if (atomicAdd(&done[seq], 1u) == nblocks - 1) stamps[seq] = globaltimer();
    }
}

// ---- globaltimer -> CLOCK_MONOTONIC ----------------------------------------------------
static long long timer_offset_ns(double *err_ns) {
    unsigned long long *d;
    CK(cudaMalloc(&d, sizeof *d));
    long long best_off = 0;
    uint64_t best = ~0ull;
    for (int i = 0; i < 50; i++) {
        unsigned long long g = 0;
        uint64_t t1 = mono_ns();
        read_timer<<<1, 1>>>(d);
        CK(cudaMemcpy(&g, d, sizeof g, cudaMemcpyDeviceToHost));
        uint64_t t2 = mono_ns();
        if (t2 - t1 < best) {
            best = t2 - t1;
            best_off = (long long)g - (long long)((t1 + t2) / 2);
        }
    }
    CK(cudaFree(d));
    *err_ns = (double)best / 2;
    return best_off;
}

// ---- control block writer (the benchmark plays the manager for (c)) ------------------
static void control_write_rate(dilu_shim_control_t *c, double rate) {
    uint64_t e = __atomic_load_n(&c->epoch, __ATOMIC_RELAXED);
    e += e & 1;
    __atomic_store_n(&c->epoch, e + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    c->rate_blocks_per_ms = rate;
    __atomic_store_n(&c->manager_heartbeat_ns, mono_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&c->epoch, e + 2, __ATOMIC_RELEASE);
}

// ---- modes ---------------------------------------------------------------------------
static int mode_enqueue(const Args &a) {
    int grid = atoi(a.get("--grid", "1"));
    int batches = atoi(a.get("--batches", "2000"));
    const int batch = 256;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int i = 0; i < 200; i++) empty_kernel<<<grid, 1, 0, s>>>();
    CK(cudaStreamSynchronize(s));
    std::vector<double> per, sync_rt;
    per.reserve(batches);
    for (int b = 0; b < batches; b++) {
        uint64_t t0 = mono_ns();
        for (int i = 0; i < batch; i++) empty_kernel<<<grid, 1, 0, s>>>();
        uint64_t t1 = mono_ns();
        per.push_back((double)(t1 - t0) / batch / 1e3);
        CK(cudaStreamSynchronize(s));
    }
    for (int i = 0; i < 500; i++) {
        uint64_t t0 = mono_ns();
        empty_kernel<<<grid, 1, 0, s>>>();
        CK(cudaStreamSynchronize(s));
        sync_rt.push_back((double)(mono_ns() - t0) / 1e3);
    }
    CK(cudaGetLastError());
    printf("{\"mode\": \"enqueue\", \"grid\": %d, \"batches\": %d, \"batch\": %d, \"enqueue_us_p50\": %.4f, "
           "\"enqueue_us_p90\": %.4f, \"enqueue_us_min\": %.4f, \"launch_sync_us_p50\": %.3f, \"launch_sync_us_p99\": %.3f}\n",
           grid, batches, batch, pct(per, 0.5), pct(per, 0.9), pct(per, 0.0), pct(sync_rt, 0.5), pct(sync_rt, 0.99));
    return 0;
}

static int mode_burn(const Args &a) {
    int blocks = atoi(a.get("--blocks", "528"));
    int iters = atoi(a.get("--iters", "4096"));
    int threads = atoi(a.get("--threads-per-block", "256"));
    double seconds = atof(a.get("--seconds", "3"));
    double skip_ms = atof(a.get("--skip-ms", "500"));
    double bin_ms = atof(a.get("--bin-ms", "0"));
    uint64_t start_at = strtoull(a.get("--start-at", "0"), nullptr, 10);
    const unsigned max_kernels = 4u << 20;

    unsigned *done;
    unsigned long long *stamps;
    float *sink;
    CK(cudaMalloc(&done, max_kernels * sizeof *done));
    CK(cudaMalloc(&stamps, max_kernels * sizeof *stamps));
    CK(cudaMalloc(&sink, sizeof *sink));
    CK(cudaMemset(done, 0, max_kernels * sizeof *done));
    CK(cudaMemset(stamps, 0, max_kernels * sizeof *stamps));
    double off_err = 0;
    long long off = timer_offset_ns(&off_err);

    // warm-up kernels (not measured) use the top of the arrays
    unsigned warm_base = max_kernels - 64;
    for (unsigned i = 0; i < 8; i++) burn_kernel<<<blocks, threads>>>(iters, done, stamps, warm_base + i, sink);
    CK(cudaDeviceSynchronize());
    // one solo kernel time, for information
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    burn_kernel<<<blocks, threads>>>(iters, done, stamps, warm_base + 8, sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float kernel_ms = 0;
    CK(cudaEventElapsedTime(&kernel_ms, e0, e1));

    // flips of the control block's rate (reaction benchmark)
    dilu_shim_control_t *ctl = nullptr;
    const char *ctl_path = a.get("--control", nullptr);
    std::vector<std::pair<double, double>> flips;
    for (auto &f : a.all("--flip")) {
        double t = 0, r = 0;
        if (sscanf(f.c_str(), "%lf:%lf", &t, &r) == 2) flips.push_back({t, r});
    }
    if (ctl_path && !flips.empty()) {
        int fd = open(ctl_path, O_RDWR);
        if (fd < 0) { perror(ctl_path); return 4; }
        void *p = mmap(nullptr, sizeof(dilu_shim_control_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) { perror("mmap"); return 4; }
        ctl = (dilu_shim_control_t *)p;
    }

    uint64_t start = start_at ? start_at : mono_ns() + 20000000ull;
    sleep_until(start);
    uint64_t end = start + (uint64_t)(seconds * 1e9);
    std::vector<uint64_t> flip_done(flips.size(), 0);
    std::thread flipper;
    if (ctl) {
        flipper = std::thread([&] {
            for (size_t i = 0; i < flips.size(); i++) {
                sleep_until(start + (uint64_t)(flips[i].first * 1e6));
                control_write_rate(ctl, flips[i].second);
                flip_done[i] = mono_ns();
            }
        });
    }
    unsigned seq = 0;
    while (mono_ns() < end && seq < warm_base) burn_kernel<<<blocks, threads>>>(iters, done, stamps, seq++, sink);
    uint64_t last_launch = mono_ns();
    CK(cudaDeviceSynchronize());
    if (flipper.joinable()) flipper.join();
    CK(cudaGetLastError());

    std::vector<unsigned long long> st(seq);
    CK(cudaMemcpy(st.data(), stamps, seq * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    // completion times relative to start, in host CLOCK_MONOTONIC
    std::vector<double> t_ms(seq);
    unsigned missing = 0;
    for (unsigned i = 0; i < seq; i++) {
        if (!st[i]) { missing++; t_ms[i] = -1; continue; }
        t_ms[i] = ((double)((long long)st[i] - off) - (double)start) / 1e6;
    }
    double w0 = skip_ms, w1 = seconds * 1e3 - skip_ms;
    unsigned in_window = 0;
    for (double t : t_ms) in_window += (t >= w0 && t < w1);
    double bpms = w1 > w0 ? (double)in_window * blocks / (w1 - w0) : 0;

    printf("{\"mode\": \"burn\", \"blocks\": %d, \"iters\": %d, \"threads_per_block\": %d, \"seconds\": %.3f, "
           "\"kernels\": %u, \"missing_stamps\": %u, \"kernel_ms_solo\": %.4f, \"window_ms\": [%.1f, %.1f], "
           "\"kernels_in_window\": %u, \"blocks_per_ms\": %.3f, \"timer_offset_err_us\": %.2f, "
           "\"start_ns\": %llu, \"last_launch_ms\": %.3f",
           blocks, iters, threads, seconds, seq, missing, kernel_ms, w0, w1, in_window, bpms, off_err / 1e3,
           (unsigned long long)start, (double)(last_launch - start) / 1e6);
    if (!flips.empty()) {
        printf(", \"flips\": [");
        for (size_t i = 0; i < flips.size(); i++)
            printf("%s{\"at_ms\": %.4f, \"rate\": %.4f}", i ? ", " : "",
                   flip_done[i] ? (double)(flip_done[i] - start) / 1e6 : -1.0, flips[i].second);
        printf("]");
    }
    if (bin_ms > 0) {
        size_t nb = (size_t)(seconds * 1e3 / bin_ms) + 1;
        std::vector<double> bins(nb, 0.0);
        for (double t : t_ms)
            if (t >= 0 && t < (double)nb * bin_ms) bins[(size_t)(t / bin_ms)] += blocks;
        printf(", \"bin_ms\": %.3f, \"bins_blocks\": [", bin_ms);
        for (size_t i = 0; i < nb; i++) printf("%s%.0f", i ? ", " : "", bins[i]);
        printf("]");
    }
    printf("}\n");
    return 0;
}

static int mode_threads(const Args &a) {
    int nthreads = atoi(a.get("--threads", "64"));
    int launches = atoi(a.get("--launches", "500"));
    int grid = atoi(a.get("--grid", "4"));
    CK(cudaFree(nullptr));
    std::atomic<int> errors{0};
    uint64_t t0 = mono_ns();
    std::vector<std::thread> ts;
    for (int t = 0; t < nthreads; t++) {
        ts.emplace_back([&] {
            if (cudaSetDevice(0) != cudaSuccess) { errors++; return; }
            cudaStream_t s;
            if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) { errors++; return; }
            for (int i = 0; i < launches; i++) empty_kernel<<<grid, 32, 0, s>>>();
            if (cudaStreamSynchronize(s) != cudaSuccess) errors++;
            cudaStreamDestroy(s);
        });
    }
    for (auto &t : ts) t.join();
    double ms = (double)(mono_ns() - t0) / 1e6;
    printf("{\"mode\": \"threads\", \"threads\": %d, \"launches_per_thread\": %d, \"grid\": %d, \"elapsed_ms\": %.3f, "
           "\"errors\": %d}\n",
           nthreads, launches, grid, ms, errors.load());
    return errors.load() ? 5 : 0;
}

static int mode_memcap(const Args &) {
    size_t fr0 = 0, tot0 = 0;
    CK(cudaMemGetInfo(&fr0, &tot0));
    // A first allocation, so that whatever cudart allocates lazily is already counted.
    void *warm = nullptr, *a = nullptr, *b = nullptr;
    CK(cudaMalloc(&warm, fr0 / 2));
    size_t fr1 = 0, tot1 = 0;
    CK(cudaMemGetInfo(&fr1, &tot1));
    cudaError_t all = cudaMalloc(&a, fr1);            // exactly what is left under the cap
    size_t fr_rest = 0, tot_rest = 0;
    cudaMemGetInfo(&fr_rest, &tot_rest);
    cudaError_t one_more = cudaMalloc(&b, 1);         // one byte over
    cudaGetLastError();
    cudaError_t freed = a ? cudaFree(a) : cudaErrorInvalidValue;
    size_t fr2 = 0, tot2 = 0;
    cudaMemGetInfo(&fr2, &tot2);
    // stream-ordered allocations are capped too
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    void *c = nullptr, *d = nullptr;
    cudaError_t async_all = cudaMallocAsync(&c, fr2, s);
    cudaError_t async_more = cudaMallocAsync(&d, 1, s);
    cudaGetLastError();
    if (c) cudaFreeAsync(c, s);
    cudaStreamSynchronize(s);
    cudaGetLastError();
    cudaFree(warm);
    printf("{\"mode\": \"memcap\", \"total0\": %zu, \"free0\": %zu, \"free_before_rest\": %zu, \"alloc_rest\": %d, "
           "\"free_after_rest\": %zu, \"alloc_one_more\": %d, \"alloc_one_more_name\": \"%s\", \"free_rc\": %d, "
           "\"free_after_free\": %zu, \"async_rest\": %d, \"async_one_more\": %d}\n",
           tot0, fr0, fr1, (int)all, fr_rest, (int)one_more, cudaGetErrorName(one_more), (int)freed, fr2,
           (int)async_all, (int)async_more);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s enqueue|burn|threads|memcap [options]\n", argv[0]);
        return 2;
    }
    Args a;
    for (int i = 2; i < argc; i++) a.v.push_back(argv[i]);
    std::string m = argv[1];
    if (m == "enqueue") return mode_enqueue(a);
    if (m == "burn") return mode_burn(a);
    if (m == "threads") return mode_threads(a);
    if (m == "memcap") return mode_memcap(a);
    fprintf(stderr, "unknown mode %s\n", m.c_str());
    return 2;
}
