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
//
// This file: construction, the plan record and the cells' moves between windows and tails (stream copies, elastic
// windows); the graph side is llama-kv-cache-split-graph.cpp, the state I/O llama-kv-cache-split-state.cpp.
#include "llama-kv-cache-split.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-context.h"
#include "llama-kv-residency.h"
#include "ggml-rolling-kv.h"
#include "ggml-alloc.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>

//
// construction
//


// the group of the layers on device dev (null: none yet)
static llama_rkv_layer_group * llama_rkv_group_of(llama_rkv_cache_desc & desc, ggml_backend_dev_t dev) {
    for (auto & g : desc.groups) {
        if (g.dev == dev) {
            return &g;
        }
    }
    return nullptr;
}

// what the planner needs of each layer this cache holds: its device, its row bytes in the window and the tail, the
// layer groups per device and the head split's per-layer figures; refuses (desc.refuse, desc.refuse_head) the tail
// and head cuts the types' blocks do not allow
static void llama_rkv_describe_layers(llama_rkv_cache_desc & desc, const llama_model & model,
        const llama_hparams & hparams, ggml_type type_k, ggml_type type_v, ggml_type type_k_tail, ggml_type type_v_tail,
        bool offload, const llama_kv_cache::layer_filter_cb & filter) {
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

        llama_rkv_layer_group * g = llama_rkv_group_of(desc, dev);
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
            hl.conv_head_bytes   = (type_k != GGML_TYPE_F16 ? (size_t) head_k*2 : 0) +
                    (type_v != GGML_TYPE_F16 ? (size_t) head_v*2 : 0);
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
                (type_k != GGML_TYPE_F16 ? (size_t) n_embd_k_gqa*2 : 0) +
                (type_v != GGML_TYPE_F16 ? (size_t) n_embd_v_gqa*2 : 0));
    }
}

// the caches that never split but share the window's devices: an iSWA model's SWA cache (sized as llama_kv_cache_iswa
// sizes it) and a hybrid model's recurrent state
static void llama_rkv_count_other_caches(llama_rkv_cache_desc & desc, const llama_rkv_state & st,
        const llama_model & model, const llama_hparams & hparams, llama_swa_type swa_type, uint32_t kv_size,
        uint32_t n_stream, ggml_type type_k, ggml_type type_v, bool offload) {
    // the base cache of an iSWA model: its SWA cache is created right after this one, stays whole on the device,
    // and must fit next to the window (sized as llama_kv_cache_iswa sizes it)
    if (swa_type == LLAMA_SWA_TYPE_NONE && hparams.swa_type != LLAMA_SWA_TYPE_NONE && !desc.groups.empty()) {
        const uint32_t n_ubatch = st.n_ubatch > 0 ? st.n_ubatch : 512;
        const uint32_t size_swa = st.swa_full ? kv_size :
            GGML_PAD(std::min(kv_size, hparams.n_swa*(n_stream == 1 ? std::max<uint32_t>(1, st.n_seq_max) : 1) +
                              n_ubatch), 256);

        for (uint32_t il = 0; il < hparams.n_layer_all; il++) {
            if (!hparams.has_kv(il) || !hparams.is_swa(il)) {
                continue;
            }
            if (llama_rkv_layer_group * g = llama_rkv_group_of(desc, offload ? model.dev_layer(il) : nullptr)) {
                g->other_kv  += (size_t) size_swa*n_stream*(ggml_row_size(type_k, hparams.n_embd_k_gqa(il)) +
                                                            ggml_row_size(type_v, hparams.n_embd_v_gqa(il)));
                g->n_kv_other = size_swa;
            }
        }
    }

    // the attention cache of a hybrid model: its recurrent state (recorded by llama_rkv_note_recurrent before this
    // cache was constructed) stays whole on its device, next to the window
    for (const auto & [dev, bytes] : st.recurrent_bytes) {
        if (llama_rkv_layer_group * g = llama_rkv_group_of(desc, dev)) {
            g->other_kv  += bytes;
            g->recurrent += bytes;
        }
    }
}

