// rolling-KV: the CPU part of a hybrid tail on a CUDA device (see rolling-kv-hybrid.cuh)

#include "rolling-kv-hybrid.cuh"
#include "rolling-kv-stream.cuh"

#include "ggml-rolling-kv.h"
#include "../ggml-rolling-kv-impl.h"
#include "../ggml-cpu/rolling-kv-cpu-part.h" // struct rkv_cpu_part_job only: the functions come from the CPU backend

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RKV_CPU_RELAX() _mm_pause()
#else
#define RKV_CPU_RELAX() std::this_thread::yield()
#endif

// cudaLaunchHostFunc and the capture of host nodes: CUDA only (vendors/hip.h and musa.h do not map them all)
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
#define RKV_HYBRID 1
#else
#define RKV_HYBRID 0
#endif

namespace {

// The CPU part's functions, asked of the CPU backend's registry (GGML_RKV_CPU_PART_*_PROC, ggml-rolling-kv.h): this
// backend links no CPU code (the CPU backend may be a module). Resolved once the CPU backend is registered; a CPU
// backend without them: no CPU part is planned, said once.
struct rkv_cpu_procs {
    ggml_rkv_cpu_part_run_t       run       = nullptr;
    ggml_rkv_cpu_part_prepare_t   prepare   = nullptr;
    ggml_rkv_cpu_part_supported_t supported = nullptr;
    ggml_rkv_cpu_part_runs_t      calib_runs = nullptr; // the latency probe: its parts ran
    ggml_rkv_get_cpu_threads_t    threads   = nullptr;
};

static const rkv_cpu_procs * rkv_cpu() {
    static std::mutex m;
    static rkv_cpu_procs procs;
    static std::atomic<int> state{0}; // 0: not asked (no CPU backend registered yet), 1: found, 2: missing
    const int st = state.load(std::memory_order_acquire);
    if (st != 0) {
        return st == 1 ? &procs : nullptr;
    }
    ggml_backend_reg_t reg = ggml_rkv_cpu_backend_reg();
    if (!reg) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lk(m);
    if (state.load(std::memory_order_relaxed) == 0) {
        procs.run       = (ggml_rkv_cpu_part_run_t) ggml_backend_reg_get_proc_address(reg, GGML_RKV_CPU_PART_RUN_PROC);
        procs.prepare   = (ggml_rkv_cpu_part_prepare_t) ggml_backend_reg_get_proc_address(reg,
                GGML_RKV_CPU_PART_PREPARE_PROC);
        procs.supported = (ggml_rkv_cpu_part_supported_t) ggml_backend_reg_get_proc_address(reg,
                GGML_RKV_CPU_PART_SUPPORTED_PROC);
        procs.calib_runs = (ggml_rkv_cpu_part_runs_t) ggml_backend_reg_get_proc_address(reg,
                GGML_RKV_CPU_PART_CALIB_RUNS_PROC);
        procs.threads   = (ggml_rkv_get_cpu_threads_t) ggml_backend_reg_get_proc_address(reg,
                GGML_RKV_GET_CPU_THREADS_PROC);
        const bool ok = procs.run && procs.prepare && procs.supported && procs.calib_runs && procs.threads;
        if (!ok) {
            GGML_LOG_INFO("rolling KV: the CPU backend does not offer the hybrid tail's CPU part (%s): no CPU part is "
                          "planned\n", GGML_RKV_CPU_PART_RUN_PROC);
        }
        state.store(ok ? 1 : 2, std::memory_order_release);
    }
    return state.load(std::memory_order_relaxed) == 1 ? &procs : nullptr;
}

// pinned host staging of one CPU part: Q | mask columns | output rows | LSEs
struct rkv_staging {
    char      * host = nullptr;
    size_t      cap  = 0;
    cudaEvent_t done = nullptr;
};

// The hand-off of the k-th CPU part of a graph through mapped memory (ROLLINGKV_CPU_PART_HANDOFF=flag): the device
// rings (job, req = 1) after the part's inputs are staged; the agent, a host thread, takes it (req = 0), runs the part
// and sets done = 1; a one-thread kernel on the compute stream waits for done, resets it and the merge follows in
// stream order. Fixed for the context's life (a staging buffer that grows moves; a kernel already queued rings here
// still), one line each way so that the two sides never share a cache line.
struct alignas(128) rkv_bell {
    uint32_t                         req;
    uint32_t                         pad0;
    const struct rkv_cpu_part_job *  job;
    char                             pad1[48];
    uint32_t                         done;
    char                             pad2[60];
};
static_assert(sizeof(rkv_bell) == 128, "one 64-byte line per direction");
constexpr int RKV_MAX_BELLS = 512; // CPU parts per graph with a bell; a later one uses the host function

} // namespace

