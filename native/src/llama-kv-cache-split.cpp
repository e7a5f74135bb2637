// rollingkv: the position-windowed and the head split of llama_kv_cache.
//
// Window: a split layer keeps cells [0, wc) of every stream in its window tensors k/v ([n_embd, wc + 1, n_stream], on
// the layer's buffer type, as upstream) and cells [wc, kv_size) in tail tensors k_tail/v_tail
// ([n_embd, kv_size - wc + 1, n_stream], host memory, possibly another type). The last row of each stream is
// a trash row: every ubatch writes all its tokens into both regions, the tokens meant for the other region
// land in the trash row, so the graph topology does not depend on where the cells are (reserve == live).
// The KQ mask is unchanged: its columns are the cells in order, window first, then tail.
//
// Head: layer il keeps its first h KV heads of every cell in k/v ([D*h, kv_size, n_stream], the layer's buffer type)
// and the other n_head_kv - h in k_tail/v_tail ([D*(n_head_kv - h), kv_size, n_stream], host memory, the tail types):
// a cell's row is split, not the cells, so both tensors take every token at its cell (upstream's index input) and the
// graph attends the device heads with upstream's flash attention and the host heads with the streaming op over an
// empty window (every cell is "tail" for them), their outputs concatenated by head (no merge across heads). A layer
// with h = n_head_kv has no tail. Separate tensors keep each part's rows contiguous, as the GPU's streamed tail needs.
#include "llama-kv-cache.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-context.h"
#include "llama-kv-residency.h"
#include "ggml-rolling-kv.h"
#include "ggml-alloc.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

//
// construction
//

// test lever ROLLINGKV_DEBUG_ONE_OP_STREAMS=1: a ubatch of several streams attends as one op over the longest stream's
// cells (the behaviour before per-stream ops), for A/B runs (it implies
// static windows: one op needs every stream's window at the same rows of its slab)
static bool llama_rkv_one_op_streams() {
    static const bool v = [] {
        const char * e = getenv("ROLLINGKV_DEBUG_ONE_OP_STREAMS");
        return e && strcmp(e, "1") == 0;
    }();
    return v;
}


uint32_t llama_kv_cache::rkv_plan(llama_rkv_state & st, uint32_t kv_size, ggml_type type_k, ggml_type type_v, bool offload,
        const layer_filter_cb & filter, const layer_share_cb & share) {
    if (st.resolved) {
        return 0;
    }

    llama_rkv_cache_desc desc;
    desc.kv_size          = kv_size;
    desc.n_stream         = n_stream;
    desc.type_k           = type_k;
    desc.type_v           = type_v;
    desc.v_trans          = v_trans;
    desc.offload          = offload;
    desc.refuse           = nullptr;
    desc.row_bytes_window = 0;
    desc.row_bytes_tail   = 0;

    const ggml_type type_k_tail = st.req.type_k_tail == GGML_TYPE_COUNT ? type_k : st.req.type_k_tail;
    const ggml_type type_v_tail = st.req.type_v_tail == GGML_TYPE_COUNT ? type_v : st.req.type_v_tail;

    auto group_of = [&](ggml_backend_dev_t dev) -> llama_rkv_layer_group * {
        for (auto & g : desc.groups) {
            if (g.dev == dev) {
                return &g;
            }
        }
        return nullptr;
    };

    for (uint32_t il = 0; il < hparams.n_layer_all; il++) {
        if (!hparams.has_kv(il) || (filter && !filter(il))) {
            continue;
        }
        const uint32_t n_embd_k_gqa = hparams.n_embd_k_gqa(il);
        const uint32_t n_embd_v_gqa = hparams.n_embd_v_gqa(il);

        if (n_embd_k_gqa % ggml_blck_size(type_k_tail) != 0 || n_embd_v_gqa % ggml_blck_size(type_v_tail) != 0) {
            desc.refuse = "the K/V row size is not a multiple of the tail type's block size";
        }

        // the head split cuts a cell's row between KV heads: every part a whole number of blocks of its type
        const uint32_t n_head_kv_l = hparams.n_head_kv(il);
        const uint32_t head_k = hparams.n_embd_head_k(il);
        const uint32_t head_v = hparams.n_embd_head_v(il);
        if (n_head_kv_l < 2) {
            desc.refuse_head = "a layer with one KV head (MQA) cannot be split by head";
        } else if (head_k % ggml_blck_size(type_k) != 0 || head_k % ggml_blck_size(type_k_tail) != 0 ||
                   head_v % ggml_blck_size(type_v) != 0 || head_v % ggml_blck_size(type_v_tail) != 0) {
            desc.refuse_head = "the KV head size is not a multiple of a cache type's block size";
        }

        ggml_backend_dev_t dev = offload ? model.dev_layer(il) : nullptr;

        const size_t row_w = ggml_row_size(type_k,      n_embd_k_gqa) + ggml_row_size(type_v,      n_embd_v_gqa);
        const size_t row_t = ggml_row_size(type_k_tail, n_embd_k_gqa) + ggml_row_size(type_v_tail, n_embd_v_gqa);

        desc.layer_devs.push_back(dev);
        desc.row_bytes_window += row_w;
        desc.row_bytes_tail   += row_t;

        llama_rkv_layer_group * g = group_of(dev);
        if (!g) {
            desc.groups.emplace_back();
            g = &desc.groups.back();
            g->dev           = dev;
            g->n_embd_head_k = hparams.n_embd_head_k(il);
            g->n_embd_head_v = hparams.n_embd_head_v(il);
            g->n_head        = hparams.n_head(il);
            g->n_head_kv     = hparams.n_head_kv(il);
        }
        {
            llama_rkv_head_layer hl;
            hl.il                = (int32_t) il;
            hl.dev               = (int32_t) (g - desc.groups.data());
            hl.n_head_kv         = n_head_kv_l;
            hl.head_bytes_window = ggml_row_size(type_k, head_k) + ggml_row_size(type_v, head_v);
            hl.head_bytes_tail   = ggml_row_size(type_k_tail, head_k) + ggml_row_size(type_v_tail, head_v);
            hl.conv_head_bytes   = (type_k != GGML_TYPE_F16 ? (size_t) head_k*2 : 0) + (type_v != GGML_TYPE_F16 ? (size_t) head_v*2 : 0);
            hl.device_heads      = n_head_kv_l;
            desc.head_layers.push_back(hl);
        }
        g->n_layer          += 1;
        g->row_bytes_window += row_w;
        g->row_bytes_tail   += row_t;
        g->max_row_k_tail    = std::max(g->max_row_k_tail, ggml_row_size(type_k_tail, n_embd_k_gqa));
        g->max_row_v_tail    = std::max(g->max_row_v_tail, ggml_row_size(type_v_tail, n_embd_v_gqa));
        // CUDA flash attention converts non-f16 K/V to f16 in its pool, one layer at a time
        g->conv_cell_bytes = std::max(g->conv_cell_bytes,
                (type_k != GGML_TYPE_F16 ? (size_t) n_embd_k_gqa*2 : 0) + (type_v != GGML_TYPE_F16 ? (size_t) n_embd_v_gqa*2 : 0));
    }

    // the base cache of an iSWA model: its SWA cache is created right after this one, stays whole on the device,
    // and must fit next to the window (sized as llama_kv_cache_iswa sizes it)
    if (swa_type == LLAMA_SWA_TYPE_NONE && hparams.swa_type != LLAMA_SWA_TYPE_NONE && !desc.groups.empty()) {
        const uint32_t n_ubatch = st.n_ubatch > 0 ? st.n_ubatch : 512;
        const uint32_t size_swa = st.swa_full ? kv_size :
            GGML_PAD(std::min(kv_size, hparams.n_swa*(n_stream == 1 ? std::max<uint32_t>(1, st.n_seq_max) : 1) + n_ubatch), 256);

        for (uint32_t il = 0; il < hparams.n_layer_all; il++) {
            if (!hparams.has_kv(il) || !hparams.is_swa(il)) {
                continue;
            }
            if (llama_rkv_layer_group * g = group_of(offload ? model.dev_layer(il) : nullptr)) {
                g->other_kv  += (size_t) size_swa*n_stream*(ggml_row_size(type_k, hparams.n_embd_k_gqa(il)) +
                                                            ggml_row_size(type_v, hparams.n_embd_v_gqa(il)));
                g->n_kv_other = size_swa;
            }
        }
    }

    // the attention cache of a hybrid model: its recurrent state (recorded by llama_rkv_note_recurrent before this cache
    // was constructed) stays whole on its device, next to the window
    for (const auto & [dev, bytes] : st.recurrent_bytes) {
        if (llama_rkv_layer_group * g = group_of(dev)) {
            g->other_kv  += bytes;
            g->recurrent += bytes;
        }
    }

    // eligibility: the cache shapes the split serves, and the architectures whose graphs attend through the
    // split-aware build_attn paths only
    if (!ggml_rkv_tail_type_supported(type_k) || !ggml_rkv_tail_type_supported(type_v)) {
        // the split's parts, the window included, are attended by the streaming op, which takes these types only
        // (a window of another type, e.g. iq4_nl, made the scheduler abort after start-up)
        static thread_local std::string why; // desc.refuse is read before this cache returns
        why = std::string("the cache types (K ") + ggml_type_name(type_k) + ", V " + ggml_type_name(type_v) +
              ") are not ones a split cache takes (" + ggml_rkv_tail_type_names() + "): stays whole";
        desc.refuse = why.c_str();
    } else if (hparams.is_mla()) {
        desc.refuse = "MLA cache (K only): the split is not supported";
    } else if (swa_type != LLAMA_SWA_TYPE_NONE) {
        desc.refuse = "SWA cache: stays whole on the device";
    } else if (other || share) {
        desc.refuse = "the cache shares cells or layers with another cache";
    } else if (v_trans && hparams.is_n_embd_v_gqa_variable()) {
        desc.refuse = "variable V embedding size with a transposed V cache";
    } else if (desc.layer_devs.empty()) {
        desc.refuse = "no attention layers";
    } else if (model.arch == LLM_ARCH_T5) {
        desc.refuse = "T5 attends with a relative position bias the streaming op does not take: not supported";
    }
    if (hparams.f_max_alibi_bias > 0.0f) {
        desc.refuse_head = "ALiBi: a head's slope depends on its index and the head count, which the attention over a subset of "
                           "the heads is not told";
    }

    const uint32_t wc = llama_rkv_plan_cache(st, desc, model);

    rkv_head = st.chosen == LLAMA_KV_RESIDENCY_HEAD;
    if (wc || rkv_head) {
        rkv_live = st.live;
    }
    rkv_st = &st;

    // elastic windows: the streams' device cells as one pool (llama-kv-window-pool.h), where moving a row between the
    // window and the tail is a byte copy
    if (wc) {
        // the tail types the plan chose (auto tail types resolve in the planner)
        const ggml_type tk = st.type_k_tail == GGML_TYPE_COUNT ? type_k : st.type_k_tail;
        const ggml_type tv = st.type_v_tail == GGML_TYPE_COUNT ? type_v : st.type_v_tail;
        const char * why_static =
            n_stream < 2                                                 ? "one stream (a unified cache, or one sequence)" :
            st.req.windows == LLAMA_KV_WINDOWS_STATIC                    ? "static windows requested" :
            type_k != tk || type_v != tv                                 ? "the tail's types differ from the window's (a move would convert rows)" :
            llama_rkv_one_op_streams()                                   ? "ROLLINGKV_DEBUG_ONE_OP_STREAMS=1" : nullptr;
        rkv_elastic    = why_static == nullptr;
        rkv_tail_first = rkv_elastic ? 0 : wc;
        st.elastic        = rkv_elastic;
        st.pool_cells     = rkv_elastic ? n_stream*wc : 0;
        st.windows_reason = why_static ? why_static : "";
        if (rkv_elastic) {
            rkv_pool.init(n_stream, kv_size, n_stream*wc);
        }
    }
    rkv_dev_heads.assign(hparams.n_layer_all, 0);
    if (rkv_head) {
        for (const auto & hl : st.head_layers) {
            rkv_dev_heads[hl.il] = hl.device_heads;
        }
    }

    if (wc) {
        LLAMA_LOG_INFO("%s: rolling KV: split, window %u cells + tail %u cells per stream (%u streams), "
                "K %s/%s, V %s/%s (window/tail): %s\n", __func__, wc, kv_size - wc, n_stream,
                ggml_type_name(type_k), ggml_type_name(st.type_k_tail), ggml_type_name(type_v), ggml_type_name(st.type_v_tail),
                st.reason.c_str());
        if (rkv_elastic) {
            LLAMA_LOG_INFO("%s: rolling KV: elastic windows, one pool of %u device cells that follows the load\n", __func__, n_stream*wc);
        } else if (n_stream > 1) {
            LLAMA_LOG_INFO("%s: rolling KV: static windows (%s)\n", __func__, st.windows_reason.c_str());
        }
    } else if (rkv_head) {
        LLAMA_LOG_INFO("%s: rolling KV: split by head, %s (%u streams), K %s/%s, V %s/%s (device/host): %s\n", __func__,
                llama_rkv_heads_summary(st).c_str(), n_stream, ggml_type_name(type_k), ggml_type_name(st.type_k_tail),
                ggml_type_name(type_v), ggml_type_name(st.type_v_tail), st.reason.c_str());
    } else {
        LLAMA_LOG_INFO("%s: rolling KV: resident (%s)\n", __func__, st.reason.c_str());
    }

    return wc;
}

