// rollingkv: KV residency planner, the request hand-over to the context, the plan as JSON, the planner on
// given figures (simulate), and the attention over a split layer (see llama-kv-residency.h).
#include "llama-kv-residency.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-cpp.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>

static const size_t LLAMA_RKV_MIB = 1024ull*1024;

// reserve kept free on the device when the budget is the free VRAM (no vram_target): what the compute
// estimate does not cover (cuBLAS workspaces, the CUDA pool's growth for dequantized weights in large
// batches, fragmentation, other processes starting later)
static const size_t LLAMA_RKV_VRAM_RESERVE = 1024*LLAMA_RKV_MIB;

// the device memory of a GPU runtime that no ggml buffer accounts for: the CUDA context and its kernel modules,
// cuBLAS handles and workspaces, the CUDA pool's growth. A vram_target is a per-process cap as NVML measures it, so
// it counts against the target (the free-VRAM budget sees the context gone from free already). On the H200 with
// CUDA 13, llama-server's NVML peak was 653 MiB above weights + compute estimate + ring + window
// (docs/perf/2026-11-30-gpu-gates/vram-*.json); LLAMA_RKV_RUNTIME_MIB overrides it.
static const size_t LLAMA_RKV_RUNTIME_RESERVE = 640*LLAMA_RKV_MIB;

static size_t llama_rkv_runtime_reserve() {
    const char * v = getenv("LLAMA_RKV_RUNTIME_MIB");
    if (v && *v) {
        char * end = nullptr;
        const long long mib = strtoll(v, &end, 10);
        if (end && *end == '\0' && mib >= 0) {
            return (size_t) mib*LLAMA_RKV_MIB;
        }
    }
    return LLAMA_RKV_RUNTIME_RESERVE;
}

// n_kv grows in steps of 256 cells (llama_kv_cache::get_n_kv) and the CUDA kernels split the parts at
// 256-cell boundaries: a window of a multiple of 256 cells keeps whole n_kv steps on one side
static const uint32_t LLAMA_RKV_WINDOW_ALIGN = 256;

// the streaming op's staging ring (ggml-cuda/rolling-kv-fa.cu reads the same variables)

// the copy that measures the device memory bandwidth: large enough to leave the caches of any device behind,
// small enough to fit next to the weights (a smaller one is tried when it does not)
static const size_t LLAMA_RKV_BW_COPY_MIB[] = { 256, 64 };
static const int    LLAMA_RKV_BW_REPS       = 5;

static double llama_rkv_mib(size_t bytes) {
    return bytes/(double) LLAMA_RKV_MIB;
}

//
// planner inputs
//

size_t llama_rkv_min_slot(size_t row_k_tail, size_t row_v_tail, uint32_t n_stream) {
    if (row_k_tail == 0 && row_v_tail == 0) {
        return 0;
    }
    return ggml_streaming_flash_attn_slot_need(row_k_tail, row_v_tail, n_stream, 256);
}

size_t llama_rkv_slot_ring(int * n_slots, size_t * slot_bytes, size_t min_slot) {
    const int    slots = ggml_streaming_flash_attn_ring_slots();
    const size_t slot  = std::max(ggml_streaming_flash_attn_ring_slot_bytes(), min_slot);
    if (n_slots) {
        *n_slots = slots;
    }
    if (slot_bytes) {
        *slot_bytes = slot;
    }
    return slots*slot;
}

static bool llama_rkv_dev_is_gpu(ggml_backend_dev_t dev) {
    if (!dev) {
        return false;
    }
    const auto t = ggml_backend_dev_type(dev);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

size_t llama_rkv_weights_bytes(const llama_model & model, ggml_backend_dev_t dev) {
    // host memory: every host buffer (CPU, mmapped, repacked); a GPU: its own buffers, not the pinned host ones
    // its buffer types also report as theirs
    const bool host = !llama_rkv_dev_is_gpu(dev);

    size_t res = 0;
    for (const auto & [buft, size] : model.memory_breakdown()) {
        const bool buft_host = ggml_backend_buft_is_host(buft);
        if (host ? buft_host : (!buft_host && ggml_backend_buft_get_device(buft) == dev)) {
            res += size;
        }
    }
    return res;
}

// The compute buffer of a device is the peak of the graph allocator over the worst-case graph, which
// llama_context reserves for a ubatch of T = min(n_ctx, n_ubatch) tokens that are all outputs. The allocator
// frees a tensor after its last use, so the peak is about the larger of
//   the head:    T x (n_vocab + n_embd) f32 logits                (on the device of the output layer only)
//   one layer:   T x (3 n_ff + 4 n_embd + Q/K/V widths + n_expert) f32 (n_ff: the widest dense FFN, or the
//                experts in use x expert FFN + shared expert FFN), plus the KQ masks that stay live through
//                every layer (f16, T x n_kv of the cache and of the SWA cache of an iSWA model)
// and the estimate is that x 1.1 + 32 MiB (positions, output ids, small temporaries, the backend's pool). On the
// demo model (n_ubatch 512) the largest term is the head, 97 MiB, for measured buffers of 102.5 MiB (2048
// cells) and 98.3 MiB (16384 cells): an estimate of 139 MiB.
size_t llama_rkv_compute_estimate(const llama_model & model, const llama_rkv_state & st, uint32_t n_kv, uint32_t n_kv_other,
        bool has_output, std::string * note) {
    const auto & hp = model.hparams;

    // unknown (a context made without llama_init_from_model_rolling_kv): llama_context_default_params' 512
    size_t n_tokens = st.n_ubatch > 0 ? st.n_ubatch : 512;
    if (st.n_ctx > 0) {
        n_tokens = std::min<size_t>(n_tokens, st.n_ctx);
    }

    const size_t n_vocab = (size_t) std::max<int32_t>(0, llama_vocab_n_tokens(llama_model_get_vocab(&model)));
    const size_t n_embd  = hp.n_embd;

    size_t n_ff  = 0;
    size_t n_qkv = 0;
    for (uint32_t il = 0; il < hp.n_layer_all; ++il) {
        n_ff  = std::max<size_t>(n_ff, hp.n_ff(il));
        n_ff  = std::max<size_t>(n_ff, (size_t) hp.n_expert_used(il)*hp.n_ff_exp(il) + hp.n_ff_shexp);
        n_qkv = std::max<size_t>(n_qkv, (size_t) hp.n_head(il)*hp.n_embd_head_k(il) +
                                        (size_t) hp.n_head_kv(il)*(hp.n_embd_head_k(il) + hp.n_embd_head_v(il)));
    }

    const size_t logits = has_output ? n_tokens*sizeof(float)*(n_vocab + n_embd) : 0;
    const size_t layer  = n_tokens*sizeof(float)*(3*n_ff + 4*n_embd + n_qkv + hp.n_expert);
    const size_t mask   = n_tokens*sizeof(ggml_fp16_t)*((size_t) n_kv + n_kv_other);

    const size_t res = (size_t) (std::max(logits, layer + mask)*1.1) + 32*LLAMA_RKV_MIB;

    if (note) {
        char buf[256];
        snprintf(buf, sizeof(buf), "%zu-token ubatch: logits %.1f MiB, one layer %.1f MiB, KQ masks %.1f MiB (%u + %u cells); "
                "max(logits, layer + masks) x 1.1 + 32 MiB", n_tokens, llama_rkv_mib(logits), llama_rkv_mib(layer), llama_rkv_mib(mask),
                n_kv, n_kv_other);
        *note = buf;
    }

    return res;
}

bool llama_rkv_dev_supports_split(ggml_backend_dev_t dev, const llama_rkv_layer_group & g, uint32_t n_stream, uint32_t n_ubatch,
        ggml_type type_k, ggml_type type_v, ggml_type type_k_tail, ggml_type type_v_tail) {
    if (!dev || g.n_embd_head_k <= 0 || g.n_embd_head_v <= 0 || g.n_head <= 0 || g.n_head_kv <= 0) {
        return true; // nothing to ask: the CPU runs every case
    }

    ggml_init_params params = {
        /*.mem_size   =*/ 64*ggml_tensor_overhead(),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx_ptr { ggml_init(params) };
    ggml_context * ctx = ctx_ptr.get();
    if (!ctx) {
        return true;
    }

    // the views the split cache hands to the graph (rkv_get_window / the tail views): both parts non-empty
    const int64_t n_part = LLAMA_RKV_WINDOW_ALIGN;
    auto part = [&](ggml_type t, int64_t d) {
        ggml_tensor * base = ggml_new_tensor_3d(ctx, t, d*g.n_head_kv, n_part + 1, n_stream);
        return ggml_view_4d(ctx, base, d, g.n_head_kv, n_part, n_stream, ggml_row_size(t, d), base->nb[1], base->nb[2], 0);
    };

    // a decode step and a full ubatch: the kernels differ
    for (const int64_t n_q : { (int64_t) 1, (int64_t) std::max<uint32_t>(1, std::min<uint32_t>(n_ubatch ? n_ubatch : 512, 512)) }) {
        ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, g.n_embd_head_k, g.n_head, n_q*n_stream);
        ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 2*n_part, n_q, 1, n_stream);

        ggml_tensor * out = llama_rkv_build_attn_mha(ctx, q,
                part(type_k, g.n_embd_head_k), part(type_v, g.n_embd_head_v),
                part(type_k_tail, g.n_embd_head_k), part(type_v_tail, g.n_embd_head_v),
                mask, nullptr, 1.0f/sqrtf((float) g.n_embd_head_k), 0.0f, 0.0f);

        // out is a reshape of the op
        ggml_tensor * op = out->src[0];
        if (!op || op->op != GGML_OP_STREAMING_FLASH_ATTN) {
            return true;
        }
        if (!ggml_backend_dev_supports_op(dev, op)) {
            return false;
        }
    }

    return true;
}

