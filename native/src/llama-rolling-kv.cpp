// rollingkv extension API: implementation (see include/llama-rolling-kv.h).
#include "llama-rolling-kv.h"

#ifndef ROLLINGKV_PIN
#define ROLLINGKV_PIN "unknown"
#endif
#ifndef ROLLINGKV_SERIES
#define ROLLINGKV_SERIES "unknown"
#endif

#define RKV_STR2(x) #x
#define RKV_STR(x) RKV_STR2(x)

const char * llama_rolling_kv_build_info(void) {
    return "rollingkv api=" RKV_STR(LLAMA_ROLLING_KV_API_VERSION) " pin=" ROLLINGKV_PIN " series=" ROLLINGKV_SERIES;
}

int32_t llama_rolling_kv_api_version(void) {
    return LLAMA_ROLLING_KV_API_VERSION;
}

size_t llama_rolling_kv_sizeof_context_params(void) {
    return sizeof(struct llama_context_params);
}

size_t llama_rolling_kv_sizeof_model_params(void) {
    return sizeof(struct llama_model_params);
}

//
// KV residency: the C API over the planner (llama-kv-residency.cpp); context creation with a request, and the plan JSON
//

#include "llama-rolling-kv-internal.h"
#include "ggml-rolling-kv.h"
#include "llama-context.h"
#include "llama-impl.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

//
// JSON
//

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
    if (st->chosen == LLAMA_KV_RESIDENCY_HEAD) {
        return "head";
    }
    // "off" only for the upstream cache the request asked for; anything else kept whole on the device is resident
    return st->req.mode == LLAMA_KV_RESIDENCY_OFF ? "off" : "resident";
}

// the plan's "tail_cpu": the hybrid tail's share, its inputs and why
static std::string llama_rkv_json_tail_cpu(const llama_rkv_state * st) {
    std::string res;
    res += ",\"tail_cpu\":{\"requested\":" +
           (st->req.tail_cpu_frac < 0.0f ? std::string("\"auto\"") : llama_rkv_json_num(st->req.tail_cpu_frac));
    res += ",\"frac\":" + llama_rkv_json_num(st->tail_cpu_frac);
    // auto: the shortest tail with a CPU part (the share is chosen again as the tail grows); null for a fixed share or
    // none
    const uint32_t from_cells = st->tail_cpu.is_auto ? llama_rkv_tail_cpu_from_cells(st->tail_cpu) : 0;
    res += ",\"from_tail_cells\":" + (from_cells > 0 ? std::to_string(from_cells) : std::string("null"));
    res += ",\"cpu_attn_gbps\":" +
           (st->cpu_attn_gbps > 0.0 ? llama_rkv_json_num(st->cpu_attn_gbps) : std::string("null"));
    res += ",\"cpu_attn_source\":" + llama_rkv_json_str(st->cpu_attn_source);
    // auto: the part's bandwidth with 2, 4 and 8 query rows that each see every cell (null: not measured), and its
    // slowdown against one row's at 1 to 8 rows, which the share taken at each step follows
    res += ",\"cpu_attn_rows_gbps\":{";
    for (int i = 0; i < 3; ++i) {
        const double g = st->cpu_attn_rows_gbps[i];
        res += std::string(i ? "," : "") + "\"" + std::to_string(2 << i) + "\":" +
               (g > 0.0 ? llama_rkv_json_num(g) : std::string("null"));
    }
    res += "},\"cpu_rows_slowdown\":[";
    for (int r = 0; r < GGML_RKV_CPU_PART_MAX_Q; ++r) {
        res += std::string(r ? "," : "") + llama_rkv_json_num(st->tail_cpu.slow[r]);
    }
    res += "]";
    res += ",\"n_threads\":" + std::to_string(st->n_threads > 0 ? st->n_threads : llama_rkv_cpu_threads());
    // the time model's per-layer terms, and where each came from (null: the share needed none)
    res += ",\"layer_decode_ms\":" +
           (st->layer_decode_ms >= 0.0 ? llama_rkv_json_num(st->layer_decode_ms) : std::string("null"));
    res += ",\"layer_decode_source\":" + llama_rkv_json_str(st->layer_decode_source);
    res += ",\"cpu_part_latency_ms\":" +
           (st->cpu_part_latency_ms >= 0.0 ? llama_rkv_json_num(st->cpu_part_latency_ms) : std::string("null"));
    res += ",\"cpu_part_latency_source\":" + llama_rkv_json_str(st->cpu_part_latency_source);
    res += ",\"reason\":" + llama_rkv_json_str(st->tail_cpu_reason) + "}";
    return res;
}

// a window split's "windows": elastic (one pool of the streams' device cells that follows the load) or static ("" for
// other plans)
static std::string llama_rkv_json_windows(const llama_rkv_state * st) {
    std::string res;
    if (st->chosen == LLAMA_KV_RESIDENCY_WINDOW) {
        res += std::string(",\"windows\":{\"policy\":") +
               (st->blocks ? "\"blocks\"" : st->elastic ? "\"elastic\"" : "\"static\"");
        res += ",\"requested\":" + llama_rkv_json_str(st->req.windows == LLAMA_KV_WINDOWS_STATIC ? "static" :
                                                  st->req.windows == LLAMA_KV_WINDOWS_BLOCKS ? "blocks" : "elastic");
        res += ",\"pool_cells\":" + std::to_string(st->elastic ? st->pool_cells : st->window_cells*st->n_stream);
        res += ",\"reason\":" + llama_rkv_json_str(
                st->blocks  ? "one stream's 256-cell blocks move between the device and the host with the load" :
                st->elastic ? "the streams' device cells are one pool that follows the load" : st->windows_reason) +
                "}";
    }
    return res;
}