// eligibility: the cache shapes the split serves, and the architectures whose graphs attend through the split-aware
// build_attn paths only (desc.refuse, desc.refuse_head)
static void llama_rkv_check_eligible(llama_rkv_cache_desc & desc, const llama_model & model,
        const llama_hparams & hparams, llama_swa_type swa_type, ggml_type type_k, ggml_type type_v, bool v_trans,
        bool shared) {
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
    } else if (shared) {
        desc.refuse = "the cache shares cells or layers with another cache";
    } else if (v_trans && hparams.is_n_embd_v_gqa_variable()) {
        desc.refuse = "variable V embedding size with a transposed V cache";
    } else if (desc.layer_devs.empty()) {
        desc.refuse = "no attention layers";
    } else if (model.arch == LLM_ARCH_T5) {
        desc.refuse = "T5 attends with a relative position bias the streaming op does not take: not supported";
    }
    if (hparams.f_max_alibi_bias > 0.0f) {
        desc.refuse_head = "ALiBi: a head's slope depends on its index and the head count, which the attention over a "
                           "subset of the heads is not told";
    }
}

// the plan's one log line (two with several streams' windows), as the function func
static void llama_rkv_log_plan(const char * func, const llama_rkv_state & st, uint32_t wc, bool head, bool elastic,
        uint32_t kv_size, uint32_t n_stream, ggml_type type_k, ggml_type type_v) {
    if (wc) {
        LLAMA_LOG_INFO("%s: rolling KV: split, window %u cells + tail %u cells per stream (%u streams), "
                "K %s/%s, V %s/%s (window/tail): %s\n", func, wc, kv_size - wc, n_stream,
                ggml_type_name(type_k), ggml_type_name(st.type_k_tail), ggml_type_name(type_v),
                ggml_type_name(st.type_v_tail), st.reason.c_str());
        if (st.blocks) {
            LLAMA_LOG_INFO("%s: rolling KV: block residency, %u device slots of 256 cells that follow the load\n", func,
                           wc/256);
        } else if (elastic) {
            LLAMA_LOG_INFO("%s: rolling KV: elastic windows, one pool of %u device cells that follows the load\n", func,
                           n_stream*wc);
        } else if (n_stream > 1) {
            LLAMA_LOG_INFO("%s: rolling KV: static windows (%s)\n", func, st.windows_reason.c_str());
        }
    } else if (head) {
        LLAMA_LOG_INFO("%s: rolling KV: split by head, %s (%u streams), K %s/%s, V %s/%s (device/host): %s\n", func,
                llama_rkv_heads_summary(st).c_str(), n_stream, ggml_type_name(type_k), ggml_type_name(st.type_k_tail),
                ggml_type_name(type_v), ggml_type_name(st.type_v_tail), st.reason.c_str());
    } else {
        LLAMA_LOG_INFO("%s: rolling KV: resident (%s)\n", func, st.reason.c_str());
    }
}

llama_kv_split::llama_kv_split(llama_kv_cache & kv) :
    cache(kv), model(kv.model), hparams(kv.hparams), v_trans(kv.v_trans), n_seq_max(kv.n_seq_max),
    n_stream(kv.n_stream), n_pad(kv.n_pad), swa_type(kv.swa_type), v_cells(kv.v_cells),
    map_layer_ids(kv.map_layer_ids) {
}

std::shared_ptr<llama_kv_split> llama_kv_split::plan(llama_kv_cache & kv, llama_rkv_state * st, uint32_t kv_size,
        ggml_type type_k, ggml_type type_v, bool offload, const llama_kv_cache::layer_filter_cb & filter,
        const llama_kv_cache::layer_share_cb & share) {
    if (!st) {
        return nullptr;
    }
    auto split = std::make_shared<llama_kv_split>(kv);
    split->rkv_wc      = split->rkv_plan(*st, kv_size, type_k, type_v, offload, filter, share);
    split->rkv_offload = offload;
    if (!split->rkv_split()) {
        return nullptr;
    }
    split->rkv_cpu = std::make_shared<const llama_rkv_tail_cpu>(st->tail_cpu);
    return split;
}