double llama_rkv_measure_mem_bw(ggml_backend_dev_t dev, std::string * how) {
    static std::mutex mutex;
    static std::map<ggml_backend_dev_t, std::pair<double, std::string>> measured;

    std::lock_guard<std::mutex> lock(mutex);

    auto it = measured.find(dev);
    if (it != measured.end()) {
        if (how) {
            *how = it->second.second + " (measured earlier in this process)";
        }
        return it->second.first;
    }

    const bool host = !llama_rkv_dev_is_gpu(dev);
    ggml_backend_buffer_type_t buft = host ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_buffer_type(dev);
    const char * name = host ? "host memory" : ggml_backend_dev_name(dev);

    double      res  = -1.0;
    std::string desc = std::string("not measured: no memory for the copy on ") + name;

    for (const size_t mib : LLAMA_RKV_BW_COPY_MIB) {
        const size_t size = mib*LLAMA_RKV_MIB;

        ggml_init_params params = {
            /*.mem_size   =*/ 2*ggml_tensor_overhead(),
            /*.mem_buffer =*/ NULL,
            /*.no_alloc   =*/ true,
        };
        ggml_context_ptr ctx { ggml_init(params) };
        if (!ctx) {
            break;
        }
        ggml_tensor * a = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I8, size);
        ggml_tensor * b = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I8, size);

        ggml_backend_buffer_ptr buf { ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft) };
        if (!buf) {
            continue;
        }

        // touch every page first (host memory faults pages in on first write), then one untimed copy
        ggml_backend_buffer_clear(buf.get(), 0);
        ggml_backend_tensor_copy(a, b);

        // ggml_backend_tensor_copy returns when the copy is done (host: memcpy; CUDA: the copy is synchronized)
        int64_t best_us = INT64_MAX;
        for (int i = 0; i < LLAMA_RKV_BW_REPS; ++i) {
            const int64_t t0 = ggml_time_us();
            ggml_backend_tensor_copy(i % 2 ? b : a, i % 2 ? a : b);
            best_us = std::min(best_us, ggml_time_us() - t0);
        }
        best_us = std::max<int64_t>(best_us, 1);

        // a copy reads and writes every byte
        res = 2.0*size/(best_us*1e-6)/1e9;

        char tmp[160];
        snprintf(tmp, sizeof(tmp), "%zu MiB copy in %s, best of %d", mib, name, LLAMA_RKV_BW_REPS);
        desc = tmp;
        break;
    }

    measured[dev] = { res, desc };
    if (how) {
        *how = desc;
    }
    return res;
}

//
// budget and link model (no device access: simulate runs them on given figures)
//

uint32_t llama_rkv_plan_budget(llama_rkv_state & st) {
    const int64_t  target       = st.req.vram_target_mib;
    const size_t   target_bytes = target > 0 ? (size_t) target*LLAMA_RKV_MIB : 0;
    const uint64_t kv_size      = st.kv_size;
    const uint64_t n_stream     = std::max<uint32_t>(1, st.n_stream);

    st.error.clear();
    st.min_target_mib = 0;

    bool     fits   = true;
    uint64_t wc_fit = UINT32_MAX;
    const llama_rkv_dev_budget * binding = nullptr;

    for (auto & d : st.devs) {
        d.cell_bytes  = (d.row_bytes_window + d.conv_cell_bytes)*n_stream;
        d.kv_resident = kv_size*d.cell_bytes;

        if (target > 0) {
            // the weights are allocated already: they count against the target, and free excludes them
            d.avail = target_bytes > d.weights ? std::min(target_bytes - d.weights, d.free) : 0;
        } else {
            d.avail = d.free > st.reserve ? d.free - st.reserve : 0;
        }

        const size_t fixed       = d.compute + d.other_kv + (target > 0 ? d.runtime : 0);
        const size_t fixed_split = fixed + d.ring; // a resident cache streams nothing: no ring

        if (fixed + d.kv_resident > d.avail) {
            fits = false;
        }

        d.kv_budget = d.avail > fixed_split ? d.avail - fixed_split : 0;

        // the window tensors hold one more (trash) row per stream
        const uint64_t rows = d.cell_bytes > 0 ? d.kv_budget/d.cell_bytes : (uint64_t) UINT32_MAX + 1;
        d.fit_cells = (uint32_t) std::min<uint64_t>(rows > 0 ? rows - 1 : 0, UINT32_MAX);

        if (!binding || d.fit_cells < wc_fit) {
            binding = &d;
            wc_fit  = d.fit_cells;
        }

        // the smallest target with a plan: the whole KV, or the smallest window
        // (as a target: the runtime counts)
        const size_t fixed_target  = d.compute + d.other_kv + d.runtime;
        const size_t need_resident = d.weights + fixed_target + d.kv_resident;
        const size_t need_split    = d.weights + fixed_target + d.ring + (LLAMA_RKV_WINDOW_ALIGN + 1)*d.cell_bytes;
        const size_t need          = kv_size > LLAMA_RKV_WINDOW_ALIGN ? std::min(need_resident, need_split) : need_resident;

        d.min_target_mib  = (int64_t) ((need + LLAMA_RKV_MIB - 1)/LLAMA_RKV_MIB);
        st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib);
    }

    if (fits || !binding) {
        return 0;
    }

    const uint64_t wc = wc_fit/LLAMA_RKV_WINDOW_ALIGN*LLAMA_RKV_WINDOW_ALIGN;
    if (wc >= LLAMA_RKV_WINDOW_ALIGN && wc < kv_size) {
        return (uint32_t) wc;
    }

    const auto & d = *binding;
    const size_t min_window = (LLAMA_RKV_WINDOW_ALIGN + 1)*d.cell_bytes;

    char buf[768];
    if (target > 0 && target < d.min_target_mib) {
        snprintf(buf, sizeof(buf),
                "vram_target %" PRId64 " MiB is below the minimum of %" PRId64 " MiB on %s: weights %.0f MiB + compute buffers "
                "~%.0f MiB (estimate) + GPU runtime ~%.0f MiB + other KV caches %.0f MiB + streaming ring %.0f MiB + a %u-cell KV window %.0f MiB",
                target, d.min_target_mib, d.name.c_str(), llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.runtime),
                llama_rkv_mib(d.other_kv), llama_rkv_mib(d.ring), LLAMA_RKV_WINDOW_ALIGN, llama_rkv_mib(min_window));
    } else {
        const std::string reserve = target > 0 ? "" : " minus a " + std::to_string(st.reserve/LLAMA_RKV_MIB) + " MiB reserve";
        snprintf(buf, sizeof(buf),
                "not enough free memory on %s for the KV cache: %.0f MiB free%s leave %.0f MiB, and compute buffers ~%.0f MiB "
                "(estimate) + other KV caches %.0f MiB + streaming ring %.0f MiB + a %u-cell KV window %.0f MiB need %.0f MiB",
                d.name.c_str(), llama_rkv_mib(d.free), reserve.c_str(), llama_rkv_mib(d.avail), llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv), llama_rkv_mib(d.ring),
                LLAMA_RKV_WINDOW_ALIGN, llama_rkv_mib(min_window), llama_rkv_mib(d.compute + d.other_kv + d.ring + min_window));
    }
    st.error = buf;

    return 0;
}

