// rollingkv: the graph side of a split KV layer (see llama-rolling-kv-graph.h)
#include "llama-rolling-kv-graph.h"

#include "ggml-rolling-kv.h"

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
               float   tail_cpu_frac) {
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
    ggml_streaming_flash_attn_set_tail_cpu_frac(cur, tail_cpu_frac);

    return ggml_reshape_2d(ctx, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
}
