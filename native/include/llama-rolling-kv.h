// rollingkv: public extension API of the patched libllama.
//
// Kept out of llama.h on purpose: llama-cpp-python 0.3.36 mirrors llama_context_params field by
// field and passes it by value, so our parameters travel through new functions, never new fields.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Version of the extension API below; bumped on any change to it.
#define LLAMA_ROLLING_KV_API_VERSION 1

// "rollingkv api=<n> pin=<llama.cpp commit> series=<patch series hash>": identifies the build.
LLAMA_API const char * llama_rolling_kv_build_info(void);

LLAMA_API int32_t llama_rolling_kv_api_version(void);

// sizeof() of the structs llama-cpp-python mirrors in ctypes: lets bindings prove the layout matches.
LLAMA_API size_t llama_rolling_kv_sizeof_context_params(void);
LLAMA_API size_t llama_rolling_kv_sizeof_model_params(void);

//
// KV residency: each attention layer's cache split by key position into a device-resident window
// (cells [0, wc)) and a tail in pinned host memory (cells [wc, kv_size)), possibly of another type.
//

enum llama_kv_residency_mode {
    LLAMA_KV_RESIDENCY_OFF    = 0, // the upstream cache, untouched (bit-identical to an unpatched build)
    LLAMA_KV_RESIDENCY_AUTO   = 1, // resident when the KV fits the budget, window otherwise
    LLAMA_KV_RESIDENCY_HEAD   = 2, // head-axis split (not implemented yet: refused with a message)
    LLAMA_KV_RESIDENCY_WINDOW = 3, // always split: device window + host tail
};

struct llama_rolling_kv_params {
    enum llama_kv_residency_mode mode;
    int64_t        vram_target_mib; // device memory budget in MiB; <= 0: free VRAM at start minus a reserve
    int64_t        window_cells;    // > 0: explicit window size in cells per stream; 0: the planner decides
    enum ggml_type type_k_tail;     // GGML_TYPE_COUNT: same type as the window's K
    enum ggml_type type_v_tail;     // GGML_TYPE_COUNT: same type as the window's V
    float          pcie_bw_gbps;    // host->device bandwidth for the planner; <= 0: unknown
};

LLAMA_API struct llama_rolling_kv_params llama_rolling_kv_default_params(void);

// llama_init_from_model with residency parameters (rkv == NULL: defaults). Returns NULL on failure,
// e.g. an impossible window or an unsupported tail type, after logging why.
LLAMA_API struct llama_context * llama_init_from_model_rolling_kv(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv);

// The residency plan of a context as JSON: mode requested and chosen, the reason, per-layer window
// and tail cells and types, bytes on device and on host. Writes at most buf_size bytes including the
// terminating NUL; returns the full length (excluding NUL), or -1 if ctx is NULL.
LLAMA_API int32_t llama_rolling_kv_plan_json(const struct llama_context * ctx, char * buf, size_t buf_size);

LLAMA_API const char * llama_kv_residency_mode_name(enum llama_kv_residency_mode mode);
// -1 when s names no mode ("off", "auto", "head", "window")
LLAMA_API int32_t llama_kv_residency_mode_from_str(const char * s);

#ifdef __cplusplus
}
#endif