void llama_rkv_plan_estimate(llama_rkv_state & st) {
    st.link_bw_gbps     = -1.0;
    st.est_device_bytes = 0;
    st.est_tail_bytes   = 0;
    st.t_resident_ms    = -1.0;
    st.t_tail_ms        = -1.0;
    st.t_token_ms       = -1.0;

    bool all_host = !st.devs.empty();
    for (const auto & d : st.devs) {
        all_host = all_host && d.host_memory;
    }

    if (st.req.pcie_bw_gbps > 0.0f) {
        st.link_bw_gbps   = st.req.pcie_bw_gbps;
        st.link_bw_source = "pcie_bw_gbps of the request";
    } else if (all_host && st.mem_bw_gbps > 0.0) {
        st.link_bw_gbps   = st.mem_bw_gbps;
        st.link_bw_source = "host memory bandwidth (the tail is in the same memory)";
    } else {
        st.link_bw_source = "unknown: no pcie_bw_gbps in the request (rollingkv probe pcie measures it)";
    }

    if (st.window_cells == 0 || st.devs.empty()) {
        return;
    }

    // every token of a decode step reads the weights, the window and the other caches from device memory and
    // streams the tail over the link, at full context on every stream
    const double n_stream = std::max<uint32_t>(1, st.n_stream);
    for (const auto & d : st.devs) {
        st.est_device_bytes += (double) d.weights + (double) d.other_kv + (double) st.window_cells*d.row_bytes_window*n_stream;
        st.est_tail_bytes   += (double) st.tail_cells*d.row_bytes_tail*n_stream;
    }

    if (st.mem_bw_gbps > 0.0) {
        st.t_resident_ms = st.est_device_bytes/(st.mem_bw_gbps*1e9)*1e3;
    }
    if (st.link_bw_gbps > 0.0) {
        st.t_tail_ms = st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3;
    }
    if (st.t_resident_ms >= 0.0 && st.t_tail_ms >= 0.0) {
        st.t_token_ms = st.t_resident_ms + st.t_tail_ms;
    }
}

//
// decision
//

struct llama_rkv_decide_in {
    const char * refuse = nullptr;  // why this cache cannot split (not eligible), nullptr: eligible
    std::string  op_unsupported;    // a device that cannot run the streaming op, why ("": all can)
    std::string  no_device;         // why no device could be budgeted (st.devs empty)
    bool         host_memory = false; // st.devs are host memory (a run without GPU)
    bool         quiet       = false; // no logs (simulate)
    size_t       reserve     = LLAMA_RKV_VRAM_RESERVE; // kept free when there is no vram_target
    std::function<double(std::string *)> measure; // device memory bandwidth; called only for a split
};

static uint32_t llama_rkv_resident(llama_rkv_state & st, std::string reason, bool eligible = true) {
    st.chosen       = LLAMA_KV_RESIDENCY_OFF;
    st.reason       = std::move(reason);
    st.eligible     = eligible;
    st.window_cells = 0;
    st.tail_cells   = 0;
    st.type_k_tail  = st.type_k;
    st.type_v_tail  = st.type_v;
    return 0;
}

static void llama_rkv_log_budget(const llama_rkv_state & st) {
    for (const auto & d : st.devs) {
        char target[64];
        if (st.req.vram_target_mib > 0) {
            snprintf(target, sizeof(target), "target %" PRId64 " MiB", st.req.vram_target_mib);
        } else {
            snprintf(target, sizeof(target), "free %.0f MiB - reserve %.0f MiB", llama_rkv_mib(d.free), llama_rkv_mib(st.reserve));
        }
        LLAMA_LOG_INFO("%s: rolling KV: budget on %s: %s, weights %.0f MiB, compute ~%.0f MiB (estimate), other KV %.0f MiB, "
                "streaming ring %.0f MiB (%d x %.0f MiB), free %.0f MiB -> %.0f MiB for the KV window (%.3f MiB/cell); "
                "whole KV %.0f MiB; minimum vram_target %" PRId64 " MiB\n", __func__,
                d.name.c_str(), target, llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv),
                llama_rkv_mib(d.ring), d.ring ? st.ring_slots : 0, d.ring ? llama_rkv_mib(st.ring_slot_size) : 0.0,
                llama_rkv_mib(d.free), llama_rkv_mib(d.kv_budget), llama_rkv_mib(d.cell_bytes), llama_rkv_mib(d.kv_resident),
                d.min_target_mib);
    }
    if (!st.devs.empty() && !st.compute_note.empty()) {
        LLAMA_LOG_INFO("%s: rolling KV: compute buffer estimate: %s\n", __func__, st.compute_note.c_str());
    }
}

