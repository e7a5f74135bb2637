// rolling-KV: the CPU part of a hybrid tail on a pool of host threads (see rolling-kv-cpu-part.h), and the
// calibration of its bandwidth (ggml_rkv_cpu_attn_measure_gbps, ggml-rolling-kv.h).

#include "rolling-kv-cpu-part.h"

#include "ggml.h"
#include "ggml-rolling-kv.h"
#include "ggml-rolling-kv-impl.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void rkv_pause() { _mm_pause(); }
#else
static inline void rkv_pause() { std::this_thread::yield(); }
#endif

namespace {

std::atomic<int> g_cpu_threads{0}; // 0: unset
std::atomic<uint64_t> g_runs{0};

// ROLLINGKV_CPU_PART_STATS: the parts' wall time and the K+V bytes they read, printed at exit
std::atomic<uint64_t> g_stat_runs{0};
std::atomic<uint64_t> g_stat_ns{0};
std::atomic<uint64_t> g_stat_bytes{0};

void print_stats() {
    const uint64_t n = g_stat_runs.load(), ns = g_stat_ns.load(), b = g_stat_bytes.load();
    fprintf(stderr, "rolling KV: CPU part: %llu runs, %.1f us each, %.1f GB/s of K+V while running (%.3f GB in %.3f s)\n",
            (unsigned long long) n, n ? ns/1e3/n : 0.0, ns ? b/(double) ns : 0.0, b/1e9, ns/1e9);
}

bool stats_on() {
    static const bool on = [] {
        const bool v = ggml_rkv_get_knobs()->cpu_part_stats;
        if (v) {
            atexit(print_stats);
        }
        return v;
    }();
    return on;
}

int default_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return (int) std::max(1u, std::min(hw ? hw : 4u, 16u));
}

// A pool of worker threads that runs one task at a time over ids [0, nth): the caller is id 0. Between tasks the
// workers spin for a short while (the CPU parts of a decode's layers follow each other within a millisecond or so)
// and then sleep, so an idle process costs nothing.
class rkv_pool {
public:
    ~rkv_pool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_ = true;
            gen_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto & t : workers_) {
            t.join();
        }
    }

    // make the workers of an nth-thread task now (from a thread of the application, not a runtime's callback thread)
    void prepare(int nth) {
        std::lock_guard<std::mutex> one(run_mutex_);
        spawn(nth);
    }

    void run(int nth, const std::function<void(int)> & fn) {
        std::lock_guard<std::mutex> one(run_mutex_); // one job at a time (several GPUs may call at once)
        nth = std::max(1, nth);
        spawn(nth);
        task_ = &fn;
        nth_  = nth;
        pending_.store(nth - 1);
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        fn(0);
        while (pending_.load(std::memory_order_acquire) > 0) {
            rkv_pause();
        }
        task_ = nullptr;
    }

private:
    void spawn(int nth) {
        while ((int) workers_.size() < nth - 1) {
            // the generation before this task's: a worker that starts after the bump below still sees the task
            const int id = (int) workers_.size() + 1;
            const uint64_t seen = gen_.load();
            workers_.emplace_back([this, id, seen] { work(id, seen); });
        }
    }

    void work(int id, uint64_t seen) {
#if defined(__linux__)
        // every CPU: a worker inherits the affinity of the thread that made it (a GPU runtime's callback thread may be
        // confined to one core, which serializes the whole pool)
        cpu_set_t all;
        CPU_ZERO(&all);
        for (unsigned c = 0; c < std::thread::hardware_concurrency() && c < CPU_SETSIZE; ++c) {
            CPU_SET(c, &all);
        }
        pthread_setaffinity_np(pthread_self(), sizeof(all), &all);
#endif
        for (;;) {
            // spin up to ~2 ms for the next task, then sleep
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
                rkv_pause();
                if ((i & 255) == 255 && std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(2)) {
                    std::unique_lock<std::mutex> lk(m_);
                    cv_.wait(lk, [&] { return gen_.load() != seen; });
                    break;
                }
            }
            seen = gen_.load(std::memory_order_acquire);
            if (stop_) {
                return;
            }
            if (id < nth_) {
                (*task_)(id);
                pending_.fetch_sub(1, std::memory_order_release);
            }
        }
    }

    std::vector<std::thread> workers_;
    std::mutex               run_mutex_;
    std::mutex               m_;
    std::condition_variable  cv_;
    std::atomic<uint64_t>    gen_{0};
    std::atomic<int>         pending_{0};
    const std::function<void(int)> * task_ = nullptr;
    int  nth_  = 1;
    bool stop_ = false;
};

