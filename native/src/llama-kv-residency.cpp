// rollingkv: the KV residency planner's glue (see llama-kv-residency.h): what the cache constructor asks
// (llama_rkv_plan_cache: the devices to budget, their figures and measurers, then the decision), and a hybrid model's
// recurrent state noted before it. The pieces: llama-kv-residency-probe.cpp (device access: figures, probes,
// measurements), llama-kv-residency-model.cpp and llama-kv-residency-decide.cpp (the planner, no device access).
#include "llama-kv-residency.h"

#include "llama-model.h"
#include "llama-rolling-kv-graph.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

const char * llama_rkv_mode_name(enum llama_kv_residency_mode mode) {
    switch (mode) {
        case LLAMA_KV_RESIDENCY_OFF:    return "off";
        case LLAMA_KV_RESIDENCY_AUTO:   return "auto";
        case LLAMA_KV_RESIDENCY_HEAD:   return "head";
        case LLAMA_KV_RESIDENCY_WINDOW: return "window";
    }
    return "unknown";
}

llama_rkv_state * llama_rkv_note_recurrent(llama_rkv_state * st, const llama_model & model, ggml_type type_r,
        ggml_type type_s, bool offload, uint32_t mem_size, uint32_t n_rs_seq,
        const std::function<bool(int32_t)> & filter) {
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

// the cache's description into st, and why the cache cannot split at all (in.refuse) or by head (st.head_refuse)
static void llama_rkv_take_desc(llama_rkv_state & st, const llama_rkv_cache_desc & desc, const llama_model & model,
        llama_rkv_decide_in & in) {
    st.resolved = true;
    st.kv_size  = desc.kv_size;
    st.n_stream = desc.n_stream;
    st.type_k   = desc.type_k;
    st.type_v   = desc.type_v;

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
}

// the devices to budget: the GPUs holding KV layers; on a machine without GPU, host memory (it holds window and tail
// alike, so only an explicit vram_target sizes a window there: in.host_memory); in.no_device says why there is none
static std::vector<const llama_rkv_layer_group *> llama_rkv_budget_groups(const llama_rkv_cache_desc & desc,
                                                                          llama_rkv_decide_in & in) {
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
        in.no_device = desc.offload ? "no GPU holds KV layers: resident"
                       : "KV offload is off (no GPU holds the cache): resident";
    }
    return groups;
}

// whether the groups' devices run the streaming op at the requested tail types (in.op_unsupported) and, where the
// request may split by head, the head split's op (in.head_op_unsupported)
static void llama_rkv_probe_ops(const llama_rkv_state & st, const llama_rkv_cache_desc & desc,
        const std::vector<const llama_rkv_layer_group *> & groups, bool may_head, ggml_type type_k_tail,
        ggml_type type_v_tail, llama_rkv_decide_in & in) {
    for (const auto * g : groups) {
        if (!in.host_memory && !llama_rkv_dev_supports_split(g->dev, *g, desc.n_stream, st.n_ubatch,
                    desc.type_k, desc.type_v, type_k_tail, type_v_tail)) {
            char buf[256];
            snprintf(buf, sizeof(buf),
                    "the %s backend cannot run the streaming flash-attention op for K %s/%s, V %s/%s (window/tail)",
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
            snprintf(buf, sizeof(buf),
                    "the %s backend cannot run the head split's streaming flash-attention op for K %s, V %s (host "
                    "heads)", ggml_backend_dev_name(g->dev), ggml_type_name(type_k_tail), ggml_type_name(type_v_tail));
            in.head_op_unsupported = buf;
            break;
        }
    }
}

// st.devs, in the order of groups: each device's budget inputs (its memory, weights, compute estimate, the caches that
// never split, its KV rows), the head split's layers on them, and what each device's backend spends beyond the tensors
static void llama_rkv_budget_devs(llama_rkv_state & st, const llama_rkv_cache_desc & desc, const llama_model & model,
        const std::vector<const llama_rkv_layer_group *> & groups, const llama_rkv_decide_in & in) {
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
        // a GPU's copy of the mask for one op per stream (host memory: one backend, nothing is copied)
        // (the lab's one-op layout has none: it is counted as per-stream ops, one mask over)
        d.stream_masks = in.host_memory ? 0 : llama_rkv_stream_mask_bytes(llama_rkv_estimate_tokens(st), desc.kv_size,
                desc.n_stream);
        d.compute += d.stream_masks;

        st.devs.push_back(std::move(d));
    }
}

