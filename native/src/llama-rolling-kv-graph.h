// rollingkv: the graph side of a split KV layer (llama-rolling-kv-graph.cpp)
#pragma once

#include "ggml.h"

// attention over a split layer: like llm_graph_context::build_attn_mha's flash-attention branch, over the
// window views k/v and the tail views k_tail/v_tail, with GGML_OP_STREAMING_FLASH_ATTN (ggml-rolling-kv.h).
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
               float   logit_softcap,
               float   tail_cpu_frac); // the share of the tail attended on the CPU (the hybrid tail), 0: none
