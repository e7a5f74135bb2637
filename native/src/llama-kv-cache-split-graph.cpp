// rollingkv: the graph side of a split llama_kv_cache (see llama-kv-cache-split.cpp for the layout): the window and
// tail views a split layer attends, the per-stream layout of the attention and whether a graph may be reused, the
// writes of new K/V rows, the index inputs and the K-shift; and what a llama_kv_cache_context asks of them
// (llama_kv_split_ctx).
#include "llama-kv-cache-split.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-context.h"
#include "llama-kv-residency.h"
#include "ggml-rolling-kv.h"
#include "ggml-alloc.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>

//
// graph
//

ggml_tensor * llama_kv_split::rkv_get_window(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo,
                                             bool is_v) const {
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

    if (rkv_blocks) {
        // the pool's slots through the highest in use (the mask's first columns)
        return ggml_view_4d(ctx, t,
                n_embd_head, t->ne[0]/n_embd_head, (int64_t) rkv_blk_pool_n()*256, 1,
                ggml_row_size(t->type, n_embd_head), t->nb[1], t->nb[2], 0);
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

// the tail view of one layer's K or V tail t (rows of n_embd_head per KV head) that a graph at n_kv cells attends
ggml_tensor * llama_kv_split::rkv_get_tail(ggml_context * ctx, ggml_tensor * t, uint32_t n_embd_head, uint32_t n_kv,
        const slot_info & sinfo) const {
    if (rkv_head) {
        // every cell of the host heads (none: the layer is whole on the device)
        return t ? llama_rkv_tail_view(ctx, t, n_embd_head, n_kv, sinfo) : nullptr;
    }
    if (rkv_elastic) {
        // every row of the ubatch's streams (the per-stream attention takes each one's tail cells); none when every
        // stream is within its window
        if (rkv_elastic_whole(n_kv, sinfo)) {
            return nullptr;
        }
        return llama_rkv_tail_view(ctx, t, n_embd_head, get_size(), sinfo);
    }
    if (rkv_blocks) {
        return llama_rkv_tail_view(ctx, t, n_embd_head, n_kv, sinfo); // a row for every cell, in order
    }
    if (!rkv_wc || n_kv <= rkv_wc) {
        return nullptr;
    }
    return llama_rkv_tail_view(ctx, t, n_embd_head, n_kv - rkv_wc, sinfo);
}

ggml_tensor * llama_kv_split::rkv_get_k_tail(ggml_context * ctx, int32_t il, uint32_t n_kv,
                                             const slot_info & sinfo) const {
    return rkv_get_tail(ctx, layers[map_layer_ids.at(il)].k_tail, hparams.n_embd_head_k(il), n_kv, sinfo);
}

ggml_tensor * llama_kv_split::rkv_get_v_tail(ggml_context * ctx, int32_t il, uint32_t n_kv,
                                             const slot_info & sinfo) const {
    return rkv_get_tail(ctx, layers[map_layer_ids.at(il)].v_tail, hparams.n_embd_head_v(il), n_kv, sinfo);
}

uint32_t llama_kv_split::rkv_stream_n_kv(uint32_t strm) const {
    // as get_n_kv for one stream
    const uint32_t n_pad_cur = std::max(n_pad, 256u);
    const auto & cells = v_cells[strm];
    return std::min(cells.size(), std::max(n_pad_cur, GGML_PAD(cells.used_max_p1(), n_pad_cur)));
}

// The tail blocks (256 cells from the tail's first cell) of one stream that a ubatch reads: those holding a cell of one
// of its sequences. Every other cell is masked for each of its queries (another sequence's, or empty), so leaving those
// blocks out changes no result: as runs of blocks, at most GGML_RKV_MAX_TAIL_RUNS of them (the closest runs are joined,
// reading the masked blocks between them). The whole tail: no runs. None read: the first block (a tail the op keeps, so
// that the kernels' paths and chunking stay those of the whole key range, at the cost of one block). rows: how many of
// the ubatch's sequences see a cell it reads, on average (a prefix its sequences share counts once for each: the CPU
// part dots such a cell once per row), counted only with count_rows (a ubatch that takes a CPU part: without the count
// a read block is known at its first read cell, where counting reads every cell of the tail).
static void llama_rkv_tail_runs(const llama_kv_cells & cells, uint32_t tail0, uint32_t n_kv,
        const llama_ubatch & ubatch, const std::vector<int32_t> * blk_slot, bool count_rows,
        std::vector<uint32_t> & first, std::vector<uint32_t> & n, double & rows) {
    first.clear();
    n.clear();
    rows = 1.0;
    if (n_kv <= tail0 || ubatch.n_seqs_unq == 0) {
        return;
    }
    uint64_t n_seen = 0, n_views = 0; // cells some sequence of the ubatch holds, and (cell, such sequence) pairs
    const uint32_t n_tail = n_kv - tail0;
    const uint32_t block  = 256;
    llama_kv_cells::seq_set_t seqs; // the ubatch's sequences
    for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
        seqs.set(ubatch.seq_id_unq[s]);
    }
    std::vector<std::pair<uint32_t, uint32_t>> runs; // [first, end) in tail cells
    for (uint32_t b0 = 0; b0 < n_tail; b0 += block) {
        const uint32_t b1 = std::min(n_tail, b0 + block);
        if (blk_slot && (*blk_slot)[(tail0 + b0)/block] >= 0) {
            continue; // block residency: the block is on the device (its tail rows are stale, masked)
        }
        bool read = false;
        for (uint32_t i = tail0 + b0; i < tail0 + b1 && (count_rows || !read); ++i) {
            const auto & held = cells.seq_get_all(i); // an empty cell holds no sequence
            if (!(held & seqs).any()) {
                continue;
            }
            read = true;
            // a decode ubatch has few sequences: testing their bits beats a 256-bit popcount, which the library's
            // baseline x86-64 build has no instruction for
            uint32_t k = 0;
            for (uint32_t s = 0; count_rows && s < ubatch.n_seqs_unq; ++s) {
                k += held.test(ubatch.seq_id_unq[s]) ? 1 : 0;
            }
            n_seen  += 1;
            n_views += k;
        }
        if (!read) {
            continue;
        }
        if (!runs.empty() && runs.back().second == b0) {
            runs.back().second = b1;
        } else {
            runs.push_back({ b0, b1 });
        }
    }
    rows = count_rows && n_seen ? (double) n_views/n_seen : 1.0;
    if (runs.empty()) {
        runs.push_back({ 0, std::min(n_tail, block) });
    }
    while (runs.size() > GGML_RKV_MAX_TAIL_RUNS) {
        size_t j = 0; // join the runs with the smallest gap
        for (size_t k = 1; k + 1 < runs.size(); ++k) {
            if (runs[k + 1].first - runs[k].second < runs[j + 1].first - runs[j].second) {
                j = k;
            }
        }
        runs[j].second = runs[j + 1].second;
        runs.erase(runs.begin() + j + 1);
    }
    if ((runs.size() == 1 && runs[0].first == 0 && runs[0].second == n_tail) ||
            (n_tail + block - 1)/block > GGML_RKV_MAX_TAIL_RUN_BLOCKS) {
        return; // the whole tail (a tail past the runs' reach too: exact, only more read)
    }
    for (const auto & r : runs) {
        first.push_back(r.first);
        n.push_back(r.second - r.first);
    }
}

// The CPU part of a tail read in runs: it attends the far end [n_tail - n, n_tail) of the tail, and of those cells only
// the runs' hold keys some row sees (the others are masked for every row: an F16 K's are not even read). So its share is
// taken of the runs' cells (the bytes the step attends), the boundary at the block from which the runs' cells past it
// come closest to the share: taken of the whole tail instead, a tail whose far end holds idle sequences or holes left
// the CPU part little and the link the rest.
static uint32_t llama_rkv_runs_cpu_cells(uint32_t n_tail, const std::vector<uint32_t> & first,
                                         const std::vector<uint32_t> & n, const std::function<float(uint32_t)> & frac) {
    uint32_t n_read = 0;
    for (const uint32_t c : n) {
        n_read += c;
    }
    const float f = n_read ? frac(n_read) : 0.0f;
    if (!(f > 0.0f)) {
        return 0;
    }
    if (f >= 1.0f) {
        return n_tail;
    }
    const double want = (double) f*n_read;
    uint32_t best = n_tail, past = 0; // the boundary, and the runs' cells past the current one
    double best_err = want;           // boundary n_tail: no cell on the CPU
    for (int64_t b = (int64_t) (n_tail - 1)/256*256; b >= 0 && past < want; b -= 256) {
        past = 0;
        for (size_t r = 0; r < first.size(); ++r) {
            const uint32_t r1 = first[r] + n[r];
            past += r1 > b ? r1 - std::max<uint32_t>(first[r], (uint32_t) b) : 0;
        }
        const double err = std::fabs(past - want);
        if (err < best_err) {
            best_err = err;
            best     = (uint32_t) b;
        }
    }
    return n_tail - best;
}

llama_rkv_attn_layout llama_kv_split::rkv_attn_layout(uint32_t n_kv, const slot_info & sinfo, bool full,
                                                      const llama_ubatch * ubatch) const {
    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;
    // the query rows per stream: a prompt's ubatch has more than a CPU part takes (GGML_RKV_CPU_PART_MAX_Q), so none
    // (the graph, which also builds ubatch-less worst-case graphs, checks the same on the op's Q)
    const double q_rows   = ubatch ? (double) ubatch->n_tokens/ns : 1.0;
    const bool   cpu_part = q_rows <= GGML_RKV_CPU_PART_MAX_Q;
    // the query rows that see each tail cell: a stream's tokens (one sequence's), or in a unified stream its sequences
    // per cell the ubatch reads (llama_rkv_tail_runs: a shared prefix is seen by each of its sequences)
    double rows = std::max(1.0, q_rows);
    // the one place a share becomes the cells the op attends on the CPU (the graph, the stats and the backend agree)
    const std::function<float(uint32_t)> frac_of = [this, &rows, cpu_part](uint32_t n) {
        return cpu_part ? rkv_tail_cpu_frac_cells(n, rows) : 0.0f;
    };
    const auto cpu_cells = [&frac_of](uint32_t n_tail) {
        return (uint32_t) ggml_rkv_tail_cpu_cells(n_tail, frac_of(n_tail));
    };
    llama_rkv_attn_layout lay;
    lay.perturb_tail   = rkv_st ? rkv_st->test.perturb_tail : 0.0f;
    lay.n_win          = rkv_head ? 0 : rkv_wc;
    if (rkv_blocks) {
        // the pool's slots in use, then every cell's tail row; of the tail, the blocks the ubatch reads that are not on
        // the device (llama-kv-cache-blocks.cpp). The CPU part's share is of the cells past those the pool holds, not
        // of every cell's tail row (frac x n_kv gave the CPU more cells than the host held, and left the link idle)
        lay.n_win = rkv_blk_pool_n()*256;
        if (!full && ubatch) {
            llama_rkv_tail_runs(v_cells[0], 0, n_kv, *ubatch, &rkv_blk_slot, cpu_part, lay.run_first, lay.run_n, rows);
        }
        // the op's tail is every cell's row (n_kv), the runs the blocks in it that are not on the device
        lay.tail_cpu_cells = lay.run_first.empty() ? cpu_cells(n_kv > lay.n_win ? n_kv - lay.n_win : 0)
                                                   : llama_rkv_runs_cpu_cells(n_kv, lay.run_first, lay.run_n, frac_of);
        return lay;
    }

    const uint32_t n_tail = rkv_head ? n_kv : n_kv > rkv_wc ? n_kv - rkv_wc : 0;
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
            lay.cpu_cells.push_back(cpu_cells(n_s > w ? n_s - w : 0));
        }
        return lay;
    }
    if (rkv_split() && ns == 1 && !full && ubatch) {
        // one op over one stream (a unified cache holds every sequence in it): the tail blocks the ubatch reads
        llama_rkv_tail_runs(v_cells[sinfo.s0], rkv_head ? 0 : rkv_wc, n_kv, *ubatch, nullptr, cpu_part, lay.run_first,
                            lay.run_n, rows);
    }
    lay.tail_cpu_cells = lay.run_first.empty() ? cpu_cells(n_tail)
                                               : llama_rkv_runs_cpu_cells(n_tail, lay.run_first, lay.run_n, frac_of);
    if (!rkv_split() || ns < 2) {
        return lay;
    }
    // one op per stream, each over its own cells: a stream's cells past its own n_kv are all masked for its tokens,
    // so leaving them out changes nothing but the bytes read (the worst-case graph: every stream at n_kv)
    for (uint32_t s = 0; s < ns; ++s) {
        const uint32_t n_s = full ? n_kv : std::min(n_kv, rkv_stream_n_kv(sinfo.s0 + s));
        lay.n_kv.push_back(n_s);
        lay.cpu_cells.push_back(cpu_cells(rkv_head ? n_s : n_s > rkv_wc ? n_s - rkv_wc : 0));
    }
    return lay;
}

