// rolling-KV: the CPU part of a hybrid tail on a pool of host threads (see rolling-kv-cpu-part.h), the calibration
// of its bandwidth (ggml_rkv_cpu_attn_measure_gbps, ggml-rolling-kv.h), and the names the CPU backend's registry
// answers for them (ggml_rkv_cpu_get_proc_address).

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
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#include <immintrin.h>
static inline void rkv_pause() { _mm_pause(); }
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
static inline void rkv_pause() { __asm__ __volatile__("yield" ::: "memory"); }
#else
static inline void rkv_pause() { std::this_thread::yield(); }
#endif

namespace {

std::atomic<uint64_t> g_runs{0};
std::atomic<uint64_t> g_calib_runs{0};
std::atomic<uint64_t> g_sleeps{0}; // the pool's workers that slept between tasks (the spin ran out)

// ROLLINGKV_CPU_PART_STATS: per part, its wall time (from the call to the merged result), how late its threads
// started after the task was posted, the busiest and the idlest thread's work, the gap since the previous part
// ended, the K+V bytes; printed at exit: where a hybrid decode's time goes, next to the token time llama-bench reports
struct part_stats {
    std::mutex m;
    uint64_t runs = 0, bytes = 0;
    double wall = 0, late_max = 0, busy_max = 0, busy_min = 0, gap = 0, busy_sum = 0, oncpu_sum = 0;
    uint64_t gaps = 0;
    std::vector<double> walls, gaps_v;  // for the quantiles: the last STATS_SAMPLES of each (a server runs for days)
    int threads = 0, caller_cpus = 0;
    std::chrono::steady_clock::time_point last_end;
    bool have_last = false;
};
part_stats g_stats;
constexpr size_t STATS_SAMPLES = 1u << 16;

void keep_sample(std::vector<double> & v, uint64_t i, double x) {
    if (v.size() < STATS_SAMPLES) {
        v.push_back(x);
    } else {
        v[i % STATS_SAMPLES] = x;
    }
}

void print_stats() {
    part_stats & s = g_stats;
    std::lock_guard<std::mutex> lk(s.m);
    const double n = s.runs ? (double) s.runs : 1.0;
    std::vector<double> w = s.walls;
    std::sort(w.begin(), w.end());
    std::vector<double> g = s.gaps_v;
    std::sort(g.begin(), g.end());
    auto q = [&](double f) { return w.empty() ? 0.0 : w[std::min(w.size() - 1, (size_t) (f*(double) w.size()))]; };
    const double gap_p50 = g.empty() ? 0.0 : g[g.size()/2];
    fprintf(stderr,
            "rolling KV: CPU part: %llu runs, %.1f us each (p50 %.1f, p90 %.1f, max %.1f), %.1f GB/s of K+V while "
            "running (%.3f GB in %.3f s); %d threads, the caller may run on %d CPUs\n",
            (unsigned long long) s.runs, s.wall/n*1e6, q(0.5)*1e6, q(0.9)*1e6, q(1.0)*1e6,
            s.wall > 0 ? s.bytes/s.wall/1e9 : 0.0, s.bytes/1e9, s.wall, s.threads, s.caller_cpus);
    fprintf(stderr,
            "rolling KV: CPU part: per part, the last thread started %.1f us after the post, the busiest thread worked "
            "%.1f us (its chunks and merges), the idlest %.1f us; from one part's end to the next one's start %.1f us "
            "(p50 %.1f); the threads were on a CPU %.0f%% of their working time; the workers fell asleep %llu times "
            "between tasks (%.2f per part; ROLLINGKV_CPU_PART_SPIN_US=%d)\n",
            s.late_max/n*1e6, s.busy_max/n*1e6, s.busy_min/n*1e6, s.gaps ? s.gap/(double) s.gaps*1e6 : 0.0, gap_p50*1e6,
            s.busy_sum > 0 ? 100.0*s.oncpu_sum/s.busy_sum : 0.0, (unsigned long long) g_sleeps.load(),
            (double) g_sleeps.load()/n, ggml_rkv_get_knobs()->cpu_part_spin_us);
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

// CPU time of the calling thread (s): next to its wall time, how long it was descheduled
double thread_cpu_s() {
#if defined(__linux__)
    timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
        return ts.tv_sec + ts.tv_nsec*1e-9;
    }
#endif
    return 0.0;
}

int caller_cpus() {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        return CPU_COUNT(&set);
    }
#endif
    return 0;
}