// the host thread that serves the bells: it spins while the graphs begun so far have parts it has not served (the
// graph's plan counts them, rolling-kv-stream.cu), else sleeps on a condition the next graph's begin signals, with a
// timeout that grows from 1 ms to 100 ms (a part the count missed is still served)
struct rkv_agent {
    rkv_bell *             bells   = nullptr; // [RKV_MAX_BELLS], cudaMallocHost (portable, mapped)
    std::atomic<int>       n_bells { 0 };     // bells in use (the most CPU parts a graph had)
    std::atomic<int64_t>   pending { 0 };     // parts expected and not served yet
    std::atomic<bool>      stop    { false };
    std::mutex              m;
    std::condition_variable cv;
    uint64_t               wakes   = 0;       // under m: graphs begun since the agent last looked
    std::thread            th;

    void expect(int n) {
        pending.fetch_add(n, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lk(m);
            wakes++;
        }
        cv.notify_one();
    }

    bool serve_once() {
        bool served = false;
        const int n = n_bells.load(std::memory_order_acquire);
        for (int i = 0; i < n; ++i) {
            rkv_bell & b = bells[i];
            if (__atomic_load_n(&b.req, __ATOMIC_ACQUIRE) != 1) {
                continue;
            }
            const rkv_cpu_part_job * job = __atomic_load_n(&b.job, __ATOMIC_ACQUIRE);
            __atomic_store_n(&b.req, 0u, __ATOMIC_RELAXED);
            rkv_cpu()->run(job); // a part was launched: the CPU backend offers it
            __atomic_store_n(&b.done, 1u, __ATOMIC_RELEASE); // after the part's output and LSE (x86: stores in order)
            pending.fetch_sub(1, std::memory_order_relaxed);
            served = true;
        }
        return served;
    }

    void main() {
        using clk = std::chrono::steady_clock;
        auto last = clk::now();
        auto nap  = std::chrono::milliseconds(1);
        while (!stop.load(std::memory_order_relaxed)) {
            if (serve_once()) {
                last = clk::now();
                nap  = std::chrono::milliseconds(1);
                continue;
            }
            const auto now = clk::now();
            // spin while parts are expected (given up after 200 ms without one: a count that missed), or for the
            // pool's spin time after the last one
            const bool expected = pending.load(std::memory_order_relaxed) > 0 &&
                                  now - last < std::chrono::milliseconds(200);
            if (expected || now - last < std::chrono::microseconds(ggml_rkv_get_knobs()->cpu_part_spin_us)) {
                RKV_CPU_RELAX();
                continue;
            }
            if (pending.load(std::memory_order_relaxed) > 0) {
                pending.store(0, std::memory_order_relaxed);
            }
            std::unique_lock<std::mutex> lk(m);
            const uint64_t w = wakes;
            cv.wait_for(lk, nap, [&] { return wakes != w || stop.load(std::memory_order_relaxed); });
            if (wakes != w) {
                last = clk::now();
                nap  = std::chrono::milliseconds(1);
            } else {
                nap = std::min<std::chrono::milliseconds>(nap*2, std::chrono::milliseconds(100));
            }
        }
    }

    void start() {
#if RKV_HYBRID
        CUDA_CHECK(cudaHostAlloc((void **) &bells, RKV_MAX_BELLS*sizeof(rkv_bell),
                                 cudaHostAllocPortable | cudaHostAllocMapped));
        memset(bells, 0, RKV_MAX_BELLS*sizeof(rkv_bell));
        th = std::thread([this] { main(); });
#endif
    }

    ~rkv_agent() {
        if (th.joinable()) {
            {
                std::lock_guard<std::mutex> lk(m);
                stop = true;
            }
            cv.notify_one();
            th.join();
        }
#if RKV_HYBRID
        if (bells) {
            CUDA_CHECK(cudaFreeHost(bells));
        }
#endif
    }
};