static uint32_t llama_rkv_decide_impl(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;

    st.error.clear();
    st.budgeted = false;

    // the answers that need no budget report none
    if (req.mode == LLAMA_KV_RESIDENCY_OFF) {
        st.devs.clear();
        return llama_rkv_resident(st, "mode off: the upstream resident cache");
    }
    if (req.mode == LLAMA_KV_RESIDENCY_HEAD) {
        // refused before the context is created; kept for completeness
        st.devs.clear();
        return llama_rkv_resident(st, "head mode is not implemented yet");
    }
    if (in.refuse) {
        st.devs.clear();
        return llama_rkv_resident(st, in.refuse, false);
    }

    const bool explicit_wc = req.window_cells > 0;

    if (explicit_wc && (uint64_t) req.window_cells >= st.kv_size) {
        st.devs.clear();
        return llama_rkv_resident(st, "window_cells >= kv_size: the whole cache is the window (resident)");
    }

    if (!in.op_unsupported.empty()) {
        if (!explicit_wc) {
            st.devs.clear();
            return llama_rkv_resident(st, in.op_unsupported + ": resident", false);
        }
        if (!in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: %s: the op runs on the CPU, the window is copied to the host every step\n",
                    __func__, in.op_unsupported.c_str());
        }
    }

    const int64_t target = req.vram_target_mib;
    st.reserve = target > 0 ? 0 : in.reserve;

    uint32_t wc = 0;

    if (explicit_wc) {
        wc = (uint32_t) req.window_cells;
        if (!st.devs.empty()) {
            // the budget terms, for the plan; an explicit window needs no 256-cell minimum
            llama_rkv_plan_budget(st);
            st.error.clear();
            for (const auto & d : st.devs) {
                const size_t fixed = d.weights + d.compute + d.other_kv + d.ring;
                if (target > 0 && (size_t) target*LLAMA_RKV_MIB < fixed) {
                    char buf[512];
                    snprintf(buf, sizeof(buf), "vram_target %" PRId64 " MiB is below the minimum of %.0f MiB on %s before any KV: "
                            "weights %.0f MiB + compute buffers ~%.0f MiB (estimate) + other KV caches %.0f MiB + streaming ring %.0f MiB",
                            target, std::ceil(llama_rkv_mib(fixed)), d.name.c_str(), llama_rkv_mib(d.weights), llama_rkv_mib(d.compute),
                            llama_rkv_mib(d.other_kv), llama_rkv_mib(d.ring));
                    st.error = buf;
                    if (!in.quiet) {
                        llama_rkv_log_budget(st);
                    }
                    return llama_rkv_resident(st, st.error);
                }
                const size_t need = (size_t) (wc + 1)*d.cell_bytes;
                if (need > d.kv_budget && !in.quiet) {
                    LLAMA_LOG_WARN("%s: rolling KV: the explicit window of %u cells needs %.0f MiB on %s, %.0f MiB more than the budget\n",
                            __func__, wc, llama_rkv_mib(need), d.name.c_str(), llama_rkv_mib(need - d.kv_budget));
                }
            }
        }
    } else {
        if (st.devs.empty()) {
            return llama_rkv_resident(st, in.no_device.empty() ? "no device to budget: resident" : in.no_device);
        }
        if (in.host_memory && target <= 0) {
            st.devs.clear();
            return llama_rkv_resident(st, "no GPU and no vram_target: resident (a vram_target sizes a window in host memory)");
        }

        st.budgeted = true;
        wc = llama_rkv_plan_budget(st);

        if (!in.quiet) {
            llama_rkv_log_budget(st);
        }
        if (!st.error.empty()) {
            return llama_rkv_resident(st, st.error);
        }
        if (wc == 0) {
            size_t kv = 0;
            for (const auto & d : st.devs) {
                kv += d.kv_resident;
            }
            char buf[160];
            snprintf(buf, sizeof(buf), "the whole KV (%.0f MiB) fits the %s budget: resident", llama_rkv_mib(kv),
                    target > 0 ? "vram_target" : "free VRAM");
            return llama_rkv_resident(st, buf);
        }
    }

    st.chosen       = LLAMA_KV_RESIDENCY_WINDOW;
    st.eligible     = true;
    st.window_cells = wc;
    st.tail_cells   = st.kv_size - wc;
    st.type_k_tail  = req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : req.type_k_tail;
    st.type_v_tail  = req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : req.type_v_tail;

    char buf[256];
    if (explicit_wc) {
        snprintf(buf, sizeof(buf), "%s: explicit window of %u cells", llama_kv_residency_mode_name(req.mode), wc);
    } else {
        snprintf(buf, sizeof(buf), "%s: window of %u cells, the largest multiple of %u that fits the %s budget",
                llama_kv_residency_mode_name(req.mode), wc, LLAMA_RKV_WINDOW_ALIGN, target > 0 ? "vram_target" : "free VRAM");
    }
    st.reason = buf;

    // the link model: only a split needs the device's memory bandwidth
    if (!st.devs.empty() && in.measure) {
        st.mem_bw_gbps = in.measure(&st.mem_bw_source);
    }
    llama_rkv_plan_estimate(st);

    if (!in.quiet && !st.devs.empty()) {
        LLAMA_LOG_INFO("%s: rolling KV: device memory bandwidth %.1f GB/s (%s); link %.2f GB/s (%s)\n", __func__,
                st.mem_bw_gbps, st.mem_bw_source.c_str(), st.link_bw_gbps, st.link_bw_source.c_str());
        if (st.t_token_ms >= 0.0) {
            LLAMA_LOG_INFO("%s: rolling KV: expected %.2f ms/token at full context = %.2f ms resident (%.0f MiB at %.1f GB/s) "
                    "+ %.2f ms tail (%.0f MiB at %.2f GB/s)\n", __func__, st.t_token_ms,
                    st.t_resident_ms, st.est_device_bytes/LLAMA_RKV_MIB, st.mem_bw_gbps,
                    st.t_tail_ms, st.est_tail_bytes/LLAMA_RKV_MIB, st.link_bw_gbps);
        } else {
            LLAMA_LOG_INFO("%s: rolling KV: no ms/token estimate (%s)\n", __func__,
                    st.mem_bw_gbps <= 0.0 ? st.mem_bw_source.c_str() : st.link_bw_source.c_str());
        }
    }

    return wc;
}

static uint32_t llama_rkv_decide(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const uint32_t wc = llama_rkv_decide_impl(st, in);
    if (wc == 0) {
        // a resident plan still reports the link it would have planned with
        llama_rkv_plan_estimate(st);
    }
    return wc;
}