uint32_t llama_kv_cache::rkv_row_dev(uint32_t il, uint32_t n_embd_gqa, bool is_v) const {
    if (!rkv_head || il >= rkv_dev_heads.size() || rkv_dev_heads[il] == 0) {
        return n_embd_gqa;
    }
    return rkv_dev_heads[il]*(is_v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il));
}

void llama_kv_cache::rkv_add_tail(kv_layer & layer, ggml_backend_dev_t dev, const rkv_ctx_for_buft_t & ctx_for_buft,
        ggml_type type_k_tail, ggml_type type_v_tail) const {
    // pinned host memory of the layer's device when it is a GPU, else plain CPU memory
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
    if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        if (auto * host_buft = ggml_backend_dev_host_buffer_type(dev)) {
            buft = host_buft;
        }
    }

    ggml_context * ctx = ctx_for_buft(buft);
    if (!ctx) {
        throw std::runtime_error("failed to create ggml context for the kv cache tail");
    }

    // window: the cells past the window (elastic windows: every cell) +1 trash row, at the full row; head: every cell, the
    // host heads' part of the row
    const uint32_t rows   = rkv_head ? get_size() : get_size() - rkv_tail_first + 1;
    const int64_t  n_k    = rkv_head ? (int64_t) hparams.n_embd_k_gqa(layer.il) - layer.k->ne[0] : layer.k->ne[0];
    const int64_t  n_v    = !layer.v ? 0 : rkv_head ? (int64_t) hparams.n_embd_v_gqa(layer.il) - layer.v->ne[0] : layer.v->ne[0];

    if (n_k == 0) {
        return; // a head split's layer whose heads are all on the device
    }

    layer.k_tail = ggml_new_tensor_3d(ctx, type_k_tail, n_k, rows, n_stream);
    ggml_format_name(layer.k_tail, "cache_k_tail_l%d", layer.il);

    if (layer.v) {
        layer.v_tail = ggml_new_tensor_3d(ctx, type_v_tail, n_v, rows, n_stream);
        ggml_format_name(layer.v_tail, "cache_v_tail_l%d", layer.il);
    }

    // a tail in a GPU's pinned memory is accessed in place by that GPU (new rows written through unified addressing,
    // attention streaming it in bulk) instead of being copied whole by the scheduler before every graph
    if (buft != ggml_backend_cpu_buffer_type()) {
        ggml_set_streamed(layer.k_tail);
        if (layer.v_tail) {
            ggml_set_streamed(layer.v_tail);
        }
    }
}

ggml_backend_buffer_t llama_rkv_alloc_ctx_tensors(ggml_context * ctx, ggml_backend_buffer_type_t buft) {
    bool streamed = false;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t && !streamed; t = ggml_get_next_tensor(ctx, t)) {
        streamed = ggml_is_streamed(t);
    }
    ggml_backend_dev_t dev = streamed ? ggml_backend_buft_get_device(buft) : nullptr;
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto host_alloc = reg ? (ggml_backend_rkv_host_buffer_alloc_t) ggml_backend_reg_get_proc_address(reg, GGML_RKV_HOST_ALLOC_PROC) : nullptr;
    if (host_alloc && ggml_backend_dev_host_buffer_type(dev) == buft) {
        if (ggml_backend_buffer_t buf = host_alloc(dev, ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft))) {
            ggml_tallocr talloc = ggml_tallocr_new(buf);
            for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
                if (t->data == nullptr && t->view_src == nullptr && ggml_tallocr_alloc(&talloc, t) != GGML_STATUS_SUCCESS) {
                    ggml_backend_buffer_free(buf);
                    return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
                }
            }
            LLAMA_LOG_DEBUG("%s: rolling KV: host tails in %.2f MiB of 2 MiB-page memory registered with %s\n", __func__,
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0, ggml_backend_dev_name(dev));
            return buf;
        }
    }
    return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
}

float llama_kv_cache::rkv_tail_cpu_frac(uint32_t n_kv) const {
    // the tail a graph attends: the host heads of every cell (head split), the cells past the (static) window
    return rkv_tail_cpu_frac_cells(rkv_head ? n_kv : n_kv > rkv_wc ? n_kv - rkv_wc : 0);
}

float llama_kv_cache::rkv_tail_cpu_frac_cells(uint32_t n_tail) const {
    return rkv_cpu ? llama_rkv_tail_cpu_frac_at(*rkv_cpu, n_tail) : 0.0f;
}

bool llama_kv_cache::rkv_elastic_whole(uint32_t n_kv, const slot_info & sinfo) const {
    if (sinfo.s0 == sinfo.s1) {
        return n_kv <= rkv_pool.cells[sinfo.s0];
    }
    // several streams in one view: each at its static place, its cells in use within its window, and the view's n_kv rows
    // of each stream within its share (rows past a stream's cells hold no cell of it: the mask hides them)
    if (n_kv > rkv_pool.share) {
        return false;
    }
    for (uint32_t s = sinfo.s0; s <= sinfo.s1; ++s) {
        if (rkv_pool.base[s] != s*rkv_pool.share || v_cells[s].used_max_p1() > rkv_pool.cells[s]) {
            return false;
        }
    }
    return true;
}

uint32_t llama_kv_cache::rkv_win_cells(uint32_t strm) const {
    return rkv_elastic ? rkv_pool.cells[strm] : rkv_wc;
}

size_t llama_kv_cache::rkv_win_off(const ggml_tensor * t, uint32_t strm, uint32_t cell) const {
    // elastic: the stream's window in the pool (the rows of all slabs); static: the stream's own slab
    const size_t row0 = rkv_elastic ? rkv_pool.base[strm] : (size_t) strm*t->ne[1];
    return (row0 + cell)*t->nb[1];
}