llama_rkv_graph_note & llama_kv_split::rkv_graph_note(const ggml_tensor * k_idxs) const {
    for (auto & e : rkv_graph_cells) {
        if (e.k_idxs == k_idxs) {
            return e;
        }
    }
    // llama_context keeps two graphs for reuse (each with a k and a v index input); a few more entries cover graphs
    // whose inputs were freed
    if (rkv_graph_cells.size() >= 16) {
        rkv_graph_cells.erase(rkv_graph_cells.begin());
    }
    rkv_graph_cells.push_back({ k_idxs, {}, {}, rkv_pool.epoch, false, nullptr });
    return rkv_graph_cells.back();
}

// the one op's tail runs as (first, n) pairs
static std::vector<uint32_t> llama_rkv_runs_of(const llama_rkv_attn_layout & layout) {
    std::vector<uint32_t> runs;
    for (size_t r = 0; r < layout.run_first.size(); ++r) {
        runs.push_back(layout.run_first[r]);
        runs.push_back(layout.run_n[r]);
    }
    return runs;
}

llama_rkv_attn_layout llama_kv_split::rkv_graph_layout(const ggml_tensor * k_idxs, uint32_t n_kv,
        const slot_info & sinfo, bool full, const llama_ubatch * ubatch) const {
    llama_rkv_graph_note & e = rkv_graph_note(k_idxs);
    llama_rkv_attn_layout lay = rkv_attn_layout(n_kv, sinfo, full, ubatch);
    lay.block_map = e.block_map;
    lay.views     = &rkv_views;
    GGML_ASSERT(!rkv_blocks || lay.block_map);
    e.n_kv       = lay.n_kv;
    e.runs       = llama_rkv_runs_of(lay);
    e.epoch      = rkv_pool.epoch;
    e.per_stream = true;
    return lay;
}