// the plan's "heads": the head split's request, whether this cache can split by head, and per layer what it keeps on
// the device
static std::string llama_rkv_json_heads(const llama_rkv_state * st) {
    std::string res;
    uint32_t h_dev = 0, h_host = 0;
    for (const auto & hl : st->head_layers) {
        h_dev  += hl.device_heads;
        h_host += hl.n_head_kv - hl.device_heads;
    }
    const bool head = st->chosen == LLAMA_KV_RESIDENCY_HEAD;
    res += ",\"heads\":{\"requested\":" +
           (st->req.device_heads > 0 ? std::to_string(st->req.device_heads) : std::string("null"));
    res += std::string(",\"eligible\":") + (st->head_refuse.empty() ? "true" : "false");
    res += ",\"refuse\":" + (st->head_refuse.empty() ? std::string("null") : llama_rkv_json_str(st->head_refuse));
    res += std::string(",\"split\":") + (head ? "true" : "false");
    res += ",\"device\":" + std::to_string(head ? h_dev : 0) + ",\"host\":" + std::to_string(head ? h_host : 0);
    res += ",\"summary\":" + llama_rkv_json_str(llama_rkv_heads_summary(*st));
    res += ",\"per_layer\":[";
    for (size_t i = 0; head && i < st->head_layers.size(); ++i) {
        res += (i > 0 ? "," : "") + std::to_string(st->head_layers[i].device_heads);
    }
    res += "]}";
    return res;
}

// the plan's "auto": auto's comparison of the two splits (null when auto did not compare them)
static std::string llama_rkv_json_auto(const llama_rkv_state * st) {
    std::string res;
    if (!st->auto_compared) {
        res += ",\"auto\":null";
    } else {
        auto tactic = [](const llama_rkv_tactic_cost & c) {
            std::string r = std::string("{\"candidate\":") + (c.valid ? "true" : "false");
            r += ",\"why_not\":" + (c.valid ? std::string("null") : llama_rkv_json_str(c.why_not));
            r += ",\"device_bytes_per_token\":" + llama_rkv_json_num(c.valid ? c.device_bytes : -1.0);
            r += ",\"tail_bytes_per_token\":" + llama_rkv_json_num(c.valid ? c.tail_bytes : -1.0);
            r += ",\"ms_per_token\":" + llama_rkv_json_num(c.valid ? c.t_token_ms : -1.0);
            r += ",\"device_bytes_per_token_mean\":" + llama_rkv_json_num(c.valid ? c.device_bytes_mean : -1.0);
            r += ",\"tail_bytes_per_token_mean\":" + llama_rkv_json_num(c.valid ? c.tail_bytes_mean : -1.0);
            r += ",\"ms_per_token_mean\":" + llama_rkv_json_num(c.valid ? c.t_token_mean_ms : -1.0) + "}";
            return r;
        };
        res += ",\"auto\":{\"window\":" + tactic(st->cost_window) + ",\"head\":" + tactic(st->cost_head);
        res += ",\"reason\":" + llama_rkv_json_str(st->auto_reason) + "}";
    }
    return res;
}

// the plan's "tail_types": what was asked for per axis ("auto", a type, or null: the window's), what the plan holds and
// why
static std::string llama_rkv_json_tail_types(const llama_rkv_state * st) {
    std::string res;
    auto requested = [](bool is_auto, ggml_type t) {
        return is_auto ? std::string("\"auto\"") : t == GGML_TYPE_COUNT ? std::string("null")
               : llama_rkv_json_str(ggml_type_name(t));
    };
    res += ",\"tail_types\":{\"requested_k\":" + requested(st->tail_auto_k, st->req.type_k_tail);
    res += ",\"requested_v\":" + requested(st->tail_auto_v, st->req.type_v_tail);
    res += std::string(",\"auto\":") + (st->tail_auto_k || st->tail_auto_v ? "true" : "false");
    res += ",\"k\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_k_tail));
    res += ",\"v\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_v_tail));
    res += ",\"q4_ratio\":" + llama_rkv_json_num(LLAMA_RKV_AUTO_TAIL_Q4_RATIO);
    res += ",\"t_resident_ms\":" + llama_rkv_json_num(st->tail_auto_t_res_ms);
    res += ",\"t_link_floor_ms\":" + llama_rkv_json_num(st->tail_auto_t_link_ms);
    res += ",\"reason\":" + llama_rkv_json_str(st->tail_types_reason) + "}";
    return res;
}

