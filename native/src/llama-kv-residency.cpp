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
        ggml_type type_k, ggml_type type_v, ggml_type type_k_tail, ggml_type type_v_tail, bool head) {
    if (!dev || g.n_embd_head_k <= 0 || g.n_embd_head_v <= 0 || g.n_head <= 0 || g.n_head_kv <= 0) {
        return true; // nothing to ask: the CPU runs every case
    }
    if (head && g.n_head_kv < 2) {
        return true; // no head split of this shape (refused elsewhere)
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

    // the views the split cache hands to the graph (rkv_get_window / the tail views): both parts non-empty; a head
    // split's host part: the last n_head_kv - 1 heads of every cell, in a tensor of their own (no trash row)
    const int64_t n_part  = LLAMA_RKV_WINDOW_ALIGN;
    const int64_t n_heads = head ? g.n_head_kv - 1 : g.n_head_kv;
    auto part = [&](ggml_type t, int64_t d) {
        ggml_tensor * base = ggml_new_tensor_3d(ctx, t, d*n_heads, n_part + (head ? 0 : 1), n_stream);
        return ggml_view_4d(ctx, base, d, n_heads, n_part, n_stream, ggml_row_size(t, d), base->nb[1], base->nb[2], 0);
    };
    // the query heads that follow those KV heads
    const int64_t n_q_head = head ? g.n_head/g.n_head_kv*n_heads : g.n_head;

    // a decode step and a full ubatch: the kernels differ
    for (const int64_t n_q : { (int64_t) 1, (int64_t) std::max<uint32_t>(1, std::min<uint32_t>(n_ubatch ? n_ubatch : 512, 512)) }) {
        ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, g.n_embd_head_k, n_q_head, n_q*n_stream);
        ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 2*n_part, n_q, 1, n_stream);

        ggml_tensor * out = head
            ? llama_rkv_build_attn_mha(ctx, q, nullptr, nullptr,
                    part(type_k_tail, g.n_embd_head_k), part(type_v_tail, g.n_embd_head_v),
                    mask, nullptr, 1.0f/sqrtf((float) g.n_embd_head_k), 0.0f, 0.0f, llama_rkv_attn_layout{})
            : llama_rkv_build_attn_mha(ctx, q,
                    part(type_k, g.n_embd_head_k), part(type_v, g.n_embd_head_v),
                    part(type_k_tail, g.n_embd_head_k), part(type_v_tail, g.n_embd_head_v),
                    mask, nullptr, 1.0f/sqrtf((float) g.n_embd_head_k), 0.0f, 0.0f, llama_rkv_attn_layout{});

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

// bytes read from device memory and streamed over the link per token at n_kv cells of every stream, for a window of wc
// cells (window) or the head split of st.head_layers (head), over the budgeted devices; mean: averaged over a sequence that
// grows from 0 to n_kv cells instead (the window: mean min(n, wc) and max(0, n - wc); the head split: n_kv/2)
static void llama_rkv_token_bytes(const llama_rkv_state & st, bool head, uint32_t wc, double n_kv, double & device, double & tail,
        bool mean = false) {
    const double n_stream = std::max<uint32_t>(1, st.n_stream);
    const double w = std::min<double>(wc, n_kv);
    // cells of the window and of the tail read per token: at n_kv, or their means over n in [0, n_kv]
    const double c_win  = mean ? w - w*w/(2.0*n_kv) : w;
    const double c_tail = mean ? (n_kv - w)*(n_kv - w)/(2.0*n_kv) : n_kv - w;
    const double c_all  = mean ? n_kv/2.0 : n_kv;
    device = 0.0;
    tail   = 0.0;
    for (size_t i = 0; i < st.devs.size(); ++i) {
        const auto & d = st.devs[i];
        device += (double) d.weights + (double) d.other_kv;
        if (!head) {
            device += c_win*d.row_bytes_window*n_stream;
            tail   += c_tail*d.row_bytes_tail*n_stream;
            continue;
        }
        for (const auto & hl : st.head_layers) {
            if (hl.dev == (int32_t) i) {
                device += c_all*hl.device_heads*hl.head_bytes_window*n_stream;
                tail   += c_all*(hl.n_head_kv - hl.device_heads)*hl.head_bytes_tail*n_stream;
            }
        }
    }
}

// ms per token for the bytes of llama_rkv_token_bytes (< 0: a bandwidth is unknown)
static double llama_rkv_token_ms(double device, double tail, double mem_bw, double link_bw) {
    if (mem_bw <= 0.0 || link_bw <= 0.0) {
        return -1.0;
    }
    return device/(mem_bw*1e9)*1e3 + tail/(link_bw*1e9)*1e3;
}

static void llama_rkv_link_source(llama_rkv_state & st) {
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
}

void llama_rkv_plan_estimate(llama_rkv_state & st) {
    st.link_bw_gbps     = -1.0;
    st.est_device_bytes = 0;
    st.est_tail_bytes   = 0;
    st.t_resident_ms    = -1.0;
    st.t_tail_ms        = -1.0;
    st.t_token_ms       = -1.0;

    llama_rkv_link_source(st);

    if (!llama_rkv_is_split(st) || st.devs.empty()) {
        return;
    }

    // every token of a decode step reads the weights, the device's KV and the other caches from device memory and
    // streams the tail over the link, at full context on every stream
    llama_rkv_token_bytes(st, st.chosen == LLAMA_KV_RESIDENCY_HEAD, st.window_cells, st.kv_size, st.est_device_bytes, st.est_tail_bytes);

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
// the head split
//

uint32_t llama_rkv_device_heads(const llama_rkv_state & st, int32_t il) {
    if (st.chosen != LLAMA_KV_RESIDENCY_HEAD) {
        return 0;
    }
    for (const auto & hl : st.head_layers) {
        if (hl.il == il) {
            return hl.device_heads;
        }
    }
    return 0;
}

std::string llama_rkv_heads_summary(const llama_rkv_state & st) {
    if (st.chosen != LLAMA_KV_RESIDENCY_HEAD || st.head_layers.empty()) {
        return "";
    }
    uint32_t h_min = UINT32_MAX, h_max = 0, n_min = UINT32_MAX, n_max = 0, n_split = 0;
    for (const auto & hl : st.head_layers) {
        h_min = std::min(h_min, hl.device_heads);
        h_max = std::max(h_max, hl.device_heads);
        n_min = std::min(n_min, hl.n_head_kv);
        n_max = std::max(n_max, hl.n_head_kv);
        n_split += hl.device_heads < hl.n_head_kv;
    }
    char buf[256];
    const std::string h = h_min == h_max ? std::to_string(h_min) : std::to_string(h_min) + "-" + std::to_string(h_max);
    const std::string n = n_min == n_max ? std::to_string(n_min) : std::to_string(n_min) + "-" + std::to_string(n_max);
    snprintf(buf, sizeof(buf), "%s of %s KV heads on the device, %u of %zu layers split", h.c_str(), n.c_str(), n_split,
            st.head_layers.size());
    return buf;
}

static void llama_rkv_heads_whole(llama_rkv_state & st) {
    for (auto & hl : st.head_layers) {
        hl.device_heads = hl.n_head_kv;
    }
}

// device bytes of the head split's KV on device di (+ the f16 copy flash attention makes of one layer's device heads)
static size_t llama_rkv_head_dev_bytes(const llama_rkv_state & st, int32_t di) {
    const size_t n = (size_t) st.kv_size*std::max<uint32_t>(1, st.n_stream);
    size_t kv = 0, conv = 0;
    for (const auto & hl : st.head_layers) {
        if (hl.dev == di) {
            kv  += hl.device_heads*hl.head_bytes_window;
            conv = std::max(conv, hl.device_heads*hl.conv_head_bytes);
        }
    }
    return (kv + conv)*n;
}

bool llama_rkv_plan_heads(llama_rkv_state & st) {
    const int64_t target = st.req.vram_target_mib;

    llama_rkv_heads_whole(st); // layers no budget holds stay whole

    bool ok = true;
    for (size_t di = 0; di < st.devs.size(); ++di) {
        auto & d = st.devs[di];

        std::vector<llama_rkv_head_layer *> ls;
        for (auto & hl : st.head_layers) {
            if (hl.dev == (int32_t) di) {
                ls.push_back(&hl);
            }
        }

        // one KV head of every layer first
        for (auto * l : ls) {
            l->device_heads = 1;
        }
        const size_t base = llama_rkv_head_dev_bytes(st, (int32_t) di);

        const size_t fixed_target  = d.compute + d.other_kv + d.runtime;
        const size_t need_resident = d.weights + fixed_target + d.kv_resident;
        const size_t need_head     = d.weights + fixed_target + d.ring + base;
        d.min_target_mib_head = (int64_t) ((std::min(need_resident, need_head) + LLAMA_RKV_MIB - 1)/LLAMA_RKV_MIB);

        if (base > d.kv_budget) {
            d.head_kv_bytes = base;
            if (ok) {
                char buf[768];
                if (target > 0 && target < d.min_target_mib_head) {
                    snprintf(buf, sizeof(buf),
                            "vram_target %" PRId64 " MiB is below the head split's minimum of %" PRId64 " MiB on %s: weights %.0f MiB + compute "
                            "buffers ~%.0f MiB (estimate) + GPU runtime ~%.0f MiB + other KV caches %.0f MiB + streaming ring %.0f MiB + one KV "
                            "head of each of %zu layers %.0f MiB", target, d.min_target_mib_head, d.name.c_str(), llama_rkv_mib(d.weights),
                            llama_rkv_mib(d.compute), llama_rkv_mib(d.runtime), llama_rkv_mib(d.other_kv), llama_rkv_mib(d.ring), ls.size(),
                            llama_rkv_mib(base));
                } else {
                    snprintf(buf, sizeof(buf),
                            "not enough free memory on %s for a head split: %.0f MiB left for the KV after compute buffers, other KV "
                            "caches and the streaming ring, and one KV head of each of %zu layers needs %.0f MiB",
                            d.name.c_str(), llama_rkv_mib(d.kv_budget), ls.size(), llama_rkv_mib(base));
                }
                st.error = buf;
            }
            ok = false;
            continue;
        }

        // then one head at a time to the layer with the fewest (the first of them), while it fits
        std::vector<bool> full(ls.size(), false);
        while (true) {
            int best = -1;
            for (size_t i = 0; i < ls.size(); ++i) {
                if (!full[i] && ls[i]->device_heads < ls[i]->n_head_kv && (best < 0 || ls[i]->device_heads < ls[best]->device_heads)) {
                    best = (int) i;
                }
            }
            if (best < 0) {
                break;
            }
            ls[best]->device_heads++;
            if (llama_rkv_head_dev_bytes(st, (int32_t) di) > d.kv_budget) {
                ls[best]->device_heads--;
                full[best] = true;
            }
        }
        d.head_kv_bytes = llama_rkv_head_dev_bytes(st, (int32_t) di);
    }

    if (!ok) {
        llama_rkv_heads_whole(st);
    }
    return ok;
}

// the model of the header at share f
static double llama_rkv_tail_cpu_time(double t_res_ms, double t_link_ms, double t_cpu_ms, double latency_ms, double f) {
    return std::max(t_res_ms + f*t_cpu_ms + (f > 0.0 ? latency_ms : 0.0), (1.0 - f)*t_link_ms);
}

double llama_rkv_tail_cpu_best(double t_res_ms, double t_link_ms, double t_cpu_ms, double latency_ms) {
    auto model = [&](double f) { return llama_rkv_tail_cpu_time(t_res_ms, t_link_ms, t_cpu_ms, latency_ms, f); };
    double best_f = 0.0, best_t = model(0.0);
    for (int i = 1; i <= 64; ++i) {
        const double f = i/64.0;
        if (model(f) < best_t) {
            best_t = model(f);
            best_f = f;
        }
    }
    return best_t > 0.97*model(0.0) ? 0.0 : best_f;
}

float llama_rkv_tail_cpu_frac_at(const llama_rkv_tail_cpu & m, uint32_t tail_cells) {
    if (tail_cells == 0 || (m.frac <= 0.0f && !m.is_auto)) {
        return 0.0f;
    }
    if (!m.is_auto || m.tail_cells == 0) {
        return m.frac;
    }
    const double s = (double) tail_cells/m.tail_cells;
    return (float) llama_rkv_tail_cpu_best(m.t_res_ms, s*m.t_link_ms, s*m.t_cpu_ms, m.latency_ms);
}

uint32_t llama_rkv_tail_cpu_from_cells(const llama_rkv_tail_cpu & m) {
    for (uint32_t c = LLAMA_RKV_WINDOW_ALIGN; c < m.tail_cells + LLAMA_RKV_WINDOW_ALIGN; c += LLAMA_RKV_WINDOW_ALIGN) {
        const uint32_t cells = std::min(c, m.tail_cells);
        if (llama_rkv_tail_cpu_frac_at(m, cells) > 0.0f) {
            return cells;
        }
    }
    return 0;
}

void llama_rkv_plan_tail_cpu(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.tail_cpu_frac     = 0.0f;
    st.t_token_hybrid_ms = -1.0;
    st.tail_cpu          = llama_rkv_tail_cpu{};
    const float req = st.req.tail_cpu_frac;

    bool host_memory = st.devs.empty();
    uint32_t n_layer = 0;
    for (const auto & d : st.devs) {
        host_memory = host_memory || d.host_memory;
        n_layer += d.n_layer;
    }
    if (!llama_rkv_is_split(st) || st.tail_cells == 0) {
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
    const double t_res  = std::max(0.0, st.t_resident_ms) + n_layer*LLAMA_RKV_LAYER_DECODE_MS;
    const double t_link = known ? st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3 : 0.0;
    const double t_cpu  = known ? st.est_tail_bytes/(st.cpu_attn_gbps*1e9)*1e3 : 0.0;
    const double latency = n_layer*LLAMA_RKV_CPU_PART_LATENCY_MS;

    if (req > 0.0f) {
        st.tail_cpu_frac   = std::min(1.0f, req);
        st.tail_cpu_reason = "requested";
        st.tail_cpu.frac   = st.tail_cpu_frac;
    } else if (!known) {
        st.tail_cpu_reason = std::string("auto: off, ") + (st.cpu_attn_gbps <= 0.0 ? "the CPU attention bandwidth" : "the link bandwidth") +
            " is unknown";
        return;
    } else {
        const double best_f = llama_rkv_tail_cpu_best(t_res, t_link, t_cpu, latency);
        char buf[256];
        if (best_f == 0.0) {
            snprintf(buf, sizeof(buf), "auto: off, a CPU part would gain < 3 %% (link %.1f GB/s, CPU attention %.1f GB/s)",
                    st.link_bw_gbps, st.cpu_attn_gbps);
            st.tail_cpu_reason = buf;
            return;
        }
        st.tail_cpu_frac = (float) best_f;
        st.tail_cpu = { st.tail_cpu_frac, true, t_res, t_link, t_cpu, latency, st.tail_cells };
        snprintf(buf, sizeof(buf), "auto: %.0f %% of each tail on the CPU at full context (link %.1f GB/s, CPU attention %.1f GB/s, "
                "%d threads), chosen again as the tail grows: none below %u cells", 100.0*best_f, st.link_bw_gbps, st.cpu_attn_gbps,
                st.n_threads, llama_rkv_tail_cpu_from_cells(st.tail_cpu));
        st.tail_cpu_reason = buf;
    }
    if (known) {
        st.t_token_hybrid_ms = llama_rkv_tail_cpu_time(t_res, t_link, t_cpu, latency, st.tail_cpu_frac);
    }
}

//
// auto tail types (see the header)
//

void llama_rkv_take_auto_tail(llama_rkv_state & st) {
    if (st.req.type_k_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO) {
        st.tail_auto_k     = true;
        st.req.type_k_tail = GGML_TYPE_COUNT;
    }
    if (st.req.type_v_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO) {
        st.tail_auto_v     = true;
        st.req.type_v_tail = GGML_TYPE_COUNT;
    }
}

// an auto axis' floor: q8_0 under a float window, else the window's own (already compact) type
static ggml_type llama_rkv_auto_tail_floor(ggml_type window) {
    return window == GGML_TYPE_F32 || window == GGML_TYPE_F16 || window == GGML_TYPE_BF16 ? GGML_TYPE_Q8_0 : window;
}

static double llama_rkv_bytes_per_elem(ggml_type t) {
    return (double) ggml_type_size(t)/(double) ggml_blck_size(t);
}

// whether every layer's tail can hold type t: a window split stores whole rows of its blocks, a head split whole heads
// (false when the layers' shapes are unknown, unless t is the window's type, which the cache holds already)
static bool llama_rkv_tail_type_fits(const llama_rkv_state & st, ggml_type t, bool is_v, bool head) {
    if (t == (is_v ? st.type_v : st.type_k)) {
        return true;
    }
    if (st.head_layers.empty()) {
        return false;
    }
    const uint64_t blck = (uint64_t) ggml_blck_size(t);
    for (const auto & hl : st.head_layers) {
        const uint64_t h = is_v ? hl.head_v : hl.head_k;
        if (h == 0 || (head ? h : h*hl.n_head_kv) % blck != 0) {
            return false;
        }
    }
    return true;
}

// the plan's tail-dependent figures at these types: the devices' K+V row bytes of the tail, the head layers' bytes of one
// host head (0 where the type does not divide a head: no head split at it)
static void llama_rkv_retype_tail(llama_rkv_state & st, ggml_type tk, ggml_type tv) {
    st.type_k_tail = tk;
    st.type_v_tail = tv;
    bool known = !st.head_layers.empty();
    for (const auto & hl : st.head_layers) {
        known = known && hl.head_k > 0 && hl.head_v > 0;
    }
    if (!known) {
        return; // the figures stay as the cache described them (at the window's types)
    }
    for (auto & d : st.devs) {
        d.row_bytes_tail = 0;
    }
    const int64_t bk = ggml_blck_size(tk);
    const int64_t bv = ggml_blck_size(tv);
    for (auto & hl : st.head_layers) {
        hl.head_bytes_tail = hl.head_k % bk == 0 && hl.head_v % bv == 0 ?
            ggml_row_size(tk, hl.head_k) + ggml_row_size(tv, hl.head_v) : 0;
        const int64_t nk = (int64_t) hl.head_k*hl.n_head_kv;
        const int64_t nv = (int64_t) hl.head_v*hl.n_head_kv;
        if (hl.dev >= 0 && (size_t) hl.dev < st.devs.size() && nk % bk == 0 && nv % bv == 0) {
            st.devs[hl.dev].row_bytes_tail += ggml_row_size(tk, nk) + ggml_row_size(tv, nv);
        }
    }
}

bool llama_rkv_choose_tail_types(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.tail_auto_t_res_ms  = -1.0;
    st.tail_auto_t_link_ms = -1.0;

    const ggml_type req_k = st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail;
    const ggml_type req_v = st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail;

    if (!st.tail_auto_k && !st.tail_auto_v) {
        st.type_k_tail = req_k;
        st.type_v_tail = req_v;
        st.tail_types_reason = st.req.type_k_tail == GGML_TYPE_COUNT && st.req.type_v_tail == GGML_TYPE_COUNT ?
            "the window's types (none requested)" : "requested";
        return true;
    }

    const bool head           = st.chosen == LLAMA_KV_RESIDENCY_HEAD;
    const bool head_requested = st.req.mode == LLAMA_KV_RESIDENCY_HEAD || st.req.device_heads > 0;
    std::string notes;

    // the floor of each auto axis, where every layer takes it; an explicit axis keeps its type
    ggml_type fk = st.tail_auto_k ? llama_rkv_auto_tail_floor(st.type_k) : req_k;
    ggml_type fv = st.tail_auto_v ? llama_rkv_auto_tail_floor(st.type_v) : req_v;
    for (const bool is_v : { false, true }) {
        ggml_type & f = is_v ? fv : fk;
        const ggml_type window = is_v ? st.type_v : st.type_k;
        if (!(is_v ? st.tail_auto_v : st.tail_auto_k) || llama_rkv_tail_type_fits(st, f, is_v, head)) {
            continue;
        }
        if (head && head_requested) {
            char buf[320];
            snprintf(buf, sizeof(buf), "the head split's host heads (%s size %u) cannot take the %s tail that auto chooses (blocks of %d "
                    "elements): give -ct%st a type that divides them, or split by window", is_v ? "V head" : "K head",
                    st.head_layers.empty() ? 0u : (is_v ? st.head_layers[0].head_v : st.head_layers[0].head_k), ggml_type_name(f),
                    (int) ggml_blck_size(f), is_v ? "v" : "k");
            st.error = buf;
            return false;
        }
        notes += std::string("; ") + (is_v ? "V" : "K") + ": " + ggml_type_name(f) + " blocks do not divide the " +
                 (head ? "KV heads" : "rows") + ", the window's " + ggml_type_name(window);
        f = window;
    }
    if (in.tail_op_unsupported && (fk != req_k || fv != req_v)) {
        const std::string why = in.tail_op_unsupported(fk, fv, head);
        if (!why.empty()) {
            notes += "; " + why + ", the window's types";
            fk = st.tail_auto_k ? st.type_k : req_k;
            fv = st.tail_auto_v ? st.type_v : req_v;
        }
    }

    // the link-only time of the split's tail at the floor types against the time of what the device reads
    llama_rkv_retype_tail(st, fk, fv);
    double dev_bytes = 0.0, tail_bytes = 0.0;
    llama_rkv_token_bytes(st, head, st.window_cells, st.kv_size, dev_bytes, tail_bytes);

    llama_rkv_link_source(st);
    double link_bw = st.link_bw_gbps;
    std::string link_how = st.link_bw_source;
    if (link_bw <= 0.0 && in.measure_link) {
        link_bw = in.measure_link(&link_how);
    }
    const bool known = !st.devs.empty() && st.mem_bw_gbps > 0.0 && link_bw > 0.0;
    if (known) {
        st.tail_auto_t_res_ms  = dev_bytes/(st.mem_bw_gbps*1e9)*1e3;
        st.tail_auto_t_link_ms = tail_bytes/(link_bw*1e9)*1e3;
    }

    ggml_type ck = fk, cv = fv;
    char buf[512];
    if (known && st.tail_auto_t_link_ms > LLAMA_RKV_AUTO_TAIL_Q4_RATIO*st.tail_auto_t_res_ms) {
        for (const bool is_v : { false, true }) {
            ggml_type & c = is_v ? cv : ck;
            const ggml_type window = is_v ? st.type_v : st.type_k;
            if ((is_v ? st.tail_auto_v : st.tail_auto_k) && llama_rkv_bytes_per_elem(window) > llama_rkv_bytes_per_elem(GGML_TYPE_Q4_0)) {
                if (llama_rkv_tail_type_fits(st, GGML_TYPE_Q4_0, is_v, head)) {
                    c = GGML_TYPE_Q4_0;
                } else {
                    notes += std::string("; ") + (is_v ? "V" : "K") + ": q4_0 blocks do not divide the " + (head ? "KV heads" : "rows");
                }
            }
        }
        if (in.tail_op_unsupported && (ck != fk || cv != fv)) {
            const std::string why = in.tail_op_unsupported(ck, cv, head);
            if (!why.empty()) {
                notes += "; " + why;
                ck = fk;
                cv = fv;
            }
        }
        snprintf(buf, sizeof(buf), "auto: K %s, V %s: the tail's link-only time at %s/%s (%.3g ms/token at full context) exceeds %g x "
                "the resident time (%.3g ms)", ggml_type_name(ck), ggml_type_name(cv), ggml_type_name(fk), ggml_type_name(fv),
                st.tail_auto_t_link_ms, LLAMA_RKV_AUTO_TAIL_Q4_RATIO, st.tail_auto_t_res_ms);
    } else if (known) {
        snprintf(buf, sizeof(buf), "auto: K %s, V %s (the floor): the tail's link-only time (%.3g ms/token at full context) is within "
                "%g x the resident time (%.3g ms)", ggml_type_name(ck), ggml_type_name(cv), st.tail_auto_t_link_ms,
                LLAMA_RKV_AUTO_TAIL_Q4_RATIO, st.tail_auto_t_res_ms);
    } else {
        snprintf(buf, sizeof(buf), "auto: K %s, V %s (the floor): the link-only time cannot be weighed against the resident time (%s)",
                ggml_type_name(ck), ggml_type_name(cv),
                st.devs.empty() ? "no device was budgeted" : st.mem_bw_gbps <= 0.0 ? st.mem_bw_source.c_str() : link_how.c_str());
    }
    st.tail_types_reason = buf + notes;
    llama_rkv_retype_tail(st, ck, cv);
    return true;
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
    st.tail_auto_t_res_ms  = -1.0;
    st.tail_auto_t_link_ms = -1.0;
    st.tail_types_reason = !st.error.empty() ? "refused (see error)" :
        st.tail_auto_k || st.tail_auto_v ? "auto: nothing spills (resident): the window's types" : "no tail (resident)";
    llama_rkv_heads_whole(st);
    return 0;
}

// the whole KV fits the budget (the vram_target's, or the free VRAM's when target <= 0): resident, saying so
static uint32_t llama_rkv_resident_fits(llama_rkv_state & st, int64_t target) {
    size_t kv = 0;
    for (const auto & d : st.devs) {
        kv += d.kv_resident;
    }
    char buf[160];
    snprintf(buf, sizeof(buf), "the whole KV (%.0f MiB) fits the %s budget: resident", llama_rkv_mib(kv),
            target > 0 ? "vram_target" : "free VRAM");
    return llama_rkv_resident(st, buf);
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

// the vram_target terms of an explicit split (window cells or device heads): refused below what the device needs
// before any KV (st.error), a warning when the split's device bytes exceed the budget
static bool llama_rkv_check_explicit(llama_rkv_state & st, const llama_rkv_decide_in & in, const char * what,
        const std::function<size_t(const llama_rkv_dev_budget &, size_t)> & need_of) {
    const int64_t target = st.req.vram_target_mib;
    // the budget terms, for the plan; an explicit split needs no minimum
    llama_rkv_plan_budget(st);
    st.error.clear();
    for (size_t i = 0; i < st.devs.size(); ++i) {
        const auto & d = st.devs[i];
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
            return false;
        }
        const size_t need = need_of(d, i);
        if (need > d.kv_budget && !in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: the explicit %s needs %.0f MiB on %s, %.0f MiB more than the budget\n",
                    __func__, what, llama_rkv_mib(need), d.name.c_str(), llama_rkv_mib(need - d.kv_budget));
        }
    }
    return true;
}

// a split was chosen (st.chosen, st.reason): the tail types, the link model, the hybrid tail's share and the logs; false
// (st.error set) when the tail types refuse the request
static bool llama_rkv_finish_split(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.eligible = true;

    // the link model: only a split needs the device's memory bandwidth (auto may have measured it already)
    if (!st.devs.empty() && in.measure && st.mem_bw_gbps <= 0.0) {
        st.mem_bw_gbps = in.measure(&st.mem_bw_source);
    }
    if (!llama_rkv_choose_tail_types(st, in)) {
        return false;
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
        if (!st.auto_reason.empty()) {
            LLAMA_LOG_INFO("%s: rolling KV: %s\n", __func__, st.auto_reason.c_str());
        }
        if (st.tail_auto_k || st.tail_auto_v) {
            LLAMA_LOG_INFO("%s: rolling KV: tail types K %s, V %s (%s)\n", __func__, ggml_type_name(st.type_k_tail),
                    ggml_type_name(st.type_v_tail), st.tail_types_reason.c_str());
        }
    }
    return true;
}

static uint32_t llama_rkv_choose_window(llama_rkv_state & st, uint32_t wc, std::string reason) {
    st.chosen       = LLAMA_KV_RESIDENCY_WINDOW;
    st.window_cells = wc;
    st.tail_cells   = st.kv_size - wc;
    st.reason       = std::move(reason);
    llama_rkv_heads_whole(st);
    return wc;
}

static void llama_rkv_choose_head(llama_rkv_state & st, std::string reason) {
    // every cell of the host heads is "tail"
    st.chosen       = LLAMA_KV_RESIDENCY_HEAD;
    st.window_cells = 0;
    st.tail_cells   = st.kv_size;
    st.reason       = std::move(reason) + " (" + llama_rkv_heads_summary(st) + ")";
}

// auto's margin: head must be this much cheaper than the window at full context (the window streams less at any shorter
// context, and nothing while a sequence fits it)
static const double LLAMA_RKV_HEAD_MARGIN = 0.97;

// a tactic's cost at full context (and its tail bytes at half context) from the current plan in st
static llama_rkv_tactic_cost llama_rkv_tactic(const llama_rkv_state & st, bool head, uint32_t wc) {
    llama_rkv_tactic_cost c;
    c.valid = true;
    llama_rkv_token_bytes(st, head, wc, st.kv_size, c.device_bytes, c.tail_bytes);
    llama_rkv_token_bytes(st, head, wc, st.kv_size, c.device_bytes_mean, c.tail_bytes_mean, true);
    c.t_token_ms      = llama_rkv_token_ms(c.device_bytes, c.tail_bytes, st.mem_bw_gbps, st.link_bw_gbps);
    c.t_token_mean_ms = llama_rkv_token_ms(c.device_bytes_mean, c.tail_bytes_mean, st.mem_bw_gbps, st.link_bw_gbps);
    return c;
}

// the head split of a request that asks for it (mode head, or auto with device_heads)
static uint32_t llama_rkv_decide_head(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;
    const int64_t target = req.vram_target_mib;

    st.reserve = target > 0 ? 0 : in.reserve;

    if (req.device_heads > 0) {
        const uint32_t n = (uint32_t) req.device_heads;
        uint32_t n_max = 0;
        bool any = false;
        for (auto & hl : st.head_layers) {
            hl.device_heads = std::min(n, hl.n_head_kv);
            any   = any || hl.device_heads < hl.n_head_kv;
            n_max = std::max(n_max, hl.n_head_kv);
        }
        if (!any) {
            st.devs.clear();
            if (st.tail_auto_k || st.tail_auto_v) {
                st.error = "device_heads " + std::to_string(n) + " keeps every KV head on the device (" + std::to_string(n_max) +
                    " per layer): nothing spills, so auto has no tail to choose a type for; give fewer device heads, or a tail type";
                return llama_rkv_resident(st, st.error);
            }
            return llama_rkv_resident(st, "device_heads " + std::to_string(n) + " >= the KV heads of every layer (" +
                    std::to_string(n_max) + "): the whole cache on the device (resident)");
        }
        if (!in.head_op_unsupported.empty() && !in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: %s: the op runs on the CPU, the device heads' results are copied every step\n",
                    __func__, in.head_op_unsupported.c_str());
        }
        st.heads_explicit = true;
        if (!st.devs.empty()) {
            const auto heads = st.head_layers; // the budget does not change them
            if (!llama_rkv_check_explicit(st, in, "head split", [&](const llama_rkv_dev_budget &, size_t i) {
                        return llama_rkv_head_dev_bytes(st, (int32_t) i); })) {
                return llama_rkv_resident(st, st.error);
            }
            st.head_layers = heads;
            for (size_t i = 0; i < st.devs.size(); ++i) {
                st.devs[i].head_kv_bytes = llama_rkv_head_dev_bytes(st, (int32_t) i);
            }
        }
        llama_rkv_choose_head(st, std::string(llama_rkv_mode_name(req.mode)) + ": explicit " + std::to_string(n) +
                " device KV heads per layer");
        if (!llama_rkv_finish_split(st, in)) {
            return llama_rkv_resident(st, st.error);
        }
        return 0;
    }

    if (st.devs.empty()) {
        return llama_rkv_resident(st, in.no_device.empty() ? "no device to budget: resident" : in.no_device);
    }
    if (in.host_memory && target <= 0) {
        st.devs.clear();
        return llama_rkv_resident(st, "no GPU and no vram_target: resident (a vram_target sizes a head split in host memory)");
    }
    if (!in.head_op_unsupported.empty()) {
        st.devs.clear();
        return llama_rkv_resident(st, in.head_op_unsupported + ": resident", false);
    }

    st.budgeted = true;
    const uint32_t wc = llama_rkv_plan_budget(st);
    const bool fits = wc == 0 && st.error.empty();
    st.error.clear();
    if (!fits) {
        llama_rkv_plan_heads(st);
    }
    st.min_target_mib = 0;
    for (const auto & d : st.devs) {
        st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib_head);
    }
    if (!in.quiet) {
        llama_rkv_log_budget(st);
    }
    if (fits) {
        return llama_rkv_resident_fits(st, target);
    }
    if (!st.error.empty()) {
        return llama_rkv_resident(st, st.error);
    }
    llama_rkv_choose_head(st, std::string("head: the most KV heads per layer that fit the ") +
            (target > 0 ? "vram_target" : "free VRAM") + " budget");
    if (!llama_rkv_finish_split(st, in)) {
        return llama_rkv_resident(st, st.error);
    }
    return 0;
}