struct ggml_cuda_rkv_hybrid {
    std::vector<rkv_staging> staging;  // the k-th CPU part of a graph uses staging[k]
    std::vector<char *>      retired;  // staging that grew: a captured graph may still copy through it
    int next = 0;                      // CPU parts issued in the graph being evaluated
    cudaEvent_t ev_fork = nullptr;
    std::unique_ptr<rkv_agent> agent;  // flag: made with the first graph that has CPU parts
    // the graph being evaluated: the later members of each group, by its first op, and the parts handed over ahead of
    // their ops
    std::unordered_map<const ggml_tensor *, std::vector<const ggml_tensor *>> group_rest;
    std::unordered_map<const ggml_tensor *, ggml_cuda_rkv_cpu_part>         ahead;
    // the ALiBi slopes (times the test hook's factor) per (heads, max_bias, factor): what a job's slope points to,
    // never changed once made (a replayed graph's job points to it); as many as the model's distinct layer shapes
    std::unordered_map<std::string, std::unique_ptr<std::vector<float>>> slopes;
};

void ggml_cuda_rkv_hybrid_free(ggml_cuda_rkv_hybrid * h) {
    if (!h) {
        return;
    }
    h->agent.reset(); // joined before the staging its jobs point into goes
    for (auto & s : h->staging) {
        if (s.host) CUDA_CHECK(cudaFreeHost(s.host));
        if (s.done) CUDA_CHECK(cudaEventDestroy(s.done));
    }
    for (char * p : h->retired) {
        CUDA_CHECK(cudaFreeHost(p));
    }
    if (h->ev_fork) CUDA_CHECK(cudaEventDestroy(h->ev_fork));
    delete h;
}

static ggml_cuda_rkv_hybrid & rkv_hybrid_make(ggml_cuda_rkv_hybrid *& hp) {
    if (!hp) {
        hp = new ggml_cuda_rkv_hybrid;
        CUDA_CHECK(cudaEventCreateWithFlags(&hp->ev_fork, cudaEventDisableTiming));
    }
    return *hp;
}

// the roots a group's ops share: one layer's query, one layer's tail
static const ggml_tensor * rkv_root(const ggml_tensor * t) {
    return t && t->view_src ? t->view_src : t;
}

void ggml_cuda_rkv_hybrid_graph_begin(ggml_cuda_rkv_hybrid *& hp, const std::vector<const ggml_tensor *> & cpu_ops) {
    const int n_cpu_parts = (int) std::count_if(cpu_ops.begin(), cpu_ops.end(),
                                                [](const ggml_tensor * t) { return t != nullptr; });
    if (hp) {
        hp->next = 0;
        hp->group_rest.clear();
        hp->ahead.clear();
    }
    if (n_cpu_parts == 0) {
        return;
    }
    ggml_cuda_rkv_hybrid & g = rkv_hybrid_make(hp);
    const int n = (int) cpu_ops.size();
    for (int i = 0; i < n;) {
        const ggml_tensor * first = cpu_ops[i];
        if (!first) {
            ++i;
            continue;
        }
        int j = i + 1;
        while (j < n && cpu_ops[j] &&
                rkv_root(cpu_ops[j]->src[GGML_STREAMING_FA_SRC_Q]) == rkv_root(first->src[GGML_STREAMING_FA_SRC_Q]) &&
                rkv_root(cpu_ops[j]->src[GGML_STREAMING_FA_SRC_K_TAIL]) ==
                rkv_root(first->src[GGML_STREAMING_FA_SRC_K_TAIL])) {
            g.group_rest[first].push_back(cpu_ops[j]);
            ++j;
        }
        i = j;
    }
#if RKV_HYBRID
    if (!ggml_rkv_get_knobs()->cpu_part_host_fn) {
        if (!g.agent) {
            g.agent = std::make_unique<rkv_agent>();
            g.agent->start();
        }
        g.agent->expect(n_cpu_parts); // the agent spins from here until it has served them
    }
#endif
}