size_t llama_kv_cache::rkv_tail_off(const ggml_tensor * t, uint32_t strm, uint32_t cell) const {
    GGML_ASSERT(cell >= rkv_tail_first);
    return strm*t->nb[2] + (size_t) (cell - rkv_tail_first)*t->nb[1];
}

void llama_kv_cache::rkv_record_plan(llama_rkv_state & st) const {
    if (!st.layers.empty()) {
        return; // recorded by another cache of the context
    }

    size_t dev_total = 0;
    size_t host_total = 0;

    for (const auto & layer : layers) {
        llama_rkv_layer_plan lp;
        lp.il           = (int32_t) layer.il;
        lp.n_head_kv    = hparams.n_head_kv(layer.il);
        lp.device_heads = rkv_head ? rkv_dev_heads[layer.il] : lp.n_head_kv;
        lp.split        = rkv_wc > 0 || layer.k_tail != nullptr;
        lp.window_cells = rkv_wc ? rkv_wc : get_size();
        lp.tail_cells   = rkv_wc ? get_size() - rkv_wc : layer.k_tail ? get_size() : 0;
        lp.device_bytes = ggml_nbytes(layer.k) + (layer.v ? ggml_nbytes(layer.v) : 0);
        lp.host_bytes   = (layer.k_tail ? ggml_nbytes(layer.k_tail) : 0) + (layer.v_tail ? ggml_nbytes(layer.v_tail) : 0);

        dev_total  += lp.device_bytes;
        host_total += lp.host_bytes;

        st.layers.push_back(lp);
    }

    if (rkv_wc) {
        LLAMA_LOG_INFO("%s: rolling KV: window %.2f MiB (layer buffers), tail %.2f MiB (host)\n", __func__,
                dev_total/1024.0/1024.0, host_total/1024.0/1024.0);
    } else if (rkv_head) {
        LLAMA_LOG_INFO("%s: rolling KV: device heads %.2f MiB (layer buffers), host heads %.2f MiB (host)\n", __func__,
                dev_total/1024.0/1024.0, host_total/1024.0/1024.0);
    }
}

//
// graph
//

ggml_tensor * llama_kv_cache::rkv_get_window(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo, bool is_v) const {
    const int32_t ikv = map_layer_ids.at(il);

    ggml_tensor * t = is_v ? layers[ikv].v : layers[ikv].k;

    const int64_t  n_embd_head = is_v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il);
    const uint32_t ns          = sinfo.s1 - sinfo.s0 + 1;

    if (rkv_elastic) {
        // every stream within its window: upstream's attention over their window rows (several streams: at the static
        // layout's stride); otherwise the whole pool, from which the per-stream attention takes each stream's window
        // (rkv_attn_layout)
        if (rkv_elastic_whole(n_kv, sinfo)) {
            const size_t stride = (size_t) rkv_pool.share*t->nb[1];
            return ggml_view_4d(ctx, t,
                    n_embd_head, t->ne[0]/n_embd_head, n_kv, ns,
                    ggml_row_size(t->type, n_embd_head), t->nb[1], stride, rkv_win_off(t, sinfo.s0, 0));
        }
        return ggml_view_4d(ctx, t,
                n_embd_head, t->ne[0]/n_embd_head, rkv_pool.capacity, 1,
                ggml_row_size(t->type, n_embd_head), t->nb[1], (size_t) rkv_pool.capacity*t->nb[1], 0);
    }

    // window: the window's cells of every head; head: every cell of the device's heads
    return ggml_view_4d(ctx, t,
            n_embd_head, t->ne[0]/n_embd_head, rkv_head ? n_kv : std::min(n_kv, rkv_wc), ns,
            ggml_row_size(t->type, n_embd_head), t->nb[1], t->nb[2], t->nb[2]*sinfo.s0);
}

static ggml_tensor * llama_rkv_tail_view(ggml_context * ctx, ggml_tensor * t, int64_t n_embd_head,
        uint32_t n_tail, const llama_kv_cache::slot_info & sinfo) {
    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;

    return ggml_view_4d(ctx, t,
            n_embd_head, t->ne[0]/n_embd_head, n_tail, ns,
            ggml_row_size(t->type, n_embd_head), t->nb[1], t->nb[2], t->nb[2]*sinfo.s0);
}

ggml_tensor * llama_kv_cache::rkv_get_k_tail(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const {
    const int32_t ikv = map_layer_ids.at(il);
    if (rkv_head) {
        // every cell of the host heads (none: the layer is whole on the device)
        return layers[ikv].k_tail ? llama_rkv_tail_view(ctx, layers[ikv].k_tail, hparams.n_embd_head_k(il), n_kv, sinfo) : nullptr;
    }
    if (rkv_elastic) {
        // every row of the ubatch's streams (the per-stream attention takes each one's tail cells); none when every
        // stream is within its window
        if (rkv_elastic_whole(n_kv, sinfo)) {
            return nullptr;
        }
        return llama_rkv_tail_view(ctx, layers[ikv].k_tail, hparams.n_embd_head_k(il), get_size(), sinfo);
    }
    if (!rkv_wc || n_kv <= rkv_wc) {
        return nullptr;
    }
    return llama_rkv_tail_view(ctx, layers[ikv].k_tail, hparams.n_embd_head_k(il), n_kv - rkv_wc, sinfo);
}

ggml_tensor * llama_kv_cache::rkv_get_v_tail(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const {
    const int32_t ikv = map_layer_ids.at(il);
    if (rkv_head) {
        return layers[ikv].v_tail ? llama_rkv_tail_view(ctx, layers[ikv].v_tail, hparams.n_embd_head_v(il), n_kv, sinfo) : nullptr;
    }
    if (rkv_elastic) {
        // every row of the ubatch's streams (the per-stream attention takes each one's tail cells); none when every
        // stream is within its window
        if (rkv_elastic_whole(n_kv, sinfo)) {
            return nullptr;
        }
        return llama_rkv_tail_view(ctx, layers[ikv].v_tail, hparams.n_embd_head_v(il), get_size(), sinfo);
    }
    if (!rkv_wc || n_kv <= rkv_wc) {
        return nullptr;
    }
    return llama_rkv_tail_view(ctx, layers[ikv].v_tail, hparams.n_embd_head_v(il), n_kv - rkv_wc, sinfo);
}

uint32_t llama_kv_cache::rkv_stream_n_kv(uint32_t strm) const {
    // as get_n_kv for one stream
    const uint32_t n_pad_cur = std::max(n_pad, 256u);
    const auto & cells = v_cells[strm];
    return std::min(cells.size(), std::max(n_pad_cur, GGML_PAD(cells.used_max_p1(), n_pad_cur)));
}

llama_rkv_attn_layout llama_kv_cache::rkv_attn_layout(uint32_t n_kv, const slot_info & sinfo, bool full) const {
    llama_rkv_attn_layout lay;
    lay.n_win         = rkv_head ? 0 : rkv_wc;
    lay.tail_cpu_frac = rkv_tail_cpu_frac(n_kv);

    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;
    if (rkv_elastic) {
        // one op per stream, one stream included: each over its own cells, its window where the pool keeps it
        lay.pool = true;
        for (uint32_t s = 0; s < ns; ++s) {
            const uint32_t strm = sinfo.s0 + s;
            const uint32_t n_s  = full ? n_kv : std::min(n_kv, rkv_stream_n_kv(strm));
            const uint32_t w    = rkv_pool.cells[strm];
            lay.n_kv.push_back(n_s);
            lay.win_cells.push_back(w);
            lay.win_row0.push_back(rkv_pool.base[strm]);
            lay.tail_row0.push_back(w - rkv_tail_first);
            lay.cpu_frac.push_back(rkv_tail_cpu_frac_cells(n_s > w ? n_s - w : 0));
        }
        return lay;
    }
    if (!rkv_split() || ns < 2 || llama_rkv_one_op_streams()) {
        return lay;
    }
    // one op per stream, each over its own cells: a stream's cells past its own n_kv are all masked for its tokens,
    // so leaving them out changes nothing but the bytes read (the worst-case graph: every stream at n_kv)
    for (uint32_t s = 0; s < ns; ++s) {
        const uint32_t n_s = full ? n_kv : std::min(n_kv, rkv_stream_n_kv(sinfo.s0 + s));
        lay.n_kv.push_back(n_s);
        lay.cpu_frac.push_back(rkv_tail_cpu_frac(n_s));
    }
    return lay;
}

llama_rkv_graph_note & llama_kv_cache::rkv_graph_note(const ggml_tensor * k_idxs) const {
    for (auto & e : rkv_graph_cells) {
        if (e.k_idxs == k_idxs) {
            return e;
        }
    }
    // llama_context keeps two graphs for reuse (each with a k and a v index input); a few more entries cover graphs whose
    // inputs were freed
    if (rkv_graph_cells.size() >= 16) {
        rkv_graph_cells.erase(rkv_graph_cells.begin());
    }
    rkv_graph_cells.push_back({ k_idxs, {}, rkv_pool.epoch, false });
    return rkv_graph_cells.back();
}

void llama_kv_cache::rkv_note_graph(const ggml_tensor * k_idxs, const llama_rkv_attn_layout & layout) const {
    llama_rkv_graph_note & e = rkv_graph_note(k_idxs);
    e.n_kv       = layout.n_kv;
    e.epoch      = rkv_pool.epoch;
    e.per_stream = true;
}

bool llama_kv_cache::rkv_can_reuse(const ggml_tensor * k_idxs, uint32_t n_kv, const slot_info & sinfo, bool full) const {
    if (!rkv_split()) {
        return true;
    }
    const llama_rkv_attn_layout lay = rkv_attn_layout(n_kv, sinfo, full);
    for (const auto & e : rkv_graph_cells) {
        if (e.k_idxs != k_idxs) {
            continue;
        }
        // elastic windows: a graph's views hold the windows as they were when it was built
        if (rkv_elastic && e.epoch != rkv_pool.epoch) {
            return false;
        }
        if (e.per_stream) {
            return e.n_kv == lay.n_kv;
        }
        break;
    }
    // not built through the split's attention (no layer attended a tail): upstream's attention over the window
    if (rkv_elastic) {
        return rkv_elastic_whole(n_kv, sinfo);
    }
    return lay.n_kv.empty() || n_kv <= lay.n_win;
}

void llama_kv_cache::rkv_note_step(const slot_info & sinfo) const {
    if (!rkv_live) {
        return;
    }
    uint64_t cell_bytes = 0; // one tail cell of every split layer
    bool     streamed   = false;
    for (const auto & layer : layers) {
        for (const ggml_tensor * t : { layer.k_tail, layer.v_tail }) {
            if (t) {
                cell_bytes += t->nb[1];
                streamed   |= ggml_is_streamed(t);
            }
        }
    }

    uint32_t n_kv = 0;
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        n_kv = std::max(n_kv, rkv_stream_n_kv(sinfo.strm[s]));
    }
    const llama_rkv_attn_layout lay = rkv_attn_layout(n_kv, sinfo, false);

    uint64_t tail = 0, stream = 0, occupied = 0;
    std::vector<std::pair<uint32_t, std::pair<uint32_t, uint32_t>>> cells_of; // (stream, (device, tail) cells in use)
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        const auto & cells = v_cells[strm];
        const uint32_t wc = rkv_head ? 0 : rkv_win_cells(strm);
        uint32_t dev = 0, host = 0;
        for (uint32_t i = 0, n = cells.used_max_p1(); i < n; ++i) {
            if (!cells.is_empty(i)) {
                (i < wc ? dev : host) += 1;
            }
        }
        if (rkv_head) {
            dev = host; // every cell's device heads and host heads
        }
        cells_of.push_back({ strm, { dev, host } });

        const uint32_t n_s    = lay.n_kv.empty() ? n_kv : lay.n_kv[s];
        GGML_ASSERT(lay.n_kv.empty() || (uint32_t) sinfo.strm[s] == sinfo.s0 + s);
        const uint32_t n_tail = n_s > wc ? n_s - wc : 0;
        const float    frac   = lay.n_kv.empty() ? lay.tail_cpu_frac : lay.cpu_frac[s];
        tail     += n_tail;
        stream   += streamed ? n_tail - ggml_rkv_tail_cpu_cells(n_tail, frac) : 0;
        occupied += host;
    }

    std::lock_guard<std::mutex> lock(rkv_live->mtx);
    llama_rkv_live & lv = *rkv_live;
    lv.block_bytes = 256*cell_bytes;
    if (lv.device_cells.size() < n_stream) {
        lv.device_cells.resize(n_stream, 0);
        lv.tail_cells.resize(n_stream, 0);
    }
    for (const auto & c : cells_of) {
        lv.device_cells[c.first] = c.second.first;
        lv.tail_cells[c.first]   = c.second.second;
    }
    lv.window_cells.resize(n_stream, 0);
    for (uint32_t s = 0; s < n_stream && !rkv_head; ++s) {
        lv.window_cells[s] = rkv_win_cells(s);
    }
    if (tail == 0) {
        return;
    }
    lv.steps += 1;
    lv.last_streams        = sinfo.n_stream();
    lv.last_per_stream_ops = lay.n_kv.empty() ? 0 : (uint32_t) lay.n_kv.size();
    lv.last_tail_bytes     = tail*cell_bytes;
    lv.last_streamed_bytes = stream*cell_bytes;
    lv.last_occupied_bytes = occupied*cell_bytes;
    lv.tail_bytes     += lv.last_tail_bytes;
    lv.streamed_bytes += lv.last_streamed_bytes;
    lv.occupied_bytes += lv.last_occupied_bytes;
}

