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
    const auto n_stream = (k ? k : k_tail)->ne[3];

    q = ggml_view_4d(ctx, q, q->ne[0], q->ne[1], q->ne[2]/n_stream, n_stream, q->nb[1], q->nb[2], q->nb[2]*(q->ne[2]/n_stream), 0);

    q = ggml_permute(ctx, q, 0, 2, 1, 3);
    if (k) {
        k = ggml_permute(ctx, k, 0, 2, 1, 3);
        v = ggml_permute(ctx, v, 0, 2, 1, 3);
    }
    k_tail = ggml_permute(ctx, k_tail, 0, 2, 1, 3);
    v_tail = ggml_permute(ctx, v_tail, 0, 2, 1, 3);

    ggml_tensor * cur = ggml_streaming_flash_attn(ctx, q, k, v, k_tail, v_tail, kq_mask, kq_scale, max_alibi_bias, logit_softcap);

    ggml_streaming_flash_attn_add_sinks(cur, sinks);
    ggml_streaming_flash_attn_set_prec(cur, GGML_PREC_F32);
    ggml_streaming_flash_attn_set_tail_cpu_frac(cur, tail_cpu_frac);

    return ggml_reshape_2d(ctx, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
}

ggml_tensor * llama_rkv_build_attn_heads(
        ggml_context * ctx,
         ggml_tensor * q,
             int64_t   n_head_kv_dev,
         ggml_tensor * k_tail,
         ggml_tensor * v_tail,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
               float   max_alibi_bias,
               float   logit_softcap,
               float   tail_cpu_frac,
    const llama_rkv_attn_fn & attn_dev) {
    GGML_ASSERT(max_alibi_bias == 0.0f && "a head split cannot attend with ALiBi");

    const int64_t n_head    = q->ne[1];
    const int64_t n_head_kv = n_head_kv_dev + k_tail->ne[1];
    GGML_ASSERT(n_head_kv_dev > 0 && n_head % n_head_kv == 0);

    // the query heads of a GQA group follow its KV head (ggml's broadcast: query head i reads KV head i/(n_head/n_head_kv))
    const int64_t n_q_dev = n_head_kv_dev*(n_head/n_head_kv);

    ggml_tensor * q_dev  = ggml_view_3d(ctx, q, q->ne[0], n_q_dev,          q->ne[2], q->nb[1], q->nb[2], 0);
    ggml_tensor * q_host = ggml_view_3d(ctx, q, q->ne[0], n_head - n_q_dev, q->ne[2], q->nb[1], q->nb[2], n_q_dev*q->nb[1]);

    ggml_tensor * sinks_dev  = sinks ? ggml_view_1d(ctx, sinks, n_q_dev, 0) : nullptr;
    ggml_tensor * sinks_host = sinks ? ggml_view_1d(ctx, sinks, n_head - n_q_dev, n_q_dev*sinks->nb[0]) : nullptr;

    ggml_tensor * a = attn_dev(q_dev, sinks_dev);
    ggml_tensor * b = llama_rkv_build_attn_mha(ctx, q_host, nullptr, nullptr, k_tail, v_tail, kq_mask, sinks_host, kq_scale,
            max_alibi_bias, logit_softcap, tail_cpu_frac);

    // [DV*n_q_dev, T] and [DV*(n_head - n_q_dev), T]: the rows of the unsplit layer's output
    return ggml_concat(ctx, a, b, 0);
}