rkv_pool & pool() {
    static rkv_pool p;
    return p;
}

} // namespace

uint64_t rkv_cpu_part_runs(void) {
    return g_runs.load();
}

static int rkv_pool_threads(int n_threads) {
    int nth = n_threads > 0 ? n_threads : ggml_rkv_get_cpu_threads();
    // leave a core to the thread that launches and waits for the GPU's work: a pool thread that shares a core with it
    // (or with anything else) holds up the whole part
    const unsigned hw = std::thread::hardware_concurrency();
    if (hw > 1) {
        nth = std::min(nth, (int) hw - 1);
    }
    return std::max(1, nth);
}

void rkv_cpu_pool_run(int nth, const std::function<void(int)> & fn) {
    pool().run(nth, fn);
}

void rkv_cpu_part_prepare(int n_threads) {
    pool().prepare(rkv_pool_threads(n_threads));
}

void rkv_cpu_part_run(const rkv_cpu_part_job & job) {
    g_runs.fetch_add(1, std::memory_order_relaxed);
    const bool stats = stats_on();
    const auto t_start = stats ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    const int64_t n_rows = job.n_stream*job.n_q;
    rkv_cpu_decode_params base = {};
    base.n_head    = job.n_head;
    base.n_head_kv = job.n_head_kv;
    base.D         = job.D;
    base.DV        = job.DV;
    base.k_type    = job.k_type;
    base.v_type    = job.v_type;
    base.k_nb1     = job.k_nb1;
    base.k_nb_head = job.k_nb2;
    base.v_nb1     = job.v_nb1;
    base.v_nb_head = job.v_nb2;
    base.n_cells   = job.n_cells;
    base.slope     = job.slope;
    base.scale     = job.scale;
    base.softcap   = job.softcap;

    auto row_params = [&](int64_t r) {
        const int64_t s = r / job.n_q, t = r % job.n_q;
        rkv_cpu_decode_params p = base;
        p.q    = (const float *) (job.q + t*job.q_nb1 + s*job.q_nb3);
        p.k    = job.k + s*job.k_nb3;
        p.v    = job.v + s*job.v_nb3;
        p.mask = job.mask ? job.mask + ((s % job.n_mask_planes)*job.n_q + t)*job.n_cells : nullptr;
        return p;
    };

    // split the cells into ranges of whole 16-cell blocks, at least 64 cells per thread
    int nth = rkv_pool_threads(job.n_threads);
    nth = (int) std::max<int64_t>(1, std::min<int64_t>(nth, (job.n_cells + 63)/64));
    const size_t part_floats = rkv_cpu_decode_part_floats(base);
    std::vector<float> parts((size_t) n_rows*nth*part_floats);

    const std::function<void(int)> fn = [&](int ith) {
        const int64_t n_blk = (job.n_cells + 15)/16;
        const int64_t c0 = std::min(job.n_cells, n_blk*ith/nth*16);
        const int64_t c1 = std::min(job.n_cells, n_blk*(ith + 1)/nth*16);
        for (int64_t r = 0; r < n_rows; ++r) {
            rkv_cpu_decode_range(row_params(r), c0, c1, parts.data() + ((size_t) r*nth + ith)*part_floats);
        }
    };
    pool().run(nth, fn);

    for (int64_t r = 0; r < n_rows; ++r) {
        rkv_cpu_decode_merge(row_params(r), parts.data() + (size_t) r*nth*part_floats, nth,
            job.o + (size_t) r*job.n_head*job.DV, job.lse + (size_t) r*job.n_head);
    }
    if (stats) {
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_start).count();
        g_stat_runs.fetch_add(1);
        g_stat_ns.fetch_add((uint64_t) ns);
        g_stat_bytes.fetch_add((uint64_t) (job.n_stream*job.n_cells)*(job.k_nb1 + job.v_nb1));
    }
}