void llama_kv_split::finish(llama_kv_cache & kv, llama_rkv_state & st) {
    llama_kv_split * split = kv.split.get();
    if (split) {
        split->rkv_add_tails(st.type_k_tail, st.type_v_tail);
    }
    rkv_record_plan(kv, split, st);
}

uint32_t llama_kv_split::rkv_plan(llama_rkv_state & st, uint32_t kv_size, ggml_type type_k, ggml_type type_v,
        bool offload, const llama_kv_cache::layer_filter_cb & filter, const llama_kv_cache::layer_share_cb & share) {
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

    llama_rkv_describe_layers(desc, model, hparams, type_k, type_v, type_k_tail, type_v_tail, offload, filter);

    llama_rkv_count_other_caches(desc, st, model, hparams, swa_type, kv_size, n_stream, type_k, type_v, offload);

    llama_rkv_check_eligible(desc, model, hparams, swa_type, type_k, type_v, v_trans, cache.other || share);

    const uint32_t wc = llama_rkv_plan_cache(st, desc, model);

    rkv_head = st.chosen == LLAMA_KV_RESIDENCY_HEAD;
    if (wc || rkv_head) {
        rkv_live = st.live;
    }
    rkv_st = &st;

    // elastic windows: the streams' device cells as one pool (llama-kv-window-pool.h), where moving a row between the
    // window and the tail is a byte copy, or a conversion into the tail's type (auto tail types included: the planner
    // may choose a quantized tail and the windows still follow the load)
    if (wc) {
        // one stream: block residency only when asked for (--kv-windows blocks): under a random mix on an H100 it was
        // slower than the static window (docs/perf/2026-12-06-h100-unified-blocks)
        const char * why_static =
            n_stream < 2 ? "one stream (a unified cache, or one sequence; block residency: --kv-windows blocks)" :
            st.req.windows == LLAMA_KV_WINDOWS_STATIC                    ? "static windows requested" : nullptr;
        rkv_elastic    = why_static == nullptr;
        // one stream holding several sequences (a unified cache), when asked: its 256-cell blocks follow the load
        // (llama-kv-cache-blocks.cpp)
        rkv_blocks = n_stream == 1 && st.n_seq_max > 1 && wc % 256 == 0 && kv_size % 256 == 0 &&
                     st.req.windows == LLAMA_KV_WINDOWS_BLOCKS;
        if (rkv_blocks) {
            why_static = nullptr;
        }
        rkv_tail_first = rkv_elastic || rkv_blocks ? 0 : wc;
        st.blocks         = rkv_blocks;
        st.elastic        = rkv_elastic;
        st.pool_cells     = rkv_elastic ? n_stream*wc : 0;
        st.windows_reason = why_static ? why_static : "";
        if (rkv_elastic) {
            rkv_pool.init(n_stream, kv_size, n_stream*wc);
        }
        if (rkv_blocks) {
            rkv_blk_init(wc);
        }
    }
    rkv_dev_heads.assign(hparams.n_layer_all, 0);
    if (rkv_head) {
        for (const auto & hl : st.head_layers) {
            rkv_dev_heads[hl.il] = hl.device_heads;
        }
    }

    llama_rkv_log_plan(__func__, st, wc, rkv_head, rkv_elastic, kv_size, n_stream, type_k, type_v);

    return wc;
}

uint32_t llama_kv_split::rkv_row_dev(uint32_t il, uint32_t n_embd_gqa, bool is_v) const {
    if (!rkv_head || il >= rkv_dev_heads.size() || rkv_dev_heads[il] == 0) {
        return n_embd_gqa;
    }
    return rkv_dev_heads[il]*(is_v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il));
}