ggml_tensor * llama_kv_cache::rkv_cpy(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_v, bool tail) const {
    const int32_t ikv = map_layer_ids.at(il);
    const auto & layer = layers[ikv];

    ggml_tensor * t = tail ? (is_v ? layer.v_tail : layer.k_tail) : (is_v ? layer.v : layer.k);
    if (!t) {
        return nullptr; // a head split's layer whose heads are all on the device has no tail
    }

    const int64_t n_embd_head = cur->ne[0];
    const int64_t n_head      = cur->ne[1];
    const int64_t n_tokens    = cur->ne[2];

    // we can merge dims 0 and 1
    GGML_ASSERT(ggml_row_size(cur->type, n_embd_head) == cur->nb[1]);

    // all streams in one 2D tensor: the indices are global (strm*rows_per_stream + row)
    ggml_tensor * dst = ggml_reshape_2d(ctx, t, t->ne[0], t->ne[1]*t->ne[2]);

    if (rkv_head) {
        // this part's heads of every token (the device's first, the host's after them) at upstream's index input: both
        // tensors have kv_size rows per stream
        const ggml_tensor * t_dev  = is_v ? layer.v      : layer.k;
        const ggml_tensor * t_host = is_v ? layer.v_tail : layer.k_tail;
        const int64_t n_dev = t_dev->ne[0];
        GGML_ASSERT(n_embd_head*n_head == n_dev + (t_host ? t_host->ne[0] : 0));
        GGML_ASSERT(idxs->ne[0] == n_tokens && ggml_nrows(idxs) == 1);
        cur = ggml_view_2d(ctx, cur, t->ne[0], n_tokens, cur->nb[2], tail ? ggml_row_size(cur->type, n_dev) : 0);
        return ggml_set_rows(ctx, dst, cur, idxs);
    }

    GGML_ASSERT(n_embd_head*n_head == t->ne[0]);
    GGML_ASSERT(idxs->ne[0] == n_tokens && idxs->ne[1] == 2);

    cur = ggml_view_2d(ctx, cur, n_embd_head*n_head, n_tokens, cur->nb[2], 0);

    // row 0 of idxs routes to the window, row 1 to the tail: through the views made with the input (shared by all
    // layers), else a view of its own
    const auto it = rkv_idx_views.find(idxs);
    ggml_tensor * ix = it != rkv_idx_views.end() ? (tail ? it->second.second : it->second.first)
                                                 : ggml_view_1d(ctx, idxs, n_tokens, tail ? idxs->nb[1] : 0);

    return ggml_set_rows(ctx, dst, cur, ix);
}

ggml_tensor * llama_kv_cache::rkv_cpy_k_tail(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_idxs, int32_t il) const {
    return rkv_split() ? rkv_cpy(ctx, k_cur, k_idxs, il, false, true) : nullptr;
}

ggml_tensor * llama_kv_cache::rkv_cpy_v_tail(ggml_context * ctx, ggml_tensor * v_cur, ggml_tensor * v_idxs, int32_t il) const {
    return rkv_split() ? rkv_cpy(ctx, v_cur, v_idxs, il, true, true) : nullptr;
}

ggml_tensor * llama_kv_cache::rkv_build_input_idxs(ggml_context * ctx, const llama_ubatch & ubatch, const char * name) const {
    // [n_tokens, 2]: row 0 window indices, row 1 tail indices (ne[0] stays n_tokens for the graph reuse checks)
    ggml_tensor * idxs = ggml_new_tensor_2d(ctx, GGML_TYPE_I64, ubatch.n_tokens, 2);

    ggml_set_input(idxs);
    ggml_set_name(idxs, name);

    // One window-row and one tail-row view for every layer: the scheduler copies each distinct view of a CPU input to
    // the GPU on its own, with a synchronization (a view per layer cost ~1 ms of host time per decode token on the
    // H200, docs/perf). They are kept per input tensor for the graph being built, which is the graph of the ggml
    // context the input is made in: the views of a graph built in another context are dropped. (The graph contexts
    // of consecutive builds differ: a graph result allocates its new context before it frees the old one.) Every
    // index input a cpy receives was made here for the graph being built, since the inputs precede the layers.
    if (ctx != rkv_idx_ctx) {
        rkv_idx_views.clear();
        rkv_idx_ctx = ctx;
    }
    ggml_tensor * win  = ggml_view_1d(ctx, idxs, ubatch.n_tokens, 0);
    ggml_tensor * tail = ggml_view_1d(ctx, idxs, ubatch.n_tokens, idxs->nb[1]);
    ggml_format_name(win,  "%s (window)", name);
    ggml_format_name(tail, "%s (tail)",   name);
    rkv_idx_views[idxs] = { win, tail };

    // a graph built now holds the windows of now (elastic windows: rkv_can_reuse compares them)
    rkv_graph_note(idxs) = { idxs, {}, rkv_pool.epoch, false };

    return idxs;
}

void llama_kv_cache::rkv_set_input_idxs(ggml_tensor * dst, const llama_ubatch * ubatch, const slot_info & sinfo) const {
    const uint32_t n_tokens = ubatch->n_tokens;
    GGML_ASSERT(n_tokens == (int64_t) sinfo.size()*sinfo.n_stream());
    GGML_ASSERT(dst->ne[0] == n_tokens && dst->ne[1] == 2);

    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int64_t * data = (int64_t *) dst->data;

    const int64_t rows_w  = rkv_wc + 1;                                // window rows per slab (last: trash)
    const int64_t rows_t  = (int64_t) get_size() - rkv_tail_first + 1; // tail rows per stream (last: trash)
    // elastic windows: the pool's trash row is the last row of all slabs
    const int64_t trash_pool = (int64_t) n_stream*rows_w - 1;

    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const int64_t strm = sinfo.strm[s];
        const int64_t wc   = rkv_win_cells(strm);
        const int64_t row0 = rkv_elastic ? (int64_t) rkv_pool.base[strm] : strm*rows_w; // the window's first row

        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            const int64_t cell = sinfo.idxs[s][i];
            const int64_t j    = s*sinfo.size() + i;

            data[j]            = cell < wc ? row0 + cell : rkv_elastic ? trash_pool : strm*rows_w + rkv_wc;
            data[n_tokens + j] = strm*rows_t + (cell >= wc ? cell - rkv_tail_first : rows_t - 1);
        }
    }
}