int64_t ggml_cuda_rkv_tail_cpu_cells(const ggml_tensor * op) {
#if RKV_HYBRID
    const ggml_tensor * q    = op->src[GGML_STREAMING_FA_SRC_Q];
    const ggml_tensor * kt   = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt   = op->src[GGML_STREAMING_FA_SRC_V_TAIL];
    const ggml_tensor * mask = op->src[GGML_STREAMING_FA_SRC_MASK];
    const int64_t n_cpu = ggml_streaming_flash_attn_get_tail_cpu_cells(op); // decided by the graph's builder, aligned
    if (n_cpu <= 0 || !kt || !vt || kt->ne[1] == 0 || !ggml_cuda_rkv_is_host(kt) || !ggml_cuda_rkv_is_host(vt)) {
        return 0;
    }
    // guards for a graph built without llama's planner (which asks for a CPU part only where these hold): the whole
    // tail streams, said once
    const char * why = nullptr;
    if (q->ne[1] > GGML_RKV_CPU_PART_MAX_Q) {
        why = "more query rows per stream than GGML_RKV_CPU_PART_MAX_Q";
    } else if (q->nb[0] != sizeof(float) || q->nb[2] != q->ne[0]*sizeof(float) || q->ne[2] > INT32_MAX ||
               kt->ne[2] > INT32_MAX) {
        why = "a query layout the CPU part does not read";
    } else if (!rkv_cpu() || !rkv_cpu()->supported(kt->type, vt->type, kt->ne[0], vt->ne[0])) {
        why = "tail types or head sizes the CPU part does not read (or no CPU backend offers the CPU part)";
    } else if (mask && mask->ne[2] != 1) {
        why = "a mask with per-head planes";
    }
    if (why) {
        static std::atomic<bool> said{false};
        if (!said.exchange(true)) {
            GGML_LOG_WARN("rolling KV: a hybrid tail's CPU part was asked for an op with %s: it streams its whole "
                          "tail\n", why);
        }
        return 0;
    }
    return std::min(n_cpu, kt->ne[1]);
#else
    GGML_UNUSED(op);
    return 0;
#endif // RKV_HYBRID
}

int64_t ggml_cuda_rkv_tail_stream_end(const ggml_tensor * op) {
    const ggml_tensor * kt = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    return kt ? kt->ne[1] - ggml_cuda_rkv_tail_cpu_cells(op) : 0;
}

int ggml_cuda_rkv_tail_stream_runs(const ggml_tensor * op, int64_t * first, int64_t * n) {
    const int64_t end = ggml_cuda_rkv_tail_stream_end(op);
    int32_t rf[GGML_RKV_MAX_TAIL_RUNS], rn[GGML_RKV_MAX_TAIL_RUNS];
    const int n_runs = ggml_streaming_flash_attn_get_tail_runs(op, rf, rn);
    if (n_runs == 0) {
        first[0] = 0;
        n[0]     = end;
        return end > 0 ? 1 : 0;
    }
    int k = 0;
    for (int r = 0; r < n_runs; ++r) {
        const int64_t lo = rf[r];
        const int64_t hi = std::min<int64_t>(end, (int64_t) rf[r] + rn[r]);
        if (hi > lo) {
            first[k] = lo;
            n[k]     = hi - lo;
            ++k;
        }
    }
    return k;
}

int64_t ggml_cuda_rkv_tail_stream_cells(const ggml_tensor * op) {
    int64_t first[GGML_RKV_MAX_TAIL_RUNS], n[GGML_RKV_MAX_TAIL_RUNS];
    int64_t cells = 0;
    for (int r = 0, nr = ggml_cuda_rkv_tail_stream_runs(op, first, n); r < nr; ++r) {
        cells += n[r];
    }
    return cells;
}

#if RKV_HYBRID
// the part's inputs straight into its pinned staging (mapped: the device writes it through unified addressing), in one
// launch instead of a copy of Q and one of the mask columns per plane: Q's bytes as they are, then the mask columns
// [col0, col0 + n_cpu) of every row and plane, packed [plane][row][cell], and the job itself (a kernel argument: a
// captured graph carries it, and an updated graph its new value), which the host function then reads from the
// staging. So the job's bytes (its cells change with every token) need no store of their own.
static __global__ void rkv_stage_inputs(const float * __restrict__ q, const int64_t q_floats,
        const char * __restrict__ mask, const int64_t mask_nb1, const int64_t mask_nb3, const int64_t col0,
        const int64_t n_cpu, const int64_t n_q, const int64_t n_planes,
        float * __restrict__ q_host, uint16_t * __restrict__ mask_host, const rkv_cpu_part_job job,
        rkv_cpu_part_job * job_host) {
    const int64_t i0 = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    const int64_t n  = (int64_t) gridDim.x*blockDim.x;
    if (i0 == 0) {
        *job_host = job;
    }
    for (int64_t i = i0; i < q_floats; i += n) {
        q_host[i] = q[i];
    }
    const int64_t n_mask = mask ? n_planes*n_q*n_cpu : 0;
    for (int64_t i = i0; i < n_mask; i += n) {
        const int64_t c = i % n_cpu, r = (i / n_cpu) % n_q, p = i / (n_cpu*n_q);
        mask_host[i] = *(const uint16_t *) (mask + p*mask_nb3 + r*mask_nb1 + (col0 + c)*sizeof(uint16_t));
    }
}

