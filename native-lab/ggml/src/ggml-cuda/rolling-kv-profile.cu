// rolling-KV: GPU timeline profile of graph evaluations (the lab series, ROLLINGKV_DEBUG_PROFILE=1; see
// rolling-kv-profile.cuh)

#include "rolling-kv-profile.cuh"

#ifdef GGML_CUDA_RKV_PROFILE

#include "rolling-kv-lab.cuh"

#include "ggml-rolling-kv.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct rkv_prof_stat {
    double  ms = 0.0;
    int64_t n  = 0;
};

struct rkv_prof_group {
    int64_t evals      = 0;
    int64_t copy_evals = 0;     // evaluations that streamed a tail
    int64_t gaps       = 0;     // evaluations with a previous one on this context (host gap measured)
    int64_t host_bound = 0;     // evaluations whose enqueue outlasted the hold (the timeline includes launch gaps)
    double  span_ms    = 0.0;   // GPU: end of the hold to the last node
    double  gap_ms     = 0.0;   // host: end of the previous evaluation to the start of this one
    double  enqueue_ms = 0.0;   // host: enqueueing the nodes
    double  copy_bytes = 0.0;
    double  copy_ms    = 0.0;   // copy stream busy
    double  lead_ms    = 0.0;   // span start to the first copy
    double  trail_ms   = 0.0;   // last copy done to span end
    std::map<std::string, rkv_prof_stat> steps;
    std::vector<float> gaps_ms;     // per evaluation, for the median (the first decode's gap follows the prefill)
    std::vector<float> replay_ms;   // CUDA graph replays: GPU time of each launch (graphs on, no per-node events)
};

// host time between consecutive profile points of a context, charged to the later point (medians per token)
struct rkv_host_points {
    std::chrono::steady_clock::time_point last;
    bool have = false;
    std::map<int64_t, std::map<std::string, std::vector<float>>> ms; // per ubatch size and point: one value per graph
    std::map<std::string, float> token;                              // the current graph's sums
    int64_t key = -1;                                                // the current graph's ubatch size
};

struct rkv_prof {
    std::vector<cudaEvent_t> pool;
    size_t used = 0;
    cudaEvent_t begin = nullptr;
    std::vector<std::pair<cudaEvent_t, std::string>> marks;                    // compute stream, in order
    std::vector<std::pair<cudaEvent_t, cudaEvent_t>> copies;                   // (start, end) on the copy stream
    std::vector<size_t> copy_bytes;
    int64_t key = 0;
    std::chrono::steady_clock::time_point t_begin, t_end;
    bool have_end = false;
    bool active   = false;
    cudaEvent_t replay0 = nullptr, replay1 = nullptr; // around the last graph launch, read at the next one
    int64_t replay_key = -1;
    rkv_host_points host;
    std::map<int64_t, rkv_prof_group> groups;

    cudaEvent_t event() {
        if (used == pool.size()) {
            cudaEvent_t e;
            CUDA_CHECK(cudaEventCreate(&e));
            pool.push_back(e);
        }
        return pool[used++];
    }
};

static std::mutex g_mutex;
static std::unordered_map<const ggml_backend_cuda_context *, rkv_prof *> g_profs;

static rkv_prof * rkv_prof_of(const ggml_backend_cuda_context & ctx, bool create) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_profs.find(&ctx);
    if (it != g_profs.end()) {
        return it->second;
    }
    if (!create) {
        return nullptr;
    }
    return g_profs[&ctx] = new rkv_prof;
}

static int64_t rkv_prof_key(const ggml_cgraph * cgraph) {
    // group by ubatch size: the Q rows of the first attention node (else the first node's ne[1])
    ggml_cgraph * g = const_cast<ggml_cgraph *>(cgraph);
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        const ggml_tensor * n = ggml_graph_node(g, i);
        if (n->op == GGML_OP_FLASH_ATTN_EXT || n->op == GGML_OP_STREAMING_FLASH_ATTN) {
            return n->src[0]->ne[1];
        }
    }
    return ggml_graph_n_nodes(g) > 0 ? ggml_graph_node(g, 0)->ne[1] : 0;
}

static float rkv_median(std::vector<float> v) {
    if (v.empty()) {
        return 0.0f;
    }
    std::nth_element(v.begin(), v.begin() + v.size()/2, v.end());
    return v[v.size()/2];
}

static rkv_prof * rkv_prof_active(const ggml_backend_cuda_context & ctx) {
    if (!ggml_cuda_rkv_prof_enabled()) {
        return nullptr;
    }
    rkv_prof * p = rkv_prof_of(ctx, false);
    return p && p->active ? p : nullptr;
}

static double rkv_ms(std::chrono::steady_clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
}

static float rkv_elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

} // namespace

static __global__ void rkv_prof_hold(const unsigned long long ns) {
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= ns) {
            break;
        }
        __nanosleep(1000);
    }
}

bool ggml_cuda_rkv_prof_enabled() {
    static const bool on = ggml_cuda_rkv_lab().profile;
    return on;
}