void llama_kv_cache::rkv_copy_stream(const kv_layer & layer, uint32_t ssrc, uint32_t sdst) const {
    if (rkv_head) {
        // the host heads' slab (upstream copied the device heads')
        for (ggml_tensor * t : { layer.k_tail, layer.v_tail }) {
            if (!t) {
                continue;
            }
            std::vector<uint8_t> tmp(t->nb[2]);
            ggml_backend_tensor_get(t, tmp.data(), ssrc*t->nb[2], t->nb[2]);
            ggml_backend_tensor_set(t, tmp.data(), sdst*t->nb[2], t->nb[2]);
        }
        return;
    }
    // a window split: every cell, from where the source stream keeps it to where the destination keeps it (the windows of
    // the two streams may differ, and with elastic windows they are not slabs)
    const uint32_t w_src = rkv_win_cells(ssrc);
    const uint32_t w_dst = rkv_win_cells(sdst);
    const uint32_t cuts[] = { 0, std::min(w_src, w_dst), std::max(w_src, w_dst), get_size() };
    for (int kv = 0; kv < 2; ++kv) {
        ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
        ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
        if (!win) {
            continue;
        }
        std::vector<uint8_t> tmp;
        for (int r = 0; r < 3; ++r) {
            const uint32_t c0 = cuts[r];
            const uint32_t n  = cuts[r + 1] - c0;
            if (n == 0) {
                continue;
            }
            const bool src_win = c0 < w_src;
            const bool dst_win = c0 < w_dst;
            ggml_tensor * ts = src_win ? win : tail;
            ggml_tensor * td = dst_win ? win : tail;
            GGML_ASSERT(ts->type == td->type || (src_win == dst_win));
            tmp.resize((size_t) n*ts->nb[1]);
            ggml_backend_tensor_get(ts, tmp.data(), src_win ? rkv_win_off(ts, ssrc, c0) : rkv_tail_off(ts, ssrc, c0), tmp.size());
            ggml_backend_tensor_set(td, tmp.data(), dst_win ? rkv_win_off(td, sdst, c0) : rkv_tail_off(td, sdst, c0), tmp.size());
        }
    }
}

void llama_kv_cache::rkv_build_shift_layer(const llama_cparams & cparams, ggml_context * ctx, ggml_cgraph * gf,
        const kv_layer & layer, ggml_tensor * k_shift, ggml_tensor * k_rot) const {
    const uint32_t il = layer.il;

    const auto    n_rot         = hparams.n_rot(il);
    const auto    n_embd_head_k = hparams.n_embd_head_k(il);
    const auto    n_embd_nope   = hparams.n_lora_kv > 0 ? n_embd_head_k - n_rot : 0;

    const float freq_base_l  = model.get_rope_freq_base (cparams, il);
    const float freq_scale_l = model.get_rope_freq_scale(cparams, il);

    ggml_tensor * rope_factors = model.get_rope_factors(cparams, il);

    // same as build_rope_shift
    const auto rope_type = hparams.rope_type == LLAMA_ROPE_TYPE_MROPE || hparams.rope_type == LLAMA_ROPE_TYPE_IMROPE
        ? LLAMA_ROPE_TYPE_NEOX : hparams.rope_type;

    const uint32_t kv_size = get_size();

    for (uint32_t s = 0; s < n_stream; ++s) {
        const uint32_t wc = rkv_head ? 0 : rkv_win_cells(s);
        for (int part = 0; part < 2; ++part) {
            // window: cells [0, wc) and [wc, kv_size) of every head; head: every cell of the device's and the host's heads
            ggml_tensor * t       = part == 0 ? layer.k : layer.k_tail;
            const uint32_t first  = part == 0 || rkv_head ? 0 : wc;
            const uint32_t n_cell = rkv_head ? kv_size : part == 0 ? wc : kv_size - wc;
            if (!t || n_cell == 0) {
                continue;
            }
            const size_t row0 = rkv_head ? s*t->nb[2] : part == 0 ? rkv_win_off(t, s, 0) : rkv_tail_off(t, s, first);

            ggml_tensor * k = ggml_view_3d(ctx, t,
                    n_rot, t->ne[0]/n_embd_head_k, n_cell,
                    ggml_row_size(t->type, n_embd_head_k),
                    t->nb[1],
                    row0 + ggml_row_size(t->type, n_embd_nope));

            // the shift input is [kv_size*n_stream], cells in order per stream
            ggml_tensor * shift = ggml_view_1d(ctx, k_shift, n_cell, ((size_t) s*kv_size + first)*ggml_element_size(k_shift));

            ggml_tensor * cur;

            // the K-rotation is keyed on the window type: a region of another type may hold rotated data
            // (rotate back before RoPE) or be quantized without rotation (no Hadamard)
            if (ggml_is_quantized(t->type) || k_rot) {
                cur = ggml_cast(ctx, k, GGML_TYPE_F32);
                if (k_rot) {
                    cur = llama_mul_mat_hadamard(ctx, cur, k_rot);
                }
                cur = ggml_rope_ext(ctx, cur, shift, rope_factors, n_rot, rope_type, cparams.n_ctx_orig_yarn,
                        freq_base_l, freq_scale_l, cparams.yarn_ext_factor, cparams.yarn_attn_factor,
                        cparams.yarn_beta_fast, cparams.yarn_beta_slow);
                if (k_rot) {
                    cur = llama_mul_mat_hadamard(ctx, cur, k_rot);
                }
                cur = ggml_cpy(ctx, cur, k);
            } else {
                cur = ggml_rope_ext_inplace(ctx, k, shift, rope_factors, n_rot, rope_type, cparams.n_ctx_orig_yarn,
                        freq_base_l, freq_scale_l, cparams.yarn_ext_factor, cparams.yarn_attn_factor,
                        cparams.yarn_beta_fast, cparams.yarn_beta_slow);
            }

            ggml_build_forward_expand(gf, cur);
        }
    }
}

//
// elastic windows (llama-kv-window-pool.h)
//

// n bytes of t from byte offset src to dst, where the two ranges do not overlap (llama_rkv_pool_rebalance cuts a move into
// such pieces)
static void llama_rkv_copy_within(ggml_tensor * t, size_t src, size_t dst, size_t n) {
    if (ggml_backend_buffer_is_host(t->buffer)) {
        memcpy((char *) t->data + dst, (const char *) t->data + src, n);
        return;
    }
    // a device buffer: a copy between two views of it (the backend's own device-to-device copy)
    ggml_init_params params = { 2*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    const int64_t n_el = (int64_t) (n/ggml_type_size(t->type))*ggml_blck_size(t->type);
    ggml_tensor * a = ggml_view_1d(ctx, t, n_el, src);
    ggml_tensor * b = ggml_view_1d(ctx, t, n_el, dst);
    GGML_ASSERT(ggml_backend_view_init(a) == GGML_STATUS_SUCCESS && ggml_backend_view_init(b) == GGML_STATUS_SUCCESS);
    ggml_backend_tensor_copy(a, b);
    ggml_free(ctx);
}

void llama_kv_cache::rkv_pool_copy(const llama_rkv_pool_copy & c) const {
    for (const auto & layer : layers) {
        for (int kv = 0; kv < 2; ++kv) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }
            const size_t row = win->nb[1];
            GGML_ASSERT(tail && tail->type == win->type && tail->nb[1] == row && ggml_backend_buffer_is_host(tail->buffer));
            char * host = (char *) tail->data + rkv_tail_off(tail, c.strm, c.cell0);
            switch (c.kind) {
                case llama_rkv_pool_copy::DEMOTE:
                    ggml_backend_tensor_get(win, host, (size_t) c.row_src*row, (size_t) c.n*row);
                    break;
                case llama_rkv_pool_copy::PROMOTE:
                    ggml_backend_tensor_set(win, host, (size_t) c.row_dst*row, (size_t) c.n*row);
                    break;
                case llama_rkv_pool_copy::RELOCATE:
                    llama_rkv_copy_within(win, (size_t) c.row_src*row, (size_t) c.row_dst*row, (size_t) c.n*row);
                    break;
            }
        }
    }
}

void llama_kv_cache::rkv_begin_batch(const slot_info_vec_t & sinfos) {
    if (!rkv_elastic) {
        return;
    }
    std::vector<uint8_t> in_batch(n_stream, 0);
    for (const auto & sinfo : sinfos) {
        for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
            in_batch[sinfo.strm[s]] = 1;
        }
    }
    llama_rkv_pool_begin_batch(rkv_pool, in_batch);
}

