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
// KV residency
//

#include "llama-kv-residency.h"
#include "llama-context.h"
#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <memory>

struct llama_rolling_kv_params llama_rolling_kv_default_params(void) {
    llama_rolling_kv_params res;
    res.mode            = LLAMA_KV_RESIDENCY_AUTO;
    res.vram_target_mib = 0;
    res.window_cells    = 0;
    res.type_k_tail     = GGML_TYPE_COUNT;
    res.type_v_tail     = GGML_TYPE_COUNT;
    res.pcie_bw_gbps    = 0.0f;
    return res;
}

const char * llama_kv_residency_mode_name(enum llama_kv_residency_mode mode) {
    switch (mode) {
        case LLAMA_KV_RESIDENCY_OFF:    return "off";
        case LLAMA_KV_RESIDENCY_AUTO:   return "auto";
        case LLAMA_KV_RESIDENCY_HEAD:   return "head";
        case LLAMA_KV_RESIDENCY_WINDOW: return "window";
    }
    return "unknown";
}

int32_t llama_kv_residency_mode_from_str(const char * s) {
    if (!s) {
        return -1;
    }
    for (auto m : { LLAMA_KV_RESIDENCY_OFF, LLAMA_KV_RESIDENCY_AUTO, LLAMA_KV_RESIDENCY_HEAD, LLAMA_KV_RESIDENCY_WINDOW }) {
        if (strcmp(s, llama_kv_residency_mode_name(m)) == 0) {
            return (int32_t) m;
        }
    }
    return -1;
}

struct llama_context * llama_init_from_model_rolling_kv(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv) {
    const llama_rolling_kv_params req = rkv ? *rkv : llama_rolling_kv_default_params();

    switch (req.mode) {
        case LLAMA_KV_RESIDENCY_OFF:
        case LLAMA_KV_RESIDENCY_AUTO:
        case LLAMA_KV_RESIDENCY_WINDOW:
            break;
        case LLAMA_KV_RESIDENCY_HEAD:
            LLAMA_LOG_ERROR("%s: kv residency mode 'head' is not implemented yet; use window or auto\n", __func__);
            return nullptr;
        default:
            LLAMA_LOG_ERROR("%s: invalid kv residency mode %d\n", __func__, (int) req.mode);
            return nullptr;
    }

    if (req.window_cells < 0) {
        LLAMA_LOG_ERROR("%s: window_cells must be >= 0 (got %" PRId64 ")\n", __func__, req.window_cells);
        return nullptr;
    }
    if (req.vram_target_mib < 0) {
        LLAMA_LOG_ERROR("%s: vram_target_mib must be >= 0 (got %" PRId64 ")\n", __func__, req.vram_target_mib);
        return nullptr;
    }
    for (ggml_type t : { req.type_k_tail, req.type_v_tail }) {
        if (t != GGML_TYPE_COUNT && ((int) t < 0 || (int) t > GGML_TYPE_COUNT || !llama_rkv_tail_type_ok(t))) {
            LLAMA_LOG_ERROR("%s: unsupported KV tail type %s: the tail must be one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1\n",
                    __func__, ((int) t >= 0 && (int) t < GGML_TYPE_COUNT) ? ggml_type_name(t) : "(invalid)");
            return nullptr;
        }
    }

    // the cache constructor plans with this request (mode off: the upstream cache, the plan only reports it)
    auto st = std::make_shared<llama_rkv_state>();
    st->req = req;
    llama_rkv_set_pending(st);

    llama_context * ctx = llama_init_from_model(model, params);

    // never leave a request behind for the next context of this thread
    llama_rkv_set_pending(nullptr);

    if (ctx) {
        auto & st = ctx->get_cparams().rkv;
        if (st && !st->resolved) {
            st->resolved = true;
            st->chosen   = LLAMA_KV_RESIDENCY_OFF;
            st->reason   = req.mode == LLAMA_KV_RESIDENCY_OFF
                ? "mode off: the upstream resident cache"
                : "this model's memory (recurrent, hybrid, sparse-attention or no KV cache) does not support the split: resident";
            LLAMA_LOG_INFO("%s: rolling KV: resident (%s)\n", __func__, st->reason.c_str());
        }
    }

    return ctx;
}

int32_t llama_rolling_kv_plan_json(const struct llama_context * ctx, char * buf, size_t buf_size) {
    if (!ctx) {
        return -1;
    }
    const std::string s = llama_rkv_plan_to_json(ctx->get_cparams().rkv.get());
    if (buf && buf_size > 0) {
        const size_t n = std::min(s.size(), buf_size - 1);
        memcpy(buf, s.data(), n);
        buf[n] = '\0';
    }
    return (int32_t) s.size();
}
