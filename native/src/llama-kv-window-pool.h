// rollingkv: elastic windows, the device cells of a split cache's streams as one pool that follows the load.
//
// A window split with several streams (llama-server's slots, -np N without a unified cache) has a budget of capacity =
// n_stream * wc device cells per layer. With static windows every stream owns wc of them, used or not: a short request
// leaves most of its window idle while a long one streams its tail. Here the budget is one pool: stream s keeps cells
// [0, cells[s]) of its sequence in pool rows [base[s], base[s] + cells[s]) and the rest in its host tail, and before
// each ubatch the windows are rebalanced (llama_rkv_pool_rebalance):
//
//   - a window never holds cells beyond the block (256 cells) that covers its stream's cells in use: what a sequence
//     releases (it ended, was truncated or cleared) returns to the pool at once, without a copy;
//   - the streams of the ubatch whose cells in use outgrow their window take free blocks, the smallest deficit first
//     (new tokens then land on the device and the oldest tail blocks move up: promotion);
//   - when the pool is full, idle streams give up their windows, least recently used first: demotion of their newest
//     device blocks to their host rows. A stream is active while it has tokens in the current batch (one llama_decode:
//     a server step, every generating slot's next token and a chunk of a prompt) or the one before; a finished request
//     whose cells llama-server keeps for its prompt cache is idle from the second step after its last token;
//   - once every active stream fits its share, an idle stream keeps at most its share (the excess demoted once), so
//     that the windows return to the static layout (below) instead of an idle window holding the pool off it;
//   - an active stream never loses cells to another active one: the bytes streamed per step are the same however the
//     pool is shared among them, and moving cells between them would only cost copies.
//
// Windows sit in stream order. While every window fits its share (capacity / n_stream) they sit where static windows
// would, at one stride: a ubatch whose streams are all within their windows then attends them as upstream does, in one
// op over a strided view (no overhead against static windows or the resident cache). A window that outgrows its share
// stays where it is while it ends before the next window, else the pool repacks, the free cells spread evenly as gaps
// between windows (so that each can grow in place again). Moves are byte copies between rows of one type, hence exact;
// they run between ubatches, after the previous graph finished. This file is the policy and the copy list only (no
// tensors): llama-kv-cache-split.cpp carries the copies out, and the pool simulation test library
// (rollingkv/pool-simulate.cpp) checks them on given figures.
#pragma once

#include <cstdint>
#include <vector>

static const uint32_t LLAMA_RKV_POOL_BLOCK = 256;

struct llama_rkv_window_pool {
    uint32_t n_stream = 0;
    uint32_t kv_size  = 0; // cells per stream
    uint32_t capacity = 0; // pool rows: every window lies in [0, capacity)
    uint32_t share    = 0; // the static layout's window per stream: stream s at rows [s*share, (s + 1)*share)

    std::vector<uint32_t> base;      // first pool row of each stream's window
    std::vector<uint32_t> cells;     // window size of each stream: its cells [0, cells[s]) are on the device
    std::vector<uint64_t> last_used;  // the ubatch count when the stream was last in a ubatch (0: never)
    std::vector<uint64_t> last_batch; // the batch count when the stream was last in a batch (0: never)

    uint64_t n_ubatch = 0;
    uint64_t n_batch  = 0;
    uint64_t epoch    = 0; // bumped by every change of a window: graphs built before attend stale views

    // totals, in cells (a cell: one row of every split layer's K and V)
    uint64_t promoted  = 0;
    uint64_t demoted   = 0;
    uint64_t relocated = 0;
    uint64_t n_rebalance = 0; // ubatches before which a window changed

    void init(uint32_t n_stream, uint32_t kv_size, uint32_t capacity);
};

// one copy of cells [cell0, cell0 + n) of stream strm: DEMOTE from pool rows starting at row_src to the stream's host
// rows, RELOCATE from pool rows at row_src to pool rows at row_dst (never overlapping), PROMOTE from the host rows to
// pool rows at row_dst. To be carried out in list order.
struct llama_rkv_pool_copy {
    enum kind_t : uint8_t { DEMOTE, RELOCATE, PROMOTE };
    kind_t   kind;
    uint32_t strm;
    uint32_t cell0;
    uint32_t n;
    uint32_t row_src;
    uint32_t row_dst;
};

// A batch (one llama_decode) with tokens of the streams in_batch[s] begins: they are active for it and the next one.
void llama_rkv_pool_begin_batch(llama_rkv_window_pool & pool, const std::vector<uint8_t> & in_batch);

// Rebalances the pool before a ubatch. ext_old[s]: stream s's cells in use (used_max_p1) before the ubatch, ext_new[s]:
// after it (the ubatch's cells included); in_ubatch[s]: s has tokens in it. Updates pool (windows, bases, counters,
// epoch) and returns the copies that move the rows of cells in use (< ext_old) to where the new windows put them; the
// ubatch's own cells are written by its graph at their new places.
std::vector<llama_rkv_pool_copy> llama_rkv_pool_rebalance(
        llama_rkv_window_pool & pool,
        const std::vector<uint32_t> & ext_old,
        const std::vector<uint32_t> & ext_new,
        const std::vector<uint8_t>  & in_ubatch);