void llama_kv_cache::rkv_rebalance(const slot_info & sinfo) {
    if (!rkv_elastic) {
        return;
    }
    std::vector<uint32_t> ext_old(n_stream), ext_new(n_stream);
    std::vector<uint8_t>  in_ubatch(n_stream, 0);
    for (uint32_t s = 0; s < n_stream; ++s) {
        ext_old[s] = ext_new[s] = v_cells[s].used_max_p1();
    }
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        in_ubatch[strm] = 1;
        for (const uint32_t idx : sinfo.idxs[s]) {
            ext_new[strm] = std::max(ext_new[strm], idx + 1);
        }
    }

    const uint64_t promoted = rkv_pool.promoted, demoted = rkv_pool.demoted, relocated = rkv_pool.relocated;
    const std::vector<llama_rkv_pool_copy> copies = llama_rkv_pool_rebalance(rkv_pool, ext_old, ext_new, in_ubatch);

    int64_t t0 = 0;
    if (!copies.empty()) {
        // the graph before this ubatch may still read and write these rows (an asynchronous backend)
        if (rkv_st && rkv_st->synchronize) {
            rkv_st->synchronize();
        }
        t0 = ggml_time_us();
        for (const auto & c : copies) {
            rkv_pool_copy(c);
        }
    }
    if (!rkv_live) {
        return;
    }
    uint64_t cell_bytes = 0; // one row of every split layer's K and V
    for (const auto & layer : layers) {
        cell_bytes += layer.k->nb[1] + (layer.v ? layer.v->nb[1] : 0);
    }
    std::lock_guard<std::mutex> lock(rkv_live->mtx);
    llama_rkv_live & lv = *rkv_live;
    const uint64_t moved = (rkv_pool.promoted - promoted) + (rkv_pool.demoted - demoted) + (rkv_pool.relocated - relocated);
    lv.promoted_cells  = rkv_pool.promoted;
    lv.demoted_cells   = rkv_pool.demoted;
    lv.relocated_cells = rkv_pool.relocated;
    lv.rebalances      = rkv_pool.n_rebalance;
    lv.moved_bytes    += moved*cell_bytes;
    lv.move_ms        += copies.empty() ? 0.0 : (ggml_time_us() - t0)/1000.0;
    lv.window_cells    = rkv_pool.cells;
}

//
// state
//
// With the same type in window and tail, a split layer writes exactly the bytes of an unsplit cache (state
// files move between splits and unsplit caches). With different types it writes a marker instead of the type
// (an unsplit reader refuses it as a type mismatch), both types, and per cell range the number of window and
// tail rows, each row in its region's type. The reader converts rows whose type differs from the region
// they land in (through f32), and refuses what it cannot convert.
//

static const int32_t LLAMA_RKV_STATE_MIXED = -0x524B56; // "RKV"

// A head split writes, per layer and K/V, the bytes of an unsplit cache when its two parts have one type (each row
// gathered from the device's heads and the host's). With two types: LLAMA_RKV_STATE_HEADS instead of the type, the
// device part's and the host part's types, widths (elements) and row sizes, then per chunk of at most
// LLAMA_RKV_STATE_CHUNK cells of a range their count, the device rows and the host rows. A head split reads those,
// unsplit states and a window split's mixed states (converting through f32 what differs); a window split refuses a
// head state with two types.
static const int32_t  LLAMA_RKV_STATE_HEADS = -0x524B57;
static const uint32_t LLAMA_RKV_STATE_CHUNK = 4096;

// cells [from, to) of a stream whose cells [0, wc) are in the window, at win_off(c) and tail_off(c)
template <typename F, typename G>
static void llama_rkv_write_rows(llama_io_write_i & io, ggml_tensor * win, ggml_tensor * tail, uint32_t wc,
        uint32_t from, uint32_t to, bool mixed, F win_off, G tail_off) {
    const size_t row_w = win->nb[1];
    const size_t row_t = tail->nb[1];

    const uint32_t w1 = std::min(to, wc);              // window cells [from, w1)
    const uint32_t t0 = std::max(from, wc);            // tail cells   [t0, to)

    if (mixed) {
        const uint32_t n_w = w1 > from ? w1 - from : 0;
        const uint32_t n_t = to > t0 ? to - t0 : 0;
        io.write(&n_w, sizeof(n_w));
        io.write(&n_t, sizeof(n_t));
    }
    if (w1 > from) {
        io.write_tensor(win, win_off(from), (w1 - from)*row_w);
    }
    if (to > t0) {
        io.write_tensor(tail, tail_off(t0), (to - t0)*row_t);
    }
}

// a head split's rows [from, to) of stream strm: the device part's and the host part's (tail may be null: a layer whole
// on the device), as whole rows (same type: the bytes of an unsplit cache) or part after part (two types)
static void llama_rkv_write_heads(llama_io_write_i & io, ggml_tensor * dev, ggml_tensor * host, uint32_t strm,
        const std::vector<std::pair<uint32_t, uint32_t>> & ranges) {
    const bool   mixed = host && host->type != dev->type;
    const size_t row_d = dev->nb[1];
    const size_t row_h = host ? host->nb[1] : 0;

    if (!mixed) {
        const int32_t  type_i   = (int32_t) dev->type;
        const uint64_t size_row = row_d + row_h;
        io.write(&type_i, sizeof(type_i));
        io.write(&size_row, sizeof(size_row));
    } else {
        const int32_t  marker = LLAMA_RKV_STATE_HEADS;
        const int32_t  type_d = (int32_t) dev->type;
        const int32_t  type_h = (int32_t) host->type;
        const uint64_t n_d    = dev->ne[0];
        const uint64_t n_h    = host->ne[0];
        const uint64_t rd     = row_d;
        const uint64_t rh     = row_h;
        io.write(&marker, sizeof(marker));
        io.write(&type_d, sizeof(type_d));
        io.write(&type_h, sizeof(type_h));
        io.write(&n_d, sizeof(n_d));
        io.write(&n_h, sizeof(n_h));
        io.write(&rd, sizeof(rd));
        io.write(&rh, sizeof(rh));
    }

    std::vector<uint8_t> buf_d, buf_h, rows;
    for (const auto & range : ranges) {
        for (uint32_t c0 = range.first; c0 < range.second; c0 += LLAMA_RKV_STATE_CHUNK) {
            const uint32_t n = std::min(range.second - c0, LLAMA_RKV_STATE_CHUNK);
            if (mixed) {
                io.write(&n, sizeof(n));
                io.write_tensor(dev,  strm*dev->nb[2]  + c0*row_d, n*row_d);
                io.write_tensor(host, strm*host->nb[2] + c0*row_h, n*row_h);
                continue;
            }
            if (!host) {
                io.write_tensor(dev, strm*dev->nb[2] + c0*row_d, n*row_d);
                continue;
            }
            buf_d.resize(n*row_d);
            buf_h.resize(n*row_h);
            rows.resize(n*(row_d + row_h));
            ggml_backend_tensor_get(dev,  buf_d.data(), strm*dev->nb[2]  + c0*row_d, buf_d.size());
            ggml_backend_tensor_get(host, buf_h.data(), strm*host->nb[2] + c0*row_h, buf_h.size());
            for (uint32_t i = 0; i < n; ++i) {
                memcpy(rows.data() + i*(row_d + row_h),         buf_d.data() + i*row_d, row_d);
                memcpy(rows.data() + i*(row_d + row_h) + row_d, buf_h.data() + i*row_h, row_h);
            }
            io.write(rows.data(), rows.size());
        }
    }
}

void llama_kv_cache::rkv_state_write_data(llama_io_write_i & io, const cell_ranges_t & cr) const {
    const uint32_t v_trans = this->v_trans ? 1 : 0;
    const uint32_t n_layer = layers.size();

    io.write(&v_trans, sizeof(v_trans));
    io.write(&n_layer, sizeof(n_layer));

    for (int kv = 0; kv < 2; ++kv) {
        for (const auto & layer : layers) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }

            if (rkv_head) {
                llama_rkv_write_heads(io, win, tail, cr.strm, cr.data);
                continue;
            }

            const bool mixed = win->type != tail->type;

            if (!mixed) {
                const int32_t  type_i   = (int32_t) win->type;
                const uint64_t size_row = win->nb[1];
                io.write(&type_i, sizeof(type_i));
                io.write(&size_row, sizeof(size_row));
            } else {
                const int32_t  marker = LLAMA_RKV_STATE_MIXED;
                const int32_t  type_w = (int32_t) win->type;
                const int32_t  type_t = (int32_t) tail->type;
                const uint64_t row_w  = win->nb[1];
                const uint64_t row_t  = tail->nb[1];
                io.write(&marker, sizeof(marker));
                io.write(&type_w, sizeof(type_w));
                io.write(&type_t, sizeof(type_t));
                io.write(&row_w,  sizeof(row_w));
                io.write(&row_t,  sizeof(row_t));
            }

            const uint32_t strm = cr.strm;
            for (const auto & range : cr.data) {
                llama_rkv_write_rows(io, win, tail, rkv_win_cells(strm), range.first, range.second, mixed,
                        [&](uint32_t c) { return rkv_win_off(win, strm, c); }, [&](uint32_t c) { return rkv_tail_off(tail, strm, c); });
            }
        }
    }
}

// convert n rows of type src_type (row size of n_per_row elements) into dst_type
static bool llama_rkv_convert_rows(ggml_type src_type, ggml_type dst_type, const void * src, void * dst, int64_t n_rows, int64_t n_per_row) {
    const auto * traits = ggml_get_type_traits(src_type);
    if (!traits->to_float && src_type != GGML_TYPE_F32) {
        return false;
    }
    if (ggml_quantize_requires_imatrix(dst_type)) {
        return false;
    }
    std::vector<float> tmp(n_rows*n_per_row);
    if (src_type == GGML_TYPE_F32) {
        memcpy(tmp.data(), src, tmp.size()*sizeof(float));
    } else {
        traits->to_float(src, tmp.data(), tmp.size());
    }
    if (dst_type == GGML_TYPE_F32) {
        memcpy(dst, tmp.data(), tmp.size()*sizeof(float));
        return true;
    }
    ggml_quantize_chunk(dst_type, tmp.data(), dst, 0, n_rows, n_per_row, nullptr);
    return true;
}