// the plan's "budget": the devices' terms and their sums (null when no device was budgeted)
static std::string llama_rkv_json_budget(const llama_rkv_state * st) {
    char buf[1024];
    std::string res;
    if (st->devs.empty()) {
        res += ",\"budget\":null";
    } else {
        size_t free = 0, weights = 0, compute = 0, other_kv = 0, recurrent = 0, ring = 0, kv_resident = 0, runtime = 0;
        for (const auto & d : st->devs) {
            recurrent   += d.recurrent;
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
                ",\"reserve_bytes\":%zu,\"free_bytes\":%zu,\"weights_bytes\":%zu,\"compute_bytes\":%zu"
                ",\"other_kv_bytes\":%zu,\"recurrent_bytes\":%zu,\"ring_bytes\":%zu,\"ring_slots\":%d"
                ",\"ring_slot_bytes\":%zu,\"kv_resident_bytes\":%zu,\"runtime_bytes\":%zu",
                st->budgeted ? "true" : "false", st->req.vram_target_mib, st->min_target_mib,
                st->reserve, free, weights, compute, other_kv, recurrent, ring, st->ring_slots, st->ring_slot_size,
                kv_resident, runtime);
        res += buf;
        res += ",\"compute_note\":" + llama_rkv_json_str(st->compute_note);
        res += ",\"devices\":[";
        for (size_t i = 0; i < st->devs.size(); ++i) {
            const auto & d = st->devs[i];
            res += i > 0 ? ",{" : "{";
            res += "\"name\":" + llama_rkv_json_str(d.name);
            snprintf(buf, sizeof(buf),
                    ",\"host_memory\":%s,\"n_layer\":%u,\"free_bytes\":%zu,\"weights_bytes\":%zu,\"compute_bytes\":%zu"
                    ",\"other_kv_bytes\":%zu,\"recurrent_bytes\":%zu,\"ring_bytes\":%zu,\"avail_bytes\":%zu"
                    ",\"kv_budget_bytes\":%zu"
                    ",\"kv_resident_bytes\":%zu,\"cell_bytes\":%zu,\"conv_cell_bytes\":%zu,\"fit_cells\":%u"
                    ",\"min_target_mib\":%" PRId64 ",\"runtime_bytes\":%zu,\"stream_mask_bytes\":%zu}",
                    d.host_memory ? "true" : "false", d.n_layer, d.free, d.weights, d.compute, d.other_kv, d.recurrent,
                    d.ring, d.avail, d.kv_budget, d.kv_resident, d.cell_bytes, d.conv_cell_bytes, d.fit_cells,
                    d.min_target_mib, d.runtime, d.stream_masks);
            res += buf;
        }
        res += "]}";
    }
    return res;
}

// the plan's "link" and "estimate": the link model's inputs and its figures
static std::string llama_rkv_json_link(const llama_rkv_state * st) {
    std::string res;
    res += ",\"link\":{\"mem_bw_gbps\":" + llama_rkv_json_num(st->mem_bw_gbps);
    res += ",\"mem_bw_source\":" + llama_rkv_json_str(st->mem_bw_source);
    res += ",\"link_bw_gbps\":" + llama_rkv_json_num(st->link_bw_gbps);
    res += ",\"link_bw_source\":" + llama_rkv_json_str(st->link_bw_source) + "}";

    const bool split = llama_rkv_is_split(*st);
    res += ",\"estimate\":{\"device_bytes_per_token\":" + llama_rkv_json_num(split ? st->est_device_bytes : -1.0);
    res += ",\"tail_bytes_per_token\":" + llama_rkv_json_num(split ? st->est_tail_bytes : -1.0);
    res += ",\"t_resident_ms\":" + llama_rkv_json_num(st->t_resident_ms);
    res += ",\"t_tail_ms\":" + llama_rkv_json_num(st->t_tail_ms);
    res += ",\"ms_per_token\":" + llama_rkv_json_num(st->t_token_ms);
    res += ",\"t_token_hybrid_ms\":" + llama_rkv_json_num(st->t_token_hybrid_ms) + "}";
    return res;
}

// the plan's "recurrent": a hybrid model's recurrent layers, whose state stays whole (not in "layers", which are the
// attention cache's)
static std::string llama_rkv_json_recurrent(const llama_rkv_state * st) {
    std::string res;
    if (!st->hybrid) {
        res += ",\"recurrent\":null";
    } else {
        size_t recr_total = 0;
        for (const auto & e : st->recurrent_bytes) {
            recr_total += e.second;
        }
        res += ",\"recurrent\":{\"split\":false,\"layers\":[";
        for (size_t i = 0; i < st->recurrent_layers.size(); ++i) {
            res += (i > 0 ? "," : "") + std::to_string(st->recurrent_layers[i]);
        }
        res += "],\"bytes\":" + std::to_string(recr_total) + "}";
    }
    return res;
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
    res += std::string(",\"split\":") + (llama_rkv_is_split(*st) ? "true" : "false");
    res += ",\"reason\":"        + llama_rkv_json_str(st->reason);
    res += std::string(",\"eligible\":") + (st->eligible ? "true" : "false");
    res += ",\"error\":" + (st->error.empty() ? std::string("null") : llama_rkv_json_str(st->error));

    snprintf(buf, sizeof(buf),
            ",\"kv_size\":%u,\"n_stream\":%u,\"window_cells\":%u,\"tail_cells\":%u"
            ",\"vram_target_mib\":%" PRId64 ",\"pcie_bw_gbps\":%g",
            st->kv_size, st->n_stream, st->window_cells, st->tail_cells,
            st->req.vram_target_mib, (double) st->req.pcie_bw_gbps);
    res += buf;

    res += llama_rkv_json_tail_cpu(st);
    res += llama_rkv_json_windows(st);
    res += ",\"placement\":{\"requested\":" + llama_rkv_json_str(
            st->req.placement == LLAMA_KV_PLACEMENT_UPSTREAM ? "upstream" :
            st->req.placement == LLAMA_KV_PLACEMENT_SEQUENCES ? "sequences" : "auto");
    res += std::string(",\"chosen\":") + (st->placed_by_seq ? "\"sequences\"" : "\"upstream\"") + "}";
    res += llama_rkv_json_heads(st);
    res += llama_rkv_json_auto(st);
    res += llama_rkv_json_tail_types(st);

    res += ",\"type_k\":"      + llama_rkv_json_str(llama_rkv_type_name(st->type_k));
    res += ",\"type_v\":"      + llama_rkv_json_str(llama_rkv_type_name(st->type_v));
    res += ",\"type_k_tail\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_k_tail));
    res += ",\"type_v_tail\":" + llama_rkv_json_str(llama_rkv_type_name(st->type_v_tail));

    res += llama_rkv_json_budget(st);
    res += llama_rkv_json_link(st);

    size_t dev_total = 0;
    size_t host_total = 0;

    res += ",\"layers\":[";
    for (size_t i = 0; i < st->layers.size(); ++i) {
        const auto & l = st->layers[i];
        snprintf(buf, sizeof(buf),
                "%s{\"il\":%d,\"window_cells\":%u,\"tail_cells\":%u,\"device_bytes\":%zu,\"host_bytes\":%zu"
                ",\"split\":%s,\"n_head_kv\":%u,\"device_heads\":%u,\"host_heads\":%u}",
                i > 0 ? "," : "", l.il, l.window_cells, l.tail_cells, l.device_bytes, l.host_bytes,
                l.split ? "true" : "false", l.n_head_kv, l.device_heads, l.n_head_kv - l.device_heads);
        res += buf;
        dev_total  += l.device_bytes;
        host_total += l.host_bytes;
    }
    res += "]";

    res += llama_rkv_json_recurrent(st);

    snprintf(buf, sizeof(buf), ",\"device_bytes\":%zu,\"host_bytes\":%zu}", dev_total, host_total);
    res += buf;

    return res;
}