// the bell rung once the staging kernel before it in stream order is done (a kernel boundary: its writes happen before
// this release at system scope, which the agent's acquire of req pairs with)
static __global__ void rkv_ring_bell(rkv_bell * bell, const rkv_cpu_part_job * job) {
    bell->job = job;
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(&bell->req), "r"(1u) : "memory");
#else
    __threadfence_system();
    *(volatile uint32_t *) &bell->req = 1u;
#endif
}

// the compute stream waits for the agent's done (an acquire at system scope: the part's output and LSE, written
// before it, are what the merge after this kernel reads), then re-arms the bell; a part that never ends stops the
// process with a line after 60 s instead of hanging it
static __global__ void rkv_wait_bell(rkv_bell * bell) {
    uint64_t t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        uint32_t v;
#if __CUDA_ARCH__ >= 700
        asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(&bell->done) : "memory");
#else
        v = *(volatile uint32_t *) &bell->done;
        __threadfence_system();
#endif
        if (v) {
            break;
        }
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 60ull*1000000000ull) {
            printf("rolling KV: the CPU part of a hybrid tail did not finish in 60 s (its host agent is gone?)\n");
            __trap();
        }
#if __CUDA_ARCH__ >= 700
        __nanosleep(256);
#endif
    }
    *(volatile uint32_t *) &bell->done = 0u;
}

static void CUDART_CB rkv_cpu_part_host(void * data) {
    rkv_cpu()->run((const rkv_cpu_part_job *) data); // the job the staging kernel wrote before it, in stream order
}

// the ALiBi slope of each head, as ggml_flash_attn_ext computes it (1 without ALiBi), times the test hook's factor
static std::vector<float> rkv_slopes(int n_head, float max_bias, float mul) {
    std::vector<float> slope(n_head, mul);
    if (max_bias > 0.0f) {
        const uint32_t n_head_log2 = 1u << (uint32_t) floorf(log2f((float) n_head));
        const float m0 = powf(2.0f, -(max_bias       )/n_head_log2);
        const float m1 = powf(2.0f, -(max_bias/2.0f)/n_head_log2);
        for (int h = 0; h < n_head; ++h) {
            slope[h] = mul*(h < (int) n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1));
        }
    }
    return slope;
}
#endif // RKV_HYBRID