uint32_t llama_rkv_plan_cache(llama_rkv_state & st, const llama_rkv_cache_desc & desc, const llama_model & model) {
    if (st.resolved) {
        // only one cache of a context splits (the non-SWA one); another one asking stays resident
        return 0;
    }

    const auto & req = st.req;

    st.resolved = true;
    st.kv_size  = desc.kv_size;
    st.n_stream = desc.n_stream;
    st.type_k   = desc.type_k;
    st.type_v   = desc.type_v;

    llama_rkv_decide_in in;

    // eligibility: a cache shape the split serves, flash attention, and a device backend that runs the op
    in.refuse = desc.refuse;
    if (!in.refuse && desc.v_trans) {
        in.refuse = "flash attention is off (transposed V cache): the split needs flash attention";
    }

    const bool needs_devices = req.mode == LLAMA_KV_RESIDENCY_AUTO || req.mode == LLAMA_KV_RESIDENCY_WINDOW;

    if (needs_devices && !in.refuse) {
        const ggml_type type_k_tail = req.type_k_tail == GGML_TYPE_COUNT ? desc.type_k : req.type_k_tail;
        const ggml_type type_v_tail = req.type_v_tail == GGML_TYPE_COUNT ? desc.type_v : req.type_v_tail;

        // the devices to budget: the GPUs holding KV layers; on a machine without GPU, host memory (it holds
        // window and tail alike, so only an explicit vram_target sizes a window there)
        std::vector<const llama_rkv_layer_group *> groups;
        for (const auto & g : desc.groups) {
            if (llama_rkv_dev_is_gpu(g.dev)) {
                groups.push_back(&g);
            }
        }

        bool any_gpu = false;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            any_gpu = any_gpu || llama_rkv_dev_is_gpu(ggml_backend_dev_get(i));
        }

        if (groups.empty() && desc.offload && !any_gpu) {
            for (const auto & g : desc.groups) {
                groups.push_back(&g);
            }
            in.host_memory = true;
        }

        if (groups.empty()) {
            in.no_device = desc.offload ? "no GPU holds KV layers: resident" : "KV offload is off (no GPU holds the cache): resident";
        }

        for (const auto * g : groups) {
            if (!in.host_memory && !llama_rkv_dev_supports_split(g->dev, *g, desc.n_stream, st.n_ubatch,
                        desc.type_k, desc.type_v, type_k_tail, type_v_tail)) {
                char buf[256];
                snprintf(buf, sizeof(buf), "the %s backend cannot run the streaming flash-attention op for K %s/%s, V %s/%s (window/tail)",
                        ggml_backend_dev_name(g->dev), ggml_type_name(desc.type_k), ggml_type_name(type_k_tail),
                        ggml_type_name(desc.type_v), ggml_type_name(type_v_tail));
                in.op_unsupported = buf;
                break;
            }
        }

        st.ring_slots = 0;
        st.ring_slot_size = 0;
        size_t min_slot = 0;
        for (const auto * g : groups) {
            min_slot = std::max(min_slot, llama_rkv_min_slot(g->max_row_k_tail, g->max_row_v_tail, desc.n_stream));
        }
        const size_t ring = llama_rkv_slot_ring(&st.ring_slots, &st.ring_slot_size, min_slot);

        ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);

        for (const auto * g : groups) {
            ggml_backend_dev_t dev = in.host_memory ? cpu_dev : g->dev;

            llama_rkv_dev_budget d;
            d.name             = in.host_memory ? "host memory" : ggml_backend_dev_name(dev);
            d.host_memory      = in.host_memory;
            d.n_layer          = g->n_layer;
            d.weights          = llama_rkv_weights_bytes(model, dev);
            d.other_kv         = g->other_kv;
            d.ring             = in.host_memory ? 0 : ring; // no staging: the CPU op reads the tail in place
            d.runtime          = in.host_memory ? 0 : llama_rkv_runtime_reserve();
            d.row_bytes_window = g->row_bytes_window;
            d.row_bytes_tail   = g->row_bytes_tail;
            d.conv_cell_bytes  = in.host_memory ? 0 : g->conv_cell_bytes;

            size_t free = 0, total = 0;
            if (dev) {
                ggml_backend_dev_memory(dev, &free, &total);
            }
            d.free = free;

            const bool has_output = in.host_memory ? !llama_rkv_dev_is_gpu(model.dev_output()) : model.dev_output() == dev;
            d.compute = llama_rkv_compute_estimate(model, st, desc.kv_size, g->n_kv_other, has_output,
                    st.compute_note.empty() ? &st.compute_note : nullptr);

            st.devs.push_back(std::move(d));
        }

        ggml_backend_dev_t bw_dev = in.host_memory ? cpu_dev : (groups.empty() ? nullptr : groups[0]->dev);
        in.measure = [bw_dev](std::string * how) {
            return llama_rkv_measure_mem_bw(bw_dev, how);
        };
    }

    const uint32_t wc = llama_rkv_decide(st, in);

    if (!st.error.empty()) {
        // llama_init_from_model_rolling_kv logs it and returns NULL
        throw std::runtime_error(st.error);
    }

    return wc;
}

//
// request hand-over
//

static thread_local std::shared_ptr<llama_rkv_state> g_rkv_pending;

void llama_rkv_set_pending(std::shared_ptr<llama_rkv_state> st) {
    g_rkv_pending = std::move(st);
}

std::shared_ptr<llama_rkv_state> llama_rkv_take_pending() {
    return std::move(g_rkv_pending);
}

//
// JSON
//

static std::string llama_rkv_json_str(const std::string & s) {
    std::string res = "\"";
    for (const char c : s) {
        switch (c) {
            case '"':  res += "\\\""; break;
            case '\\': res += "\\\\"; break;
            case '\n': res += "\\n";  break;
            default:
                if ((unsigned char) c < 0x20) {
                    char buf[8];
                    snprintf(buf, sizeof(buf), "\\u%04x", c);
                    res += buf;
                } else {
                    res += c;
                }
        }
    }
    return res + "\"";
}

// a number, or null when unknown (< 0)
static std::string llama_rkv_json_num(double v) {
    if (v < 0.0 || !std::isfinite(v)) {
        return "null";
    }
    char buf[64];
    snprintf(buf, sizeof(buf), "%.6g", v);
    return buf;
}

static const char * llama_rkv_type_name(ggml_type t) {
    return t == GGML_TYPE_COUNT ? "none" : ggml_type_name(t);
}

static const char * llama_rkv_chosen_name(const llama_rkv_state * st) {
    if (!st->error.empty()) {
        return "refused";
    }
    if (st->chosen == LLAMA_KV_RESIDENCY_WINDOW) {
        return "window";
    }
    // "off" only for the upstream cache the request asked for; anything else kept whole on the device is resident
    return st->req.mode == LLAMA_KV_RESIDENCY_OFF ? "off" : "resident";
}