//
// the C API
//

struct llama_rolling_kv_params llama_rolling_kv_default_params(void) {
    llama_rolling_kv_params res;
    res.mode            = LLAMA_KV_RESIDENCY_AUTO;
    res.vram_target_mib = 0;
    res.window_cells    = 0;
    res.type_k_tail     = GGML_TYPE_COUNT;
    res.type_v_tail     = GGML_TYPE_COUNT;
    res.pcie_bw_gbps    = 0.0f;
    res.tail_cpu_frac   = -1.0f; // auto: the planner puts a share on the CPU where its model says it pays (docs/perf)
    res.cpu_attn_gbps   = 0.0f;
    res.device_heads    = 0;
    res.windows         = LLAMA_KV_WINDOWS_ELASTIC;
    res.placement       = LLAMA_KV_PLACEMENT_AUTO;
    return res;
}

const char * llama_kv_residency_mode_name(enum llama_kv_residency_mode mode) {
    return llama_rkv_mode_name(mode);
}

int32_t llama_kv_residency_mode_from_str(const char * s) {
    if (!s) {
        return -1;
    }
    for (auto m : { LLAMA_KV_RESIDENCY_OFF, LLAMA_KV_RESIDENCY_AUTO, LLAMA_KV_RESIDENCY_HEAD,
                   LLAMA_KV_RESIDENCY_WINDOW }) {
        if (strcmp(s, llama_kv_residency_mode_name(m)) == 0) {
            return (int32_t) m;
        }
    }
    return -1;
}

// why the last llama_init_from_model_rolling_kv of this thread returned NULL
static thread_local std::string g_rkv_last_error;

LLAMA_ATTRIBUTE_FORMAT(2, 3)
static struct llama_context * llama_rkv_fail(const char * func, const char * fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    g_rkv_last_error = buf;
    LLAMA_LOG_ERROR("%s: %s\n", func, buf);
    return nullptr;
}

const char * llama_rolling_kv_last_error(void) {
    return g_rkv_last_error.c_str();
}

// the shared state the cache constructor plans with for this request (mode off: the upstream cache, the plan only
// reports it), with what the constructor cannot see resolved as llama_context resolves it
static std::shared_ptr<llama_rkv_state> llama_rkv_make_state(const llama_rolling_kv_params & req,
        const llama_model * model, const llama_context_params & params) {
    auto st = std::make_shared<llama_rkv_state>();
    st->req = req;
    llama_rkv_take_auto_tail(*st); // the cache describes itself at the window's types; the planner chooses the tail's

    // what the cache constructor cannot see, resolved as llama_context resolves it (causal models: the batch is
    // capped by the context), for the compute buffer estimate and the size of an iSWA model's SWA cache
    if (model) {
        const uint32_t n_ctx   = params.n_ctx == 0 ? (uint32_t) std::max<int32_t>(0, llama_model_n_ctx_train(model))
                : params.n_ctx;
        const uint32_t n_batch = n_ctx > 0 ? std::min(n_ctx, params.n_batch) : params.n_batch;
        st->n_ctx      = n_ctx;
        st->n_ubatch   = std::min(n_batch, params.n_ubatch == 0 ? params.n_batch : params.n_ubatch);
        st->n_seq_max  = std::max<uint32_t>(1, params.n_seq_max);
        st->kv_unified = params.kv_unified;
        st->swa_full   = params.swa_full;
    }
    // the CPU part of a hybrid tail decodes on threads of its own (ggml_rkv_get_cpu_threads: not the context's -t,
    // whose default suits matrix work, not a memory-bound scan)
    st->n_threads = llama_rkv_cpu_threads();

    return st;
}

// a context whose memory never saw the request (no cache that splits) reports a resident plan, as the function func
static void llama_rkv_resolve_unsplit(llama_context * ctx, const llama_rolling_kv_params & req, const char * func) {
    auto & st = ctx->get_cparams().rkv;
    if (st && !st->resolved) {
        st->resolved = true;
        st->chosen   = LLAMA_KV_RESIDENCY_OFF;
        st->eligible = req.mode == LLAMA_KV_RESIDENCY_OFF;
        st->reason   = req.mode == LLAMA_KV_RESIDENCY_OFF
            ? "mode off: the upstream resident cache"
            : "this model's memory (recurrent only, hybrid with sliding-window or indexer layers, sparse-attention or "
              "no KV cache) does not support the split: resident";
        LLAMA_LOG_INFO("%s: rolling KV: resident (%s)\n", func, st->reason.c_str());
    }
}