#if RKV_HYBRID
// hand op's CPU part over: stage its inputs, ring its bell (or queue the host function) on the CPU-part stream
static ggml_cuda_rkv_cpu_part rkv_cpu_part_issue(ggml_backend_cuda_context & ctx, const ggml_tensor * op, int64_t n_cpu,
                                                 int64_t col0) {
    const ggml_tensor * q    = op->src[GGML_STREAMING_FA_SRC_Q];
    const ggml_tensor * kt   = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt   = op->src[GGML_STREAMING_FA_SRC_V_TAIL];
    const ggml_tensor * mask = op->src[GGML_STREAMING_FA_SRC_MASK];
    const int64_t n_tail = kt->ne[1];
    const int64_t c_tail = n_tail - n_cpu; // the part's first cell within the tail
    const int64_t n_q = q->ne[1], n_head = q->ne[2], ne3 = q->ne[3], DV = op->ne[0];
    const int64_t rows = n_q*n_head*ne3;
    const int64_t n_planes = mask ? mask->ne[3] : 1;

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) op->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) op->op_params + 2, sizeof(float));
    // test hook, the op's tail_perturb x: the part's scores times (1 + x), as the streamed parts'
    const float mul = 1.0f + ggml_streaming_flash_attn_get_tail_perturb(op);

    // staging: Q | mask columns | output | LSE | job, each 256-byte aligned
    const size_t q_bytes    = ggml_nbytes(q); // the byte span of a view from its data pointer
    const size_t mask_bytes = mask ? (size_t) (n_planes*n_q*n_cpu)*sizeof(uint16_t) : 0;
    const size_t o_bytes    = (size_t) rows*DV*sizeof(float);
    const size_t off_mask   = GGML_PAD(q_bytes, 256);
    const size_t off_out    = off_mask + GGML_PAD(mask_bytes, 256);
    const size_t off_job    = GGML_PAD(off_out + o_bytes + (size_t) rows*sizeof(float), 256);
    const size_t need       = off_job + sizeof(rkv_cpu_part_job);

    ggml_cuda_rkv_hybrid & h = rkv_hybrid_make(ggml_cuda_rkv_hybrid_of(ctx));
    const int k = h.next++;
    if ((int) h.staging.size() <= k) {
        h.staging.resize(k + 1);
    }
    rkv_staging & st = h.staging[k];
    if (!st.done) {
        CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
    }
    if (st.cap < need) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &cs));
        GGML_ASSERT(cs == cudaStreamCaptureStatusNone &&
                    "rolling-KV: the CPU part's staging must grow while a CUDA graph is captured");
        if (st.host) {
            h.retired.push_back(st.host);
        }
        const size_t cap = GGML_PAD(need + need/2, 4096);
        CUDA_CHECK(cudaMallocHost((void **) &st.host, cap));
        st.cap = cap;
    }
    char * host = st.host;

    // the job: a kernel argument of the staging kernel, which writes it into the staging for the host function (a
    // captured graph's host node points to the staging, whose job its kernel node rewrites at every replay)
    rkv_cpu_part_job j;
    memset(&j, 0, sizeof(j));
    j.n_head = (int32_t) n_head; j.n_head_kv = (int32_t) kt->ne[2]; j.D = (int32_t) kt->ne[0]; j.DV = (int32_t) DV;
    j.k_type = kt->type; j.v_type = vt->type;
    j.n_q = n_q; j.n_stream = ne3; j.n_cells = n_cpu;
    j.q = (const uint8_t *) host; j.q_nb1 = q->nb[1]; j.q_nb3 = q->nb[3];
    j.k = (const uint8_t *) kt->data + c_tail*kt->nb[1]; j.k_nb1 = kt->nb[1]; j.k_nb2 = kt->nb[2]; j.k_nb3 = kt->nb[3];
    j.v = (const uint8_t *) vt->data + c_tail*vt->nb[1]; j.v_nb1 = vt->nb[1]; j.v_nb2 = vt->nb[2]; j.v_nb3 = vt->nb[3];
    j.mask = mask ? (const uint16_t *) (host + off_mask) : nullptr; j.n_mask_planes = n_planes;
    j.scale = scale*mul;
    j.softcap = softcap != 0.0f ? softcap*mul : 0.0f; // softcap*tanh(qk*scale/softcap): the whole score times mul
    j.o = (float *) (host + off_out); j.lse = (float *) (host + off_out + o_bytes);
    j.n_threads = 0;
    j.slope = nullptr;
    if (max_bias > 0.0f || mul != 1.0f) {
        std::string key((const char *) &n_head, sizeof(n_head));
        key.append((const char *) &max_bias, sizeof(max_bias));
        key.append((const char *) &mul, sizeof(mul));
        auto it = h.slopes.find(key);
        if (it == h.slopes.end()) {
            it = h.slopes.emplace(std::move(key),
                                  std::make_unique<std::vector<float>>(rkv_slopes((int) n_head, max_bias, mul))).first;
        }
        j.slope = it->second->data();
    }
    rkv_cpu_part_job * job_host = (rkv_cpu_part_job *) (host + off_job);

    rkv_cpu()->prepare(0); // the pool's workers start here, not on CUDA's callback thread (a part is planned: offered)

    cudaStream_t cs = ctx.stream(ctx.device, GGML_CUDA_RKV_CPU_STREAM);
    CUDA_CHECK(cudaEventRecord(h.ev_fork, ctx.stream()));
    CUDA_CHECK(cudaStreamWaitEvent(cs, h.ev_fork, 0));
    {
        const int64_t work = std::max<int64_t>((int64_t) (q_bytes/sizeof(float)),
                                               (int64_t) (mask_bytes/sizeof(uint16_t)));
        const int nth = 256;
        const int nblk = (int) std::max<int64_t>(1, std::min<int64_t>((work + nth - 1)/nth, 1024));
        rkv_stage_inputs<<<nblk, nth, 0, cs>>>((const float *) q->data, (int64_t) (q_bytes/sizeof(float)),
            mask ? (const char *) mask->data : nullptr, mask ? (int64_t) mask->nb[1] : 0,
            mask ? (int64_t) mask->nb[3] : 0, col0, n_cpu, n_q, n_planes, (float *) host,
            (uint16_t *) (host + off_mask), j, job_host);
        CUDA_CHECK(cudaGetLastError());
    }
    // the bell when the graph's plan started the agent (a part past the bells, or one the plan did not count, takes
    // the host function)
    ggml_cuda_rkv_cpu_part part;
    part.out  = (const float *) (host + off_out); // the merge reads the result where the host wrote it (mapped memory)
    part.done = st.done;
    if (h.agent && k < RKV_MAX_BELLS) {
        rkv_bell * bell = &h.agent->bells[k];
        int n = h.agent->n_bells.load(std::memory_order_relaxed);
        while (n < k + 1 && !h.agent->n_bells.compare_exchange_weak(n, k + 1, std::memory_order_release)) {}
        rkv_ring_bell<<<1, 1, 0, cs>>>(bell, job_host);
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaEventRecord(st.done, cs)); // the fork joins the compute stream again (a capture requires it)
        part.bell = bell;
    } else {
        CUDA_CHECK(cudaLaunchHostFunc(cs, rkv_cpu_part_host, job_host));
        CUDA_CHECK(cudaEventRecord(st.done, cs));
    }
    return part;
}

