// rollingkv: the KV residency planner's inputs from the devices and the model (see llama-kv-residency.h): the
// backend's budget figures, the weights and compute buffers, whether a device runs the streaming op, and the
// bandwidths measured once per process. Everything here may touch a device; the decision itself does not
// (llama-kv-residency-model.cpp, llama-kv-residency-decide.cpp).
#include "llama-kv-residency.h"

#include "llama-model.h"
#include "llama-rolling-kv-graph.h"

#include "ggml-alloc.h"
#include "ggml-cpp.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

// the copy that measures the device memory bandwidth: large enough to leave the caches of any device behind,
// small enough to fit next to the weights (a smaller one is tried when it does not)
static const size_t LLAMA_RKV_BW_COPY_MIB[] = { 256, 64 };
static const int    LLAMA_RKV_BW_REPS       = 5;

//
// planner inputs
//

bool llama_rkv_dev_is_gpu(ggml_backend_dev_t dev) {
    if (!dev) {
        return false;
    }
    const auto t = ggml_backend_dev_type(dev);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

ggml_rkv_dev_budget llama_rkv_backend_budget(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail,
                                             uint32_t n_stream) {
    ggml_rkv_dev_budget res = {};
    ggml_backend_reg_t reg = llama_rkv_dev_is_gpu(dev) ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto fn = reg ? (ggml_backend_rkv_dev_budget_t) ggml_backend_reg_get_proc_address(reg, GGML_RKV_DEV_BUDGET_PROC)
              : nullptr;
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
size_t llama_rkv_compute_estimate(const llama_model & model, const llama_rkv_state & st, uint32_t n_kv,
        uint32_t n_kv_other, bool has_output, std::string * note) {
    const auto & hp = model.hparams;

    const size_t n_tokens = llama_rkv_estimate_tokens(st);

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
        snprintf(buf, sizeof(buf),
                "%zu-token ubatch: logits %.1f MiB, one layer %.1f MiB, KQ masks %.1f MiB (%u + %u cells); max(logits, "
                "layer + masks) x 1.1 + 32 MiB", n_tokens, llama_rkv_mib(logits), llama_rkv_mib(layer),
                llama_rkv_mib(mask), n_kv, n_kv_other);
        *note = buf;
    }

    return res;
}

bool llama_rkv_dev_supports_split(ggml_backend_dev_t dev, const llama_rkv_layer_group & g, uint32_t n_stream,
        uint32_t n_ubatch, ggml_type type_k, ggml_type type_v, ggml_type type_k_tail, ggml_type type_v_tail,
        bool head) {
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
    for (const int64_t n_q : { (int64_t) 1,
                              (int64_t) std::max<uint32_t>(1, std::min<uint32_t>(n_ubatch ? n_ubatch : 512, 512)) }) {
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
            const int64_t best_us = llama_rkv_best_us([&](int i) {
                ggml_backend_tensor_copy(i % 2 ? b : a, i % 2 ? a : b);
            });

            char tmp[160];
            snprintf(tmp, sizeof(tmp), "%zu MiB copy in %s, best of %d", mib, name, LLAMA_RKV_BW_REPS);
            *desc = tmp;
            return 2.0*size/(best_us*1e-6)/1e9; // a copy reads and writes every byte
        }
        return -1.0;
    });
}

// the CPU part's functions (llama-kv-residency.h): the CPU backend's registry, asked by name at each call (a few string
// compares: the calls are per context or per request, and the backends of a GGML_BACKEND_DL build may be loaded after
// libllama's first question)
static void * llama_rkv_cpu_proc(const char * name) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    return reg ? ggml_backend_reg_get_proc_address(reg, name) : nullptr;
}

bool llama_rkv_cpu_part_available() {
    return llama_rkv_cpu_proc(GGML_RKV_CPU_PART_RUN_PROC) != nullptr;
}

int llama_rkv_cpu_threads() {
    auto fn = (ggml_rkv_get_cpu_threads_t) llama_rkv_cpu_proc(GGML_RKV_GET_CPU_THREADS_PROC);
    return fn ? fn() : 0;
}

uint64_t llama_rkv_cpu_part_runs() {
    auto fn = (ggml_rkv_cpu_part_runs_t) llama_rkv_cpu_proc(GGML_RKV_CPU_PART_RUNS_PROC);
    return fn ? fn() : 0;
}