// the test hooks from the environment (llama_init_from_model_rolling_kv), read once per context; false: a value that is
// not one the hooks take, with why in err
static bool llama_rkv_test_hooks_from_env(llama_rolling_kv_test_hooks & out, std::string & err) {
    out = {};
    const char * tail = getenv("ROLLINGKV_DEBUG_PERTURB_TAIL");
    if (tail && *tail) {
        char * end = nullptr;
        const float x = strtof(tail, &end);
        if (end == tail || *end != '\0') {
            err = std::string("ROLLINGKV_DEBUG_PERTURB_TAIL=") + tail +
                  " is not a number (a test hook: every tail score times 1 + x, x > -1; unset it)";
            return false;
        }
        out.perturb_tail = x; // its range: llama_init_from_model_rolling_kv_test
    }
    const char * move = getenv("ROLLINGKV_DEBUG_PERTURB_MOVE");
    if (move && *move) {
        if (strcmp(move, "1") != 0 && strcmp(move, "2") != 0) {
            err = std::string("ROLLINGKV_DEBUG_PERTURB_MOVE=") + move + " is neither 1 nor 2 (a test hook: block "
                  "promotions written wrong; unset it)";
            return false;
        }
        out.perturb_move = atoi(move);
    }
    return true;
}

struct llama_context * llama_init_from_model_rolling_kv(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv) {
    g_rkv_last_error.clear();

    llama_rolling_kv_test_hooks test;
    std::string err;
    if (!llama_rkv_test_hooks_from_env(test, err)) {
        return llama_rkv_fail(__func__, "%s", err.c_str());
    }
    return llama_init_from_model_rolling_kv_test(model, params, rkv, &test);
}

struct llama_context * llama_init_from_model_rolling_kv_test(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv,
        const struct llama_rolling_kv_test_hooks * test) {
    const llama_rolling_kv_params req = rkv ? *rkv : llama_rolling_kv_default_params();
    const llama_rolling_kv_test_hooks hooks = test ? *test : llama_rolling_kv_test_hooks{};

    g_rkv_last_error.clear();

    if (!(hooks.perturb_tail > -1.0f && std::isfinite(hooks.perturb_tail))) {
        return llama_rkv_fail(__func__, "the test hook perturb_tail must be finite and above -1 (got %g)",
                              (double) hooks.perturb_tail);
    }
    if (hooks.perturb_move < 0 || hooks.perturb_move > 2) {
        return llama_rkv_fail(__func__, "the test hook perturb_move must be 0 (off), 1 or 2 (got %d)",
                              hooks.perturb_move);
    }

    switch (req.mode) {
        case LLAMA_KV_RESIDENCY_OFF:
        case LLAMA_KV_RESIDENCY_AUTO:
        case LLAMA_KV_RESIDENCY_WINDOW:
        case LLAMA_KV_RESIDENCY_HEAD:
            break;
        default:
            return llama_rkv_fail(__func__, "invalid kv residency mode %d", (int) req.mode);
    }

    if (req.window_cells < 0) {
        return llama_rkv_fail(__func__, "window_cells must be >= 0 (got %" PRId64 ")", req.window_cells);
    }
    if (req.device_heads < 0) {
        return llama_rkv_fail(__func__, "device_heads must be >= 0 (got %d)", req.device_heads);
    }
    if (req.device_heads > 0 && (req.mode == LLAMA_KV_RESIDENCY_WINDOW || req.mode == LLAMA_KV_RESIDENCY_OFF)) {
        return llama_rkv_fail(__func__, "device_heads (%d) sets a head split: it needs mode head or auto, not %s",
                req.device_heads, llama_kv_residency_mode_name(req.mode));
    }
    if (req.window_cells > 0 && req.mode == LLAMA_KV_RESIDENCY_HEAD) {
        return llama_rkv_fail(__func__,
                "window_cells (%" PRId64 ") sets a window: it needs mode window or auto, not head", req.window_cells);
    }
    if (req.window_cells > 0 && req.device_heads > 0) {
        return llama_rkv_fail(__func__,
                              "window_cells and device_heads exclude each other (a window split or a head split)");
    }
    if (!(req.tail_cpu_frac <= 1.0f) || std::isnan(req.tail_cpu_frac)) {
        return llama_rkv_fail(__func__, "tail_cpu_frac must be < 0 (auto), 0 (off) or in (0, 1] (got %g)",
                              (double) req.tail_cpu_frac);
    }
    if (req.windows != LLAMA_KV_WINDOWS_ELASTIC && req.windows != LLAMA_KV_WINDOWS_STATIC &&
            req.windows != LLAMA_KV_WINDOWS_BLOCKS) {
        return llama_rkv_fail(__func__, "invalid window policy %d (0: elastic, 1: static, 2: blocks)",
                              (int) req.windows);
    }
    if (req.placement != LLAMA_KV_PLACEMENT_AUTO && req.placement != LLAMA_KV_PLACEMENT_UPSTREAM &&
            req.placement != LLAMA_KV_PLACEMENT_SEQUENCES) {
        return llama_rkv_fail(__func__, "invalid placement %d (0: auto, 1: upstream, 2: sequences)", (int) req.placement);
    }
    if (req.vram_target_mib < 0) {
        return llama_rkv_fail(__func__, "vram_target_mib must be >= 0 (got %" PRId64 ")", req.vram_target_mib);
    }
    const bool tail_auto = req.type_k_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO ||
                           req.type_v_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO;
    if (tail_auto && req.mode == LLAMA_KV_RESIDENCY_OFF) {
        return llama_rkv_fail(__func__,
                "auto tail types choose the type of a split's tail, and mode off never splits: use mode auto or "
                "window, or give the tail a type");
    }
    for (ggml_type t : { req.type_k_tail, req.type_v_tail }) {
        if (t == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO) {
            continue;
        }
        if (t != GGML_TYPE_COUNT && ((int) t < 0 || (int) t > GGML_TYPE_COUNT || !ggml_rkv_tail_type_supported(t))) {
            return llama_rkv_fail(__func__, "unsupported KV tail type %s: the tail must be one of %s",
                    ((int) t >= 0 && (int) t < GGML_TYPE_COUNT) ? ggml_type_name(t) : "(invalid)",
                    ggml_rkv_tail_type_names());
        }
    }

    // the cache constructor plans with this request (mode off: the upstream cache, the plan only reports it)
    auto st = llama_rkv_make_state(req, model, params);
    st->test = hooks;
    // a test hook makes the outputs of a split cache wrong on purpose: never silently
    if (hooks.perturb_tail != 0.0f) {
        LLAMA_LOG_WARN("%s: test hook perturb_tail = %g: every KV tail's attention scores are perturbed on purpose, so "
                       "the outputs of a split cache are WRONG (ROLLINGKV_DEBUG_PERTURB_TAIL: unset it)\n", __func__,
                       (double) hooks.perturb_tail);
    }
    if (hooks.perturb_move != 0) {
        LLAMA_LOG_WARN("%s: test hook perturb_move = %d: every block promotion corrupts K rows on purpose, so the "
                       "outputs are WRONG (ROLLINGKV_DEBUG_PERTURB_MOVE: unset it)\n", __func__, hooks.perturb_move);
    }

    llama_context * ctx = llama_init_from_model(model, params, st);

    if (!ctx) {
        // the planner's refusal (a vram_target below the minimum, ...) when it was one
        if (!st->error.empty()) {
            return llama_rkv_fail(__func__, "rolling KV: %s", st->error.c_str());
        }
        g_rkv_last_error = "llama_init_from_model failed (see the log)";
        return nullptr;
    }

    llama_rkv_resolve_unsplit(ctx, req, __func__);

    return ctx;
}