// a group member's CPU part: its cells and first mask column as its own forward finds them (rolling-kv-fa.cu)
static void rkv_cpu_part_span(const ggml_tensor * op, int64_t & n_cpu, int64_t & col0) {
    const ggml_tensor * kw = op->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * kt = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    n_cpu = ggml_cuda_rkv_tail_cpu_cells(op);
    col0  = (kw ? kw->ne[1] : 0) + kt->ne[1] - n_cpu;
}
#endif // RKV_HYBRID

ggml_cuda_rkv_cpu_part ggml_cuda_rkv_cpu_part_launch(ggml_backend_cuda_context & ctx, const ggml_tensor * op,
                                                     int64_t n_cpu, int64_t col0) {
#if RKV_HYBRID
    ggml_cuda_rkv_hybrid & h = rkv_hybrid_make(ggml_cuda_rkv_hybrid_of(ctx));
    auto it = h.ahead.find(op);
    if (it != h.ahead.end()) {
        const ggml_cuda_rkv_cpu_part part = it->second; // handed over by the group's first op
        h.ahead.erase(it);
        return part;
    }
    const ggml_cuda_rkv_cpu_part part = rkv_cpu_part_issue(ctx, op, n_cpu, col0);
    // the group's later ops: their queries and this step's tail rows exist already (one layer's), so the host attends
    // their parts next, while the device attends this op's window and chunks
    auto g = h.group_rest.find(op);
    if (g != h.group_rest.end()) {
        for (const ggml_tensor * m : g->second) {
            int64_t m_cpu = 0, m_col0 = 0;
            rkv_cpu_part_span(m, m_cpu, m_col0);
            if (m_cpu > 0) {
                h.ahead[m] = rkv_cpu_part_issue(ctx, m, m_cpu, m_col0);
            }
        }
    }
    return part;
#else
    GGML_UNUSED(ctx); GGML_UNUSED(op); GGML_UNUSED(n_cpu); GGML_UNUSED(col0);
    GGML_ABORT("rolling-KV: no CPU part on this backend");
#endif // RKV_HYBRID
}

void ggml_cuda_rkv_cpu_part_wait(ggml_backend_cuda_context & ctx, const ggml_cuda_rkv_cpu_part & part) {
    GGML_ASSERT(part.done);
    CUDA_CHECK(cudaStreamWaitEvent(ctx.stream(), part.done, 0)); // the join (a bell was rung long before)
#if RKV_HYBRID
    if (part.bell) {
        rkv_wait_bell<<<1, 1, 0, ctx.stream()>>>((rkv_bell *) part.bell);
        CUDA_CHECK(cudaGetLastError());
    }
#endif
}