void ggml_cuda_rkv_prof_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, bool eager) {
    if (!ggml_cuda_rkv_prof_enabled() || !eager) {
        return;
    }
    rkv_prof & p = *rkv_prof_of(ctx, true);
    p.used   = 0;
    p.marks.clear();
    p.copies.clear();
    p.copy_bytes.clear();
    p.active = true;

    p.key = rkv_prof_key(cgraph);

    static const unsigned long long hold_ns = 1000ull*(unsigned long long) ggml_cuda_rkv_lab().profile_hold_us;
    p.t_begin = std::chrono::steady_clock::now();
    rkv_prof_hold<<<1, 1, 0, ctx.stream()>>>(hold_ns);
    CUDA_CHECK(cudaGetLastError());
    p.begin = p.event();
    CUDA_CHECK(cudaEventRecord(p.begin, ctx.stream()));
}

void ggml_cuda_rkv_prof_mark(ggml_backend_cuda_context & ctx, const char * label) {
    rkv_prof * p = rkv_prof_active(ctx);
    if (!p) {
        return;
    }
    cudaEvent_t e = p->event();
    CUDA_CHECK(cudaEventRecord(e, ctx.stream()));
    p->marks.emplace_back(e, label);
}

void ggml_cuda_rkv_prof_node(ggml_backend_cuda_context & ctx, const ggml_tensor * node, int n_fused) {
    rkv_prof * p = rkv_prof_active(ctx);
    if (!p) {
        return;
    }
    std::string label = n_fused > 0 ? "fused " : "";
    label += ggml_op_desc(node);
    if (node->op == GGML_OP_SET_ROWS && ggml_is_streamed(node)) {
        label += " (host tail)";
    }
    if (node->op == GGML_OP_STREAMING_FLASH_ATTN) {
        label = "rkv op rest (join, last merge)";
    }
    cudaEvent_t e = p->event();
    CUDA_CHECK(cudaEventRecord(e, ctx.stream()));
    p->marks.emplace_back(e, std::move(label));
}

void ggml_cuda_rkv_prof_copy(ggml_backend_cuda_context & ctx, cudaStream_t cs, size_t bytes) {
    rkv_prof * p = rkv_prof_active(ctx);
    if (!p) {
        return;
    }
    cudaEvent_t e = p->event();
    CUDA_CHECK(cudaEventRecord(e, cs));
    if (bytes == 0) {
        p->copies.emplace_back(e, nullptr);
    } else {
        GGML_ASSERT(!p->copies.empty() && p->copies.back().second == nullptr);
        p->copies.back().second = e;
        p->copy_bytes.push_back(bytes);
    }
}

void ggml_cuda_rkv_prof_graph_end(ggml_backend_cuda_context & ctx) {
    rkv_prof * pp = rkv_prof_active(ctx);
    if (!pp) {
        return;
    }
    rkv_prof & p = *pp;
    p.active = false;
    const auto t_enq = std::chrono::steady_clock::now();
    cudaEvent_t end = p.event();
    CUDA_CHECK(cudaEventRecord(end, ctx.stream()));
    CUDA_CHECK(cudaEventSynchronize(end));

    rkv_prof_group & g = p.groups[p.key];
    g.evals++;
    if (p.have_end) {
        g.gaps++;
        g.gap_ms += rkv_ms(p.t_begin - p.t_end);
        g.gaps_ms.push_back((float) rkv_ms(p.t_begin - p.t_end));
    }
    const double enq = rkv_ms(t_enq - p.t_begin);
    g.enqueue_ms += enq;
    static const double hold_ms = ggml_cuda_rkv_lab().profile_hold_us/1000.0;
    if (enq > hold_ms) {
        g.host_bound++;
    }
    g.span_ms += rkv_elapsed(p.begin, end);

    cudaEvent_t prev = p.begin;
    for (const auto & m : p.marks) {
        rkv_prof_stat & s = g.steps[m.second];
        s.ms += rkv_elapsed(prev, m.first);
        s.n++;
        prev = m.first;
    }
    if (!p.copies.empty() && p.copies.back().second) {
        g.copy_evals++;
        for (size_t i = 0; i < p.copies.size(); ++i) {
            g.copy_ms    += rkv_elapsed(p.copies[i].first, p.copies[i].second);
            g.copy_bytes += (double) p.copy_bytes[i];
        }
        g.lead_ms  += rkv_elapsed(p.begin, p.copies.front().first);
        g.trail_ms += rkv_elapsed(p.copies.back().second, end);
    }
    p.t_end    = std::chrono::steady_clock::now();
    p.have_end = true;
}