static int32_t llama_rkv_copy_out(const std::string & s, char * buf, size_t buf_size) {
    if (buf && buf_size > 0) {
        const size_t n = std::min(s.size(), buf_size - 1);
        memcpy(buf, s.data(), n);
        buf[n] = '\0';
    }
    return (int32_t) s.size();
}

int32_t llama_rolling_kv_plan_json(const struct llama_context * ctx, char * buf, size_t buf_size) {
    if (!ctx) {
        return -1;
    }
    return llama_rkv_copy_out(llama_rkv_plan_to_json(ctx->get_cparams().rkv.get()), buf, buf_size);
}

void llama_rkv_note_batch(llama_rkv_state * st, const llama_batch & batch) {
    if (!st || !st->live || batch.n_tokens <= 0) {
        return;
    }
    std::vector<std::pair<llama_seq_id, uint32_t>> per_seq; // a sequence's first seq id: its tokens in the batch
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        const llama_seq_id s = batch.n_seq_id && batch.n_seq_id[i] > 0 ? batch.seq_id[i][0] : 0;
        auto it = std::find_if(per_seq.begin(), per_seq.end(), [s](const auto & p) { return p.first == s; });
        if (it == per_seq.end()) {
            per_seq.push_back({ s, 1 });
        } else {
            it->second += 1;
        }
    }
    std::lock_guard<std::mutex> lock(st->live->mtx);
    for (const auto & p : per_seq) {
        (p.second == 1 ? st->live->pending_decode : st->live->pending_prompt) += p.second;
    }
}

void llama_rkv_note_eval(llama_rkv_state * st, uint32_t n_queued, int64_t t0_us) {
    if (!st || !st->live || n_queued == 0) {
        return;
    }
    const int64_t t1_us = ggml_time_us();
    llama_rkv_live & lv = *st->live;
    std::lock_guard<std::mutex> lock(lv.mtx);
    if (lv.pending_prompt + lv.pending_decode == 0) {
        return; // tokens queued by a path that did not note its batch
    }
    const auto add = [&](llama_rkv_eval_kind & k) {
        k.evals          += 1;
        k.prompt_tokens  += lv.pending_prompt;
        k.decode_tokens  += lv.pending_decode;
        k.us             += t1_us > t0_us && t0_us > 0 ? (uint64_t) (t1_us - t0_us) : 0;
        k.steps          += lv.steps          - lv.mark.steps;
        k.tail_bytes     += lv.tail_bytes     - lv.mark.tail_bytes;
        k.streamed_bytes += lv.streamed_bytes - lv.mark.streamed_bytes;
        k.move_ms        += lv.move_ms        - lv.mark.move_ms;
    };
    add(lv.evals[lv.pending_prompt == 0 ? LLAMA_RKV_EVAL_DECODE :
                 lv.pending_decode == 0 ? LLAMA_RKV_EVAL_PREFILL : LLAMA_RKV_EVAL_MIXED]);
    if (lv.pending_prompt == 0) {
        add(lv.decode_by_seqs[std::min<uint64_t>(lv.pending_decode, 8) - 1]); // a decode token per sequence
    }
    lv.mark.steps          = lv.steps;
    lv.mark.tail_bytes     = lv.tail_bytes;
    lv.mark.streamed_bytes = lv.streamed_bytes;
    lv.mark.move_ms        = lv.move_ms;
    lv.pending_prompt = lv.pending_decode = 0;
}