bool llama_kv_split::rkv_can_reuse(const ggml_tensor * k_idxs, uint32_t n_kv, const slot_info & sinfo, bool full,
        const llama_ubatch * ubatch) const {
    if (!rkv_split()) {
        return true;
    }
    const llama_rkv_attn_layout lay = rkv_attn_layout(n_kv, sinfo, full, ubatch);
    for (const auto & e : rkv_graph_cells) {
        if (e.k_idxs != k_idxs) {
            continue;
        }
        // elastic windows: a graph's views hold the windows as they were when it was built
        if (rkv_elastic && e.epoch != rkv_pool.epoch) {
            return false;
        }
        if (e.per_stream) {
            return e.n_kv == lay.n_kv && e.runs == llama_rkv_runs_of(lay);
        }
        break;
    }
    // not built through the split's attention (no layer attended a tail): upstream's attention over the window
    if (rkv_elastic) {
        return rkv_elastic_whole(n_kv, sinfo);
    }
    return lay.n_kv.empty() || n_kv <= lay.n_win;
}

void llama_kv_split::rkv_note_step(const slot_info & sinfo, const llama_ubatch & ubatch) const {
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
    const llama_rkv_attn_layout lay = rkv_attn_layout(n_kv, sinfo, false, &ubatch);

    // a stream's cells in use on the device (its window) and in host memory (its tail)
    const auto count_cells = [this](uint32_t strm) -> std::pair<uint32_t, uint32_t> {
        const auto & cells = v_cells[strm];
        uint32_t dev = 0, host = 0;
        for (uint32_t i = 0, n = cells.used_max_p1(); i < n; ++i) {
            if (!cells.is_empty(i)) {
                (!rkv_head && rkv_on_dev(strm, i) ? dev : host) += 1;
            }
        }
        return { rkv_head ? host : dev, host }; // head split: every cell's device heads and host heads
    };

    uint64_t tail = 0, stream = 0, occupied = 0;
    std::vector<std::pair<uint32_t, std::pair<uint32_t, uint32_t>>> cells_of; // (stream, (device, tail) cells in use)
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        const uint32_t wc = rkv_head || rkv_blocks ? 0 : rkv_win_cells(strm); // block residency: a tail row per cell
        const auto dh = count_cells(strm);
        const uint32_t host = dh.second;
        cells_of.push_back({ strm, dh });

        const uint32_t n_s    = lay.n_kv.empty() ? n_kv : lay.n_kv[s];
        GGML_ASSERT(lay.n_kv.empty() || (uint32_t) sinfo.strm[s] == sinfo.s0 + s);
        const uint32_t n_tail = n_s > wc ? n_s - wc : 0;
        const uint32_t n_cpu  = std::min(n_tail, lay.n_kv.empty() ? lay.tail_cpu_cells : lay.cpu_cells[s]);
        // the tail's cells the op reads (its runs: the ubatch's sequences' blocks) and, of those, the ones that stream
        // (not in the CPU part)
        uint32_t n_read = n_tail, n_streamed = n_tail - n_cpu;
        if (!lay.run_first.empty()) {
            n_read = n_streamed = 0;
            for (size_t r = 0; r < lay.run_first.size(); ++r) {
                const uint32_t r0 = lay.run_first[r], r1 = r0 + lay.run_n[r];
                n_read     += r1 - r0;
                n_streamed += std::min(r1, n_tail - n_cpu) > r0 ? std::min(r1, n_tail - n_cpu) - r0 : 0;
            }
        }
        tail     += n_read;
        stream   += streamed ? n_streamed : 0;
        occupied += host;
    }
    if (rkv_elastic) {
        // the moves before this ubatch may have demoted or relocated streams outside it: their counts follow the pool
        for (uint32_t strm = 0; strm < n_stream; ++strm) {
            if (std::none_of(cells_of.begin(), cells_of.end(), [strm](const auto & c) { return c.first == strm; })) {
                cells_of.push_back({ strm, count_cells(strm) });
            }
        }
    }

    // one stream holding several sequences (a unified cache): where each sequence's cells are, and the tail cells that
    // hold one of the ubatch's sequences (the bytes its runs must read: the rest they read is others' cells and holes)
    std::vector<uint32_t> seq_dev, seq_tail;
    uint64_t own = occupied;
    if (n_stream == 1 && n_seq_max > 1) {
        seq_dev.assign(n_seq_max, 0);
        seq_tail.assign(n_seq_max, 0);
        llama_kv_cells::seq_set_t mine;
        for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
            mine.set(ubatch.seq_id_unq[s]);
        }
        own = 0;
        const auto & cells = v_cells[0];
        for (uint32_t i = 0, n = cells.used_max_p1(); i < n; ++i) {
            if (cells.is_empty(i)) {
                continue;
            }
            const bool on_dev = !rkv_head && rkv_on_dev(0, i);
            own += !on_dev && (cells.seq_get_all(i) & mine).any() ? 1 : 0;
            auto & to = on_dev ? seq_dev : seq_tail;
            if (cells.seq_count(i) == 1) {
                to[cells.seq_get(i)] += 1;
                continue;
            }
            for (uint32_t s = 0; s < n_seq_max; ++s) {
                to[s] += cells.seq_has(i, (llama_seq_id) s) ? 1 : 0;
            }
        }
        if (rkv_head) {
            seq_dev = seq_tail; // every cell's device heads and host heads
        }
    }

    std::lock_guard<std::mutex> lock(rkv_live->mtx);
    llama_rkv_live & lv = *rkv_live;
    lv.block_bytes = 256*cell_bytes;
    lv.seq_device_cells = std::move(seq_dev);
    lv.seq_tail_cells   = std::move(seq_tail);
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
    lv.last_tail_runs      = (uint32_t) lay.run_first.size();
    lv.last_tail_bytes     = tail*cell_bytes;
    lv.last_streamed_bytes = stream*cell_bytes;
    lv.last_occupied_bytes = occupied*cell_bytes;
    lv.last_own_bytes      = own*cell_bytes;
    lv.beyond_own_bytes_max = std::max(lv.beyond_own_bytes_max, tail > own ? (tail - own)*cell_bytes : 0);
    lv.tail_bytes     += lv.last_tail_bytes;
    lv.streamed_bytes += lv.last_streamed_bytes;
    lv.occupied_bytes += lv.last_occupied_bytes;
}