// The CPUs this process may run on, read once: the main thread's affinity (what taskset, numactl or the application
// set for the process; sched_getaffinity of the process id, not of the calling thread, which may be a GPU runtime's
// callback thread confined to one core). The pool's workers run on these and on no other.
struct proc_cpus {
    int n = 0;
#if defined(__linux__)
    cpu_set_t set;
    bool have_set = false;
#endif
};

const proc_cpus & process_cpus() {
    static const proc_cpus pc = [] {
        proc_cpus r;
#if defined(__linux__)
        CPU_ZERO(&r.set);
        if (sched_getaffinity(getpid(), sizeof(r.set), &r.set) == 0 && CPU_COUNT(&r.set) > 0) {
            r.have_set = true;
            r.n = CPU_COUNT(&r.set);
            return r;
        }
#endif
        const unsigned hw = std::thread::hardware_concurrency();
        r.n = hw ? (int) hw : 4;
        return r;
    }();
    return pc;
}

int usable_cpus() { return process_cpus().n; }

// The CPU part reads memory: its speed grows with the threads up to the memory's bandwidth (H200 host: 4 threads 22
// GB/s, 15 threads 65 GB/s), so it takes every CPU but one (left to the thread that launches the GPU's work), not
// the context's -t (a heuristic for matrix work on the CPU: 4 on that host). ROLLINGKV_CPU_PART_THREADS sets it; at
// most the process's CPUs either way (more threads only wait for each other).
int part_threads(int requested) {
    const int n = requested > 0 ? requested : std::max(1, usable_cpus() - 1);
    return std::max(1, std::min(n, usable_cpus()));
}

// A pool of worker threads that runs one task at a time over ids [0, nth): the caller is id 0.
//
// A task is published in one atomic word, its generation and its width together, so that a worker always reads the
// width of the generation it saw: a worker outside a task's width (not waited for) may lag behind by any number of
// generations, and must never take a later task's width as its own (it would run that task unasked, twice, or after
// its end). A worker inside the width reads the task pointer after the word; the caller waits for that worker before
// the next generation, so the pointer is this generation's.
//
// Between tasks the workers spin for a bounded time (ROLLINGKV_CPU_PART_SPIN_US: the CPU parts of a decode's layers
// follow each other within a fraction of a millisecond), then sleep on a condition variable (a futex), so that an
// idle process leaves the CPUs to others; the caller takes the lock to wake them only when one sleeps.
class rkv_pool {
public:
    ~rkv_pool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_.store(true);
            word_.fetch_add(GEN_ONE);
        }
        cv_.notify_all();
        for (auto & t : workers_) {
            t.join();
        }
    }

    // make the workers of an nth-thread task now (from a thread of the application, not a runtime's callback thread);
    // does not wait for a task that runs
    void prepare(int nth) {
        if (n_workers_.load(std::memory_order_acquire) >= nth - 1) {
            return;
        }
        spawn(nth);
    }

    void run(int nth, const std::function<void(int)> & fn) {
        std::lock_guard<std::mutex> one(run_mutex_); // one job at a time (several GPUs may call at once)
        nth = std::max(1, std::min(nth, MAX_NTH));
        if (n_workers_.load(std::memory_order_acquire) < nth - 1) {
            spawn(nth);
        }
        task_.store(&fn, std::memory_order_relaxed);
        pending_.store(nth - 1, std::memory_order_relaxed);
        const uint64_t gen = (word_.load(std::memory_order_relaxed) >> GEN_SHIFT) + 1;
        word_.store(gen << GEN_SHIFT | (uint64_t) nth, std::memory_order_seq_cst); // releases task_ and pending_
        if (nth > 1 && sleepers_.load(std::memory_order_seq_cst) > 0) {
            // a worker between its check and its wait holds m_: it sees the word
            { std::lock_guard<std::mutex> lk(m_); }
            cv_.notify_all();
        }
        fn(0);
        while (pending_.load(std::memory_order_acquire) > 0) {
            rkv_pause();
        }
        task_.store(nullptr, std::memory_order_relaxed);
    }