void llama_kv_split::rkv_add_tails(ggml_type type_k_tail, ggml_type type_v_tail) {
    // a context per host buffer type (each GPU's pinned memory), in the cache's list of buffers: its memory breakdown,
    // clear and total size count the tails
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctxs;
    for (const auto & cl : cache.layers) {
        layer_t layer = { cl.il, cl.k, cl.v };
        ggml_backend_dev_t dev = rkv_offload ? model.dev_layer(cl.il) : nullptr;

        // pinned host memory of the layer's device when it is a GPU, else plain CPU memory
        ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
        if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            if (auto * host_buft = ggml_backend_dev_host_buffer_type(dev)) {
                buft = host_buft;
            }
        }

        // window: the cells past the window (elastic windows: every cell) +1 trash row, at the full row; head: every
        // cell, the host heads' part of the row
        const uint32_t rows = rkv_head ? get_size() : get_size() - rkv_tail_first + 1;
        const int64_t  n_k  = rkv_head ? (int64_t) hparams.n_embd_k_gqa(cl.il) - cl.k->ne[0] : cl.k->ne[0];
        const int64_t  n_v  = !cl.v ? 0
                            : rkv_head ? (int64_t) hparams.n_embd_v_gqa(cl.il) - cl.v->ne[0] : cl.v->ne[0];

        if (n_k > 0) { // else a head split's layer whose heads are all on the device
            ggml_context_ptr & ctx_ptr = ctxs[buft];
            if (!ctx_ptr) {
                ggml_init_params params = { 2u*cache.layers.size()*ggml_tensor_overhead(), nullptr, true };
                ctx_ptr.reset(ggml_init(params));
                if (!ctx_ptr) {
                    throw std::runtime_error("failed to create ggml context for the kv cache tail");
                }
            }
            ggml_context * ctx = ctx_ptr.get();

            layer.k_tail = ggml_new_tensor_3d(ctx, type_k_tail, n_k, rows, n_stream);
            ggml_format_name(layer.k_tail, "cache_k_tail_l%d", layer.il);
            if (layer.v) {
                layer.v_tail = ggml_new_tensor_3d(ctx, type_v_tail, n_v, rows, n_stream);
                ggml_format_name(layer.v_tail, "cache_v_tail_l%d", layer.il);
            }

            // a tail in a GPU's pinned memory is accessed in place by that GPU (new rows written through unified
            // addressing, attention streaming it in bulk) instead of being copied whole by the scheduler before
            // every graph
            if (buft != ggml_backend_cpu_buffer_type()) {
                ggml_set_streamed(layer.k_tail);
                if (layer.v_tail) {
                    ggml_set_streamed(layer.v_tail);
                }
            }
        }
        layers.push_back(layer);
    }

    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = llama_rkv_alloc_ctx_tensors(ctx.get(), buft);
        if (!buf) {
            throw std::runtime_error("failed to allocate buffer for the kv cache tail");
        }
        ggml_backend_buffer_clear(buf, 0);
        LLAMA_LOG_INFO("%s: %10s KV tail buffer size = %8.2f MiB\n", __func__, ggml_backend_buffer_name(buf),
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        cache.ctxs_bufs.emplace_back(std::move(ctx), buf);
    }
}