llama_rkv_plan_bytes llama_rkv_streamed_plan_bytes() {
    llama_rkv_plan_bytes out;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        auto fn = (ggml_backend_rkv_streamed_bytes_t) ggml_backend_reg_get_proc_address(ggml_backend_reg_get(i),
                GGML_RKV_STREAMED_BYTES_PROC);
        if (fn) {
            uint64_t total = 0, last = 0, plans = 0;
            fn(&total, &last, &plans);
            out.available = true;
            out.total += total;
            out.last   = plans > 0 ? last : out.last;
            out.plans += plans;
        }
    }
    return out;
}

bool llama_rkv_cpu_part_supported(ggml_type type_k, ggml_type type_v, int64_t DK, int64_t DV) {
    auto fn = (ggml_rkv_cpu_part_supported_t) llama_rkv_cpu_proc(GGML_RKV_CPU_PART_SUPPORTED_PROC);
    return fn && fn(type_k, type_v, DK, DV);
}

double llama_rkv_cpu_attn_measure_gbps(int n_threads, ggml_type type, size_t bytes, int n_rows) {
    auto fn = (ggml_rkv_cpu_attn_measure_gbps_t) llama_rkv_cpu_proc(GGML_RKV_CPU_ATTN_MEASURE_GBPS_PROC);
    return fn ? fn(n_threads, type, bytes, n_rows) : -1.0;
}

// the CPU part's attention bandwidth for a tail type on n_threads threads (ggml_rkv_cpu_attn_measure_gbps), once per
// process for each
double llama_rkv_measure_cpu_attn_bw(int n_threads, ggml_type type, std::string * how, int n_rows) {
    static llama_rkv_measured_once<std::tuple<int, int, int>> once;
    const int nt = n_threads > 0 ? n_threads : llama_rkv_cpu_threads();
    return once.get({ nt, (int) type, n_rows }, how, [nt, type, n_rows](std::string * desc) {
        *desc = "measured: 256 MiB " + std::string(ggml_type_name(type)) + " tail, " + std::to_string(nt) + " threads" +
                (n_rows > 1 ? ", " + std::to_string(n_rows) + " rows" : "");
        return llama_rkv_cpu_attn_measure_gbps(nt, type, 0, n_rows);
    });
}

bool llama_rkv_time_link_copies(ggml_backend_dev_t dev, const size_t * sizes, const int32_t * reps, size_t n_sizes,
                                double * h2d_gbps, double * d2h_gbps, void (*under_load)(void *), void * user_data,
                                bool * pinned, std::string * err) {
    const char * name = dev ? ggml_backend_dev_name(dev) : "no device";
    size_t max_size = 0;
    for (size_t i = 0; i < n_sizes; ++i) {
        if (sizes[i] == 0 || reps[i] < 1) {
            *err = "a copy of 0 bytes or fewer than 1 copy per run";
            return false;
        }
        max_size = std::max(max_size, sizes[i]);
    }
    ggml_backend_buffer_type_t host_buft = llama_rkv_dev_is_gpu(dev) ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (!host_buft) {
        *err = std::string(name) + " is not a GPU with pinned host memory";
        return false;
    }
    const std::string mib = std::to_string(max_size/LLAMA_RKV_MIB) + " MiB";
    ggml_backend_buffer_ptr buf_h { ggml_backend_buft_alloc_buffer(host_buft, max_size) };
    if (!buf_h) {
        *err = "no " + mib + " of pinned host memory for " + name;
        return false;
    }
    // a backend that cannot pin falls back to pageable memory (ggml-cuda: GGML_CUDA_NO_PINNED, or cudaMallocHost
    // failing), as it does for the tails
    *pinned = ggml_backend_buffer_get_type(buf_h.get()) == host_buft;
    ggml_init_params params = { /*.mem_size =*/ ggml_tensor_overhead(), /*.mem_buffer =*/ NULL, /*.no_alloc =*/ true };
    ggml_context_ptr ctx { ggml_init(params) };
    ggml_tensor * t = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I8, max_size);
    ggml_backend_buffer_type_t dev_buft = ggml_backend_dev_buffer_type(dev);
    ggml_backend_buffer_ptr buf_d { ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), dev_buft) };
    ggml_backend_ptr backend { ggml_backend_dev_init(dev, nullptr) };
    if (!buf_d || !backend) {
        *err = buf_d ? std::string("cannot start a backend on ") + name : "no " + mib + " free on " + name;
        return false;
    }
    // every page written before timing: nothing left to fault in
    ggml_backend_buffer_clear(buf_h.get(), 0x5A);
    ggml_backend_buffer_clear(buf_d.get(), 0);
    void * host = ggml_backend_buffer_get_base(buf_h.get());

    // n copies queued back to back on the backend's stream, one synchronize: the run's microseconds (at least 1)
    auto run = [&](bool to_device, size_t size, int32_t n) {
        const int64_t t0 = ggml_time_us();
        for (int32_t i = 0; i < n; ++i) {
            if (to_device) {
                ggml_backend_tensor_set_async(backend.get(), t, host, 0, size);
            } else {
                ggml_backend_tensor_get_async(backend.get(), t, host, 0, size);
            }
        }
        ggml_backend_synchronize(backend.get());
        return std::max<int64_t>(ggml_time_us() - t0, 1);
    };
    for (const bool to_device : { true, false }) {
        double * out = to_device ? h2d_gbps : d2h_gbps;
        if (!out) {
            continue;
        }
        for (size_t i = 0; i < n_sizes; ++i) {
            run(to_device, sizes[i], 1); // warm-up: clocks and link out of idle, mappings made
            int64_t us[LLAMA_RKV_LINK_RUNS];
            for (int64_t & u : us) {
                u = run(to_device, sizes[i], reps[i]);
            }
            std::sort(us, us + LLAMA_RKV_LINK_RUNS);
            out[i] = (double) sizes[i]*reps[i]/(us[LLAMA_RKV_LINK_RUNS/2]*1e-6)/1e9;
        }
    }
    if (under_load) {
        for (int i = 0; i < LLAMA_RKV_LINK_LOAD_COPIES; ++i) {
            ggml_backend_tensor_set_async(backend.get(), t, host, 0, max_size);
        }
        under_load(user_data);
        ggml_backend_synchronize(backend.get());
    }
    return true;
}

