// rollingkv: the split of a llama_kv_cache into a device window and a host tail (by key position), or by KV head.
//
// A cache the residency plan splits holds one llama_kv_split (llama_kv_cache::get_split()); the cache's hooks call into
// it where the split changes what upstream does: the rows its layer tensors keep, the tails it allocates, the window
// and tail views, the writes of new rows and their index inputs, the KQ mask of block residency, the K-shift, stream
// copies, state I/O and the moves of cells between ubatches. A cache without one is upstream's, unchanged.
// The split reads the cache's cells, layers and shape (a friend of it); the cells never move between caches.
//
// Layout, planning and moves: llama-kv-cache-split.cpp; the graph side: llama-kv-cache-split-graph.cpp; state I/O:
// llama-kv-cache-split-state.cpp; block residency of a unified cache: llama-kv-cache-blocks.cpp.
#pragma once

#include "llama-kv-cache.h"
#include "llama-kv-window-pool.h"
#include "llama-rolling-kv-graph.h"

#include "ggml-cpp.h"

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

struct llama_rkv_state;
struct llama_rkv_tail_cpu;
struct llama_rkv_live;

class llama_kv_split {
public:
    using slot_info       = llama_kv_cache::slot_info;
    using slot_info_vec_t = llama_kv_cache::slot_info_vec_t;
    using cell_ranges_t   = llama_kv_cache::cell_ranges_t;

    // the plan of cache kv for the request st (kv's constructor, before its layers): the split, or null when the cache
    // stays whole (no request, a resident plan, or a second cache of the context)
    static std::shared_ptr<llama_kv_split> plan(llama_kv_cache & kv, llama_rkv_state * st, uint32_t kv_size,
            ggml_type type_k, ggml_type type_v, bool offload, const llama_kv_cache::layer_filter_cb & filter,
            const llama_kv_cache::layer_share_cb & share);
    // the end of kv's constructor: the split's host tails, and the plan's per-layer record (of a whole cache too)
    static void finish(llama_kv_cache & kv, llama_rkv_state & st);

    explicit llama_kv_split(llama_kv_cache & kv);

    // rows per stream of a layer's K/V tensors: the window (+1 trash row) of a window split, else every cell
    uint32_t rkv_rows(uint32_t kv_size) const { return rkv_wc ? rkv_wc + 1 : kv_size; }
    // elements of layer il's K (or V) row on the device: n_embd_gqa unless split by head
    uint32_t rkv_row_dev(uint32_t il, uint32_t n_embd_gqa, bool is_v) const;

    // window cells per stream; 0: the cache is split by head
    uint32_t rkv_window_cells() const { return rkv_wc; }
    bool     rkv_head_split()   const { return rkv_head; }
    bool     rkv_split()        const { return rkv_wc > 0 || rkv_head; }

    // the hooks' halves of get_k/get_v (the window or device heads) and cpy_k/cpy_v (tail: the host half)
    ggml_tensor * rkv_get_window(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo,
            bool is_v) const;
    ggml_tensor * rkv_cpy(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_v,
            bool tail) const;