private:
    static constexpr int      GEN_SHIFT = 16;
    static constexpr uint64_t GEN_ONE   = 1ull << GEN_SHIFT;
    static constexpr int      MAX_NTH   = (1 << GEN_SHIFT) - 1;

    void spawn(int nth) {
        std::lock_guard<std::mutex> lk(spawn_mutex_);
        while ((int) workers_.size() < nth - 1) {
            // the generation before the next task's: a worker made before the caller publishes it sees the task
            const int id = (int) workers_.size() + 1;
            const uint64_t seen = word_.load(std::memory_order_acquire) >> GEN_SHIFT;
            workers_.emplace_back([this, id, seen] { work(id, seen); });
            n_workers_.store((int) workers_.size(), std::memory_order_release);
        }
    }

    void work(int id, uint64_t seen) {
#if defined(__linux__)
        // the process's CPUs: a worker inherits the affinity of the thread that made it (a GPU runtime's callback
        // thread may be confined to one core, which serializes the whole pool), and must not escape taskset/numactl
        const proc_cpus & pc = process_cpus();
        if (pc.have_set) {
            pthread_setaffinity_np(pthread_self(), sizeof(pc.set), &pc.set);
        }
#endif
        const auto spin = std::chrono::microseconds(ggml_rkv_get_knobs()->cpu_part_spin_us);
        for (;;) {
            uint64_t w = word_.load(std::memory_order_acquire);
            if ((w >> GEN_SHIFT) == seen) {
                const auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; (w >> GEN_SHIFT) == seen; ++i) {
                    rkv_pause();
                    if ((i & 63) == 63 && std::chrono::steady_clock::now() - t0 > spin) {
                        std::unique_lock<std::mutex> lk(m_);
                        sleepers_.fetch_add(1, std::memory_order_seq_cst);
                        g_sleeps.fetch_add(1, std::memory_order_relaxed);
                        cv_.wait(lk,
                                 [&] { w = word_.load(std::memory_order_seq_cst); return (w >> GEN_SHIFT) != seen; });
                        sleepers_.fetch_sub(1, std::memory_order_relaxed);
                        break;
                    }
                    w = word_.load(std::memory_order_acquire);
                }
            }
            if (stop_.load()) {
                return;
            }
            seen = w >> GEN_SHIFT;
            const int nth = (int) (w & (GEN_ONE - 1));
            if (id < nth) { // the caller waits for this thread: the task is still this generation's
                (*task_.load(std::memory_order_relaxed))(id);
                pending_.fetch_sub(1, std::memory_order_release);
            }
        }
    }

public:
    int sleepers() const { return sleepers_.load(); }

private:
    std::vector<std::thread> workers_;
    std::atomic<int>         n_workers_{0};
    std::mutex               run_mutex_;   // one task at a time
    std::mutex               spawn_mutex_; // workers_ (prepare does not wait for a running task)
    std::mutex               m_;
    std::condition_variable  cv_;
    std::atomic<uint64_t>    word_{0};     // generation << GEN_SHIFT | nth
    std::atomic<int>         pending_{0};
    std::atomic<int>         sleepers_{0};
    std::atomic<const std::function<void(int)> *> task_{nullptr};
    std::atomic<bool>        stop_{false};
};

rkv_pool & pool() {
    static rkv_pool p;
    return p;
}

} // namespace

uint64_t rkv_cpu_part_runs(void) {
    return g_runs.load();
}

uint64_t rkv_cpu_part_calib_runs(void) {
    return g_calib_runs.load();
}

static int proc_get_cpu_threads(void);

static int rkv_pool_threads(int n_threads) {
    return n_threads > 0 ? part_threads(n_threads) : proc_get_cpu_threads();
}

void rkv_cpu_pool_run(int nth, const std::function<void(int)> & fn) {
    pool().run(nth, fn);
}

int rkv_cpu_pool_sleepers(void) {
    return pool().sleepers();
}

void rkv_cpu_part_prepare(int n_threads) {
    pool().prepare(rkv_pool_threads(n_threads));
}