//
// the C API (ggml-rolling-kv.h)
//

extern "C" void ggml_rkv_set_cpu_threads(int n_threads) {
    g_cpu_threads.store(n_threads > 0 ? n_threads : 0);
}

extern "C" int ggml_rkv_get_cpu_threads(void) {
    const int n = g_cpu_threads.load();
    return n > 0 ? n : default_threads();
}

extern "C" bool ggml_rkv_cpu_part_supported(enum ggml_type type_k, enum ggml_type type_v, int64_t DK, int64_t DV) {
    return DK <= INT32_MAX && DV <= INT32_MAX && rkv_cpu_decode_supported((int) type_k, (int) type_v, (int) DK, (int) DV);
}

extern "C" double ggml_rkv_cpu_attn_measure_gbps(int n_threads, enum ggml_type type, size_t bytes) {
    // a Llama-like layer: head size 128, 8 KV heads, 4 query heads per KV head, one decode row
    const int D = 128, n_head_kv = 8, n_head = 32;
    if (!ggml_rkv_cpu_part_supported(type, type, D, D)) {
        return -1.0;
    }
    if (bytes == 0) {
        bytes = 256u*1024*1024;
    }
    const size_t row    = ggml_row_size(type, D);        // one head of one cell
    const size_t cell   = row*n_head_kv;                 // K (or V) bytes of one cell
    const int64_t n_cells = std::max<int64_t>(256, (int64_t) (bytes/(2*cell)));

    std::vector<uint8_t> k((size_t) n_cells*cell), v((size_t) n_cells*cell);
    // plausible values: f16 in [-1, 1), block scales of ~0.01 and random quants
    uint64_t x = 0x9e3779b97f4a7c15ull;
    auto next = [&x] { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; };
    for (auto * buf : { &k, &v }) {
        uint8_t * p = buf->data();
        if (type == GGML_TYPE_F16) {
            for (size_t i = 0; i < buf->size()/2; ++i) {
                ((ggml_fp16_t *) p)[i] = ggml_fp32_to_fp16((float) ((int64_t) (next() % 2000) - 1000)/1000.0f);
            }
        } else {
            for (size_t i = 0; i + 8 <= buf->size(); i += 8) {
                const uint64_t r = next();
                memcpy(p + i, &r, 8);
            }
            const size_t blk = ggml_type_size(type); // the f16 scale leads each block
            const ggml_fp16_t d = ggml_fp32_to_fp16(0.01f);
            for (size_t i = 0; i + blk <= buf->size(); i += blk) {
                memcpy(p + i, &d, sizeof(d));
            }
        }
    }
    std::vector<float> q((size_t) n_head*D, 0.01f), o((size_t) n_head*D), lse(n_head);

    rkv_cpu_part_job job = {};
    job.n_head = n_head; job.n_head_kv = n_head_kv; job.D = D; job.DV = D;
    job.k_type = type; job.v_type = type;
    job.n_q = 1; job.n_stream = 1; job.n_cells = n_cells;
    job.q = (const uint8_t *) q.data(); job.q_nb1 = q.size()*sizeof(float); job.q_nb3 = job.q_nb1;
    job.k = k.data(); job.k_nb1 = cell; job.k_nb2 = row; job.k_nb3 = k.size();
    job.v = v.data(); job.v_nb1 = cell; job.v_nb2 = row; job.v_nb3 = v.size();
    job.mask = nullptr; job.n_mask_planes = 1; job.slope = nullptr;
    job.scale = 1.0f/sqrtf((float) D); job.softcap = 0.0f;
    job.o = o.data(); job.lse = lse.data();
    job.n_threads = n_threads;

    double best = 1e30;
    for (int rep = 0; rep < 4; ++rep) { // the first run wakes the pool and warms the TLB
        const auto t0 = std::chrono::steady_clock::now();
        rkv_cpu_part_run(job);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) {
            best = std::min(best, s);
        }
    }
    return (double) (k.size() + v.size())/best/1e9;
}
