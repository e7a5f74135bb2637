// rollingkv: KV residency planner, the request hand-over to the context, the plan as JSON, and the
// attention over a split layer (see llama-kv-residency.h).
#include "llama-kv-residency.h"

#include "llama-impl.h"

#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

//
// planner
//

bool llama_rkv_tail_type_ok(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
            return true;
        default:
            return false;
    }
}

// reserve kept free on the device for compute buffers and other allocations when the budget is the free VRAM
static const size_t LLAMA_RKV_VRAM_RESERVE = 1024ull*1024*1024;

// n_kv grows in steps of 256 cells (llama_kv_cache::get_n_kv): a window of a multiple of 256 cells keeps
// whole n_kv steps either fully in the window or not
static const uint32_t LLAMA_RKV_WINDOW_ALIGN = 256;

static uint32_t llama_rkv_resident(llama_rkv_state & st, std::string reason) {
    st.chosen       = LLAMA_KV_RESIDENCY_OFF;
    st.reason       = std::move(reason);
    st.window_cells = 0;
    st.tail_cells   = 0;
    st.type_k_tail  = st.type_k;
    st.type_v_tail  = st.type_v;
    return 0;
}

uint32_t llama_rkv_plan_cache(llama_rkv_state & st, const llama_rkv_cache_desc & desc) {
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

    if (req.mode == LLAMA_KV_RESIDENCY_OFF) {
        return llama_rkv_resident(st, "mode off: the upstream resident cache");
    }
    if (req.mode == LLAMA_KV_RESIDENCY_HEAD) {
        // refused before the context is created; kept for completeness
        return llama_rkv_resident(st, "head mode is not implemented yet");
    }
    if (desc.refuse) {
        return llama_rkv_resident(st, desc.refuse);
    }
    if (desc.v_trans) {
        return llama_rkv_resident(st, "flash attention is off (transposed V cache): the split needs flash attention");
    }

    uint32_t wc = 0;

    if (req.window_cells > 0) {
        if ((uint64_t) req.window_cells >= desc.kv_size) {
            return llama_rkv_resident(st, "window_cells >= kv_size: the whole cache is the window (resident)");
        }
        wc = (uint32_t) req.window_cells;
    } else {
        ggml_backend_dev_t dev = nullptr;
        if (desc.offload) {
            for (auto * d : desc.layer_devs) {
                if (d && (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU ||
                          ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_IGPU)) {
                    dev = d;
                    break;
                }
            }
        }
        if (!dev) {
            return llama_rkv_resident(st, desc.offload ? "no GPU device: the cache stays resident"
                                                       : "KV offload is off (no GPU device holds the cache): resident");
        }

        size_t budget = 0;
        if (req.vram_target_mib > 0) {
            budget = (size_t) req.vram_target_mib*1024*1024;
        } else {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(dev, &free, &total);
            budget = free > LLAMA_RKV_VRAM_RESERVE ? free - LLAMA_RKV_VRAM_RESERVE : 0;
        }

        const size_t per_cell = std::max<size_t>(1, desc.row_bytes_window*desc.n_stream);
        const uint64_t fit    = budget/per_cell;

        if (fit >= desc.kv_size) {
            return llama_rkv_resident(st, "the cache fits the VRAM budget: resident");
        }

        wc = (uint32_t) (fit/LLAMA_RKV_WINDOW_ALIGN*LLAMA_RKV_WINDOW_ALIGN);
        wc = std::max(wc, LLAMA_RKV_WINDOW_ALIGN);
        if (wc >= desc.kv_size) {
            return llama_rkv_resident(st, "the minimum window covers the whole cache: resident");
        }
    }

    st.chosen       = LLAMA_KV_RESIDENCY_WINDOW;
    st.window_cells = wc;
    st.tail_cells   = desc.kv_size - wc;
    st.type_k_tail  = req.type_k_tail == GGML_TYPE_COUNT ? desc.type_k : req.type_k_tail;
    st.type_v_tail  = req.type_v_tail == GGML_TYPE_COUNT ? desc.type_v : req.type_v_tail;

    char buf[256];
    if (req.window_cells > 0) {
        snprintf(buf, sizeof(buf), "%s: explicit window of %u cells", llama_kv_residency_mode_name(req.mode), wc);
    } else {
        snprintf(buf, sizeof(buf), "%s: window of %u cells from the VRAM budget", llama_kv_residency_mode_name(req.mode), wc);
    }
    st.reason = buf;

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

static const char * llama_rkv_type_name(ggml_type t) {
    return t == GGML_TYPE_COUNT ? "none" : ggml_type_name(t);
}

std::string llama_rkv_plan_to_json(const llama_rkv_state * st) {
    if (!st) {
        return "{\"mode_requested\":\"off\",\"mode_chosen\":\"off\",\"split\":false,"
               "\"reason\":\"context created without residency parameters (llama_init_from_model)\",\"layers\":[],"
               "\"device_bytes\":0,\"host_bytes\":0}";
    }

    char buf[512];
    std::string res = "{";

    res += "\"mode_requested\":" + llama_rkv_json_str(llama_kv_residency_mode_name(st->req.mode));
    res += ",\"mode_chosen\":"   + llama_rkv_json_str(llama_kv_residency_mode_name(st->chosen));
    res += std::string(",\"split\":") + (st->window_cells > 0 ? "true" : "false");
    res += ",\"reason\":"        + llama_rkv_json_str(st->reason);

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