double llama_rkv_measure_link_bw(ggml_backend_dev_t dev, std::string * how) {
    static llama_rkv_measured_once<ggml_backend_dev_t> once;
    return once.get(dev, how, [dev](std::string * desc) {
        const size_t  size = 256*LLAMA_RKV_MIB;
        const int32_t reps = 2;
        double gbps = -1.0;
        bool pinned = false;
        std::string err;
        if (!llama_rkv_time_link_copies(dev, &size, &reps, 1, &gbps, nullptr, nullptr, nullptr, &pinned, &err)) {
            *desc = "not measured: " + err;
            return -1.0;
        }
        // pageable host memory (pinning failed): the tails get the same, so its figure is the one to plan with
        *desc = std::string("256 MiB ") + (pinned ? "pinned" : "pageable") + " host-to-device copies to " +
                ggml_backend_dev_name(dev) + ", median of " + std::to_string(LLAMA_RKV_LINK_RUNS) + " runs of " +
                std::to_string(reps);
        return gbps;
    });
}

// One decode layer's time beyond reading its bytes, on the device that holds layer il: the layer's own weight matrices,
// each multiplied by one token's activations (what a decode step does with them), then LLAMA_RKV_LAYER_SMALL_KERNELS
// small kernels (the norms, RoPE, the cache writes, the residual adds, the GLU between them), best of a few runs of one
// graph on the device's backend; minus the matrices' bytes at the device memory bandwidth the planner uses for
// t_resident. Once per process per (model, layer).
double llama_rkv_measure_layer_decode_ms(const llama_model & model, int il, ggml_backend_dev_t dev, double mem_bw_gbps,
        std::string * how) {
    static llama_rkv_measured_once<std::pair<const llama_model *, int>> once;
    return once.get({ &model, il }, how, [&model, il, dev, mem_bw_gbps](std::string * desc) {
        *desc = "not measured";
        if (!dev || !(mem_bw_gbps > 0.0)) {
            *desc = "not measured: no device memory bandwidth";
            return -1.0;
        }
        const std::string prefix = "blk." + std::to_string(il) + ".";
        std::vector<ggml_tensor *> weights;
        size_t bytes = 0;
        for (const auto & [name, t] : model.tensors_by_name) {
            if (name.rfind(prefix, 0) != 0 || ggml_n_dims(t) != 2 || !t->buffer || t->ne[1] < 64) {
                continue;
            }
            ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(t->buffer);
            if (ggml_backend_buft_get_device(buft) != dev) {
                continue; // the layer's matrices on another device (or repacked/host copies)
            }
            weights.push_back(t);
            bytes += ggml_nbytes(t);
        }
        if (weights.empty()) {
            *desc = "not measured: layer " + std::to_string(il) + " has no weight matrices on " +
                    ggml_backend_dev_name(dev);
            return -1.0;
        }
        ggml_backend_ptr be { ggml_backend_dev_init(dev, nullptr) };
        if (!be) {
            *desc = std::string("not measured: cannot start a backend on ") + ggml_backend_dev_name(dev);
            return -1.0;
        }
        const size_t n_nodes = 4*weights.size() + 4*LLAMA_RKV_LAYER_SMALL_KERNELS + 16;
        ggml_init_params params = { ggml_tensor_overhead()*n_nodes + ggml_graph_overhead_custom(n_nodes, false),
                                   nullptr, true };
        ggml_context_ptr ctx { ggml_init(params) };
        ggml_cgraph * gf = ggml_new_graph_custom(ctx.get(), n_nodes, false);
        std::vector<ggml_tensor *> inputs;
        for (ggml_tensor * w : weights) {
            ggml_tensor * x = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, w->ne[0]);
            ggml_set_input(x);
            inputs.push_back(x);
            ggml_build_forward_expand(gf, ggml_mul_mat(ctx.get(), w, x));
        }
        ggml_tensor * cur = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, 4096);
        ggml_set_input(cur);
        inputs.push_back(cur);
        for (int i = 0; i < LLAMA_RKV_LAYER_SMALL_KERNELS; ++i) {
            cur = ggml_scale(ctx.get(), cur, 0.5f);
        }
        ggml_build_forward_expand(gf, cur);

        ggml_gallocr_ptr galloc { ggml_gallocr_new(ggml_backend_get_default_buffer_type(be.get())) };
        if (!ggml_gallocr_alloc_graph(galloc.get(), gf)) {
            *desc = std::string("not measured: no memory for one token's activations on ") + ggml_backend_dev_name(dev);
            return -1.0;
        }
        for (ggml_tensor * x : inputs) {
            ggml_backend_tensor_memset(x, 0, 0, ggml_nbytes(x));
        }
        for (int i = 0; i < 3; ++i) { // warm: kernels loaded, a CUDA graph captured as a decode's is
            ggml_backend_graph_compute(be.get(), gf);
        }
        const int64_t best_us = llama_rkv_best_us([&](int) { ggml_backend_graph_compute(be.get(), gf); });
        const double t_ms     = best_us*1e-3;
        const double bytes_ms = bytes/(mem_bw_gbps*1e9)*1e3;
        char tmp[256];
        snprintf(tmp, sizeof(tmp),
                "measured: layer %d's %zu matrices (%.1f MiB) and %d small kernels on %s in %.3f ms, their bytes %.3f "
                "ms at %.0f GB/s, best of %d", il, weights.size(), llama_rkv_mib(bytes), LLAMA_RKV_LAYER_SMALL_KERNELS,
                ggml_backend_dev_name(dev), t_ms, bytes_ms, mem_bw_gbps, LLAMA_RKV_BW_REPS);
        *desc = tmp;
        return std::max(0.0, t_ms - bytes_ms);
    });
}

// what a CPU part costs a decode layer beyond its attention, measured by the device's backend when it can
// (GGML_RKV_CPU_PART_LATENCY_PROC), once per process per device
double llama_rkv_measure_cpu_part_latency_ms(ggml_backend_dev_t dev, std::string * how) {
    static llama_rkv_measured_once<ggml_backend_dev_t> once;
    return once.get(dev, how, [dev](std::string * desc) {
        ggml_backend_reg_t reg = llama_rkv_dev_is_gpu(dev) ? ggml_backend_dev_backend_reg(dev) : nullptr;
        auto fn = reg ? (ggml_backend_rkv_cpu_part_latency_t) ggml_backend_reg_get_proc_address(reg,
                GGML_RKV_CPU_PART_LATENCY_PROC) : nullptr;
        if (!fn) {
            *desc = "not measured: the device's backend has no CPU-part probe";
            return -1.0;
        }
        char tmp[256] = "";
        const double ms = fn(dev, tmp, sizeof(tmp));
        *desc = tmp;
        return ms;
    });
}