static uint32_t llama_rkv_decide_impl(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;

    st.error.clear();
    st.budgeted       = false;
    st.heads_explicit = false;
    st.auto_compared  = false;
    st.auto_reason.clear();
    st.cost_window = {};
    st.cost_head   = {};

    const bool tail_auto = st.tail_auto_k || st.tail_auto_v;
    if (tail_auto) {
        // plan at the window's types (a plan made before on this state may have left the chosen ones)
        llama_rkv_retype_tail(st, st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail,
                st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail);
    }

    // the answers that need no budget report none
    if (req.mode == LLAMA_KV_RESIDENCY_OFF) {
        st.devs.clear();
        if (tail_auto) {
            st.error = "auto tail types choose the type of a split's tail, and mode off never splits: use mode auto or window, "
                       "or give the tail a type";
            return llama_rkv_resident(st, st.error);
        }
        return llama_rkv_resident(st, "mode off: the upstream resident cache");
    }
    if (in.refuse) {
        st.devs.clear();
        return llama_rkv_resident(st, in.refuse, false);
    }

    // head mode, or auto with explicit device heads
    if (req.mode == LLAMA_KV_RESIDENCY_HEAD || (req.mode == LLAMA_KV_RESIDENCY_AUTO && req.device_heads > 0)) {
        if (!st.head_refuse.empty()) {
            st.devs.clear();
            st.error = "the head split is not possible for this model: " + st.head_refuse;
            return llama_rkv_resident(st, st.error, false);
        }
        return llama_rkv_decide_head(st, in);
    }

    const bool explicit_wc = req.window_cells > 0;

    if (explicit_wc && (uint64_t) req.window_cells >= st.kv_size) {
        st.devs.clear();
        if (tail_auto) {
            st.error = "window_cells " + std::to_string(req.window_cells) + " holds the whole cache (" + std::to_string(st.kv_size) +
                " cells per stream): nothing spills, so auto has no tail to choose a type for; give a smaller window, or a tail type";
            return llama_rkv_resident(st, st.error);
        }
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
        if (!st.devs.empty() && !llama_rkv_check_explicit(st, in, "window", [wc](const llama_rkv_dev_budget & d, size_t) {
                    return (size_t) (wc + 1)*d.cell_bytes; })) {
            return llama_rkv_resident(st, st.error);
        }
        char buf[256];
        snprintf(buf, sizeof(buf), "%s: explicit window of %u cells", llama_rkv_mode_name(req.mode), wc);
        llama_rkv_choose_window(st, wc, buf);
        if (!llama_rkv_finish_split(st, in)) {
            return llama_rkv_resident(st, st.error);
        }
        return wc;
    }

    if (st.devs.empty()) {
        return llama_rkv_resident(st, in.no_device.empty() ? "no device to budget: resident" : in.no_device);
    }
    if (in.host_memory && target <= 0) {
        st.devs.clear();
        return llama_rkv_resident(st, "no GPU and no vram_target: resident (a vram_target sizes a window in host memory)");
    }

    st.budgeted = true;
    wc = llama_rkv_plan_budget(st);
    const bool fits = wc == 0 && st.error.empty();

    // auto: the head split is the other candidate where this cache can split by head
    bool head = false;
    if (!fits && req.mode == LLAMA_KV_RESIDENCY_AUTO) {
        const std::string err_window = st.error;
        st.error.clear();
        st.auto_compared = true;

        if (err_window.empty()) {
            st.cost_window = llama_rkv_tactic(st, false, wc);
        } else {
            st.cost_window.why_not = err_window;
        }
        if (!st.head_refuse.empty()) {
            st.cost_head.why_not = st.head_refuse;
        } else if (!in.head_op_unsupported.empty()) {
            st.cost_head.why_not = in.head_op_unsupported;
        } else if (!llama_rkv_plan_heads(st)) {
            st.cost_head.why_not = st.error;
            st.error.clear();
        } else {
            st.cost_head = llama_rkv_tactic(st, true, 0);
        }

        if (st.cost_window.valid && st.cost_head.valid) {
            // both fit: compare them where they cost most, at full context (the time model when both bandwidths are known)
            if (in.measure && st.mem_bw_gbps <= 0.0) {
                st.mem_bw_gbps = in.measure(&st.mem_bw_source);
            }
            llama_rkv_link_source(st);
            st.cost_window = llama_rkv_tactic(st, false, wc);
            st.cost_head   = llama_rkv_tactic(st, true, 0);
            const bool by_time = st.cost_window.t_token_ms > 0.0 && st.cost_head.t_token_ms > 0.0;
            const double w      = by_time ? st.cost_window.t_token_ms      : st.cost_window.tail_bytes;
            const double h      = by_time ? st.cost_head.t_token_ms        : st.cost_head.tail_bytes;
            const double w_mean = by_time ? st.cost_window.t_token_mean_ms : st.cost_window.tail_bytes_mean;
            const double h_mean = by_time ? st.cost_head.t_token_mean_ms   : st.cost_head.tail_bytes_mean;
            head = h < LLAMA_RKV_HEAD_MARGIN*w && h_mean < LLAMA_RKV_HEAD_MARGIN*w_mean;
            const double unit = by_time ? 1.0 : (double) LLAMA_RKV_MIB;
            const char * what = by_time ? "ms/token" : "MiB streamed/token";
            char buf[640];
            snprintf(buf, sizeof(buf), "auto: %s: the head split %.3g %s at full context and %.3g on average over a sequence growing to "
                    "it, the window %.3g and %.3g (head is taken only where it is more than 3 %% cheaper on both: the window streams "
                    "nothing while a sequence fits it)", head ? "head" : "window", h/unit, what, h_mean/unit, w/unit, w_mean/unit);
            st.auto_reason = buf;
        } else if (st.cost_head.valid) {
            head = true;
            st.auto_reason = "auto: head, the window does not fit (" + err_window + ")";
        } else {
            st.auto_reason = "auto: window, no head split (" + st.cost_head.why_not + ")";
            st.error = err_window;
        }
        if (head) {
            st.min_target_mib = 0;
            for (auto & d : st.devs) {
                d.min_target_mib  = std::min(d.min_target_mib, d.min_target_mib_head);
                st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib);
            }
        } else {
            llama_rkv_heads_whole(st);
        }
    }

    if (!in.quiet) {
        llama_rkv_log_budget(st);
    }
    if (!st.error.empty()) {
        return llama_rkv_resident(st, st.error);
    }
    if (fits) {
        return llama_rkv_resident_fits(st, target);
    }

    if (head) {
        llama_rkv_choose_head(st, std::string("auto: the most KV heads per layer that fit the ") +
                (target > 0 ? "vram_target" : "free VRAM") + " budget");
        if (!llama_rkv_finish_split(st, in)) {
            return llama_rkv_resident(st, st.error);
        }
        return 0;
    }

    char buf[256];
    snprintf(buf, sizeof(buf), "%s: window of %u cells, the largest multiple of %u that fits the %s budget",
            llama_rkv_mode_name(req.mode), wc, LLAMA_RKV_WINDOW_ALIGN, target > 0 ? "vram_target" : "free VRAM");
    llama_rkv_choose_window(st, wc, buf);
    if (!llama_rkv_finish_split(st, in)) {
        return llama_rkv_resident(st, st.error);
    }
    return wc;
}

