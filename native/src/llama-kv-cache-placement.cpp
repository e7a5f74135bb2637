// rollingkv: where a unified cache puts a ubatch's tokens: each sequence's cells in 256-cell blocks of its own.
//
// Upstream's find_slot gives a ubatch the first free cells from the stream's head, so in one stream holding several
// sequences a decode step of N sequences takes N cells side by side and every block ends up holding cells of all of
// them. A split cache reads and streams whole blocks (the op's tail runs), and block residency moves whole blocks: a
// block read for one sequence carries the others' cells across the link. Placed by sequence, a token goes to
//   1. the next free cell of its sequence's newest block (the block of the sequence's last cell, after that cell),
//   2. else the lowest block of which no cell is in use (nor taken by this ubatch),
// and a ubatch with a token that neither gives is placed as upstream places it (a cache nearly full, or fragmented).
// The cells' metadata, the mask and the attention are upstream's: only the cells chosen change. On the CPU the
// result depends on the cells' order (the key-range chunking), so a resident reference asks for the same placement
// (LLAMA_KV_PLACEMENT_SEQUENCES).
#include "llama-kv-cache-placement.h"

#include "llama-batch.h"
#include "llama-kv-cache-split.h"
#include "llama-kv-residency.h"

#include <unordered_set>
#include <vector>

bool llama_rkv_placement::wanted(llama_rkv_state * st, const llama_kv_split * split, uint32_t n_stream,
        uint32_t n_seq_max) {
    if (!st || n_stream != 1 || n_seq_max < 2) {
        return false; // one sequence per stream: upstream's append is already by sequence
    }
    const bool res = st->req.placement == LLAMA_KV_PLACEMENT_SEQUENCES ||
                     (st->req.placement == LLAMA_KV_PLACEMENT_AUTO && split && split->rkv_window_cells() > 0);
    st->placed_by_seq = st->placed_by_seq || res;
    return res;
}

bool llama_rkv_placement::find_slot(const llama_kv_cache & kv, const llama_ubatch & ubatch, slot_info & res) {
    if (kv.n_stream != 1 || ubatch.n_tokens == 0) {
        return false;
    }
    const llama_kv_cells & cells = kv.v_cells[0];
    const uint32_t size = cells.size();
    const uint32_t B    = LLAMA_RKV_WINDOW_ALIGN;
    const uint32_t NONE = UINT32_MAX;

    std::vector<uint32_t> last(LLAMA_MAX_SEQ, NONE); // each sequence's last cell: the cache's, then this ubatch's
    std::vector<bool>     looked(LLAMA_MAX_SEQ, false);
    std::unordered_set<uint32_t> taken;  // cells this ubatch took
    std::unordered_set<uint32_t> fresh;  // blocks this ubatch opened
    uint32_t next_blk = 0;               // no free block below it (the search only moves up within a ubatch)

    auto block_free = [&](uint32_t b) {
        if (fresh.count(b)) {
            return false;
        }
        const uint32_t c1 = std::min(size, (b + 1) * B);
        for (uint32_t c = b * B; c < c1; ++c) {
            if (!cells.is_empty(c)) {
                return false;
            }
        }
        return true;
    };

    std::vector<uint32_t> idxs;
    idxs.reserve(ubatch.n_tokens);
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        const llama_seq_id s = ubatch.seq_id[i][0];
        if (!looked[s]) {
            looked[s] = true;
            const auto & sp = cells.seq_pos_get(s);
            if (!sp.empty()) {
                last[s] = sp.rbegin()->second; // the cell of its largest position
            }
        }
        uint32_t cell = NONE;
        if (last[s] != NONE) {
            const uint32_t end = std::min(size, (last[s] / B + 1) * B);
            for (uint32_t c = last[s] + 1; c < end; ++c) {
                if (cells.is_empty(c) && !taken.count(c)) {
                    cell = c;
                    break;
                }
            }
        }
        if (cell == NONE) {
            while (next_blk * B < size && !block_free(next_blk)) {
                ++next_blk;
            }
            if (next_blk * B >= size) {
                return false; // no free block left: upstream's placement for the whole ubatch
            }
            fresh.insert(next_blk);
            cell = next_blk * B;
        }
        taken.insert(cell);
        last[s] = cell;
        idxs.push_back(cell);
    }

    res.s0 = 0;
    res.s1 = 0;
    res.resize(1);
    res.strm[0] = 0;
    res.idxs[0] = std::move(idxs);
    return true;
}
