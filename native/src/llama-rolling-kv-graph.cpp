// rollingkv: the graph side of a split KV layer (see llama-rolling-kv-graph.h)
#include "llama-rolling-kv-graph.h"

#include "ggml-rolling-kv.h"

#include <algorithm>

ggml_tensor * llama_rkv_input_views::find(const ggml_context * c, const ggml_tensor * src, const int64_t ne[4],
        const size_t nb[3], size_t offs) {
    if (c != ctx) {
        entries.clear();
        ctx = c;
        return nullptr;
    }
    // the tensors made in the context since its last reset (ggml_reset leaves the objects of the graph before it in
    // place: one there may look like the view asked for without being a tensor of this graph)
    const char * lo = (const char *) ggml_get_mem_buffer(c);
    const char * hi = lo + ggml_used_mem(c);
    for (size_t i = 0; i < entries.size(); ++i) {
        const entry & e = entries[i];
        if (e.src != src || e.offs != offs || !std::equal(ne, ne + 4, e.ne) || !std::equal(nb, nb + 3, e.nb)) {
            continue;
        }
        const ggml_tensor * v = e.view;
        const bool live = (const char *) v >= lo && (const char *) (v + 1) <= hi && v->op == GGML_OP_VIEW &&
                v->view_src == src && v->view_offs == offs && std::equal(ne, ne + 4, v->ne) &&
                (nb[0] == 0 || std::equal(nb, nb + 3, v->nb + 1));
        if (live) {
            return e.view;
        }
        entries.erase(entries.begin() + i); // of a graph before this one
        return nullptr;
    }
    return nullptr;
}

void llama_rkv_input_views::add(const ggml_context * c, const ggml_tensor * src, const int64_t ne[4],
        const size_t nb[3], size_t offs, ggml_tensor * view) {
    if (entries.size() >= 4096) {
        entries.clear(); // the keys of graphs long gone
    }
    entries.push_back({ src, { ne[0], ne[1], ne[2], ne[3] }, { nb[0], nb[1], nb[2] }, offs, view });
    ctx = c;
}

ggml_tensor * llama_rkv_input_view_4d(ggml_context * ctx, llama_rkv_input_views * views, ggml_tensor * src,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offs) {
    const int64_t ne[4] = { ne0, ne1, ne2, ne3 };
    const size_t  nb[3] = { nb1, nb2, nb3 };
    ggml_tensor * v = views ? views->find(ctx, src, ne, nb, offs) : nullptr;
    if (!v) {
        v = ggml_view_4d(ctx, src, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offs);
        if (views) {
            views->add(ctx, src, ne, nb, offs, v);
        }
    }
    return v;
}

ggml_tensor * llama_rkv_input_view_1d(ggml_context * ctx, llama_rkv_input_views * views, ggml_tensor * src, int64_t ne0,
        size_t offs) {
    const int64_t ne[4] = { ne0, 1, 1, 1 };
    const size_t  nb[3] = { 0, 0, 0 };
    ggml_tensor * v = views ? views->find(ctx, src, ne, nb, offs) : nullptr;
    if (!v) {
        v = ggml_view_1d(ctx, src, ne0, offs);
        if (views) {
            views->add(ctx, src, ne, nb, offs, v);
        }
    }
    return v;
}