// the measurers the decision calls when it needs a figure: the first budgeted device's memory bandwidth (host memory's
// on a machine without GPU) and, on a GPU, the CPU part's attention bandwidth and the link's
static void llama_rkv_set_measurers(llama_rkv_state & st, const std::vector<const llama_rkv_layer_group *> & groups,
        llama_rkv_decide_in & in, const llama_model & model) {
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
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
        in.measure_cpu_attn_rows = [n_threads, &st](int n_rows, std::string * how) {
            return llama_rkv_measure_cpu_attn_bw(n_threads, st.type_k_tail, how, n_rows);
        };
        in.measure_link = [bw_dev](std::string * how) {
            return llama_rkv_measure_link_bw(bw_dev, how);
        };
        // the hybrid tail's per-layer terms on this device: its first layer's decode, a CPU part's hand-off
        int il_dev = -1;
        for (uint32_t il = 0; il < model.hparams.n_layer() && il_dev < 0; ++il) {
            il_dev = model.dev_layer((int) il) == bw_dev ? (int) il : -1;
        }
        in.measure_layer_decode = [&model, il_dev, bw_dev, &st](std::string * how) {
            if (il_dev < 0) {
                *how = "not measured: no layer on the device";
                return -1.0;
            }
            return llama_rkv_measure_layer_decode_ms(model, il_dev, bw_dev, st.mem_bw_gbps, how);
        };
        in.measure_cpu_part_latency = [bw_dev](std::string * how) {
            return llama_rkv_measure_cpu_part_latency_ms(bw_dev, how);
        };
    }
}

uint32_t llama_rkv_plan_cache(llama_rkv_state & st, const llama_rkv_cache_desc & desc, const llama_model & model) {
    if (st.resolved) {
        // only one cache of a context splits (the non-SWA one); another one asking stays resident
        return 0;
    }

    const auto & req = st.req;

    llama_rkv_decide_in in;
    llama_rkv_take_desc(st, desc, model, in);

    const bool needs_devices = req.mode == LLAMA_KV_RESIDENCY_AUTO || req.mode == LLAMA_KV_RESIDENCY_WINDOW ||
                               req.mode == LLAMA_KV_RESIDENCY_HEAD;
    const bool may_head = (req.mode == LLAMA_KV_RESIDENCY_AUTO || req.mode == LLAMA_KV_RESIDENCY_HEAD) &&
                          st.head_refuse.empty();

    if (needs_devices && !in.refuse) {
        const ggml_type type_k_tail = req.type_k_tail == GGML_TYPE_COUNT ? desc.type_k : req.type_k_tail;
        const ggml_type type_v_tail = req.type_v_tail == GGML_TYPE_COUNT ? desc.type_v : req.type_v_tail;

        const auto groups = llama_rkv_budget_groups(desc, in);
        llama_rkv_probe_ops(st, desc, groups, may_head, type_k_tail, type_v_tail, in);
        llama_rkv_budget_devs(st, desc, model, groups, in);
        llama_rkv_set_measurers(st, groups, in, model);
    }

    // auto tail types: whether the devices run the streaming op with a candidate's types
    if (!in.host_memory && (st.tail_auto_k || st.tail_auto_v)) {
        in.tail_op_unsupported = [&desc, &st](ggml_type tk, ggml_type tv, bool head) -> std::string {
            for (const auto & g : desc.groups) {
                if (llama_rkv_dev_is_gpu(g.dev) && !llama_rkv_dev_supports_split(g.dev, g, desc.n_stream, st.n_ubatch,
                            desc.type_k, desc.type_v, tk, tv, head)) {
                    return std::string("the ") + ggml_backend_dev_name(g.dev) +
                           " backend cannot run the streaming op with a " + ggml_type_name(tk) + "/" +
                           ggml_type_name(tv) + " tail";
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