// the partial states [rows][chunks] of a part: grown, never shrunk, per calling thread (a GPU's callback thread), so
// that no part pays for allocating and faulting in its ~1 MiB
static float * part_buffer(size_t n_floats) {
    static thread_local std::unique_ptr<float[]> buf;
    static thread_local size_t cap = 0;
    if (cap < n_floats) {
        buf.reset(new float[n_floats]);
        cap = n_floats;
    }
    return buf.get();
}

// Balanced and deterministic: the cells are cut into chunks fixed by the part's size and thread count alone (about 4
// per thread, whole 16-cell blocks, at least 64 cells), each chunk's partial state kept apart; the threads claim
// (chunk, stream, group of up to RKV_CPU_DECODE_MAX_ROWS rows) items as they come free, each one walk of the chunk's
// cells for all the group's rows (the K/V bytes read once, not once per row), so a slow or late thread (memory
// contention, a core shared for a while) holds up one chunk, not a 1/nth share of the part; then they claim (row, group
// of heads) items and merge the chunks in chunk order. Which thread computed what, and which rows were walked together,
// never changes the result.
void rkv_cpu_part_run(const rkv_cpu_part_job & job) {
    using clock = std::chrono::steady_clock;
    (job.calib ? g_calib_runs : g_runs).fetch_add(1, std::memory_order_relaxed);
    const bool stats = !job.calib && stats_on();
    const clock::time_point t_start = stats ? clock::now() : clock::time_point();
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

    // the params of stream s's rows [t0, t0 + n): one walk of the cells for all of them (rkv_cpu_decode_range)
    auto rows_params = [&](int64_t s, int64_t t0, int64_t n) {
        rkv_cpu_decode_params p = base;
        p.q        = (const float *) (job.q + t0*job.q_nb1 + s*job.q_nb3);
        p.q_row    = job.q_nb1/sizeof(float);
        p.k        = job.k + s*job.k_nb3;
        p.v        = job.v + s*job.v_nb3;
        p.mask     = job.mask ? job.mask + ((s % job.n_mask_planes)*job.n_q + t0)*job.n_cells : nullptr;
        p.mask_row = (size_t) job.n_cells;
        p.n_rows   = (int32_t) n;
        return p;
    };

    const int nth = rkv_pool_threads(job.n_threads);
    const int64_t n_blk    = (job.n_cells + 15)/16;
    const int     n_chunks = (int) std::max<int64_t>(1, std::min<int64_t>(4*(int64_t) nth, (job.n_cells + 63)/64));
    const size_t  row_floats = rkv_cpu_decode_part_floats(base); // one row's state (base: one row)
    float * parts = part_buffer((size_t) n_rows*n_chunks*row_floats); // [stream][chunk][row of the stream][state]

    // items: (chunk, stream, group of rows): a group's rows share one walk of the chunk's cells (its K/V read once)
    const int64_t rows_per_walk = RKV_CPU_DECODE_MAX_ROWS;
    const int64_t n_groups = (job.n_q + rows_per_walk - 1)/rows_per_walk;
    const int     head_group = 4;
    const int64_t n_hgroups = (job.n_head + head_group - 1)/head_group;
    const int64_t n_items = job.n_stream*n_groups*n_chunks;
    const int64_t n_merge = n_rows*n_hgroups;
    std::atomic<int64_t> next_item{0}, items_done{0}, next_merge{0};

    std::vector<double> late(stats ? nth : 0), busy(stats ? nth : 0), oncpu(stats ? nth : 0);
    const clock::time_point t_post = stats ? clock::now() : clock::time_point();
    const std::function<void(int)> fn = [&](int ith) {
        const clock::time_point t0 = stats ? clock::now() : clock::time_point();
        const double c0_cpu = stats ? thread_cpu_s() : 0.0;
        for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < n_items; ) {
            // chunk-major: consecutive claims read neighbouring cells
            const int64_t k = i / (job.n_stream*n_groups), sg = i % (job.n_stream*n_groups);
            const int64_t s = sg / n_groups, t0 = sg % n_groups*rows_per_walk,
                              n = std::min(rows_per_walk, job.n_q - t0);
            const int64_t c0 = std::min(job.n_cells, n_blk*k/n_chunks*16);
            const int64_t c1 = std::min(job.n_cells, n_blk*(k + 1)/n_chunks*16);
            rkv_cpu_decode_range(rows_params(s, t0, n), c0, c1,
                                 parts + ((size_t) (s*n_chunks + k)*job.n_q + t0)*row_floats);
            items_done.fetch_add(1, std::memory_order_release);
        }
        while (items_done.load(std::memory_order_acquire) < n_items) {
            rkv_pause(); // the last chunks are being attended by other threads
        }
        for (int64_t i; (i = next_merge.fetch_add(1, std::memory_order_relaxed)) < n_merge; ) {
            const int64_t r = i / n_hgroups, s = r / job.n_q, t = r % job.n_q;
            const int h0 = (int) (i % n_hgroups)*head_group, h1 = std::min(job.n_head, h0 + head_group);
            // the stream's states as one walk over its n_q rows left them: row t's head h is t*n_head + h
            const rkv_cpu_decode_params ps = rows_params(s, 0, job.n_q);
            rkv_cpu_decode_merge_heads(ps, parts + (size_t) s*n_chunks*job.n_q*row_floats, n_chunks,
                (int) t*job.n_head + h0, (int) t*job.n_head + h1,
                job.o + (size_t) s*job.n_q*job.n_head*job.DV, job.lse + (size_t) s*job.n_q*job.n_head);
        }
        if (stats) {
            late[ith] = std::chrono::duration<double>(t0 - t_post).count();
            busy[ith] = std::chrono::duration<double>(clock::now() - t0).count();
            oncpu[ith] = thread_cpu_s() - c0_cpu;
        }
    };
    pool().run(nth, fn);

    if (stats) {
        const clock::time_point t_end = clock::now();
        part_stats & s = g_stats;
        std::lock_guard<std::mutex> lk(s.m);
        const double wall = std::chrono::duration<double>(t_end - t_start).count();
        s.runs++;
        s.bytes += (uint64_t) (job.n_stream*job.n_cells)*(job.k_nb1 + job.v_nb1);
        s.wall += wall;
        keep_sample(s.walls, s.runs, wall);
        s.late_max += *std::max_element(late.begin(), late.end());
        s.busy_max += *std::max_element(busy.begin(), busy.end());
        s.busy_min += *std::min_element(busy.begin(), busy.end());
        for (int i = 0; i < nth; ++i) {
            s.busy_sum += busy[i];
            s.oncpu_sum += oncpu[i];
        }
        if (s.have_last) {
            s.gap += std::chrono::duration<double>(t_start - s.last_end).count();
            s.gaps++;
            keep_sample(s.gaps_v, s.gaps, std::chrono::duration<double>(t_start - s.last_end).count());
        }
        s.last_end = t_end;
        s.have_last = true;
        s.threads = nth;
        if (!s.caller_cpus) s.caller_cpus = caller_cpus(); // once: the calling thread does not change its CPUs
    }
}

