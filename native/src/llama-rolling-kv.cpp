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
#include "ggml-rolling-kv.h"
#include "llama-context.h"
#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

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

struct llama_context * llama_init_from_model_rolling_kv(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv) {
    const llama_rolling_kv_params req = rkv ? *rkv : llama_rolling_kv_default_params();

    g_rkv_last_error.clear();

    switch (req.mode) {
        case LLAMA_KV_RESIDENCY_OFF:
        case LLAMA_KV_RESIDENCY_AUTO:
        case LLAMA_KV_RESIDENCY_WINDOW:
            break;
        case LLAMA_KV_RESIDENCY_HEAD:
            return llama_rkv_fail(__func__, "kv residency mode 'head' is not implemented yet; use window or auto");
        default:
            return llama_rkv_fail(__func__, "invalid kv residency mode %d", (int) req.mode);
    }

    if (req.window_cells < 0) {
        return llama_rkv_fail(__func__, "window_cells must be >= 0 (got %" PRId64 ")", req.window_cells);
    }
    if (req.vram_target_mib < 0) {
        return llama_rkv_fail(__func__, "vram_target_mib must be >= 0 (got %" PRId64 ")", req.vram_target_mib);
    }
    for (ggml_type t : { req.type_k_tail, req.type_v_tail }) {
        if (t != GGML_TYPE_COUNT && ((int) t < 0 || (int) t > GGML_TYPE_COUNT || !ggml_streaming_flash_attn_cpu_type_supported(t))) {
            return llama_rkv_fail(__func__, "unsupported KV tail type %s: the tail must be one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1",
                    ((int) t >= 0 && (int) t < GGML_TYPE_COUNT) ? ggml_type_name(t) : "(invalid)");
        }
    }

    // the cache constructor plans with this request (mode off: the upstream cache, the plan only reports it)
    auto st = std::make_shared<llama_rkv_state>();
    st->req = req;

    // what the cache constructor cannot see, resolved as llama_context resolves it (causal models: the batch is
    // capped by the context), for the compute buffer estimate and the size of an iSWA model's SWA cache
    if (model) {
        const uint32_t n_ctx   = params.n_ctx == 0 ? (uint32_t) std::max<int32_t>(0, llama_model_n_ctx_train(model)) : params.n_ctx;
        const uint32_t n_batch = n_ctx > 0 ? std::min(n_ctx, params.n_batch) : params.n_batch;
        st->n_ctx      = n_ctx;
        st->n_ubatch   = std::min(n_batch, params.n_ubatch == 0 ? params.n_batch : params.n_ubatch);
        st->n_seq_max  = std::max<uint32_t>(1, params.n_seq_max);
        st->kv_unified = params.kv_unified;
        st->swa_full   = params.swa_full;
    }

    llama_rkv_set_pending(st);

    llama_context * ctx = llama_init_from_model(model, params);

    // never leave a request behind for the next context of this thread
    llama_rkv_set_pending(nullptr);

    if (!ctx) {
        // the planner's refusal (a vram_target below the minimum, ...) when it was one
        if (!st->error.empty()) {
            return llama_rkv_fail(__func__, "rolling KV: %s", st->error.c_str());
        }
        g_rkv_last_error = "llama_init_from_model failed (see the log)";
        return nullptr;
    }

    {
        auto & st = ctx->get_cparams().rkv;
        if (st && !st->resolved) {
            st->resolved = true;
            st->chosen   = LLAMA_KV_RESIDENCY_OFF;
            st->eligible = req.mode == LLAMA_KV_RESIDENCY_OFF;
            st->reason   = req.mode == LLAMA_KV_RESIDENCY_OFF
                ? "mode off: the upstream resident cache"
                : "this model's memory (recurrent, hybrid, sparse-attention or no KV cache) does not support the split: resident";
            LLAMA_LOG_INFO("%s: rolling KV: resident (%s)\n", __func__, st->reason.c_str());
        }
    }

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

int32_t llama_rolling_kv_plan_simulate(const char * json_in, char * buf, size_t buf_size) {
    if (!json_in) {
        return -1;
    }
    return llama_rkv_copy_out(llama_rkv_plan_simulate(json_in), buf, buf_size);
}