ggml_backend_buffer_t llama_rkv_alloc_ctx_tensors(ggml_context * ctx, ggml_backend_buffer_type_t buft) {
    bool streamed = false;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t && !streamed; t = ggml_get_next_tensor(ctx, t)) {
        streamed = ggml_is_streamed(t);
    }
    ggml_backend_dev_t dev = streamed ? ggml_backend_buft_get_device(buft) : nullptr;
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto host_alloc = reg ? (ggml_backend_rkv_host_buffer_alloc_t) ggml_backend_reg_get_proc_address(reg,
            GGML_RKV_HOST_ALLOC_PROC) : nullptr;
    if (host_alloc && ggml_backend_dev_host_buffer_type(dev) == buft) {
        if (ggml_backend_buffer_t buf = host_alloc(dev, ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft))) {
            ggml_tallocr talloc = ggml_tallocr_new(buf);
            for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
                if (t->data == nullptr && t->view_src == nullptr &&
                    ggml_tallocr_alloc(&talloc, t) != GGML_STATUS_SUCCESS) {
                    ggml_backend_buffer_free(buf);
                    return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
                }
            }
            LLAMA_LOG_DEBUG("%s: rolling KV: host tails in %.2f MiB of 2 MiB-page memory registered with %s\n",
                __func__, ggml_backend_buffer_get_size(buf)/1024.0/1024.0, ggml_backend_dev_name(dev));
            return buf;
        }
    }
    return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
}

float llama_kv_split::rkv_tail_cpu_frac_cells(uint32_t n_tail, double rows) const {
    return rkv_cpu ? llama_rkv_tail_cpu_frac_at(*rkv_cpu, n_tail, rows) : 0.0f;
}

bool llama_kv_split::rkv_elastic_whole(uint32_t n_kv, const slot_info & sinfo) const {
    if (sinfo.s0 == sinfo.s1) {
        return n_kv <= rkv_pool.cells[sinfo.s0];
    }
    // several streams in one view: each at its static place, its cells in use within its window, and the view's n_kv
    // rows of each stream within its share (rows past a stream's cells hold no cell of it: the mask hides them)
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

uint32_t llama_kv_split::rkv_win_cells(uint32_t strm) const {
    return rkv_elastic ? rkv_pool.cells[strm] : rkv_wc;
}

size_t llama_kv_split::rkv_win_off(const ggml_tensor * t, uint32_t strm, uint32_t cell) const {
    if (rkv_blocks) {
        const int32_t slot = rkv_blk_slot[cell/256];
        GGML_ASSERT(slot >= 0);
        return ((size_t) slot*256 + cell % 256)*t->nb[1];
    }
    // elastic: the stream's window in the pool (the rows of all slabs); static: the stream's own slab
    const size_t row0 = rkv_elastic ? rkv_pool.base[strm] : (size_t) strm*t->ne[1];
    return (row0 + cell)*t->nb[1];
}

size_t llama_kv_split::rkv_tail_off(const ggml_tensor * t, uint32_t strm, uint32_t cell) const {
    GGML_ASSERT(cell >= rkv_tail_first);
    return strm*t->nb[2] + (size_t) (cell - rkv_tail_first)*t->nb[1];
}

void llama_kv_split::rkv_record_plan(const llama_kv_cache & kv, const llama_kv_split * split, llama_rkv_state & st) {
    if (!st.layers.empty()) {
        return; // recorded by another cache of the context
    }

    const uint32_t wc   = split ? split->rkv_wc : 0;
    const bool     head = split && split->rkv_head;

    size_t dev_total = 0;
    size_t host_total = 0;

    for (size_t ikv = 0; ikv < kv.layers.size(); ++ikv) {
        const auto & layer  = kv.layers[ikv];
        ggml_tensor * k_tail = split ? split->layers[ikv].k_tail : nullptr;
        ggml_tensor * v_tail = split ? split->layers[ikv].v_tail : nullptr;

        llama_rkv_layer_plan lp;
        lp.il           = (int32_t) layer.il;
        lp.n_head_kv    = kv.hparams.n_head_kv(layer.il);
        lp.device_heads = head ? split->rkv_dev_heads[layer.il] : lp.n_head_kv;
        lp.split        = wc > 0 || k_tail != nullptr;
        lp.window_cells = wc ? wc : kv.get_size();
        lp.tail_cells   = wc ? kv.get_size() - wc : k_tail ? kv.get_size() : 0;
        lp.device_bytes = ggml_nbytes(layer.k) + (layer.v ? ggml_nbytes(layer.v) : 0);
        lp.host_bytes   = (k_tail ? ggml_nbytes(k_tail) : 0) + (v_tail ? ggml_nbytes(v_tail) : 0);

        dev_total  += lp.device_bytes;
        host_total += lp.host_bytes;

        st.layers.push_back(lp);
    }

    if (wc) {
        LLAMA_LOG_INFO("%s: rolling KV: window %.2f MiB (layer buffers), tail %.2f MiB (host)\n", __func__,
                dev_total/1024.0/1024.0, host_total/1024.0/1024.0);
    } else if (head) {
        LLAMA_LOG_INFO("%s: rolling KV: device heads %.2f MiB (layer buffers), host heads %.2f MiB (host)\n", __func__,
                dev_total/1024.0/1024.0, host_total/1024.0/1024.0);
    }
}

size_t llama_kv_split::rkv_tail_bytes(bool is_v) const {
    size_t n = 0;
    for (const auto & layer : layers) {
        const ggml_tensor * t = is_v ? layer.v_tail : layer.k_tail;
        n += t ? ggml_nbytes(t) : 0;
    }
    return n;
}

//
// moving cells: stream copies and elastic windows (llama-kv-window-pool.h)
//

bool llama_kv_split::rkv_copy_stream(uint32_t ikv, uint32_t ssrc, uint32_t sdst) const {
    const layer_t & layer = layers[ikv];
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
        return false;
    }
    // a window split: every cell, from where the source stream keeps it to where the destination keeps it (the windows
    // of the two streams may differ, and with elastic windows they are not slabs)
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
            ggml_backend_tensor_get(ts, tmp.data(), src_win ? rkv_win_off(ts, ssrc, c0) : rkv_tail_off(ts, ssrc, c0),
                                    tmp.size());
            ggml_backend_tensor_set(td, tmp.data(), dst_win ? rkv_win_off(td, sdst, c0) : rkv_tail_off(td, sdst, c0),
                                    tmp.size());
        }
    }
    return true;
}