std::string llama_rkv_plan_to_json(const llama_rkv_state * st) {
    if (!st) {
        return "{\"mode_requested\":\"off\",\"mode_chosen\":\"off\",\"split\":false,"
               "\"reason\":\"context created without residency parameters (llama_init_from_model)\",\"layers\":[],"
               "\"device_bytes\":0,\"host_bytes\":0}";
    }

    char buf[1024];
    std::string res = "{";

    // the flat keys first: llama-bench reads mode_chosen, window_cells and tail_cells by their first occurrence
    res += "\"mode_requested\":" + llama_rkv_json_str(llama_kv_residency_mode_name(st->req.mode));
    res += ",\"mode_chosen\":"   + llama_rkv_json_str(llama_rkv_chosen_name(st));
    res += std::string(",\"split\":") + (st->window_cells > 0 ? "true" : "false");
    res += ",\"reason\":"        + llama_rkv_json_str(st->reason);
    res += std::string(",\"eligible\":") + (st->eligible ? "true" : "false");
    res += ",\"error\":" + (st->error.empty() ? std::string("null") : llama_rkv_json_str(st->error));

    snprintf(buf, sizeof(buf),
            ",\"kv_size\":%u,\"n_stream\":%u,\"window_cells\":%u,\"tail_cells\":%u"
            ",\"vram_target_mib\":%" PRId64 ",\"pcie_bw_gbps\":%g",
            st->kv_size, st->n_stream, st->window_cells, st->tail_cells,
            st->req.vram_target_mib, (double) st->req.pcie_bw_gbps);
    res += buf;

    res += ",\"type_k\":"      + llama_rkv_json_str(llama_rkv_type_name(st->type_k));
    res += ",\"type_v\":"      + llama_rkv_json_str(llama_rkv_type_name(st->type_v));
    res += ",\"type_k_tail\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_k_tail));
    res += ",\"type_v_tail\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_v_tail));

    if (st->devs.empty()) {
        res += ",\"budget\":null";
    } else {
        size_t free = 0, weights = 0, compute = 0, other_kv = 0, ring = 0, kv_resident = 0, runtime = 0;
        for (const auto & d : st->devs) {
            runtime     += d.runtime;
            free        += d.free;
            weights     += d.weights;
            compute     += d.compute;
            other_kv    += d.other_kv;
            ring        += d.ring;
            kv_resident += d.kv_resident;
        }
        snprintf(buf, sizeof(buf),
                ",\"budget\":{\"budgeted\":%s,\"vram_target_mib\":%" PRId64 ",\"min_target_mib\":%" PRId64
                ",\"reserve_bytes\":%zu,\"free_bytes\":%zu,\"weights_bytes\":%zu,\"compute_bytes\":%zu,\"other_kv_bytes\":%zu"
                ",\"ring_bytes\":%zu,\"ring_slots\":%d,\"ring_slot_bytes\":%zu,\"kv_resident_bytes\":%zu,\"runtime_bytes\":%zu",
                st->budgeted ? "true" : "false", st->req.vram_target_mib, st->min_target_mib,
                st->reserve, free, weights, compute, other_kv, ring, st->ring_slots, st->ring_slot_size, kv_resident, runtime);
        res += buf;
        res += ",\"compute_note\":" + llama_rkv_json_str(st->compute_note);
        res += ",\"devices\":[";
        for (size_t i = 0; i < st->devs.size(); ++i) {
            const auto & d = st->devs[i];
            res += i > 0 ? ",{" : "{";
            res += "\"name\":" + llama_rkv_json_str(d.name);
            snprintf(buf, sizeof(buf),
                    ",\"host_memory\":%s,\"n_layer\":%u,\"free_bytes\":%zu,\"weights_bytes\":%zu,\"compute_bytes\":%zu"
                    ",\"other_kv_bytes\":%zu,\"ring_bytes\":%zu,\"avail_bytes\":%zu,\"kv_budget_bytes\":%zu,\"kv_resident_bytes\":%zu"
                    ",\"cell_bytes\":%zu,\"conv_cell_bytes\":%zu,\"fit_cells\":%u,\"min_target_mib\":%" PRId64 ",\"runtime_bytes\":%zu}",
                    d.host_memory ? "true" : "false", d.n_layer, d.free, d.weights, d.compute, d.other_kv, d.ring, d.avail,
                    d.kv_budget, d.kv_resident, d.cell_bytes, d.conv_cell_bytes, d.fit_cells, d.min_target_mib, d.runtime);
            res += buf;
        }
        res += "]}";
    }

    res += ",\"link\":{\"mem_bw_gbps\":" + llama_rkv_json_num(st->mem_bw_gbps);
    res += ",\"mem_bw_source\":" + llama_rkv_json_str(st->mem_bw_source);
    res += ",\"link_bw_gbps\":" + llama_rkv_json_num(st->link_bw_gbps);
    res += ",\"link_bw_source\":" + llama_rkv_json_str(st->link_bw_source) + "}";

    res += ",\"estimate\":{\"device_bytes_per_token\":" + llama_rkv_json_num(st->window_cells ? st->est_device_bytes : -1.0);
    res += ",\"tail_bytes_per_token\":" + llama_rkv_json_num(st->window_cells ? st->est_tail_bytes : -1.0);
    res += ",\"t_resident_ms\":" + llama_rkv_json_num(st->t_resident_ms);
    res += ",\"t_tail_ms\":" + llama_rkv_json_num(st->t_tail_ms);
    res += ",\"ms_per_token\":" + llama_rkv_json_num(st->t_token_ms) + "}";

    size_t dev_total = 0;
    size_t host_total = 0;

    res += ",\"layers\":[";
    for (size_t i = 0; i < st->layers.size(); ++i) {
        const auto & l = st->layers[i];
        snprintf(buf, sizeof(buf),
                "%s{\"il\":%d,\"window_cells\":%u,\"tail_cells\":%u,\"device_bytes\":%zu,\"host_bytes\":%zu,\"split\":%s}",
                i > 0 ? "," : "", l.il, l.window_cells, l.tail_cells, l.device_bytes, l.host_bytes, l.split ? "true" : "false");
        res += buf;
        dev_total  += l.device_bytes;
        host_total += l.host_bytes;
    }
    res += "]";

    snprintf(buf, sizeof(buf), ",\"device_bytes\":%zu,\"host_bytes\":%zu}", dev_total, host_total);
    res += buf;

    return res;
}

//
// simulate: the planner on figures given as JSON
//

namespace {

// the JSON subset the simulate input needs: objects, arrays, strings, numbers, true/false/null
struct rkv_jv {
    enum kind_t { NUL, BOOL, NUM, STR, ARR, OBJ } kind = NUL;
    bool        b   = false;
    double      num = 0.0;
    std::string str;
    std::vector<rkv_jv> arr;
    std::vector<std::pair<std::string, rkv_jv>> obj;

    const rkv_jv * get(const std::string & key) const {
        for (const auto & kv : obj) {
            if (kv.first == key) {
                return &kv.second;
            }
        }
        return nullptr;
    }
};

struct rkv_jparser {
    const char * p;
    const char * end;
    std::string  err;

    void ws() {
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
            ++p;
        }
    }

    bool fail(const char * what) {
        if (err.empty()) {
            err = what;
        }
        return false;
    }

    bool lit(const char * s) {
        const size_t n = strlen(s);
        if ((size_t) (end - p) >= n && strncmp(p, s, n) == 0) {
            p += n;
            return true;
        }
        return false;
    }

    bool string(std::string & out) {
        if (p >= end || *p != '"') {
            return fail("expected a string");
        }
        ++p;
        while (p < end && *p != '"') {
            char c = *p++;
            if (c == '\\') {
                if (p >= end) {
                    return fail("unterminated string");
                }
                c = *p++;
                switch (c) {
                    case '"': case '\\': case '/': out += c; break;
                    case 'b': out += '\b'; break;
                    case 'f': out += '\f'; break;
                    case 'n': out += '\n'; break;
                    case 'r': out += '\r'; break;
                    case 't': out += '\t'; break;
                    case 'u': {
                        if (end - p < 4) {
                            return fail("bad \\u escape");
                        }
                        const unsigned long cp = strtoul(std::string(p, 4).c_str(), nullptr, 16);
                        out += cp < 0x80 ? (char) cp : '?';
                        p += 4;
                    } break;
                    default: return fail("bad escape");
                }
            } else {
                out += c;
            }
        }
        if (p >= end) {
            return fail("unterminated string");
        }
        ++p;
        return true;
    }