uint32_t llama_rkv_decide(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const uint32_t wc = llama_rkv_decide_impl(st, in);
    if (!llama_rkv_is_split(st)) {
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

    // the head split: every layer, and why it cannot split by head
    st.head_layers = desc.head_layers;
    st.head_refuse = desc.refuse_head ? desc.refuse_head : "";
    for (auto & hl : st.head_layers) {
        hl.dev = -1;
        hl.device_heads = hl.n_head_kv;
        // the head shapes, for the figures of another tail type (auto tail types)
        hl.head_k = model.hparams.n_embd_head_k(hl.il);
        hl.head_v = model.hparams.n_embd_head_v(hl.il);
    }

    const bool needs_devices = req.mode == LLAMA_KV_RESIDENCY_AUTO || req.mode == LLAMA_KV_RESIDENCY_WINDOW ||
                               req.mode == LLAMA_KV_RESIDENCY_HEAD;
    const bool may_head = (req.mode == LLAMA_KV_RESIDENCY_AUTO || req.mode == LLAMA_KV_RESIDENCY_HEAD) && st.head_refuse.empty();

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
        for (const auto * g : groups) {
            if (may_head && !in.host_memory && !llama_rkv_dev_supports_split(g->dev, *g, desc.n_stream, st.n_ubatch,
                        desc.type_k, desc.type_v, type_k_tail, type_v_tail, true)) {
                char buf[256];
                snprintf(buf, sizeof(buf), "the %s backend cannot run the head split's streaming flash-attention op for K %s, V %s (host heads)",
                        ggml_backend_dev_name(g->dev), ggml_type_name(type_k_tail), ggml_type_name(type_v_tail));
                in.head_op_unsupported = buf;
                break;
            }
        }

        // the head split's layers on the budgeted devices (st.devs is filled in the order of groups)
        for (size_t ig = 0; ig < groups.size(); ++ig) {
            const int32_t gi = (int32_t) (groups[ig] - desc.groups.data());
            for (size_t il = 0; il < st.head_layers.size(); ++il) {
                if (desc.head_layers[il].dev == gi) {
                    st.head_layers[il].dev = (int32_t) ig;
                    if (in.host_memory) {
                        st.head_layers[il].conv_head_bytes = 0;
                    }
                }
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
            // the tail's K type as the plan chose it (auto tail types decide it after the split)
            in.measure_cpu_attn = [n_threads, &st](std::string * how) {
                return llama_rkv_measure_cpu_attn_bw(n_threads, st.type_k_tail, how);
            };
            in.measure_link = [bw_dev](std::string * how) {
                return llama_rkv_measure_link_bw(bw_dev, how);
            };
        }
    }

    // auto tail types: whether the devices run the streaming op with a candidate's types
    if (!in.host_memory && (st.tail_auto_k || st.tail_auto_v)) {
        in.tail_op_unsupported = [&desc, &st](ggml_type tk, ggml_type tv, bool head) -> std::string {
            for (const auto & g : desc.groups) {
                if (llama_rkv_dev_is_gpu(g.dev) && !llama_rkv_dev_supports_split(g.dev, g, desc.n_stream, st.n_ubatch,
                            desc.type_k, desc.type_v, tk, tv, head)) {
                    return std::string("the ") + ggml_backend_dev_name(g.dev) + " backend cannot run the streaming op with a " +
                           ggml_type_name(tk) + "/" + ggml_type_name(tv) + " tail";
                }
            }
            return "";
        };
    }

    const uint32_t wc = llama_rkv_decide(st, in);

    if (!st.error.empty()) {
        // llama_init_from_model_rolling_kv logs it and returns NULL
        throw std::runtime_error(st.error);
    }

    return wc;
}