ggml_tensor * llama_kv_split::rkv_cpy(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_v,
                                      bool tail) const {
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

ggml_tensor * llama_kv_split::rkv_cpy_k_tail(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_idxs,
                                             int32_t il) const {
    return rkv_split() ? rkv_cpy(ctx, k_cur, k_idxs, il, false, true) : nullptr;
}

ggml_tensor * llama_kv_split::rkv_cpy_v_tail(ggml_context * ctx, ggml_tensor * v_cur, ggml_tensor * v_idxs,
                                             int32_t il) const {
    return rkv_split() ? rkv_cpy(ctx, v_cur, v_idxs, il, true, true) : nullptr;
}

ggml_tensor * llama_kv_split::rkv_build_input_idxs(ggml_context * ctx, const llama_ubatch & ubatch,
                                                   const char * name) const {
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

    // block residency: the graph's block map, an input set with the k indices (rkv_set_input_idxs)
    ggml_tensor * map = nullptr;
    if (rkv_blocks && strcmp(name, "attn_inp_k_idxs") == 0) {
        map = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) rkv_blk_slot.size());
        ggml_set_input(map);
        ggml_set_name(map, "attn_inp_rkv_block_map");
    }

    // a graph built now holds the windows of now (elastic windows: rkv_can_reuse compares them)
    rkv_graph_note(idxs) = { idxs, {}, {}, rkv_pool.epoch, false, map };

    return idxs;
}