int32_t llama_rolling_kv_stats_json(const struct llama_context * ctx, char * buf, size_t buf_size) {
    if (!ctx) {
        return -1;
    }
    const llama_rkv_state * st = ctx->get_cparams().rkv.get();
    const bool split = st && llama_rkv_is_split(*st);
    std::string res = std::string("{\"split\":") + (split ? "true" : "false");
    // process-wide, every backend: a hybrid tail's CPU parts that ran (a share planned and none run is a GPU-only run)
    res += ",\"cpu_part_runs\":" + std::to_string(llama_rkv_cpu_part_runs());
    // process-wide: the bytes the GPU backends' copy plans put on the link (counted where the copies are planned,
    // beside the cache's own account of each step below); absent without a backend that streams
    const llama_rkv_plan_bytes pb = llama_rkv_streamed_plan_bytes();
    if (pb.available) {
        res += ",\"plan_streamed\":{\"bytes\":" + std::to_string(pb.total) + ",\"last_bytes\":" +
               std::to_string(pb.last) + ",\"plans\":" + std::to_string(pb.plans) + "}";
    }
    if (st && st->live) {
        const llama_rkv_live & lv = *st->live;
        std::lock_guard<std::mutex> lock(lv.mtx);
        char tmp[512];
        snprintf(tmp, sizeof(tmp),
                ",\"window_cells\":%u,\"n_stream\":%u,\"steps\":%" PRIu64 ",\"tail_bytes_total\":%" PRIu64
                ",\"streamed_bytes_total\":%" PRIu64 ",\"occupied_bytes_total\":%" PRIu64
                ",\"last\":{\"streams\":%u,\"per_stream_ops\":%u,\"tail_runs\":%u,\"tail_bytes\":%" PRIu64
                ",\"streamed_bytes\":%" PRIu64 ",\"occupied_bytes\":%" PRIu64 "},\"block_bytes\":%" PRIu64,
                st->window_cells, st->n_stream, lv.steps, lv.tail_bytes, lv.streamed_bytes, lv.occupied_bytes,
                lv.last_streams, lv.last_per_stream_ops, lv.last_tail_runs, lv.last_tail_bytes, lv.last_streamed_bytes,
                lv.last_occupied_bytes, lv.block_bytes);
        res += tmp;
        // API 11: the ubatch's own sequences' tail bytes, inside "last"
        res.insert(res.rfind("},\"block_bytes\":"), ",\"own_bytes\":" + std::to_string(lv.last_own_bytes));
        res += ",\"beyond_own_bytes_max\":" + std::to_string(lv.beyond_own_bytes_max);
        snprintf(tmp, sizeof(tmp),
                ",\"windows\":\"%s\",\"pool_cells\":%u,\"moves\":{\"rebalances\":%" PRIu64
                ",\"promoted_cells\":%" PRIu64
                ",\"demoted_cells\":%" PRIu64 ",\"relocated_cells\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"ms\":%.3f}",
                st->blocks ? "blocks" : st->elastic ? "elastic" : "static",
                st->elastic ? st->pool_cells : st->window_cells*st->n_stream,
                lv.rebalances, lv.promoted_cells, lv.demoted_cells, lv.relocated_cells, lv.moved_bytes, lv.move_ms);
        res += tmp;
        res += ",\"slots\":[";
        for (size_t s = 0; s < lv.device_cells.size(); ++s) {
            snprintf(tmp, sizeof(tmp), "%s{\"stream\":%zu,\"device_cells\":%u,\"tail_cells\":%u,\"window_cells\":%u}",
                    s ? "," : "", s, lv.device_cells[s], s < lv.tail_cells.size() ? lv.tail_cells[s] : 0u,
                    s < lv.window_cells.size() ? lv.window_cells[s] : st->window_cells);
            res += tmp;
        }
        res += "]";
        // a unified cache: each sequence (llama-server's slot id) that holds cells
        res += ",\"seqs\":[";
        bool first = true;
        for (size_t s = 0; s < lv.seq_device_cells.size(); ++s) {
            const uint32_t dev = lv.seq_device_cells[s],
                           tail = s < lv.seq_tail_cells.size() ? lv.seq_tail_cells[s] : 0u;
            if (dev == 0 && tail == 0) {
                continue;
            }
            snprintf(tmp, sizeof(tmp), "%s{\"seq\":%zu,\"device_cells\":%u,\"tail_cells\":%u}", first ? "" : ",", s,
                     dev, tail);
            res += tmp;
            first = false;
        }
        res += "]";
        res += ",\"evals\":{";
        const auto kind_json = [&tmp](const llama_rkv_eval_kind & k) {
            snprintf(tmp, sizeof(tmp),
                    "{\"evals\":%" PRIu64 ",\"prompt_tokens\":%" PRIu64 ",\"decode_tokens\":%" PRIu64
                    ",\"ms\":%.3f,\"steps\":%" PRIu64 ",\"tail_bytes\":%" PRIu64 ",\"streamed_bytes\":%" PRIu64
                    ",\"move_ms\":%.3f}", k.evals, k.prompt_tokens, k.decode_tokens, k.us/1000.0, k.steps,
                    k.tail_bytes, k.streamed_bytes, k.move_ms);
            return std::string(tmp);
        };
        static const char * kinds[] = { "decode", "prefill", "mixed" };
        for (int i = 0; i < 3; ++i) {
            res += std::string(i ? "," : "") + "\"" + kinds[i] + "\":" + kind_json(lv.evals[i]);
        }
        res += ",\"decode_by_seqs\":[";
        for (int i = 0; i < 8; ++i) {
            res += (i ? "," : "") + kind_json(lv.decode_by_seqs[i]);
        }
        res += "]}";
    }
    res += "}";
    return llama_rkv_copy_out(res, buf, buf_size);
}

