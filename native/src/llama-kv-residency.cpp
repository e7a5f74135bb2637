// rollingkv: the KV residency planner (see llama-kv-residency.h).
#include "llama-kv-residency.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-rolling-kv-graph.h"

#include "ggml-cpp.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>

// the copy that measures the device memory bandwidth: large enough to leave the caches of any device behind,
// small enough to fit next to the weights (a smaller one is tried when it does not)
static const size_t LLAMA_RKV_BW_COPY_MIB[] = { 256, 64 };
static const int    LLAMA_RKV_BW_REPS       = 5;

static double llama_rkv_mib(size_t bytes) {
    return bytes/(double) LLAMA_RKV_MIB;
}

const char * llama_rkv_mode_name(enum llama_kv_residency_mode mode) {
    switch (mode) {
        case LLAMA_KV_RESIDENCY_OFF:    return "off";
        case LLAMA_KV_RESIDENCY_AUTO:   return "auto";
        case LLAMA_KV_RESIDENCY_HEAD:   return "head";
        case LLAMA_KV_RESIDENCY_WINDOW: return "window";
    }
    return "unknown";
}

//
// planner inputs
//

static bool llama_rkv_dev_is_gpu(ggml_backend_dev_t dev) {
    if (!dev) {
        return false;
    }
    const auto t = ggml_backend_dev_type(dev);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

ggml_rkv_dev_budget llama_rkv_backend_budget(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail, uint32_t n_stream) {
    ggml_rkv_dev_budget res = {};
    ggml_backend_reg_t reg = llama_rkv_dev_is_gpu(dev) ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto fn = reg ? (ggml_backend_rkv_dev_budget_t) ggml_backend_reg_get_proc_address(reg, GGML_RKV_DEV_BUDGET_PROC) : nullptr;
    if (fn) {
        fn(dev, row_k_tail, row_v_tail, n_stream, &res);
    }
    return res;
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
                mask, nullptr, 1.0f/sqrtf((float) g.n_embd_head_k), 0.0f, 0.0f, 0.0f);

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

// A measurement made once per process and key: later calls return the same figure, their description saying so.
// Each measuring function owns one (a device has a memory and a link figure).
template <typename K>
struct llama_rkv_measured_once {
    std::mutex mutex;
    std::map<K, std::pair<double, std::string>> values;

    double get(const K & key, std::string * how, const std::function<double(std::string *)> & measure) {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = values.find(key);
        const bool fresh = it == values.end();
        if (fresh) {
            std::string desc;
            const double res = measure(&desc);
            it = values.emplace(key, std::make_pair(res, desc)).first;
        }
        if (how) {
            *how = it->second.second + (fresh ? "" : " (measured earlier in this process)");
        }
        return it->second.first;
    }
};

// the shortest of LLAMA_RKV_BW_REPS runs of copy(i), in microseconds (at least 1)
static int64_t llama_rkv_best_us(const std::function<void(int)> & copy) {
    int64_t best_us = INT64_MAX;
    for (int i = 0; i < LLAMA_RKV_BW_REPS; ++i) {
        const int64_t t0 = ggml_time_us();
        copy(i);
        best_us = std::min(best_us, ggml_time_us() - t0);
    }
    return std::max<int64_t>(best_us, 1);
}

double llama_rkv_measure_mem_bw(ggml_backend_dev_t dev, std::string * how) {
    static llama_rkv_measured_once<ggml_backend_dev_t> once;
    return once.get(dev, how, [dev](std::string * desc) {
        const bool host = !llama_rkv_dev_is_gpu(dev);
        ggml_backend_buffer_type_t buft = host ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_buffer_type(dev);
        const char * name = host ? "host memory" : ggml_backend_dev_name(dev);

        *desc = std::string("not measured: no memory for the copy on ") + name;

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
            const int64_t best_us = llama_rkv_best_us([&](int i) { ggml_backend_tensor_copy(i % 2 ? b : a, i % 2 ? a : b); });

            char tmp[160];
            snprintf(tmp, sizeof(tmp), "%zu MiB copy in %s, best of %d", mib, name, LLAMA_RKV_BW_REPS);
            *desc = tmp;
            return 2.0*size/(best_us*1e-6)/1e9; // a copy reads and writes every byte
        }
        return -1.0;
    });
}