//
// the functions the CPU backend's registry answers (ggml-rolling-kv.h: GGML_RKV_CPU_*_PROC)
//

static uint64_t proc_cpu_part_runs(void) {
    return rkv_cpu_part_runs();
}

static uint64_t proc_cpu_part_calib_runs(void) {
    return rkv_cpu_part_calib_runs();
}

static int proc_get_cpu_threads(void) {
    // the knob once: ggml_rkv_get_knobs takes ggml's critical section, and this runs at every part's launch and start
    static const int knob = ggml_rkv_get_knobs()->cpu_part_threads;
    return part_threads(knob);
}

static bool proc_cpu_part_supported(enum ggml_type type_k, enum ggml_type type_v, int64_t DK, int64_t DV) {
    return DK <= INT32_MAX && DV <= INT32_MAX &&
           rkv_cpu_decode_supported((int) type_k, (int) type_v, (int) DK, (int) DV);
}

static void proc_cpu_part_run(const struct rkv_cpu_part_job * job) {
    rkv_cpu_part_run(*job);
}

static void proc_cpu_part_prepare(int n_threads) {
    rkv_cpu_part_prepare(n_threads);
}

static double proc_cpu_attn_measure_gbps(int n_threads, enum ggml_type type, size_t bytes, int n_rows);