    bool value(rkv_jv & v, int depth) {
        if (depth > 16) {
            return fail("nested too deep");
        }
        ws();
        if (p >= end) {
            return fail("unexpected end");
        }
        if (*p == '{') {
            ++p;
            v.kind = rkv_jv::OBJ;
            ws();
            if (p < end && *p == '}') {
                ++p;
                return true;
            }
            while (true) {
                ws();
                std::string key;
                if (!string(key)) {
                    return false;
                }
                ws();
                if (p >= end || *p != ':') {
                    return fail("expected ':'");
                }
                ++p;
                rkv_jv item;
                if (!value(item, depth + 1)) {
                    return false;
                }
                if (v.get(key)) {
                    err = "duplicate key " + key;
                    return false;
                }
                v.obj.emplace_back(std::move(key), std::move(item));
                ws();
                if (p < end && *p == ',') {
                    ++p;
                    continue;
                }
                if (p < end && *p == '}') {
                    ++p;
                    return true;
                }
                return fail("expected ',' or '}'");
            }
        }
        if (*p == '[') {
            ++p;
            v.kind = rkv_jv::ARR;
            ws();
            if (p < end && *p == ']') {
                ++p;
                return true;
            }
            while (true) {
                rkv_jv item;
                if (!value(item, depth + 1)) {
                    return false;
                }
                v.arr.push_back(std::move(item));
                ws();
                if (p < end && *p == ',') {
                    ++p;
                    continue;
                }
                if (p < end && *p == ']') {
                    ++p;
                    return true;
                }
                return fail("expected ',' or ']'");
            }
        }
        if (*p == '"') {
            v.kind = rkv_jv::STR;
            return string(v.str);
        }
        if (lit("true"))  { v.kind = rkv_jv::BOOL; v.b = true;  return true; }
        if (lit("false")) { v.kind = rkv_jv::BOOL; v.b = false; return true; }
        if (lit("null"))  { v.kind = rkv_jv::NUL;               return true; }

        // a number: the JSON characters only, then strtod on them
        const char * q = p;
        while (q < end && (isdigit((unsigned char) *q) || *q == '-' || *q == '+' || *q == '.' || *q == 'e' || *q == 'E')) {
            ++q;
        }
        if (q == p) {
            return fail("unexpected character");
        }
        const std::string num(p, q);
        char * num_end = nullptr;
        v.num  = strtod(num.c_str(), &num_end);
        v.kind = rkv_jv::NUM;
        if (*num_end != '\0' || !std::isfinite(v.num)) {
            return fail("bad number");
        }
        p = q;
        return true;
    }
};

// typed reads of the input object that refuse wrong types and remember every key read
struct rkv_jreader {
    const rkv_jv & o;
    std::string    err;
    std::vector<std::string> known;

    const rkv_jv * at(const char * key, rkv_jv::kind_t kind, const char * what) {
        known.push_back(key);
        const rkv_jv * v = o.get(key);
        if (!v || v->kind == rkv_jv::NUL) {
            return nullptr;
        }
        if (v->kind != kind && err.empty()) {
            err = std::string(key) + " must be " + what;
            return nullptr;
        }
        return v->kind == kind ? v : nullptr;
    }

    double num(const char * key, double def, bool required = false) {
        const rkv_jv * v = at(key, rkv_jv::NUM, "a number");
        if (!v) {
            if (required && err.empty()) {
                err = std::string(key) + " is required";
            }
            return def;
        }
        return v->num;
    }

    // a count: a non-negative integer
    uint64_t count(const char * key, uint64_t def, bool required = false) {
        const double v = num(key, (double) def, required);
        if (v < 0 || v != std::floor(v) || v > 9.0e15) {
            if (err.empty()) {
                err = std::string(key) + " must be a non-negative integer";
            }
            return def;
        }
        return (uint64_t) v;
    }

    size_t mib(const char * key, size_t def_bytes) {
        const double v = num(key, -1.0);
        if (!o.get(key) || o.get(key)->kind == rkv_jv::NUL) {
            return def_bytes;
        }
        if (v < 0) {
            if (err.empty()) {
                err = std::string(key) + " must be >= 0";
            }
            return def_bytes;
        }
        return (size_t) std::llround(v*LLAMA_RKV_MIB);
    }

    std::string str(const char * key, const std::string & def) {
        const rkv_jv * v = at(key, rkv_jv::STR, "a string");
        return v ? v->str : def;
    }

    bool flag(const char * key, bool def) {
        const rkv_jv * v = at(key, rkv_jv::BOOL, "true or false");
        return v ? v->b : def;
    }

    std::string unknown_key() const {
        for (const auto & kv : o.obj) {
            if (std::find(known.begin(), known.end(), kv.first) == known.end()) {
                return kv.first;
            }
        }
        return "";
    }
};

ggml_type rkv_type_from_name(const std::string & s) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * name = ggml_type_name((ggml_type) t);
        if (name && s == name) {
            return (ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}

std::string rkv_invalid(const std::string & why) {
    return "{\"error\":" + llama_rkv_json_str("invalid input: " + why) + ",\"invalid_input\":true}";
}

} // namespace