bool llama_kv_split::rkv_set_input_idxs(ggml_tensor * dst, const llama_ubatch * ubatch, const slot_info & sinfo,
        bool is_k) const {
    if (is_k) {
        rkv_note_step(sinfo, *ubatch); // once per ubatch: what it attends of each stream's tail (stats json)
    }
    if (!rkv_wc) {
        return false;
    }
    const uint32_t n_tokens = ubatch->n_tokens;
    GGML_ASSERT(n_tokens == (int64_t) sinfo.size()*sinfo.n_stream());
    GGML_ASSERT(dst->ne[0] == n_tokens && dst->ne[1] == 2);

    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int64_t * data = (int64_t *) dst->data;

    const int64_t rows_w  = rkv_wc + 1;                                // window rows per slab (last: trash)
    const int64_t rows_t  = (int64_t) get_size() - rkv_tail_first + 1; // tail rows per stream (last: trash)
    // elastic windows: the pool's trash row is the last row of all slabs
    const int64_t trash_pool = (int64_t) n_stream*rows_w - 1;

    if (rkv_blocks) {
        // a token's window row is its block's slot's (or the trash row), its tail row its cell (or the trash row)
        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            const int64_t cell = sinfo.idxs[0][i];
            const int32_t slot = rkv_blk_slot[cell/256];
            data[i]            = slot >= 0 ? (int64_t) slot*256 + cell % 256 : rkv_wc;
            data[n_tokens + i] = slot >= 0 ? rows_t - 1 : cell;
        }
        for (const auto & e : rkv_graph_cells) {
            if (e.k_idxs == dst && e.block_map && e.block_map->buffer) {
                rkv_blk_set_input_map(e.block_map);
            }
        }
        return true;
    }

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
    return true;
}