void * ggml_rkv_cpu_get_proc_address(const char * name) {
    // typed through the typedefs of ggml-rolling-kv.h and the declarations of the headers: a change of signature does
    // not compile
    static const ggml_rkv_get_cpu_threads_t       threads  = proc_get_cpu_threads;
    static const ggml_rkv_cpu_part_runs_t         runs     = proc_cpu_part_runs;
    static const ggml_rkv_cpu_part_runs_t         calib    = proc_cpu_part_calib_runs;
    static const ggml_rkv_cpu_attn_measure_gbps_t gbps     = proc_cpu_attn_measure_gbps;
    static const ggml_rkv_cpu_part_supported_t    supp     = proc_cpu_part_supported;
    static const ggml_rkv_cpu_part_run_t          run      = proc_cpu_part_run;
    static const ggml_rkv_cpu_part_prepare_t      prepare  = proc_cpu_part_prepare;
    struct entry { const char * name; void * fn; };
    static const entry table[] = {
        { GGML_RKV_GET_CPU_THREADS_PROC,       (void *) threads },
        { GGML_RKV_CPU_PART_RUNS_PROC,         (void *) runs },
        { GGML_RKV_CPU_PART_CALIB_RUNS_PROC,   (void *) calib },
        { GGML_RKV_CPU_ATTN_MEASURE_GBPS_PROC, (void *) gbps },
        { GGML_RKV_CPU_PART_SUPPORTED_PROC,    (void *) supp },
        { GGML_RKV_CPU_PART_RUN_PROC,          (void *) run },
        { GGML_RKV_CPU_PART_PREPARE_PROC,      (void *) prepare },
        // test-rolling-kv-cpu-decode's
        { "rkv_cpu_decode_part_floats",        (void *) &rkv_cpu_decode_part_floats },
        { "rkv_cpu_decode_range",              (void *) &rkv_cpu_decode_range },
        { "rkv_cpu_decode_merge",              (void *) &rkv_cpu_decode_merge },
        { "rkv_cpu_decode_isa",                (void *) &rkv_cpu_decode_isa },
        { "rkv_cpu_decode_force_isa",          (void *) &rkv_cpu_decode_force_isa },
        { "rkv_cpu_decode_read_scan",          (void *) &rkv_cpu_decode_read_scan },
        { "rkv_cpu_part_run",                  (void *) &rkv_cpu_part_run },
        { "rkv_cpu_pool_run",                  (void *) &rkv_cpu_pool_run },
        { "rkv_cpu_pool_sleepers",             (void *) &rkv_cpu_pool_sleepers },
    };
    for (const entry & e : table) {
        if (strcmp(name, e.name) == 0) {
            return e.fn;
        }
    }
    return nullptr;
}

static double proc_cpu_attn_measure_gbps(int n_threads, enum ggml_type type, size_t bytes, int n_rows) {
    // a Llama-like layer: head size 128, 8 KV heads, 4 query heads per KV head; n_rows decode rows that each see every
    // cell (a step of several sequences over a shared prefix: each K/V row read once, dotted once per row and head)
    const int D = 128, n_head_kv = 8, n_head = 32;
    if (!proc_cpu_part_supported(type, type, D, D) || n_rows < 1 || n_rows > GGML_RKV_CPU_PART_MAX_Q) {
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
    std::vector<float> q((size_t) n_rows*n_head*D, 0.01f), o((size_t) n_rows*n_head*D), lse((size_t) n_rows*n_head);

    rkv_cpu_part_job job = {};
    job.n_head = n_head; job.n_head_kv = n_head_kv; job.D = D; job.DV = D;
    job.k_type = type; job.v_type = type;
    job.n_q = n_rows; job.n_stream = 1; job.n_cells = n_cells;
    job.q = (const uint8_t *) q.data(); job.q_nb1 = (size_t) n_head*D*sizeof(float); job.q_nb3 = q.size()*sizeof(float);
    job.k = k.data(); job.k_nb1 = cell; job.k_nb2 = row; job.k_nb3 = k.size();
    job.v = v.data(); job.v_nb1 = cell; job.v_nb2 = row; job.v_nb3 = v.size();
    job.mask = nullptr; job.n_mask_planes = 1; job.slope = nullptr;
    job.scale = 1.0f/sqrtf((float) D); job.softcap = 0.0f;
    job.o = o.data(); job.lse = lse.data();
    job.n_threads = n_threads;
    job.calib = 1;

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