bool llama_rolling_kv_plan_get(const struct llama_context * ctx, struct llama_rolling_kv_plan_info * info) {
    if (!ctx || !info) {
        return false;
    }
    const llama_rkv_state * st = ctx->get_cparams().rkv.get();

    *info = {};
    info->mode_requested = st ? st->req.mode : LLAMA_KV_RESIDENCY_OFF;
    info->mode_chosen    = st ? llama_rkv_chosen_name(st) : "off";
    info->split          = st && llama_rkv_is_split(*st);
    info->kv_size        = st ? st->kv_size  : 0;
    info->n_stream       = st ? st->n_stream : 0;
    info->window_cells   = st ? st->window_cells : 0;
    info->tail_cells     = st ? st->tail_cells   : 0;
    info->type_k_tail    = st ? st->type_k_tail  : GGML_TYPE_COUNT;
    info->type_v_tail    = st ? st->type_v_tail  : GGML_TYPE_COUNT;
    info->tail_cpu_frac  = st ? st->tail_cpu_frac : 0.0f;
    if (st) {
        for (const auto & l : st->layers) {
            info->device_bytes += l.device_bytes;
            info->host_bytes   += l.host_bytes;
        }
        if (st->chosen == LLAMA_KV_RESIDENCY_HEAD) {
            for (const auto & hl : st->head_layers) {
                info->heads_device += hl.device_heads;
                info->heads_host   += hl.n_head_kv - hl.device_heads;
            }
        }
    }
    return true;
}

double llama_rolling_kv_measure_cpu_attn_gbps(int32_t n_threads, enum ggml_type type) {
    return llama_rkv_cpu_attn_measure_gbps(n_threads, type, 0);
}

static_assert(LLAMA_RKV_LINK_RUNS == 3 && LLAMA_RKV_LINK_LOAD_COPIES == 4, "llama-rolling-kv.h states these counts");

static bool llama_rkv_same_name(const char * a, const char * b) {
    for (; *a && *b; ++a, ++b) {
        if (tolower((unsigned char) *a) != tolower((unsigned char) *b)) {
            return false;
        }
    }
    return *a == *b;
}

// a GPU by ggml name or PCI bus id (either case); nullptr or "": the first one
static ggml_backend_dev_t llama_rkv_link_device(const char * device, std::string * seen) {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (!llama_rkv_dev_is_gpu(dev)) {
            continue;
        }
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        if (!device || !*device || llama_rkv_same_name(device, ggml_backend_dev_name(dev)) ||
            (props.device_id && llama_rkv_same_name(device, props.device_id))) {
            return dev;
        }
        *seen += std::string(seen->empty() ? "" : ", ") + ggml_backend_dev_name(dev) + " (" +
                 (props.device_id ? props.device_id : "no bus id") + ")";
    }
    return nullptr;
}

static void llama_rkv_copy_str(char * dst, size_t size, const char * src) {
    snprintf(dst, size, "%s", src ? src : "");
}

int32_t llama_rolling_kv_measure_link(const char * device, const size_t * sizes, const int32_t * reps, int32_t n_sizes,
                                      void (*under_load)(void *), void * user_data,
                                      struct llama_rolling_kv_link_figures * out) {
    g_rkv_last_error.clear();
    if (!out || !sizes || !reps || n_sizes < 1 || n_sizes > LLAMA_ROLLING_KV_LINK_MAX_SIZES) {
        g_rkv_last_error = "llama_rolling_kv_measure_link: no output, or not 1 to " +
                           std::to_string(LLAMA_ROLLING_KV_LINK_MAX_SIZES) + " sizes";
        return LLAMA_ROLLING_KV_LINK_FAILED;
    }
    *out = {};
    std::string seen;
    ggml_backend_dev_t dev = llama_rkv_link_device(device, &seen);
    if (!dev) {
        if (seen.empty()) {
            g_rkv_last_error = "this library sees no GPU (a build without a GPU backend, no driver, or every device "
                               "hidden)";
            return LLAMA_ROLLING_KV_LINK_NO_GPU;
        }
        g_rkv_last_error = std::string("no GPU ") + device + " among " + seen;
        return LLAMA_ROLLING_KV_LINK_NOT_FOUND;
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    const char * name = ggml_backend_dev_name(dev);
    const std::string not_pinned = std::string(name) + "'s backend gives pageable host memory, not pinned";
    if (!props.caps.host_buffer) { // ggml-cuda: GGML_CUDA_NO_PINNED is set
        g_rkv_last_error = not_pinned + " (GGML_CUDA_NO_PINNED is set?)";
        return LLAMA_ROLLING_KV_LINK_FAILED;
    }
    bool pinned = false;
    std::string err;
    const bool ok = llama_rkv_time_link_copies(dev, sizes, reps, (size_t) n_sizes, out->h2d_gbps, out->d2h_gbps,
                                               under_load, user_data, &pinned, &err);
    if (!ok || !pinned) {
        *out = {};
        g_rkv_last_error = ok ? not_pinned + " (pinning failed)" : err;
        return LLAMA_ROLLING_KV_LINK_FAILED;
    }
    llama_rkv_copy_str(out->device, sizeof(out->device), name);
    llama_rkv_copy_str(out->description, sizeof(out->description), ggml_backend_dev_description(dev));
    llama_rkv_copy_str(out->device_id, sizeof(out->device_id), props.device_id);
    return LLAMA_ROLLING_KV_LINK_OK;
}