static ggml_tensor * llama_rkv_attn_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
        ggml_tensor * k_tail, ggml_tensor * v_tail, ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale,
        float max_alibi_bias, float logit_softcap, uint32_t tail_cpu_cells, int32_t ref_streams, float perturb_tail,
        const llama_rkv_attn_layout * runs = nullptr) {
    q = ggml_permute(ctx, q, 0, 2, 1, 3);
    if (k) {
        k = ggml_permute(ctx, k, 0, 2, 1, 3);
        v = ggml_permute(ctx, v, 0, 2, 1, 3);
    }
    if (k_tail) {
        k_tail = ggml_permute(ctx, k_tail, 0, 2, 1, 3);
        v_tail = ggml_permute(ctx, v_tail, 0, 2, 1, 3);
    }

    ggml_tensor * cur = ggml_streaming_flash_attn(ctx, q, k, v, k_tail, v_tail, kq_mask, kq_scale, max_alibi_bias,
                                                  logit_softcap);

    ggml_streaming_flash_attn_add_sinks(cur, sinks);
    ggml_streaming_flash_attn_set_prec(cur, GGML_PREC_F32);
    // the CPU part takes decode-sized batches only (GGML_RKV_CPU_PART_MAX_Q rows per stream): a prompt's ubatch streams
    // its whole tail, decided here rather than dropped by the backend
    const bool rows_ok = q->ne[1] <= GGML_RKV_CPU_PART_MAX_Q;
    ggml_streaming_flash_attn_set_tail_cpu_cells(cur,
            k_tail && rows_ok ? std::min<int64_t>(tail_cpu_cells, k_tail->ne[1]) : 0);
    ggml_streaming_flash_attn_set_ref_streams(cur, ref_streams);
    if (perturb_tail != 0.0f) {
        ggml_streaming_flash_attn_set_tail_perturb(cur, perturb_tail); // a test hook of the context
    }
    if (k_tail && runs && !runs->run_first.empty()) {
        const int n_runs = (int) runs->run_first.size();
        GGML_ASSERT(n_runs <= GGML_RKV_MAX_TAIL_RUNS && runs->run_n.size() == runs->run_first.size());
        int32_t first[GGML_RKV_MAX_TAIL_RUNS], n[GGML_RKV_MAX_TAIL_RUNS];
        for (int r = 0; r < n_runs; ++r) {
            first[r] = (int32_t) runs->run_first[r];
            n[r]     = (int32_t) runs->run_n[r];
        }
        ggml_streaming_flash_attn_set_tail_runs(cur, n_runs, first, n);
    }
    if (runs && runs->block_map) {
        // the logical keys are the tail's rows (a row for every cell): one map entry per 256 of them
        GGML_ASSERT(k_tail && k_tail->ne[1] % 256 == 0 && k_tail->ne[1]/256 <= runs->block_map->ne[0]);
        // (one view for every layer: llama_rkv_input_views)
        ggml_streaming_flash_attn_set_block_map(cur, llama_rkv_input_view_1d(ctx, runs->views, runs->block_map,
                k_tail->ne[1]/256, 0));
    }
    return cur;
}

// stream s of a 4D get_k-layout view [D, n_head_kv, n_cells, n_stream], n cells from its cell row0
static ggml_tensor * llama_rkv_stream_cells(ggml_context * ctx, ggml_tensor * t, int64_t s, int64_t row0, int64_t n) {
    return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], n, 1, t->nb[1], t->nb[2], t->nb[3], s*t->nb[3] + row0*t->nb[2]);
}