static bool llama_rkv_convertible(ggml_type src_type, ggml_type dst_type) {
    if (src_type == dst_type) {
        return true;
    }
    const bool src_ok = src_type == GGML_TYPE_F32 || ggml_get_type_traits(src_type)->to_float != nullptr;
    const bool dst_ok = dst_type == GGML_TYPE_F32 || dst_type == GGML_TYPE_F16 || dst_type == GGML_TYPE_BF16 ||
        (ggml_is_quantized(dst_type) && !ggml_quantize_requires_imatrix(dst_type));
    return src_ok && dst_ok;
}

// cell_count rows of one layer's K or V from the state into a head split's device part dev (its first dev->ne[0]
// elements of a row) and host part host (the rest; null: a layer whole on the device), at destination cells idxs: an
// unsplit state, a window split's mixed state or a head split's state with two types, converted through f32 where the
// types or the cut differ
static bool llama_rkv_read_heads(llama_io_read_i & io, ggml_tensor * dev, ggml_tensor * host, uint32_t strm, uint32_t cell_count,
        const std::vector<uint32_t> & idxs, int32_t il, const char * what) {
    const int64_t   n_d    = dev->ne[0];
    const int64_t   n_h    = host ? host->ne[0] : 0;
    const int64_t   n_embd = n_d + n_h;
    const ggml_type td     = dev->type;
    const ggml_type th     = host ? host->type : dev->type;
    const size_t    row_d  = dev->nb[1];
    const size_t    row_h  = host ? host->nb[1] : 0;

    int32_t type_i;
    io.read(&type_i, sizeof(type_i));

    // the source: rows of part a (type sa, na elements) followed by part b (sb, nb; 0: whole rows)
    enum { SRC_ROWS, SRC_WINDOW, SRC_HEADS } kind;
    ggml_type sa, sb;
    int64_t   na = n_embd, nb = 0;
    if (type_i >= 0 && type_i < GGML_TYPE_COUNT) {
        uint64_t size_row;
        io.read(&size_row, sizeof(size_row));
        kind = SRC_ROWS;
        sa = sb = (ggml_type) type_i;
        if (size_row != ggml_row_size(sa, n_embd)) {
            LLAMA_LOG_ERROR("%s: mismatched %s row size (%zu != %zu, layer %d)\n", __func__, what,
                    ggml_row_size(sa, n_embd), (size_t) size_row, il);
            return false;
        }
    } else if (type_i == LLAMA_RKV_STATE_MIXED) {
        int32_t tw, tt;
        uint64_t rw, rt;
        io.read(&tw, sizeof(tw));
        io.read(&tt, sizeof(tt));
        io.read(&rw, sizeof(rw));
        io.read(&rt, sizeof(rt));
        if (tw < 0 || tw >= GGML_TYPE_COUNT || tt < 0 || tt >= GGML_TYPE_COUNT ||
                rw != ggml_row_size((ggml_type) tw, n_embd) || rt != ggml_row_size((ggml_type) tt, n_embd)) {
            LLAMA_LOG_ERROR("%s: invalid rolling-KV %s layout in the state (layer %d)\n", __func__, what, il);
            return false;
        }
        kind = SRC_WINDOW;
        sa = (ggml_type) tw;
        sb = (ggml_type) tt;
    } else if (type_i == LLAMA_RKV_STATE_HEADS) {
        int32_t ta, tb;
        uint64_t ua, ub, ra, rb;
        io.read(&ta, sizeof(ta));
        io.read(&tb, sizeof(tb));
        io.read(&ua, sizeof(ua));
        io.read(&ub, sizeof(ub));
        io.read(&ra, sizeof(ra));
        io.read(&rb, sizeof(rb));
        if (ta < 0 || ta >= GGML_TYPE_COUNT || tb < 0 || tb >= GGML_TYPE_COUNT || ua + ub != (uint64_t) n_embd || ua == 0 || ub == 0 ||
                ua % ggml_blck_size((ggml_type) ta) != 0 || ub % ggml_blck_size((ggml_type) tb) != 0 ||
                ra != ggml_row_size((ggml_type) ta, ua) || rb != ggml_row_size((ggml_type) tb, ub)) {
            LLAMA_LOG_ERROR("%s: invalid rolling-KV head-split %s layout in the state (layer %d)\n", __func__, what, il);
            return false;
        }
        kind = SRC_HEADS;
        sa = (ggml_type) ta;
        sb = (ggml_type) tb;
        na = (int64_t) ua;
        nb = (int64_t) ub;
    } else {
        LLAMA_LOG_ERROR("%s: invalid %s type %d in the state (layer %d)\n", __func__, what, type_i, il);
        return false;
    }

    for (ggml_type src : { sa, sb }) {
        for (ggml_type dst : { td, th }) {
            if (!llama_rkv_convertible(src, dst)) {
                LLAMA_LOG_ERROR("%s: the state's %s type %s cannot be converted to this cache's %s (layer %d)\n",
                        __func__, what, ggml_type_name(src), ggml_type_name(dst), il);
                return false;
            }
        }
    }

    std::vector<uint8_t> pa, pb, bd, bh;
    std::vector<float>   f, tmp;

    // n source rows (part a in pa, part b in pb) into the cells idxs[i0 ...]
    auto place = [&](uint32_t i0, uint32_t n, ggml_type ta, int64_t ua, ggml_type tb, int64_t ub) -> bool {
        const size_t ra = ggml_row_size(ta, ua);
        const size_t rb = ub ? ggml_row_size(tb, ub) : 0;
        if (ta == td && ua == n_d && (ub == 0 ? n_h == 0 : (tb == th && ub == n_h))) {
            bd.assign(pa.begin(), pa.begin() + n*ra); // the same cut and types: as they are
            bh.assign(pb.begin(), pb.begin() + n*rb);
        } else if (ub == 0 && ta == td && ta == th) {
            bd.resize(n*row_d); // whole rows of the cache's one type: cut between the heads
            bh.resize(n*row_h);
            for (uint32_t i = 0; i < n; ++i) {
                memcpy(bd.data() + i*row_d, pa.data() + i*ra,         row_d);
                memcpy(bh.data() + i*row_h, pa.data() + i*ra + row_d, row_h);
            }
        } else {
            // through f32: whole rows, then each part at its type
            f.resize((size_t) n*n_embd);
            tmp.resize((size_t) n*std::max(ua, ub));
            if (!llama_rkv_convert_rows(ta, GGML_TYPE_F32, pa.data(), tmp.data(), n, ua)) {
                return false;
            }
            for (uint32_t i = 0; i < n; ++i) {
                memcpy(f.data() + (size_t) i*n_embd, tmp.data() + (size_t) i*ua, ua*sizeof(float));
            }
            if (ub) {
                if (!llama_rkv_convert_rows(tb, GGML_TYPE_F32, pb.data(), tmp.data(), n, ub)) {
                    return false;
                }
                for (uint32_t i = 0; i < n; ++i) {
                    memcpy(f.data() + (size_t) i*n_embd + ua, tmp.data() + (size_t) i*ub, ub*sizeof(float));
                }
            }
            bd.resize(n*row_d);
            bh.resize(n*row_h);
            for (int part = 0; part < (n_h ? 2 : 1); ++part) {
                const int64_t c0 = part == 0 ? 0 : n_d, w = part == 0 ? n_d : n_h;
                tmp.resize((size_t) n*w);
                for (uint32_t i = 0; i < n; ++i) {
                    memcpy(tmp.data() + (size_t) i*w, f.data() + (size_t) i*n_embd + c0, w*sizeof(float));
                }
                if (!llama_rkv_convert_rows(GGML_TYPE_F32, part == 0 ? td : th, tmp.data(), part == 0 ? bd.data() : bh.data(), n, w)) {
                    return false;
                }
            }
        }
        // each run of consecutive destination cells at once
        uint32_t i = 0;
        while (i < n) {
            uint32_t j = i + 1;
            while (j < n && idxs[i0 + j] == idxs[i0 + j - 1] + 1) {
                ++j;
            }
            const uint32_t c = idxs[i0 + i];
            ggml_backend_tensor_set(dev, bd.data() + i*row_d, strm*dev->nb[2] + c*row_d, (j - i)*row_d);
            if (host) {
                ggml_backend_tensor_set(host, bh.data() + i*row_h, strm*host->nb[2] + c*row_h, (j - i)*row_h);
            }
            i = j;
        }
        return true;
    };

    // whole rows of type t for the cells [i0, i0 + n), in chunks
    auto rows = [&](uint32_t i0, uint32_t n, ggml_type t) -> bool {
        for (uint32_t k = 0; k < n; k += LLAMA_RKV_STATE_CHUNK) {
            const uint32_t m = std::min(n - k, LLAMA_RKV_STATE_CHUNK);
            pa.resize(m*ggml_row_size(t, n_embd));
            io.read(pa.data(), pa.size());
            if (!place(i0 + k, m, t, n_embd, t, 0)) {
                return false;
            }
        }
        return true;
    };

    bool ok = true;
    if (kind == SRC_ROWS) {
        ok = rows(0, cell_count, sa);
    } else {
        uint32_t done = 0;
        while (ok && done < cell_count) {
            uint32_t n_a, n_b = 0;
            io.read(&n_a, sizeof(n_a));
            if (kind == SRC_WINDOW) {
                io.read(&n_b, sizeof(n_b));
            }
            if (n_a + n_b == 0 || done + n_a + n_b > cell_count || (kind == SRC_HEADS && n_a > LLAMA_RKV_STATE_CHUNK)) {
                LLAMA_LOG_ERROR("%s: corrupt rolling-KV %s ranges in the state (layer %d)\n", __func__, what, il);
                return false;
            }
            if (kind == SRC_WINDOW) {
                ok = rows(done, n_a, sa) && rows(done + n_a, n_b, sb);
            } else {
                pa.resize(n_a*ggml_row_size(sa, na));
                pb.resize(n_a*ggml_row_size(sb, nb));
                io.read(pa.data(), pa.size());
                io.read(pb.data(), pb.size());
                ok = place(done, n_a, sa, na, sb, nb);
            }
            done += n_a + n_b;
        }
    }
    if (!ok) {
        LLAMA_LOG_ERROR("%s: the state's %s rows could not be converted to this cache's types (layer %d)\n", __func__, what, il);
    }
    return ok;
}