void llama_kv_split::rkv_build_shift_layer(const llama_cparams & cparams, ggml_context * ctx, ggml_cgraph * gf,
        uint32_t il, ggml_tensor * k_shift, ggml_tensor * k_rot) const {
    const layer_t & layer = layers[map_layer_ids.at(il)];

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

    // the pieces to rotate: (tensor, first cell, cells, byte offset of the first cell's row)
    struct piece { ggml_tensor * t; uint32_t s, first, n_cell; size_t row0; };
    std::vector<piece> pieces;
    for (uint32_t s = 0; s < n_stream; ++s) {
        if (rkv_blocks) {
            // each slot's block in the window, and every cell's tail row (those of blocks on the device are stale:
            // rotated for nothing, overwritten when the block is demoted)
            for (uint32_t slot = 0; slot < rkv_slot_blk.size(); ++slot) {
                if (rkv_slot_blk[slot] >= 0) {
                    pieces.push_back({ layer.k, s, (uint32_t) rkv_slot_blk[slot]*256, 256,
                                      (size_t) slot*256*layer.k->nb[1] });
                }
            }
            pieces.push_back({ layer.k_tail, s, 0, kv_size, 0 });
            continue;
        }
        const uint32_t wc = rkv_head ? 0 : rkv_win_cells(s);
        for (int part = 0; part < 2; ++part) {
            // window: cells [0, wc) and [wc, kv_size) of every head; head: every cell of the device's and the host's
            // heads
            ggml_tensor * t       = part == 0 ? layer.k : layer.k_tail;
            const uint32_t first  = part == 0 || rkv_head ? 0 : wc;
            const uint32_t n_cell = rkv_head ? kv_size : part == 0 ? wc : kv_size - wc;
            if (!t || n_cell == 0) {
                continue;
            }
            const size_t row0 = rkv_head ? s*t->nb[2] : part == 0 ? rkv_win_off(t, s, 0) : rkv_tail_off(t, s, first);
            pieces.push_back({ t, s, first, n_cell, row0 });
        }
    }
    for (const piece & pc : pieces) {
        {
            ggml_tensor *  t      = pc.t;
            const uint32_t s      = pc.s;
            const uint32_t first  = pc.first;
            const uint32_t n_cell = pc.n_cell;
            const size_t   row0   = pc.row0;

            ggml_tensor * k = ggml_view_3d(ctx, t,
                    n_rot, t->ne[0]/n_embd_head_k, n_cell,
                    ggml_row_size(t->type, n_embd_head_k),
                    t->nb[1],
                    row0 + ggml_row_size(t->type, n_embd_nope));

            // the shift input is [kv_size*n_stream], cells in order per stream (one view of each part for every layer:
            // llama_rkv_input_views)
            ggml_tensor * shift = llama_rkv_input_view_1d(ctx, &rkv_views, k_shift, n_cell,
                    ((size_t) s*kv_size + first)*ggml_element_size(k_shift));

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
// llama_kv_cache_context
//

llama_kv_split_ctx llama_kv_cache_context::rkv() const {
    if (!rkv_memo) {
        rkv_memo = std::make_shared<llama_rkv_layout_memo>();
    }
    return { kv->get_split(), (uint32_t) n_kv, &sinfos[i_cur], ubatches.empty() ? nullptr : &ubatches[i_cur], i_cur,
             rkv_memo.get() };
}

ggml_tensor * llama_kv_split_ctx::get_k_tail(ggml_context * ctx, int32_t il) const {
    return split ? split->rkv_get_k_tail(ctx, il, n_kv, *sinfo) : nullptr;
}

ggml_tensor * llama_kv_split_ctx::get_v_tail(ggml_context * ctx, int32_t il) const {
    return split ? split->rkv_get_v_tail(ctx, il, n_kv, *sinfo) : nullptr;
}

llama_rkv_attn_layout llama_kv_split_ctx::attn_layout(const ggml_tensor * k_idxs) const {
    if (!split) {
        return {};
    }
    // once per graph: every layer attends the same cells (the runs scan the stream's cells)
    if (memo->ubatch != i_ubatch || memo->k_idxs != k_idxs) {
        memo->layout = split->rkv_graph_layout(k_idxs, n_kv, *sinfo, ubatch == nullptr, ubatch);
        memo->ubatch = i_ubatch;
        memo->k_idxs = k_idxs;
    }
    return memo->layout;
}

bool llama_kv_split_ctx::can_reuse(const ggml_tensor * k_idxs) const {
    return !split || split->rkv_can_reuse(k_idxs, n_kv, *sinfo, ubatch == nullptr, ubatch);
}

bool llama_kv_split_ctx::is_head_split() const {
    return split && split->rkv_head_split();
}

uint32_t llama_kv_split_ctx::mask_cols() const {
    return split ? split->rkv_mask_cols(n_kv) : n_kv;
}

void llama_kv_split_ctx::cpy_k_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * k_cur, ggml_tensor * k_idxs,
                                    int32_t il) const {
    if (ggml_tensor * t = split ? split->rkv_cpy_k_tail(ctx, k_cur, k_idxs, il) : nullptr) {
        ggml_build_forward_expand(gf, t);
    }
}

void llama_kv_split_ctx::cpy_v_tail(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * v_cur, ggml_tensor * v_idxs,
                                    int32_t il) const {
    if (ggml_tensor * t = split ? split->rkv_cpy_v_tail(ctx, v_cur, v_idxs, il) : nullptr) {
        ggml_build_forward_expand(gf, t);
    }
}
