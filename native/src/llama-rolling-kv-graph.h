// rollingkv: the graph side of a split KV layer (llama-rolling-kv-graph.cpp)
#pragma once

#include "ggml.h"

#include <functional>
#include <vector>

// Views of a graph's inputs that every layer shares. ggml's scheduler copies each distinct tensor that an op on a GPU
// reads from the CPU backend (a graph input, or a view of one) as an input of its own, and all of a split's input
// copies are live at once: a view of the f16 KQ mask made by each layer's op of each stream was a copy of the whole
// mask per layer (27 x 25 MiB for -np 4 on the synthetic 28-layer model at -c 102400), and each copy a synchronization.
// One view per (input, shape, strides, offset) for the graph being built, made by the first layer that asks, keeps the
// copies to what upstream's layers, which read the inputs whole, make. A cache owns one for the graphs it builds: an
// entry holds only while it is a view of that input made in the graph's context since the context was last reset (a
// graph built again in the same context, its inputs at the same addresses, makes its own).
struct llama_rkv_input_views {
    struct entry {
        const ggml_tensor * src;
        int64_t       ne[4];
        size_t        nb[3];   // 0, 0, 0: a 1D view
        size_t        offs;
        ggml_tensor * view;
    };
    const ggml_context * ctx = nullptr;
    std::vector<entry>   entries;

    // the view made for these arguments in ctx's current graph (nullptr: none)
    ggml_tensor * find(const ggml_context * ctx, const ggml_tensor * src, const int64_t ne[4], const size_t nb[3],
                       size_t offs);
    void add(const ggml_context * ctx, const ggml_tensor * src, const int64_t ne[4], const size_t nb[3], size_t offs,
             ggml_tensor * view);
};

// as ggml_view_4d / ggml_view_1d, the same tensor for the same arguments through views (nullptr: a view of its own)
ggml_tensor * llama_rkv_input_view_4d(ggml_context * ctx, llama_rkv_input_views * views, ggml_tensor * src,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offs);
ggml_tensor * llama_rkv_input_view_1d(ggml_context * ctx, llama_rkv_input_views * views, ggml_tensor * src, int64_t ne0,
        size_t offs);

// how a ubatch attends a split layer (llama_kv_cache_context::rkv_attn_layout). One op over every stream of the ubatch,
// all of them over the cells of the longest (n_kv empty), or, for a ubatch of several streams, one op per stream over
// its own cells: stream s attends cells [0, n_kv[s]) (window [0, min(n_kv[s], n_win)), tail [n_win, n_kv[s])), so a
// short sequence beside a long one neither streams nor attends the long one's cell count.
struct llama_rkv_attn_layout {
    float    perturb_tail = 0.0f;   // every op's tail_perturb: the context's test hook (llama_rolling_kv_test_hooks);
                                    // 0: off
    uint32_t tail_cpu_cells = 0;    // one op: the tail's cells attended on the CPU (ggml_rkv_tail_cpu_cells:
                                    // 256-aligned)
    uint32_t n_win = 0;             // window cells per stream (0: a head split, where every cell is tail)
    std::vector<uint32_t> n_kv;     // one op per stream: the cells each attends
    std::vector<uint32_t> cpu_cells; // and the cells of each one's tail attended on the CPU
    // elastic windows (llama-kv-window-pool.h; pool true): the window view is the whole pool ([D, n_head_kv, rows, 1])
    // and the tail view every row of each stream; stream s's window is win_cells[s] cells from pool row win_row0[s],
    // its tail cells [win_cells[s], n_kv[s]) from row tail_row0[s] of its tail slab
    bool pool = false;
    std::vector<uint32_t> win_cells;
    std::vector<uint32_t> win_row0;
    std::vector<uint32_t> tail_row0;
    // one op over one stream (a unified cache's): the runs of tail cells [run_first[r], run_first[r] + run_n[r]) that
    // the ubatch's sequences read (ggml_streaming_flash_attn_set_tail_runs; empty: the whole tail). The other tail
    // blocks hold only other sequences' cells, or none: masked for every query, neither streamed nor attended
    std::vector<uint32_t> run_first;
    std::vector<uint32_t> run_n;
    // block residency (a unified cache's blocks move, llama-kv-cache-blocks.cpp): the graph's block map input, I32
    // [kv_size/256] (logical block -> physical block of [window pool ; tail]); the op takes its first n_kv/256 entries
    ggml_tensor * block_map = nullptr;
    // where the graph's layers share their views of its inputs (the KQ mask's rows of each stream, the block map's
    // entries the op takes): the cache's (llama_kv_split::rkv_views); nullptr: a view per layer
    llama_rkv_input_views * views = nullptr;
};

// what a split cache records of a graph it built (by the graph's k index input), to tell whether the graph may be
// reused: the per-stream cells it attends and the windows it was built with
struct llama_rkv_graph_note {
    const ggml_tensor * k_idxs = nullptr;
    std::vector<uint32_t> n_kv;    // the per-stream layout's cells (per_stream: built through the split's attention)
    std::vector<uint32_t> runs;    // the one op's tail runs, (first, n) pairs (llama_rkv_attn_layout::run_first/run_n)
    uint64_t epoch = 0;            // llama_rkv_window_pool::epoch when built
    bool per_stream = false;
    // block residency: the graph's block map input (llama_rkv_attn_layout::block_map)
    ggml_tensor * block_map = nullptr;
};

// attention over a split layer: like llm_graph_context::build_attn_mha's flash-attention branch, over the window views
// k/v and the tail views k_tail/v_tail, with GGML_OP_STREAMING_FLASH_ATTN (ggml-rolling-kv.h). q: [DK, n_head,
// n_tokens]; k/v/k_tail/v_tail: 4D views [D, n_head_kv, n_kv_part, n_stream] (get_k layout); k and v may be nullptr (no
// window: the tail alone, as a head split's host heads) returns [DV*n_head, n_tokens]; n_tokens is a multiple of
// n_stream, the tokens of a stream consecutive
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
  const llama_rkv_attn_layout & layout);

// upstream's attention (build_attn_mha) over the device's KV heads of a head split, for the query heads q (a view of
// the first ones) and their sinks (a view, or nullptr): [DV*n_head_q, n_tokens]
using llama_rkv_attn_fn = std::function<ggml_tensor * (ggml_tensor * q, ggml_tensor * sinks)>;

// attention over a layer split by KV head: the device's first n_head_kv_dev KV heads through attn_dev with the query
// heads that follow them (GQA groups are never split), the host's heads k_tail/v_tail (every cell: [D, n_head_kv_host,
// n_kv, n_stream]) through GGML_OP_STREAMING_FLASH_ATTN with an empty window, the outputs concatenated by head (device
// heads first, as the rows of the unsplit layer). q: [DK, n_head, n_tokens]; sinks: [n_head] or nullptr; max_alibi_bias
// must be 0 (a head's ALiBi slope depends on its index and the head count). Returns [DV*n_head, n_tokens].
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
    const llama_rkv_attn_fn & attn_dev);