std::string llama_rkv_plan_simulate(const char * json_in) {
    rkv_jv in;
    {
        rkv_jparser ps { json_in, json_in + strlen(json_in), "" };
        if (!ps.value(in, 0)) {
            return rkv_invalid(ps.err);
        }
        ps.ws();
        if (ps.p != ps.end) {
            return rkv_invalid("trailing characters after the object");
        }
        if (in.kind != rkv_jv::OBJ) {
            return rkv_invalid("expected an object");
        }
    }

    rkv_jreader r { in, "", {} };

    llama_rkv_state st;
    st.req = llama_rolling_kv_default_params();

    const std::string mode = r.str("mode", "auto");
    const int32_t mode_i = llama_kv_residency_mode_from_str(mode.c_str());
    if (mode_i < 0) {
        return rkv_invalid("unknown mode " + mode);
    }
    st.req.mode            = (llama_kv_residency_mode) mode_i;
    st.req.vram_target_mib = (int64_t) r.count("vram_target_mib", 0);
    st.req.window_cells    = (int64_t) r.count("window_cells", 0);
    st.req.pcie_bw_gbps    = (float) r.num("pcie_bw_gbps", 0.0);

    st.kv_size  = (uint32_t) r.count("kv_size", 0, true);
    st.n_stream = (uint32_t) r.count("n_stream", 1);

    const uint32_t n_layer      = (uint32_t) r.count("n_layer", 0, true);
    const uint64_t n_embd_k_gqa = r.count("n_embd_k_gqa", 0, true);
    const uint64_t n_embd_v_gqa = r.count("n_embd_v_gqa", 0, true);

    st.type_k = rkv_type_from_name(r.str("type_k", "f16"));
    st.type_v = rkv_type_from_name(r.str("type_v", "f16"));
    const std::string tkt = r.str("type_k_tail", "");
    const std::string tvt = r.str("type_v_tail", "");
    st.req.type_k_tail = tkt.empty() ? GGML_TYPE_COUNT : rkv_type_from_name(tkt);
    st.req.type_v_tail = tvt.empty() ? GGML_TYPE_COUNT : rkv_type_from_name(tvt);

    const std::string dev_name    = r.str("device", "GPU0");
    const bool        host_memory = r.flag("host_memory", false);
    const size_t      ring_unset  = (size_t) -1; // default: the ring the CUDA op would allocate (needs the row sizes)

    llama_rkv_dev_budget base;
    base.name        = dev_name;
    base.host_memory = host_memory;
    base.free        = r.mib("free_mib", 0);
    base.weights     = r.mib("weights_mib", 0);
    base.compute     = r.mib("compute_mib", 0);
    base.other_kv    = r.mib("other_kv_mib", 0);
    base.ring        = r.mib("ring_mib", ring_unset);
    const size_t runtime_unset = (size_t) -1; // default: the library's GPU runtime reserve on a GPU, 0 in host memory
    base.runtime     = r.mib("runtime_mib", runtime_unset);
    const size_t reserve = r.mib("reserve_mib", LLAMA_RKV_VRAM_RESERVE);

    const double mem_bw = r.num("mem_bw_gbps", -1.0);
    const std::string refuse = r.str("refuse", "");

    const rkv_jv * devs = r.at("devices", rkv_jv::ARR, "a list of objects");

    if (!r.err.empty()) {
        return rkv_invalid(r.err);
    }
    if (!r.unknown_key().empty()) {
        return rkv_invalid("unknown key " + r.unknown_key());
    }
    if (st.kv_size == 0 || n_layer == 0 || n_embd_k_gqa == 0 || n_embd_v_gqa == 0 || st.n_stream == 0) {
        return rkv_invalid("kv_size, n_stream, n_layer, n_embd_k_gqa and n_embd_v_gqa must be > 0");
    }
    for (ggml_type t : { st.type_k, st.type_v }) {
        if (t == GGML_TYPE_COUNT) {
            return rkv_invalid("unknown type_k or type_v");
        }
    }
    for (ggml_type t : { st.req.type_k_tail, st.req.type_v_tail }) {
        if (t != GGML_TYPE_COUNT && !ggml_streaming_flash_attn_cpu_type_supported(t)) {
            return rkv_invalid("unsupported tail type");
        }
    }
    if ((!tkt.empty() && st.req.type_k_tail == GGML_TYPE_COUNT) || (!tvt.empty() && st.req.type_v_tail == GGML_TYPE_COUNT)) {
        return rkv_invalid("unknown tail type");
    }

    const ggml_type type_k_tail = st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail;
    const ggml_type type_v_tail = st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail;

    for (const auto & [t, n] : { std::make_pair(st.type_k, n_embd_k_gqa), std::make_pair(st.type_v, n_embd_v_gqa),
                                 std::make_pair(type_k_tail, n_embd_k_gqa), std::make_pair(type_v_tail, n_embd_v_gqa) }) {
        if (n % ggml_blck_size(t) != 0) {
            return rkv_invalid(std::string("the K/V row size is not a multiple of the block size of ") + ggml_type_name(t));
        }
    }

    if (base.ring == ring_unset) {
        base.ring = host_memory ? 0 : llama_rkv_slot_ring(&st.ring_slots, &st.ring_slot_size,
                llama_rkv_min_slot(ggml_row_size(type_k_tail, n_embd_k_gqa), ggml_row_size(type_v_tail, n_embd_v_gqa), st.n_stream));
    }

    // one layer's K+V bytes per cell and stream, as the cache constructor counts them
    const size_t row_w = ggml_row_size(st.type_k, n_embd_k_gqa) + ggml_row_size(st.type_v, n_embd_v_gqa);
    const size_t row_t = ggml_row_size(type_k_tail, n_embd_k_gqa) + ggml_row_size(type_v_tail, n_embd_v_gqa);
    const size_t conv  = (st.type_k != GGML_TYPE_F16 ? n_embd_k_gqa*2 : 0) + (st.type_v != GGML_TYPE_F16 ? n_embd_v_gqa*2 : 0);

    auto add_dev = [&](llama_rkv_dev_budget d, uint32_t n) {
        if (d.runtime == runtime_unset) {
            d.runtime = d.host_memory ? 0 : llama_rkv_runtime_reserve();
        }
        d.n_layer          = n;
        d.row_bytes_window = n*row_w;
        d.row_bytes_tail   = n*row_t;
        d.conv_cell_bytes  = d.host_memory ? 0 : conv;
        st.devs.push_back(std::move(d));
    };

    if (!devs) {
        add_dev(base, n_layer);
    } else {
        uint32_t n_total = 0;
        for (size_t i = 0; i < devs->arr.size(); ++i) {
            const rkv_jv & o = devs->arr[i];
            if (o.kind != rkv_jv::OBJ) {
                return rkv_invalid("devices must be a list of objects");
            }
            rkv_jreader dr { o, "", {} };
            llama_rkv_dev_budget d = base;
            d.name        = dr.str("name", "GPU" + std::to_string(i));
            d.host_memory = dr.flag("host_memory", base.host_memory);
            d.free        = dr.mib("free_mib", base.free);
            d.weights     = dr.mib("weights_mib", base.weights);
            d.compute     = dr.mib("compute_mib", base.compute);
            d.other_kv    = dr.mib("other_kv_mib", base.other_kv);
            d.ring        = dr.mib("ring_mib", d.host_memory ? 0 : base.ring);
            d.runtime     = dr.mib("runtime_mib", base.runtime);
            const uint32_t n = (uint32_t) dr.count("n_layer", 0, true);
            if (!dr.err.empty()) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: " + dr.err);
            }
            if (!dr.unknown_key().empty()) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: unknown key " + dr.unknown_key());
            }
            if (n == 0) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: n_layer must be > 0");
            }
            add_dev(d, n);
            n_total += n;
        }
        if (n_total != n_layer) {
            return rkv_invalid("the devices' n_layer must add up to n_layer");
        }
    }

    st.resolved = true;

    llama_rkv_decide_in di;
    di.refuse      = refuse.empty() ? nullptr : refuse.c_str();
    di.host_memory = !st.devs.empty() && st.devs[0].host_memory;
    di.quiet       = true;
    di.reserve     = reserve;
    di.measure     = [mem_bw](std::string * how) {
        *how = mem_bw > 0.0 ? "given" : "not given";
        return mem_bw > 0.0 ? mem_bw : -1.0;
    };

    const uint32_t wc = llama_rkv_decide(st, di);

    // the layers as the cache would allocate them: the window (+1 trash row) on the device, the tail
    // (+1 trash row) in host memory, per stream
    if (st.error.empty()) {
        for (uint32_t il = 0; il < n_layer; ++il) {
            llama_rkv_layer_plan lp;
            lp.il           = (int32_t) il;
            lp.split        = wc > 0;
            lp.window_cells = wc ? wc : st.kv_size;
            lp.tail_cells   = wc ? st.kv_size - wc : 0;
            lp.device_bytes = (size_t) (wc ? wc + 1 : st.kv_size)*row_w*st.n_stream;
            lp.host_bytes   = wc ? (size_t) (st.kv_size - wc + 1)*row_t*st.n_stream : 0;
            st.layers.push_back(lp);
        }
    }

    std::string res = llama_rkv_plan_to_json(&st);
    res.pop_back();
    res += ",\"simulated\":true}";
    return res;
}

//
// graph
//

ggml_tensor * llama_rkv_build_attn_mha(
        ggml_context * ctx,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * v,
         ggml_tensor * k_tail,
         ggml_tensor * v_tail,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
               float   max_alibi_bias,
               float   logit_softcap) {
    // same stream split and permutations as build_attn_mha
    const auto n_stream = k->ne[3];

    q = ggml_view_4d(ctx, q, q->ne[0], q->ne[1], q->ne[2]/n_stream, n_stream, q->nb[1], q->nb[2], q->nb[2]*(q->ne[2]/n_stream), 0);

    q      = ggml_permute(ctx, q,      0, 2, 1, 3);
    k      = ggml_permute(ctx, k,      0, 2, 1, 3);
    v      = ggml_permute(ctx, v,      0, 2, 1, 3);
    k_tail = ggml_permute(ctx, k_tail, 0, 2, 1, 3);
    v_tail = ggml_permute(ctx, v_tail, 0, 2, 1, 3);

    ggml_tensor * cur = ggml_streaming_flash_attn(ctx, q, k, v, k_tail, v_tail, kq_mask, kq_scale, max_alibi_bias, logit_softcap);

    ggml_streaming_flash_attn_add_sinks(cur, sinks);
    ggml_streaming_flash_attn_set_prec(cur, GGML_PREC_F32);

    return ggml_reshape_2d(ctx, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
}