// the CPU part's attention bandwidth for a tail type on n_threads threads (ggml_rkv_cpu_attn_measure_gbps), once per
// process for each
static double llama_rkv_measure_cpu_attn_bw(int n_threads, ggml_type type, std::string * how) {
    static llama_rkv_measured_once<std::pair<int, int>> once;
    const int nt = n_threads > 0 ? n_threads : ggml_rkv_get_cpu_threads();
    return once.get({ nt, (int) type }, how, [nt, type](std::string * desc) {
        *desc = "measured: 256 MiB " + std::string(ggml_type_name(type)) + " tail, " + std::to_string(nt) + " threads";
        return ggml_rkv_cpu_attn_measure_gbps(nt, type, 0);
    });
}

double llama_rkv_measure_link_bw(ggml_backend_dev_t dev, std::string * how) {
    static llama_rkv_measured_once<ggml_backend_dev_t> once;
    return once.get(dev, how, [dev](std::string * desc) {
        ggml_backend_buffer_type_t host_buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
        if (!host_buft || !llama_rkv_dev_is_gpu(dev)) {
            *desc = "not measured: the device has no pinned host buffer type";
            return -1.0;
        }
        const size_t size = 256*LLAMA_RKV_MIB;
        ggml_init_params params = { /*.mem_size =*/ 2*ggml_tensor_overhead(), /*.mem_buffer =*/ NULL, /*.no_alloc =*/ true };
        ggml_context_ptr ctx_h { ggml_init(params) };
        ggml_context_ptr ctx_d { ggml_init(params) };
        ggml_tensor * a = ggml_new_tensor_1d(ctx_h.get(), GGML_TYPE_I8, size);
        ggml_tensor * b = ggml_new_tensor_1d(ctx_d.get(), GGML_TYPE_I8, size);
        ggml_backend_buffer_ptr buf_h { ggml_backend_alloc_ctx_tensors_from_buft(ctx_h.get(), host_buft) };
        ggml_backend_buffer_ptr buf_d { ggml_backend_alloc_ctx_tensors_from_buft(ctx_d.get(), ggml_backend_dev_buffer_type(dev)) };
        if (!buf_h || !buf_d) {
            *desc = "not measured: no memory for a 256 MiB pinned copy";
            return -1.0;
        }
        ggml_backend_buffer_clear(buf_h.get(), 0);
        ggml_backend_tensor_copy(a, b); // untimed: the first copy maps what it needs
        // a host source: a synchronous tensor_set from pinned memory
        const int64_t best_us = llama_rkv_best_us([&](int) { ggml_backend_tensor_copy(a, b); });
        *desc = "256 MiB pinned host-to-device copy to " + std::string(ggml_backend_dev_name(dev)) + ", best of " +
                std::to_string(LLAMA_RKV_BW_REPS);
        return size/(best_us*1e-6)/1e9;
    });
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

void llama_rkv_plan_tail_cpu(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.tail_cpu_frac     = 0.0f;
    st.t_token_hybrid_ms = -1.0;
    const float req = st.req.tail_cpu_frac;

    bool host_memory = st.devs.empty();
    uint32_t n_layer = 0;
    for (const auto & d : st.devs) {
        host_memory = host_memory || d.host_memory;
        n_layer += d.n_layer;
    }
    if (st.window_cells == 0 || st.tail_cells == 0) {
        st.tail_cpu_reason = "no split: no tail";
        return;
    }
    if (host_memory) {
        st.tail_cpu_reason = "no GPU: the CPU attends the whole tail already";
        return;
    }
    if (req == 0.0f) {
        st.tail_cpu_reason = "off (tail_cpu_frac 0)";
        return;
    }
    if (!ggml_rkv_cpu_part_supported(st.type_k_tail, st.type_v_tail, st.head_k, st.head_v)) {
        char buf[200];
        snprintf(buf, sizeof(buf), "the CPU part reads f16, q8_0 and q4_0 tails with head sizes that are multiples of 32, not K %s / V %s",
                ggml_type_name(st.type_k_tail), ggml_type_name(st.type_v_tail));
        st.tail_cpu_reason = buf;
        return;
    }

    // the model's inputs (a request's share needs none, but the plan reports what it is expected to give)
    if (st.req.cpu_attn_gbps > 0.0f) {
        st.cpu_attn_gbps   = st.req.cpu_attn_gbps;
        st.cpu_attn_source = "request";
    } else if (req < 0.0f && in.measure_cpu_attn) {
        st.cpu_attn_gbps = in.measure_cpu_attn(&st.cpu_attn_source);
    }
    if (st.link_bw_gbps <= 0.0 && req < 0.0f && in.measure_link) {
        st.link_bw_gbps = in.measure_link(&st.link_bw_source);
        if (st.link_bw_gbps > 0.0) {
            st.t_tail_ms = st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3;
            if (st.t_resident_ms >= 0.0) {
                st.t_token_ms = st.t_resident_ms + st.t_tail_ms;
            }
        }
    }

    const bool known = st.cpu_attn_gbps > 0.0 && st.link_bw_gbps > 0.0;
    const double t_res  = std::max(0.0, st.t_resident_ms);
    const double t_link = known ? st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3 : 0.0;
    const double t_cpu  = known ? st.est_tail_bytes/(st.cpu_attn_gbps*1e9)*1e3 : 0.0;
    auto model = [&](double f) {
        return std::max(t_res + f*t_cpu + (f > 0.0 ? n_layer*LLAMA_RKV_CPU_PART_LATENCY_MS : 0.0), (1.0 - f)*t_link);
    };

    if (req > 0.0f) {
        st.tail_cpu_frac   = std::min(1.0f, req);
        st.tail_cpu_reason = "requested";
    } else if (!known) {
        st.tail_cpu_reason = std::string("auto: off, ") + (st.cpu_attn_gbps <= 0.0 ? "the CPU attention bandwidth" : "the link bandwidth") +
            " is unknown";
        return;
    } else {
        double best_f = 0.0, best_t = model(0.0);
        for (int i = 1; i <= 64; ++i) {
            const double f = i/64.0;
            if (model(f) < best_t) {
                best_t = model(f);
                best_f = f;
            }
        }
        char buf[256];
        if (best_t > 0.97*model(0.0)) {
            snprintf(buf, sizeof(buf), "auto: off, a CPU part would gain < 3 %% (link %.1f GB/s, CPU attention %.1f GB/s)",
                    st.link_bw_gbps, st.cpu_attn_gbps);
            st.tail_cpu_reason = buf;
            return;
        }
        st.tail_cpu_frac = (float) best_f;
        snprintf(buf, sizeof(buf), "auto: %.0f %% of each tail on the CPU (link %.1f GB/s, CPU attention %.1f GB/s, %d threads)",
                100.0*best_f, st.link_bw_gbps, st.cpu_attn_gbps, st.n_threads);
        st.tail_cpu_reason = buf;
    }
    if (known) {
        st.t_token_hybrid_ms = model(st.tail_cpu_frac);
    }
}

//
// decision
//

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
        char recr[64] = "";
        if (d.recurrent) {
            snprintf(recr, sizeof(recr), " (recurrent state %.1f MiB)", llama_rkv_mib(d.recurrent));
        }
        LLAMA_LOG_INFO("%s: rolling KV: budget on %s: %s, weights %.0f MiB, compute ~%.0f MiB (estimate), other KV %.0f MiB%s, "
                "streaming ring %.0f MiB (%d x %.0f MiB), free %.0f MiB -> %.0f MiB for the KV window (%.3f MiB/cell); "
                "whole KV %.0f MiB; minimum vram_target %" PRId64 " MiB\n", __func__,
                d.name.c_str(), target, llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv), recr,
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
        snprintf(buf, sizeof(buf), "%s: explicit window of %u cells", llama_rkv_mode_name(req.mode), wc);
    } else {
        snprintf(buf, sizeof(buf), "%s: window of %u cells, the largest multiple of %u that fits the %s budget",
                llama_rkv_mode_name(req.mode), wc, LLAMA_RKV_WINDOW_ALIGN, target > 0 ? "vram_target" : "free VRAM");
    }
    st.reason = buf;

    // the link model: only a split needs the device's memory bandwidth
    if (!st.devs.empty() && in.measure) {
        st.mem_bw_gbps = in.measure(&st.mem_bw_source);
    }
    llama_rkv_plan_estimate(st);
    llama_rkv_plan_tail_cpu(st, in);

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
        LLAMA_LOG_INFO("%s: rolling KV: CPU part of the tail: %.3f (%s)%s\n", __func__, st.tail_cpu_frac, st.tail_cpu_reason.c_str(),
                st.t_token_hybrid_ms >= 0.0 ? (", expected " + std::to_string(st.t_token_hybrid_ms) + " ms/token").c_str() : "");
    }

    return wc;
}