// n bytes of t from byte offset src to dst, where the two ranges do not overlap (llama_rkv_pool_rebalance cuts a move
// into such pieces)
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

uint8_t * llama_kv_split::rkv_staging_get(const ggml_tensor * win, size_t n) const {
    if (rkv_staging && ggml_backend_buffer_get_size(rkv_staging.get()) >= n) {
        return (uint8_t *) ggml_backend_buffer_get_base(rkv_staging.get());
    }
    if (!rkv_staging && rkv_staging_pageable.size() >= n) {
        return rkv_staging_pageable.data();
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(win->buffer));
    ggml_backend_buffer_type_t host_buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    rkv_staging.reset();
    if (host_buft) {
        rkv_staging.reset(ggml_backend_buft_alloc_buffer(host_buft, n));
    }
    if (rkv_staging) {
        rkv_staging_pageable = {};
        return (uint8_t *) ggml_backend_buffer_get_base(rkv_staging.get());
    }
    rkv_staging_pageable.resize(n);
    return rkv_staging_pageable.data();
}

void llama_kv_split::rkv_move_rows(size_t row0, uint32_t n, bool promote,
                                   const std::function<char *(const ggml_tensor * tail)> & host_of) const {
    struct conv_t {
        ggml_tensor * win;
        ggml_tensor * tail;
        char *        host;
        size_t        off; // in the staging
    };
    std::vector<conv_t> conv;
    size_t staged = 0;
    for (const auto & layer : layers) {
        for (int kv = 0; kv < 2; ++kv) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }
            GGML_ASSERT(tail && ggml_backend_buffer_is_host(tail->buffer) && tail->ne[0] == win->ne[0]);
            char * host = host_of(tail);
            const size_t bytes = (size_t) n*win->nb[1];
            if (tail->type == win->type) {
                if (promote) {
                    ggml_backend_tensor_set(win, host, row0*win->nb[1], bytes);
                } else {
                    ggml_backend_tensor_get(win, host, row0*win->nb[1], bytes);
                }
                continue;
            }
            conv.push_back({ win, tail, host, staged });
            staged += GGML_PAD(bytes, 64);
        }
    }
    if (conv.empty()) {
        return;
    }
    // the window's rows in the staging: read from the device first (demotion), written to it after (promotion); the
    // conversions between them, a layer's K or V each, on up to 16 threads (one start per move, where each conversion
    // once started threads of its own: ~22k starts for 400 blocks of a 28-layer model)
    uint8_t * stage = rkv_staging_get(conv[0].win, staged);
    if (!promote) {
        for (const auto & c : conv) {
            ggml_backend_tensor_get(c.win, stage + c.off, row0*c.win->nb[1], (size_t) n*c.win->nb[1]);
        }
    }
    std::atomic<size_t> next { 0 };
    std::atomic<bool>   ok { true };
    auto work = [&]() {
        for (size_t i = next++; i < conv.size(); i = next++) {
            const conv_t & c = conv[i];
            const bool done = promote
                ? llama_rkv_convert_rows(c.tail->type, c.win->type, c.host, stage + c.off, n, c.win->ne[0], 1)
                : llama_rkv_convert_rows(c.win->type, c.tail->type, stage + c.off, c.host, n, c.win->ne[0], 1);
            if (!done) {
                ok = false;
            }
        }
    };
    const size_t nth = std::min<size_t>({ (size_t) std::max(1u, std::thread::hardware_concurrency()), 16,
                                          conv.size() });
    std::vector<std::thread> workers;
    for (size_t t = 1; t < nth; ++t) {
        workers.emplace_back(work);
    }
    work();
    for (auto & w : workers) {
        w.join();
    }
    GGML_ASSERT(ok);
    if (promote) {
        for (const auto & c : conv) {
            ggml_backend_tensor_set(c.win, stage + c.off, row0*c.win->nb[1], (size_t) n*c.win->nb[1]);
        }
    }
}