void ggml_cuda_rkv_prof_replay(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, bool after) {
    if (!ggml_cuda_rkv_prof_enabled()) {
        return;
    }
    rkv_prof & p = *rkv_prof_of(ctx, true);
    if (!p.replay0) {
        CUDA_CHECK(cudaEventCreate(&p.replay0));
        CUDA_CHECK(cudaEventCreate(&p.replay1));
    }
    if (!after) {
        if (p.replay_key >= 0) { // the previous launch is done (llama synchronized before building this graph)
            CUDA_CHECK(cudaEventSynchronize(p.replay1));
            p.groups[p.replay_key].replay_ms.push_back(rkv_elapsed(p.replay0, p.replay1));
        }
        p.replay_key = rkv_prof_key(cgraph);
        CUDA_CHECK(cudaEventRecord(p.replay0, ctx.stream()));
    } else {
        CUDA_CHECK(cudaEventRecord(p.replay1, ctx.stream()));
    }
}

void ggml_cuda_rkv_prof_host(ggml_backend_cuda_context & ctx, const char * point, const ggml_cgraph * cgraph) {
    if (!ggml_cuda_rkv_prof_enabled()) {
        return;
    }
    rkv_host_points & h = rkv_prof_of(ctx, true)->host;
    const auto now = std::chrono::steady_clock::now();
    const std::string pt = point;
    if (h.have) {
        h.token[pt] += (float) rkv_ms(now - h.last);
    }
    if (cgraph) { // a new graph starts: the time up to here closes the previous one
        if (h.key >= 0) {
            for (const auto & kv : h.token) {
                h.ms[h.key][kv.first].push_back(kv.second);
            }
        }
        h.token.clear();
        h.key = rkv_prof_key(cgraph);
    }
    h.last = now;
    h.have = true;
}

void ggml_cuda_rkv_prof_free(ggml_backend_cuda_context & ctx) {
    rkv_prof * p = rkv_prof_of(ctx, false);
    if (!p) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_profs.erase(&ctx);
    }
    if (p->replay_key >= 0) {
        CUDA_CHECK(cudaEventSynchronize(p->replay1));
        p->groups[p->replay_key].replay_ms.push_back(rkv_elapsed(p->replay0, p->replay1));
    }
    for (const auto & kv : p->groups) {
        const rkv_prof_group & g = kv.second;
        if (!g.replay_ms.empty()) {
            fprintf(stderr,
                "rkv profile [%s] ubatch %lld: %zu CUDA graph launches, GPU time per launch: median %.3f ms\n",
                ctx.name.c_str(), (long long) kv.first, g.replay_ms.size(), rkv_median(g.replay_ms));
        }
        if (g.evals == 0) {
            continue;
        }
        const double n = (double) g.evals;
        fprintf(stderr,
            "rkv profile [%s] ubatch %lld: %lld evaluations, GPU span %.3f ms, host between evaluations: median %.3f "
            "ms, enqueue %.3f ms%s\n", ctx.name.c_str(), (long long) kv.first, (long long) g.evals, g.span_ms/n,
            rkv_median(g.gaps_ms), g.enqueue_ms/n,
            g.host_bound ? " (HOST-BOUND: enqueue outlasted the hold in some)" : "");
        if (g.copy_bytes > 0) {
            // the copy stream's idle time inside the span: waiting for a free slot (or for the fork)
            const double nc    = (double) g.copy_evals;
            const double stall = g.span_ms*nc/n - g.lead_ms - g.trail_ms - g.copy_ms;
            fprintf(stderr,
                "rkv profile   copies (%lld evaluations): %.1f MB, busy %.3f ms (%.2f GB/s), lead %.3f ms, trail %.3f "
                "ms, copy stream idle between %.3f ms\n", (long long) g.copy_evals, g.copy_bytes/nc/1e6, g.copy_ms/nc,
                g.copy_bytes/(g.copy_ms*1e6), g.lead_ms/nc, g.trail_ms/nc, stall/nc);
        }
        std::vector<std::pair<std::string, rkv_prof_stat>> steps(g.steps.begin(), g.steps.end());
        std::sort(steps.begin(), steps.end(), [](const auto & a, const auto & b) { return a.second.ms > b.second.ms; });
        for (size_t i = 0; i < steps.size() && i < 20; ++i) {
            fprintf(stderr, "rkv profile   %8.3f ms %7.1f x  %s\n", steps[i].second.ms/n, steps[i].second.n/n,
                    steps[i].first.c_str());
        }
    }
    for (const auto & g : p->host.ms) {
        fprintf(stderr,
            "rkv profile [%s] ubatch %lld: host time per graph (median), charged to the point that ends it:\n",
            ctx.name.c_str(), (long long) g.first);
        for (const auto & kv : g.second) {
            fprintf(stderr, "rkv profile   %8.3f ms  up to %s (%zu graphs)\n", rkv_median(kv.second), kv.first.c_str(),
                    kv.second.size());
        }
    }
    for (cudaEvent_t e : p->pool) {
        CUDA_CHECK(cudaEventDestroy(e));
    }
    for (cudaEvent_t e : { p->replay0, p->replay1 }) {
        if (e) {
            CUDA_CHECK(cudaEventDestroy(e));
        }
    }
    delete p;
}

#endif // GGML_CUDA_RKV_PROFILE