bool llama_kv_cache::rkv_state_read_data(llama_io_read_i & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo) {
    uint32_t v_trans_ref;
    uint32_t n_layer;

    io.read(&v_trans_ref, sizeof(v_trans_ref));
    io.read(&n_layer, sizeof(n_layer));

    if (n_layer != layers.size()) {
        LLAMA_LOG_ERROR("%s: mismatched layer count (%u instead of %u)\n", __func__, n_layer, (uint32_t) layers.size());
        return false;
    }
    if (cell_count > get_size()) {
        LLAMA_LOG_ERROR("%s: not enough cells in kv cache to restore state (%u > %u)\n", __func__, cell_count, get_size());
        return false;
    }
    if (v_trans_ref != 0) {
        LLAMA_LOG_ERROR("%s: the state has a transposed V cache (flash attention off); this split cache needs flash attention\n", __func__);
        return false;
    }

    const auto & idxs = sinfo.idxs[0];

    std::vector<uint8_t> buf_src;
    std::vector<uint8_t> buf_dst;

    for (int kv = 0; kv < 2; ++kv) {
        for (const auto & layer : layers) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }

            const int64_t n_embd = win->ne[0];
            const char *  what   = kv == 0 ? "key" : "value";

            if (rkv_head) {
                if (!llama_rkv_read_heads(io, win, tail, strm, cell_count, idxs, layer.il, what)) {
                    return false;
                }
                continue;
            }

            int32_t type_i;
            io.read(&type_i, sizeof(type_i));

            if (type_i == LLAMA_RKV_STATE_HEADS) {
                LLAMA_LOG_ERROR("%s: the state was saved by a cache split by KV head with two %s types (device and host): a window "
                        "split cannot read it; load it into a head split, or save it with one type (-ctkt/-ctvt as -ctk/-ctv)\n",
                        __func__, what);
                return false;
            }

            const bool mixed = type_i == LLAMA_RKV_STATE_MIXED;

            ggml_type src_w;
            ggml_type src_t;
            if (!mixed) {
                if (type_i < 0 || type_i >= GGML_TYPE_COUNT) {
                    LLAMA_LOG_ERROR("%s: invalid %s type %d in the state (layer %d)\n", __func__, what, type_i, layer.il);
                    return false;
                }
                uint64_t size_row_ref;
                io.read(&size_row_ref, sizeof(size_row_ref));
                src_w = src_t = (ggml_type) type_i;
                if (size_row_ref != ggml_row_size(src_w, n_embd)) {
                    LLAMA_LOG_ERROR("%s: mismatched %s row size (%zu != %zu, layer %d)\n", __func__, what,
                            ggml_row_size(src_w, n_embd), (size_t) size_row_ref, layer.il);
                    return false;
                }
            } else {
                int32_t tw, tt;
                uint64_t rw, rt;
                io.read(&tw, sizeof(tw));
                io.read(&tt, sizeof(tt));
                io.read(&rw, sizeof(rw));
                io.read(&rt, sizeof(rt));
                if (tw < 0 || tw >= GGML_TYPE_COUNT || tt < 0 || tt >= GGML_TYPE_COUNT ||
                        rw != ggml_row_size((ggml_type) tw, n_embd) || rt != ggml_row_size((ggml_type) tt, n_embd)) {
                    LLAMA_LOG_ERROR("%s: invalid rolling-KV %s layout in the state (layer %d)\n", __func__, what, layer.il);
                    return false;
                }
                src_w = (ggml_type) tw;
                src_t = (ggml_type) tt;
            }

            for (ggml_type src : { src_w, src_t }) {
                for (ggml_type dst : { win->type, tail->type }) {
                    if (!llama_rkv_convertible(src, dst)) {
                        LLAMA_LOG_ERROR("%s: the state's %s type %s cannot be converted to this cache's %s (layer %d)\n",
                                __func__, what, ggml_type_name(src), ggml_type_name(dst), layer.il);
                        return false;
                    }
                }
            }

            // place source rows [i0, i0 + n) of type src into the destination cells idxs[i0 ...]
            auto place = [&](uint32_t i0, uint32_t n, ggml_type src) -> bool {
                const size_t row_src = ggml_row_size(src, n_embd);
                uint32_t i = i0;
                const uint32_t wc = rkv_win_cells(strm);
                while (i < i0 + n) {
                    const uint32_t c0      = idxs[i];
                    const bool     in_tail = c0 >= wc;
                    ggml_tensor *  dst_t   = in_tail ? tail : win;

                    // extend the run while the destination cells stay consecutive in the same region
                    uint32_t j = i + 1;
                    while (j < i0 + n && idxs[j] == idxs[j - 1] + 1 && (idxs[j] >= wc) == in_tail) {
                        ++j;
                    }
                    const uint32_t n_run = j - i;
                    const size_t   off   = in_tail ? rkv_tail_off(dst_t, strm, c0) : rkv_win_off(dst_t, strm, c0);

                    if (src == dst_t->type) {
                        io.read_tensor(dst_t, off, n_run*row_src);
                    } else {
                        buf_src.resize(n_run*row_src);
                        buf_dst.resize(n_run*dst_t->nb[1]);
                        io.read(buf_src.data(), buf_src.size());
                        if (!llama_rkv_convert_rows(src, dst_t->type, buf_src.data(), buf_dst.data(), n_run, n_embd)) {
                            return false;
                        }
                        ggml_backend_tensor_set(dst_t, buf_dst.data(), off, buf_dst.size());
                    }
                    i = j;
                }
                return true;
            };

            if (!mixed) {
                if (!place(0, cell_count, src_w)) {
                    return false;
                }
            } else {
                uint32_t done = 0;
                while (done < cell_count) {
                    uint32_t n_w, n_t;
                    io.read(&n_w, sizeof(n_w));
                    io.read(&n_t, sizeof(n_t));
                    if (n_w + n_t == 0 || done + n_w + n_t > cell_count) {
                        LLAMA_LOG_ERROR("%s: corrupt rolling-KV %s ranges in the state (layer %d)\n", __func__, what, layer.il);
                        return false;
                    }
                    if (!place(done, n_w, src_w) || !place(done + n_w, n_t, src_t)) {
                        return false;
                    }
                    done += n_w + n_t;
                }
            }
        }
    }

    return true;
}

void llama_kv_cache::rkv_state_clear_data(uint32_t strm, const slot_info & sinfo) {
    for (const auto & layer : layers) {
        for (ggml_tensor * win : { layer.k, layer.v }) {
            if (!win) {
                continue;
            }
            ggml_tensor * tail = win == layer.k ? layer.k_tail : layer.v_tail;
            if (rkv_head) {
                // both parts of every cell's row
                for (const uint32_t c : sinfo.idxs[0]) {
                    for (ggml_tensor * t : { win, tail }) {
                        if (t) {
                            llama_clear_tensor_data(t, strm*t->nb[2] + c*t->nb[1], t->nb[1]);
                        }
                    }
                }
                continue;
            }
            const uint32_t wc = rkv_win_cells(strm);
            for (const uint32_t c : sinfo.idxs[0]) {
                ggml_tensor * t = c < wc ? win : tail;
                llama_clear_tensor_data(t, c < wc ? rkv_win_off(t, strm, c) : rkv_tail_off(t, strm, c), t->nb[1]);
            }
        }
    }
}

//
// llama_kv_cache_context
//

ggml_tensor * llama_kv_cache_context::rkv_get_k_tail(ggml_context * ctx, int32_t il) const {
    return kv->rkv_get_k_tail(ctx, il, n_kv, sinfos[i_cur]);
}

ggml_tensor * llama_kv_cache_context::rkv_get_v_tail(ggml_context * ctx, int32_t il) const {
    return kv->rkv_get_v_tail(ctx, il, n_kv, sinfos[i_cur]);
}

llama_rkv_attn_layout llama_kv_cache_context::rkv_attn_layout(const ggml_tensor * k_idxs) const {
    llama_rkv_attn_layout lay = kv->rkv_attn_layout(n_kv, sinfos[i_cur], rkv_full);
    kv->rkv_note_graph(k_idxs, lay);
    return lay;
}

bool llama_kv_cache_context::rkv_can_reuse(const ggml_tensor * k_idxs) const {
    return kv->rkv_can_reuse(k_idxs, n_kv, sinfos[i_cur], rkv_full);
}

bool llama_kv_cache_context::rkv_is_head_split() const {
    return kv->rkv_head_split();
}

void llama_kv_cache_context::rkv_cpy_k_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * k_cur, ggml_tensor * k_idxs, int32_t il) const {
    if (ggml_tensor * t = kv->rkv_cpy_k_tail(ctx, k_cur, k_idxs, il)) {
        ggml_build_forward_expand(gf, t);
    }
}

void llama_kv_cache_context::rkv_cpy_v_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * v_cur, ggml_tensor * v_idxs, int32_t il) const {
    if (ggml_tensor * t = kv->rkv_cpy_v_tail(ctx, v_cur, v_idxs, il)) {
        ggml_build_forward_expand(gf, t);
    }
}