uint32_t llama_rkv_decide(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const uint32_t wc = llama_rkv_decide_impl(st, in);
    if (wc == 0) {
        // a resident plan still reports the link it would have planned with
        llama_rkv_plan_estimate(st);
    }
    return wc;
}

llama_rkv_state * llama_rkv_note_recurrent(llama_rkv_state * st, const llama_model & model, ggml_type type_r, ggml_type type_s,
        bool offload, uint32_t mem_size, uint32_t n_rs_seq, const std::function<bool(int32_t)> & filter) {
    if (!st || st->resolved) {
        return st;
    }

    const auto & hp = model.hparams;

    st->hybrid = true;
    st->recurrent_layers.clear();
    st->recurrent_bytes.clear();

    // as llama_memory_recurrent allocates them: per layer, mem_size x (1 + n_rs_seq) rows of r and s (and of the PLE
    // conv history where the model has one), on the layer's device when offloaded, else in host memory
    const size_t n_rows = (size_t) mem_size*(1 + n_rs_seq);

    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (filter ? !filter((int32_t) il) : !hp.is_recr(il)) {
            continue;
        }
        size_t bytes = n_rows*(ggml_row_size(type_r, hp.n_embd_r()) + ggml_row_size(type_s, hp.n_embd_s()));
        if (hp.ple_conv_state() > 0 && hp.is_ple(il)) {
            bytes += n_rows*ggml_row_size(type_r, hp.ple_conv_state());
        }

        ggml_backend_dev_t dev = offload ? model.dev_layer(il) : nullptr;

        auto it = std::find_if(st->recurrent_bytes.begin(), st->recurrent_bytes.end(),
                [dev](const std::pair<ggml_backend_dev_t, size_t> & e) { return e.first == dev; });
        if (it == st->recurrent_bytes.end()) {
            st->recurrent_bytes.emplace_back(dev, bytes);
        } else {
            it->second += bytes;
        }
        st->recurrent_layers.push_back((int32_t) il);
    }

    return st;
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

        // what each device's backend spends beyond the tensors: the ring it streams the tail through (slots of at
        // least one chunk of its widest layer's tail; one slot size for all devices, the largest) and its runtime's
        // memory. Host memory streams nothing: the CPU op reads the tail in place.
        st.ring_slots = 0;
        st.ring_slot_size = 0;
        std::vector<ggml_rkv_dev_budget> dev_budgets;
        for (const auto * g : groups) {
            dev_budgets.push_back(in.host_memory ? ggml_rkv_dev_budget {} :
                    llama_rkv_backend_budget(g->dev, g->max_row_k_tail, g->max_row_v_tail, desc.n_stream));
            st.ring_slots     = std::max(st.ring_slots, dev_budgets.back().ring_slots);
            st.ring_slot_size = std::max(st.ring_slot_size, dev_budgets.back().ring_slot_bytes);
        }

        ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);

        for (size_t ig = 0; ig < groups.size(); ++ig) {
            const llama_rkv_layer_group * g  = groups[ig];
            const ggml_rkv_dev_budget   & db = dev_budgets[ig];
            ggml_backend_dev_t dev = in.host_memory ? cpu_dev : g->dev;

            llama_rkv_dev_budget d;
            d.name             = in.host_memory ? "host memory" : ggml_backend_dev_name(dev);
            d.host_memory      = in.host_memory;
            d.n_layer          = g->n_layer;
            d.weights          = llama_rkv_weights_bytes(model, dev);
            d.other_kv         = g->other_kv;
            d.recurrent        = g->recurrent;
            d.ring             = (size_t) db.ring_slots*st.ring_slot_size;
            d.runtime          = db.runtime_bytes;
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
        if (!groups.empty()) {
            st.head_k = groups[0]->n_embd_head_k;
            st.head_v = groups[0]->n_embd_head_v;
        }
        if (!in.host_memory && bw_dev) {
            const int n_threads = st.n_threads;
            in.measure_cpu_attn = [n_threads, type_k_tail](std::string * how) {
                return llama_rkv_measure_cpu_attn_bw(n_threads, type_k_tail, how);
            };
            in.measure_link = [bw_dev](std::string * how) {
                return llama_rkv_measure_link_bw(bw_dev, how);
            };
        }
    }

    const uint32_t wc = llama_rkv_decide(st, in);

    if (!st.error.empty()) {
        // llama_init_from_model_rolling_kv logs it and returns NULL
        throw std::runtime_error(st.error);
    }

    return wc;
}