void llama_kv_split::rkv_pool_copy(const llama_rkv_pool_copy & c) const {
    if (c.kind != llama_rkv_pool_copy::RELOCATE) {
        const bool promote = c.kind == llama_rkv_pool_copy::PROMOTE;
        rkv_move_rows(promote ? c.row_dst : c.row_src, c.n, promote, [&](const ggml_tensor * tail) {
            return (char *) tail->data + rkv_tail_off(tail, c.strm, c.cell0);
        });
        return;
    }
    for (const auto & layer : layers) {
        for (ggml_tensor * win : { layer.k, layer.v }) {
            if (!win) {
                continue;
            }
            const size_t row = win->nb[1];
            llama_rkv_copy_within(win, (size_t) c.row_src*row, (size_t) c.row_dst*row, (size_t) c.n*row);
        }
    }
}

void llama_kv_split::rkv_begin_batch(const slot_info_vec_t & sinfos) {
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

void llama_kv_split::rkv_rebalance(const slot_info & sinfo, const llama_ubatch & ubatch) {
    if (rkv_blocks) {
        rkv_blk_rebalance(sinfo, ubatch);
        return;
    }
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
    const uint64_t moved = (rkv_pool.promoted - promoted) + (rkv_pool.demoted - demoted) +
                           (rkv_pool.relocated - relocated);
    lv.promoted_cells  = rkv_pool.promoted;
    lv.demoted_cells   = rkv_pool.demoted;
    lv.relocated_cells = rkv_pool.relocated;
    lv.rebalances      = rkv_pool.n_rebalance;
    lv.moved_bytes    += moved*cell_bytes;
    lv.move_ms        += copies.empty() ? 0.0 : (ggml_time_us() - t0)/1000.0;
    lv.window_cells    = rkv_pool.cells;
}