// concatenation along dim 2 (tokens), pairwise so that each row is copied O(log n) times
static ggml_tensor * llama_rkv_concat_tokens(ggml_context * ctx, std::vector<ggml_tensor *> parts) {
    while (parts.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t i = 0; i + 1 < parts.size(); i += 2) {
            next.push_back(ggml_concat(ctx, parts[i], parts[i + 1], 2));
        }
        if (parts.size() % 2) {
            next.push_back(parts.back());
        }
        parts = std::move(next);
    }
    return parts[0];
}

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
  const llama_rkv_attn_layout & layout) {
    // same stream split and permutations as build_attn_mha (elastic windows: the window view is the pool, one "stream")
    const auto n_stream = layout.pool ? k_tail->ne[3] : (k ? k : k_tail)->ne[3];

    if (layout.n_kv.empty()) {
        q = ggml_view_4d(ctx, q, q->ne[0], q->ne[1], q->ne[2]/n_stream, n_stream, q->nb[1], q->nb[2],
                         q->nb[2]*(q->ne[2]/n_stream), 0);
        ggml_tensor * cur = llama_rkv_attn_op(ctx, q, k, v, k_tail, v_tail, kq_mask, sinks, kq_scale, max_alibi_bias,
                logit_softcap, layout.tail_cpu_cells, 0, layout.perturb_tail, &layout);
        return ggml_reshape_2d(ctx, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
    }

    GGML_ASSERT((int64_t) layout.n_kv.size() == n_stream && layout.cpu_cells.size() == layout.n_kv.size());
    GGML_ASSERT(kq_mask && kq_mask->ne[3] == n_stream);

    const int64_t n_tok = q->ne[2]/n_stream; // the tokens of a stream are consecutive
    std::vector<ggml_tensor *> outs;
    for (int64_t s = 0; s < n_stream; ++s) {
        const int64_t n_s    = layout.n_kv[s];
        const int64_t n_win  = layout.pool ? layout.win_cells[s] : layout.n_win;
        const int64_t n_w    = k ? std::min<int64_t>(n_s, layout.pool ? n_win : k->ne[2]) : 0;
        const int64_t n_t    = n_s > n_win ? n_s - n_win : 0;
        // where the stream's window and tail cells start in the views
        const int64_t ks_s   = layout.pool ? 0 : s;
        const int64_t ks_row = layout.pool ? layout.win_row0[s] : 0;
        const int64_t kt_row = layout.pool ? layout.tail_row0[s] : 0;
        GGML_ASSERT(!k_tail || kt_row + n_t <= k_tail->ne[2]);
        GGML_ASSERT(!n_w || ks_row + n_w <= k->ne[2]);

        ggml_tensor * qs = ggml_view_4d(ctx, q, q->ne[0], q->ne[1], n_tok, 1, q->nb[1], q->nb[2], q->nb[2]*n_tok,
                                        s*n_tok*q->nb[2]);
        ggml_tensor * ks = n_w ? llama_rkv_stream_cells(ctx, k, ks_s, ks_row, n_w) : nullptr;
        ggml_tensor * vs = n_w ? llama_rkv_stream_cells(ctx, v, ks_s, ks_row, n_w) : nullptr;
        ggml_tensor * kt = n_t && k_tail ? llama_rkv_stream_cells(ctx, k_tail, s, kt_row, n_t) : nullptr;
        ggml_tensor * vt = n_t && k_tail ? llama_rkv_stream_cells(ctx, v_tail, s, kt_row, n_t) : nullptr;
        // the stream's rows of the mask (whole rows: the op reads its first n_w + n_t columns): one view per stream for
        // every layer of the graph (llama_rkv_input_views: the scheduler copies each view to a GPU on its own, so a
        // view per layer held a copy of the whole mask per layer); one stream (an elastic pool's): the mask itself
        ggml_tensor * ms = n_stream == 1 ? kq_mask : llama_rkv_input_view_4d(ctx, layout.views, kq_mask,
                kq_mask->ne[0], kq_mask->ne[1], kq_mask->ne[2], 1, kq_mask->nb[1], kq_mask->nb[2], kq_mask->nb[3],
                s*kq_mask->nb[3]);

        outs.push_back(llama_rkv_attn_op(ctx, qs, ks, vs, kt, vt, ms, sinks, kq_scale, max_alibi_bias, logit_softcap,
                kt ? layout.cpu_cells[s] : 0, (int32_t) n_stream, layout.perturb_tail));
    }
    // [DV, n_head, n_tok, 1] per stream -> [DV, n_head, n_tok*n_stream]: the rows of the one-op output, stream-major
    ggml_tensor * cur = llama_rkv_concat_tokens(ctx, std::move(outs));
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
  const llama_rkv_attn_layout & layout,
    const llama_rkv_attn_fn & attn_dev) {
    GGML_ASSERT(max_alibi_bias == 0.0f && "a head split cannot attend with ALiBi");

    const int64_t n_head    = q->ne[1];
    const int64_t n_head_kv = n_head_kv_dev + k_tail->ne[1];
    GGML_ASSERT(n_head_kv_dev > 0 && n_head % n_head_kv == 0);

    // the query heads of a GQA group follow its KV head (ggml's broadcast: query head i reads KV head
    // i/(n_head/n_head_kv))
    const int64_t n_q_dev = n_head_kv_dev*(n_head/n_head_kv);

    ggml_tensor * q_dev  = ggml_view_3d(ctx, q, q->ne[0], n_q_dev,          q->ne[2], q->nb[1], q->nb[2], 0);
    ggml_tensor * q_host = ggml_view_3d(ctx, q, q->ne[0], n_head - n_q_dev, q->ne[2], q->nb[1], q->nb[2],
                                        n_q_dev*q->nb[1]);

    ggml_tensor * sinks_dev  = sinks ? ggml_view_1d(ctx, sinks, n_q_dev, 0) : nullptr;
    ggml_tensor * sinks_host = sinks ? ggml_view_1d(ctx, sinks, n_head - n_q_dev, n_q_dev*sinks->nb[0]) : nullptr;

    ggml_tensor * a = attn_dev(q_dev, sinks_dev);
    ggml_tensor * b = llama_rkv_build_attn_mha(ctx, q_host, nullptr, nullptr, k_tail, v_tail, kq_mask, sinks_host,
            kq_scale, max_alibi_bias, logit_softcap, layout);

    // [DV*n_q_dev, T] and [DV*(n_head - n_q_dev), T]: the rows of the unsplit layer's output
    return ggml_concat(ctx, a, b, 0);
}