    // the index inputs of a window split (window rows, then tail rows); set_input_idxs also records, once per ubatch,
    // what it attends of each stream's tail (is_k); false: a head split, whose index inputs are upstream's
    ggml_tensor * rkv_build_input_idxs(ggml_context * ctx, const llama_ubatch & ubatch, const char * name) const;
    bool          rkv_set_input_idxs(ggml_tensor * dst, const llama_ubatch * ubatch, const slot_info & sinfo,
            bool is_k) const;
    // block residency: the KQ mask in the window's and the tail's key order (false: upstream's mask is the one)
    bool          rkv_set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, bool causal_attn) const;

    // layer ikv (an index into the cache's layers) of stream ssrc copied into sdst; false: the device part is still
    // upstream's to copy (a head split's device heads)
    bool rkv_copy_stream(uint32_t ikv, uint32_t ssrc, uint32_t sdst) const;
    void rkv_build_shift_layer(const llama_cparams & cparams, ggml_context * ctx, ggml_cgraph * gf, uint32_t il,
            ggml_tensor * k_shift, ggml_tensor * k_rot) const;
    // the bytes of the host tails' K (or V)
    size_t rkv_tail_bytes(bool is_v) const;

    void rkv_state_write_data(llama_io_write_i & io, const cell_ranges_t & cr) const;
    bool rkv_state_read_data (llama_io_read_i  & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo);
    void rkv_state_clear_data(uint32_t strm, const slot_info & sinfo);

    // the streams of a batch (one llama_decode) that prepare() placed: they and those of the batch before are active
    void rkv_begin_batch(const slot_info_vec_t & sinfos);
    // before a ubatch is applied: the windows (elastic) or blocks (block residency) follow the load; else a no-op
    void rkv_rebalance(const slot_info & sinfo, const llama_ubatch & ubatch);

    // how a ubatch over sinfo's streams attends a split layer (llama-rolling-kv-graph.h); full: the worst-case graph
    // (every stream at n_kv cells)
    llama_rkv_attn_layout rkv_attn_layout(uint32_t n_kv, const slot_info & sinfo, bool full,
            const llama_ubatch * ubatch) const;
    // the graph whose index input is k_idxs was built for the per-stream cells and tail runs a ubatch over sinfo
    // attends (a graph is reused only then); rkv_graph_layout gives the graph being built its layout (once per graph,
    // every layer the same) and records it
    bool rkv_can_reuse(const ggml_tensor * k_idxs, uint32_t n_kv, const slot_info & sinfo, bool full,
            const llama_ubatch * ubatch) const;
    llama_rkv_attn_layout rkv_graph_layout(const ggml_tensor * k_idxs, uint32_t n_kv, const slot_info & sinfo,
            bool full, const llama_ubatch * ubatch) const;

    // views of the tail cells [wc, n_kv) in get_k/get_v layout; nullptr when n_kv <= wc (head split: the host heads of
    // every cell; nullptr for a layer whole on the device)
    ggml_tensor * rkv_get_k_tail(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const;
    ggml_tensor * rkv_get_v_tail(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const;

    // the tail half of cpy_k/cpy_v
    ggml_tensor * rkv_cpy_k_tail(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_idxs, int32_t il) const;
    ggml_tensor * rkv_cpy_v_tail(ggml_context * ctx, ggml_tensor * v_cur, ggml_tensor * v_idxs, int32_t il) const;

    // block residency: the KQ mask's columns for n_kv cells (the window pool's, then the tail's; n_kv without blocks)
    uint32_t rkv_mask_cols(uint32_t n_kv) const;

private:
    // one attention layer of the cache: its window (or device heads) as the cache holds them, and its host tail
    struct layer_t {
        uint32_t il;

        ggml_tensor * k;
        ggml_tensor * v;

        // cells [wc, kv_size) of a split layer (+1 trash row per stream), in host memory; head split: the host heads
        // of every cell
        ggml_tensor * k_tail = nullptr;
        ggml_tensor * v_tail = nullptr;
    };

    llama_kv_cache & cache;

    // what the split reads of the cache, under the cache's own names
    const llama_model   & model;
    const llama_hparams & hparams;
    const bool            v_trans;
    const uint32_t        n_seq_max;
    const uint32_t        n_stream;
    const uint32_t        n_pad;
    const llama_swa_type  swa_type;
    llama_kv_cells_vec  & v_cells;
    const std::unordered_map<int32_t, int32_t> & map_layer_ids;

    uint32_t get_size() const { return cache.get_size(); }

    // the cache's layers, each with its tail (in the cache's order: map_layer_ids indexes both)
    std::vector<layer_t> layers;
    bool rkv_offload = false; // the layers' tails go to their devices' pinned host memory

    // window cells per stream (0: not split); the window tensors hold wc + 1 rows per stream, the tail
    // tensors kv_size - wc + 1: the last row of each is a trash row that takes the writes meant for the
    // other region, so both set_rows of a ubatch always cover all its tokens (fixed graph topology)
    uint32_t rkv_wc = 0;
    // elastic windows (n_stream > 1, one type in window and tail): the window tensors' rows of all streams are one pool
    // (rkv_pool: stream s's window cells at rows base[s]...) and the tail tensors hold a row for every cell (the cells
    // on the device have stale ones); static windows: stream s's cells [0, wc) at rows [0, wc) of its slab of the
    // window tensors, cells [wc, kv_size) at rows [0, kv_size - wc) of its slab of the tail tensors
    bool rkv_elastic = false;
    llama_rkv_window_pool rkv_pool;
    uint32_t rkv_tail_first = 0; // the cell of a tail slab's first row (0: elastic, wc: static)
    llama_rkv_state * rkv_st = nullptr; // the context's residency state (its scheduler's synchronize, for the moves)
    // the plan's hybrid tail share, or auto's model of it (null: none)
    std::shared_ptr<const llama_rkv_tail_cpu> rkv_cpu;

    // block residency (one stream holding several sequences, one type in window and tail): the window tensors' first wc
    // rows are wc/256 slots of 256 rows, each holding one logical block of 256 cells (rkv_slot_blk) or none; the tail
    // tensors hold a row for every cell (cell c at row c, rkv_tail_first 0), stale where the block is on the device.
    // Cells never move: upstream's find_slot, mask and order of keys stay those of the resident cache, and the op
    // attends in logical order through a block map (ggml_streaming_flash_attn_set_block_map)
    bool rkv_blocks = false;
    std::vector<int32_t>  rkv_blk_slot;     // logical block -> slot, -1: in the tail
    std::vector<int32_t>  rkv_slot_blk;     // slot -> logical block, -1: free
    std::vector<uint64_t> rkv_blk_seen;     // the ubatch (rkv_blk_clock) that last read or wrote each block
    std::vector<uint64_t> rkv_seq_seen;     // the ubatch that last held each sequence (its blocks' readers are active)
    uint64_t rkv_blk_clock = 0;
    mutable bool rkv_blk_logical = false;   // rkv_set_input_kq_mask is having upstream fill the logical mask
    uint32_t rkv_blk_pool_n() const;        // the slots a graph's window view covers: through the highest in use
    bool     rkv_on_dev(uint32_t strm, uint32_t cell) const; // the cell's row is in the window (else in the tail)
    void     rkv_blk_init(uint32_t wc);
    void     rkv_blk_rebalance(const slot_info & sinfo, const llama_ubatch & ubatch);
    void     rkv_blk_move(uint32_t blk, uint32_t slot, bool promote) const;
    void     rkv_blk_set_input_map(ggml_tensor * map) const;

    // split by KV head: layer il keeps rkv_dev_heads[il] of its KV heads on the device (k/v), the rest in host memory
    // (k_tail/v_tail), every cell in both; rkv_wc is 0
    bool rkv_head = false;
    std::vector<uint32_t> rkv_dev_heads;

    // the window-row and tail-row views of each index input of the graph being built, made with the input and
    // shared by every layer's set_rows, and the ggml context of that graph (see rkv_build_input_idxs)
    mutable std::unordered_map<const ggml_tensor *, std::pair<ggml_tensor *, ggml_tensor *>> rkv_idx_views;
    mutable const ggml_context * rkv_idx_ctx = nullptr;
    // the views of the other graph inputs that the layers of the graph being built share (the KQ mask's rows of each
    // stream, the block map's entries, the K-shift's positions of each part): llama_rkv_attn_layout::views
    mutable llama_rkv_input_views rkv_views;

    // the per-stream cells each recent graph attends (rkv_note_graph), by its k index input; a few graphs only
    mutable std::vector<llama_rkv_graph_note> rkv_graph_cells;
    // the record of that graph (a new one if none)
    llama_rkv_graph_note & rkv_graph_note(const ggml_tensor * k_idxs) const;

    // what the cache does under load (llama_rolling_kv_stats_json), shared with the context's residency state
    std::shared_ptr<llama_rkv_live> rkv_live;
    uint32_t rkv_stream_n_kv(uint32_t strm) const; // the cells a ubatch of stream strm alone would attend (get_n_kv)
    void rkv_note_step(const slot_info & sinfo, const llama_ubatch & ubatch) const;

    // where stream strm's cells live: window cells (cells [0, n) are in the window), the byte offset of a cell's row in
    // the window tensor t (cell < window cells) and in the tail tensor t (cell >= window cells)
    uint32_t rkv_win_cells(uint32_t strm) const;
    // elastic windows: a ubatch over sinfo's streams at n_kv cells has every cell in use on the device, where one view
    // (upstream's attention) reaches it
    bool     rkv_elastic_whole(uint32_t n_kv, const slot_info & sinfo) const;
    // the CPU share of a tail of n_tail cells that each of its cells' rows sees rows query rows of (a prefix several
    // sequences of the ubatch share: more than 1)
    float    rkv_tail_cpu_frac_cells(uint32_t n_tail, double rows = 1.0) const;
    size_t   rkv_win_off (const ggml_tensor * t, uint32_t strm, uint32_t cell) const;
    size_t   rkv_tail_off(const ggml_tensor * t, uint32_t strm, uint32_t cell) const;
    void     rkv_pool_copy(const llama_rkv_pool_copy & c) const;
    // n rows of every split layer's K and V between the window's rows from row0 and the tail's rows at host_of(tail)
    // (promote: tail -> window): a byte copy where the two types agree, else a conversion through f32 on the host, the
    // layers' conversions on several threads at once (the moves of elastic windows and of block residency)
    void     rkv_move_rows(size_t row0, uint32_t n, bool promote,
                           const std::function<char *(const ggml_tensor * tail)> & host_of) const;
    // the converted rows' host staging, grown as needed: pinned where the window's device has a host buffer type (its
    // copies are then the device's own DMA, not a bounce through the driver's buffers)
    mutable ggml_backend_buffer_ptr rkv_staging;
    mutable std::vector<uint8_t>    rkv_staging_pageable;
    uint8_t * rkv_staging_get(const ggml_tensor * win, size_t n) const;

    uint32_t rkv_plan(llama_rkv_state & st, uint32_t kv_size, ggml_type type_k, ggml_type type_v, bool offload,
            const llama_kv_cache::layer_filter_cb & filter, const llama_kv_cache::layer_share_cb & share);
    void rkv_add_tails(ggml_type type_k_tail, ggml_type type_v_tail);
    static void rkv_record_plan(const llama_kv_cache & kv, const llama_kv_split * split, llama_rkv_state & st);

    ggml_tensor * rkv_get_tail(ggml_context * ctx, ggml_tensor * t, uint32_t n_embd_head, uint32_t n_kv,
            const slot_info & sinfo) const;
};

// the layout of the graph a llama_kv_cache_context is building, for its layers after the first
struct llama_rkv_layout_memo {
    llama_rkv_attn_layout layout;
    size_t                ubatch = SIZE_MAX;
    const ggml_tensor *   k_idxs = nullptr;
};

// what the graph asks of a split cache for the ubatch a llama_kv_cache_context is at (llama_kv_cache_context::rkv());
// for a cache that is not split every answer is upstream's (no tail, n_kv mask columns, graphs reusable)
struct llama_kv_split_ctx {
    const llama_kv_split *              split;  // null: not split
    uint32_t                            n_kv;
    const llama_kv_cache::slot_info *   sinfo;
    const llama_ubatch *                ubatch; // null: the worst-case context of a graph reserve
    size_t                              i_ubatch;
    llama_rkv_layout_memo *             memo;

    // tail views of a split layer (nullptr unless split with n_kv > window)
    ggml_tensor * get_k_tail(ggml_context * ctx, int32_t il) const;
    ggml_tensor * get_v_tail(ggml_context * ctx, int32_t il) const;
    // how this ubatch attends a split layer (and, for graph reuse, records it for the graph whose k index input is
    // k_idxs)
    llama_rkv_attn_layout attn_layout(const ggml_tensor * k_idxs) const;
    bool     can_reuse(const ggml_tensor * k_idxs) const;
    bool     is_head_split() const; // the tail views are a head split's host heads (see llama_rkv_build_attn_heads)
    uint32_t mask_cols() const;     // the KQ mask's columns (get_n_kv, but for a cache with block residency)
    // the tail writes, added to gf (no-op unless split)
    void cpy_k_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * k_cur, ggml_tensor * k_idxs, int32_t il) const;
    void cpy_v_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * v_cur, ggml_tensor * v_idxs, int32_t il) const;
};
