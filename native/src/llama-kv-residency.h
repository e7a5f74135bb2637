// rollingkv: KV residency planner and the state it shares with the context.
//
// A residency request (llama_rolling_kv_params) travels from llama_init_from_model_rolling_kv into the
// context's llama_cparams (cparams.rkv) and from there to the KV cache constructor, which asks the planner
// whether to split each attention layer's cache by cell index into a device window (cells [0, wc)) and a
// host tail (cells [wc, kv_size)). The outcome (the plan) is recorded in the same state, for
// llama_rolling_kv_plan_json and the logs.
#pragma once

#include "llama-rolling-kv.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_rkv_layer_plan {
    int32_t  il;
    uint32_t window_cells; // per stream (kv_size when not split)
    uint32_t tail_cells;   // per stream (0 when not split)
    size_t   device_bytes; // bytes of this layer's K/V in the device (or the layer's) buffer
    size_t   host_bytes;   // bytes of this layer's K/V tail in host memory
    bool     split;
};

struct llama_rkv_state {
    llama_rolling_kv_params req;

    // set by the first cache that planned with this state
    bool resolved = false;

    enum llama_kv_residency_mode chosen = LLAMA_KV_RESIDENCY_OFF;
    std::string reason;

    uint32_t kv_size      = 0;
    uint32_t n_stream     = 0;
    uint32_t window_cells = 0; // per stream; 0 when resident
    uint32_t tail_cells   = 0; // per stream

    ggml_type type_k      = GGML_TYPE_COUNT;
    ggml_type type_v      = GGML_TYPE_COUNT;
    ggml_type type_k_tail = GGML_TYPE_COUNT;
    ggml_type type_v_tail = GGML_TYPE_COUNT;

    std::vector<llama_rkv_layer_plan> layers;
};

// what the KV cache constructor knows when it asks for a plan
struct llama_rkv_cache_desc {
    uint32_t  kv_size;
    uint32_t  n_stream;
    ggml_type type_k;
    ggml_type type_v;
    bool      v_trans;
    bool      offload;
    // a reason the cache must stay resident whatever the request (nullptr: none)
    const char * refuse;
    // the devices of the layers the cache holds (nullptr entries: CPU), and their K+V row bytes
    std::vector<ggml_backend_dev_t> layer_devs;
    size_t    row_bytes_window; // sum over layers of K+V row bytes at the window types
};

// window cells per stream for this cache (0: stay resident); fills st.chosen/reason/types
uint32_t llama_rkv_plan_cache(llama_rkv_state & st, const llama_rkv_cache_desc & desc);

// the types the CPU flash attention reads for K/V (also valid tail types)
bool llama_rkv_tail_type_ok(ggml_type t);

// the request llama_init_from_model_rolling_kv hands to the llama_context being constructed on this thread
void llama_rkv_set_pending(std::shared_ptr<llama_rkv_state> st);
std::shared_ptr<llama_rkv_state> llama_rkv_take_pending();

std::string llama_rkv_plan_to_json(const llama_rkv_state * st);

// attention over a split layer: like llm_graph_context::build_attn_mha's flash-attention branch, over the
// window views k/v and the tail views k_tail/v_tail, with GGML_OP_STREAMING_FLASH_ATTN.
// q: [DK, n_head, n_tokens]; k/v/k_tail/v_tail: 4D views [D, n_head_kv, n_kv_part, n_stream] (get_k layout)
// returns [DV*n_head, n_tokens]
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
               float   logit_softcap);