double ggml_cuda_rkv_cpu_part_latency(ggml_backend_dev_t dev, char * how, size_t how_size) {
#if RKV_HYBRID
    int device = -1;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) {
        device = ggml_backend_reg_dev_get(reg, i) == dev ? (int) i : device;
    }
    if (device < 0) {
        snprintf(how, how_size, "not measured: not a device of this backend");
        return -1.0;
    }
    ggml_cuda_set_device(device);

    // N parts of 256 cells of one f16 KV head of 128 (the least a layer hands over), one after another as a decode's
    // layers hand theirs over: stage Q into mapped memory, ring the part's bell, wait for it, in one captured graph
    constexpr int N = 64, D = 128, CELLS = 256, REPS = 5;
    const size_t kv_bytes  = (size_t) CELLS*D*sizeof(uint16_t);
    const size_t off_q     = 2*kv_bytes;
    const size_t off_out   = off_q + 1024;
    const size_t off_job   = off_out + 1024;
    char * host = nullptr;
    float * q_dev = nullptr;
    CUDA_CHECK(cudaMallocHost((void **) &host, off_job + sizeof(rkv_cpu_part_job)));
    memset(host, 0, off_job + sizeof(rkv_cpu_part_job));
    CUDA_CHECK(cudaMalloc((void **) &q_dev, D*sizeof(float)));
    CUDA_CHECK(cudaMemset(q_dev, 0, D*sizeof(float)));

    rkv_cpu_part_job j;
    memset(&j, 0, sizeof(j));
    j.n_head = 1; j.n_head_kv = 1; j.D = D; j.DV = D; j.k_type = GGML_TYPE_F16; j.v_type = GGML_TYPE_F16;
    j.n_q = 1; j.n_stream = 1; j.n_cells = CELLS;
    j.q = (const uint8_t *) (host + off_q); j.q_nb1 = D*sizeof(float); j.q_nb3 = D*sizeof(float);
    j.k = (const uint8_t *) host;            j.k_nb1 = D*sizeof(uint16_t); j.k_nb2 = kv_bytes; j.k_nb3 = kv_bytes;
    j.v = (const uint8_t *) host + kv_bytes; j.v_nb1 = D*sizeof(uint16_t); j.v_nb2 = kv_bytes; j.v_nb3 = kv_bytes;
    j.calib = 1; // the probe's parts are not an op's (ggml_rkv_cpu_part_runs counts those)
    j.scale = 1.0f; j.o = (float *) (host + off_out); j.lse = (float *) (host + off_out + D*sizeof(float));
    rkv_cpu_part_job * job_host = (rkv_cpu_part_job *) (host + off_job);

    const rkv_cpu_procs * cpu = rkv_cpu();
    if (!cpu) {
        snprintf(how, how_size, "not measured: the CPU backend offers no CPU part");
        return -1.0;
    }
    cpu->prepare(0);
    auto agent = std::make_unique<rkv_agent>();
    agent->start();
    agent->n_bells.store(N, std::memory_order_release);

    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    for (int k = 0; k < N; ++k) {
        rkv_stage_inputs<<<1, 128, 0, s>>>(q_dev, D, nullptr, 0, 0, 0, 0, 1, 1, (float *) (host + off_q), nullptr, j,
                                           job_host);
        rkv_ring_bell<<<1, 1, 0, s>>>(&agent->bells[k], job_host);
        rkv_wait_bell<<<1, 1, 0, s>>>(&agent->bells[k]);
    }
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    float best_ms = 1e30f;
    const uint64_t runs0 = cpu->calib_runs();
    for (int r = 0; r < REPS + 1; ++r) { // the first: warm (the pool's threads, the graph's upload)
        agent->expect(N);
        CUDA_CHECK(cudaEventRecord(e0, s));
        CUDA_CHECK(cudaGraphLaunch(exec, s));
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0) {
            best_ms = std::min(best_ms, ms);
        }
    }
    const uint64_t runs = cpu->calib_runs() - runs0;
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(s));
    CUDA_CHECK(cudaFree(q_dev));
    agent.reset(); // joined before the staging its jobs point into goes
    CUDA_CHECK(cudaFreeHost(host));

    if (runs != (uint64_t) N*(REPS + 1)) {
        snprintf(how, how_size, "not measured: %llu of %d CPU parts ran", (unsigned long long) runs, N*(REPS + 1));
        return -1.0;
    }
    const double per_part = best_ms/N;
    snprintf(how, how_size,
            "measured: %d captured hand-offs of a 256-cell part on CUDA%d (%d threads), %.1f us each, best of %d", N,
            device, cpu->threads(), per_part*1e3, REPS);
    return per_part;
#else
    GGML_UNUSED(dev);
    snprintf(how, how_size, "not measured: no CPU part on this backend");
    return -1.0;
#endif // RKV_HYBRID
}
