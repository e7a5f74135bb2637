// rollingkv: block residency of a unified split cache (see llama-kv-cache-split.h, rkv_blocks).
//
// llama-server's default cache is one stream that holds every slot's sequence. A static window keeps whatever cells
// land in [0, wc) on the device: a finished request's cached prompt keeps them while a new request's cells spill. Here
// the window's rows are a pool of 256-row slots, each holding one logical block of 256 cells, and between ubatches the
// blocks follow the load:
//
//  1. A slot whose block holds no cell in use is free at once (no copy).
//  2. The blocks the ubatch writes, then the blocks its sequences read (oldest first), take free slots: a new token
//     lands on the device, and a sequence's spilled blocks come back (promotion: its tail rows -> the slot's rows).
//     Blocks with more readers (4.) go first.
//  3. When no slot is free, a block no ubatch read or wrote in the last LLAMA_RKV_BLK_IDLE ubatches gives its slot up,
//     the least recently used first (demotion: the slot's rows -> its tail rows).
//  4. A block's worth is its readers: the active sequences (held by a ubatch in the last LLAMA_RKV_BLK_IDLE) with a
//     cell in it. A prefix shared across slots (seq_cp) is read by each of its sequences' ubatches, so on the device it
//     saves a copy for each of them. The ubatch's blocks come back most readers first, and when no idle slot is left a
//     block this ubatch does not read gives its slot up to one with strictly more readers (the fewest readers first).
//     An active block never gives way to one with as many readers: the bytes a step streams do not depend on which of
//     them are on the device when every reader is in the step, so such a swap would only cost copies, and could
//     ping-pong between two growing requests; a strictly larger count cannot swap back while the readers stay. That is
//     the hysteresis.
//
// Cells never move: find_slot, the cells' metadata and the mask stay those of the resident cache. The op attends the
// logical keys in their order through a block map (ggml_streaming_flash_attn_set_block_map): on the CPU the result is
// bit-identical to the resident cache's under the same batches. Moves between rows of one type are byte copies, exact;
// a tail of another type (a quantized one) is written by quantizing the block and read back by dequantizing it.
#include "llama-kv-cache-split.h"

#include "llama-impl.h"
#include "llama-kv-residency.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static const uint32_t LLAMA_RKV_BLK      = 256; // cells per block (the streamed chunks' alignment)

static const uint64_t LLAMA_RKV_BLK_IDLE = 32;  // ubatches after which a block nobody read may lose its slot

void llama_kv_split::rkv_blk_init(uint32_t wc) {
    const uint32_t n_blk  = (get_size() + LLAMA_RKV_BLK - 1)/LLAMA_RKV_BLK;
    const uint32_t n_slot = wc/LLAMA_RKV_BLK; // (rkv_wc is set when the plan returns)
    rkv_blk_slot.assign(n_blk, -1);
    rkv_slot_blk.assign(n_slot, -1);
    rkv_blk_seen.assign(n_blk, 0);
    rkv_seq_seen.assign(LLAMA_MAX_SEQ, 0);
    rkv_blk_clock = 0;
}

uint32_t llama_kv_split::rkv_blk_pool_n() const {
    uint32_t n = 1;
    for (uint32_t s = 0; s < rkv_slot_blk.size(); ++s) {
        if (rkv_slot_blk[s] >= 0) {
            n = s + 1;
        }
    }
    return n;
}

uint32_t llama_kv_split::rkv_mask_cols(uint32_t n_kv) const {
    return rkv_blocks ? rkv_blk_pool_n()*LLAMA_RKV_BLK + n_kv : n_kv;
}

bool llama_kv_split::rkv_on_dev(uint32_t strm, uint32_t cell) const {
    if (rkv_blocks) {
        return rkv_blk_slot[cell/LLAMA_RKV_BLK] >= 0;
    }
    return cell < rkv_win_cells(strm);
}

// one block's rows of every split layer's K and V, between its slot and its tail rows: a byte copy, or, where the tail
// has another type, a conversion through f32 on the host (demotion quantizes the block into the tail's type, promotion
// dequantizes it: the loss of a quantized tail, no more)
void llama_kv_split::rkv_blk_move(uint32_t blk, uint32_t slot, bool promote) const {
    const uint32_t c0 = blk*LLAMA_RKV_BLK;
    const uint32_t n  = std::min(LLAMA_RKV_BLK, get_size() - c0);
    const size_t row0 = (size_t) slot*LLAMA_RKV_BLK;
    rkv_move_rows(row0, n, promote, [c0](const ggml_tensor * tail) {
        return (char *) tail->data + (size_t) c0*tail->nb[1];
    });
    // the context's test hook perturb_move (llama_rolling_kv_test_hooks), for the must-fail controls of the block
    // tests: 1, the K row of the block's first cell written over its second one's on the device (one row wrong); 2, the
    // block's K rows one cell off (an offset bug: row i takes row i + 1's data)
    const int perturb = promote && n > 1 && rkv_st ? rkv_st->test.perturb_move : 0;
    for (const auto & layer : layers) {
        ggml_tensor * win = layer.k;
        if (!perturb || !win) {
            continue;
        }
        // K rows of the slot written wrong, from the slot itself (the window's type)
        const size_t row = win->nb[1];
        std::vector<uint8_t> rows((size_t) n*row);
        ggml_backend_tensor_get(win, rows.data(), row0*row, rows.size());
        if (perturb == 1) {
            ggml_backend_tensor_set(win, rows.data(), (row0 + 1)*row, row);
        } else {
            ggml_backend_tensor_set(win, rows.data() + row, row0*row, (size_t) (n - 1)*row);
        }
    }
}

void llama_kv_split::rkv_blk_rebalance(const slot_info & sinfo, const llama_ubatch & ubatch) {
    const auto & cells = v_cells[0];
    const uint32_t n_blk = (uint32_t) rkv_blk_slot.size();

    rkv_blk_clock += 1;
    const uint64_t now = rkv_blk_clock;

    // which blocks hold a cell in use, which the ubatch reads (a cell of one of its sequences) or writes, and how many
    // active sequences read each
    llama_kv_cells::seq_set_t seqs;
    for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
        seqs.set(ubatch.seq_id_unq[s]);
        rkv_seq_seen[ubatch.seq_id_unq[s]] = now;
    }
    llama_kv_cells::seq_set_t active;
    for (uint32_t s = 0; s < rkv_seq_seen.size(); ++s) {
        if (rkv_seq_seen[s] > 0 && rkv_seq_seen[s] + LLAMA_RKV_BLK_IDLE >= now) {
            active.set(s);
        }
    }
    std::vector<uint8_t> used(n_blk, 0), want(n_blk, 0);
    std::vector<llama_kv_cells::seq_set_t> blk_seqs(n_blk);
    const uint32_t n_used = cells.used_max_p1();
    for (uint32_t i = 0; i < n_used; ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        const auto & cell_seqs = cells.seq_get_all(i);
        used[i/LLAMA_RKV_BLK] = 1;
        blk_seqs[i/LLAMA_RKV_BLK] |= cell_seqs;
        if ((cell_seqs & seqs).any()) {
            want[i/LLAMA_RKV_BLK] = 1;
        }
    }
    // the cells this ubatch writes count their sequences as readers too: a block a new request starts is read by it
    // from the next step on (and is empty until this ubatch is applied)
    std::vector<uint32_t> written;
    for (size_t i = 0; i < sinfo.idxs[0].size(); ++i) {
        const uint32_t b = sinfo.idxs[0][i]/LLAMA_RKV_BLK;
        for (int32_t k = 0; k < ubatch.n_seq_id[i]; ++k) {
            blk_seqs[b].set(ubatch.seq_id[i][k]);
        }
        if (want[b] != 2) {
            want[b] = 2;
            written.push_back(b);
        }
    }
    std::vector<uint32_t> readers(n_blk, 0);
    for (uint32_t b = 0; b < n_blk; ++b) {
        readers[b] = (uint32_t) (blk_seqs[b] & active).count();
    }
    for (uint32_t b = 0; b < n_blk; ++b) {
        if (want[b]) {
            rkv_blk_seen[b] = now;
        }
    }

    uint64_t promoted = 0, demoted = 0, freed = 0;
    bool changed = false;

    // 1. free the slots of blocks with no cell in use
    for (uint32_t s = 0; s < rkv_slot_blk.size(); ++s) {
        const int32_t b = rkv_slot_blk[s];
        if (b >= 0 && !used[b] && want[b] != 2) {
            rkv_blk_slot[b] = -1;
            rkv_slot_blk[s] = -1;
            freed  += 1;
            changed = true;
        }
    }

    // 2. the ubatch's blocks in the tail, most readers first; among as many readers, those it writes (a new token lands
    // on the device), then those it reads, oldest first
    std::vector<uint32_t> order = written;
    for (uint32_t b = 0; b < n_blk; ++b) {
        if (want[b] == 1) {
            order.push_back(b);
        }
    }
    std::stable_sort(order.begin(), order.end(),
                     [&readers](uint32_t a, uint32_t b) { return readers[a] > readers[b]; });
    order.erase(std::remove_if(order.begin(), order.end(), [this](uint32_t b) { return rkv_blk_slot[b] >= 0; }),
                order.end());

    bool synced = false;
    int64_t t0 = 0;
    for (const uint32_t b : order) {
        // a free slot (the lowest: the window views stay short), else the least recently used idle block's
        int32_t slot = -1;
        for (uint32_t s = 0; s < rkv_slot_blk.size() && slot < 0; ++s) {
            if (rkv_slot_blk[s] < 0) {
                slot = (int32_t) s;
            }
        }
        if (slot < 0) {
            uint64_t oldest = UINT64_MAX;
            for (uint32_t s = 0; s < rkv_slot_blk.size(); ++s) {
                const uint64_t seen = rkv_blk_seen[rkv_slot_blk[s]];
                if (seen + LLAMA_RKV_BLK_IDLE < now && seen < oldest) {
                    oldest = seen;
                    slot   = (int32_t) s;
                }
            }
        }
        if (slot < 0) {
            // 4. else the slot of a block this ubatch does not read, with fewer readers than b: the fewest, then the
            // least recently used
            for (uint32_t s = 0; s < rkv_slot_blk.size(); ++s) {
                const int32_t v = rkv_slot_blk[s];
                if (want[v] || readers[v] >= readers[b]) {
                    continue;
                }
                const int32_t best = slot < 0 ? -1 : rkv_slot_blk[slot];
                if (best < 0 || readers[v] < readers[best] ||
                        (readers[v] == readers[best] && rkv_blk_seen[v] < rkv_blk_seen[best])) {
                    slot = (int32_t) s;
                }
            }
        }
        if (slot < 0) {
            continue; // every slot holds a block worth as much: b stays in the tail (one with fewer readers may not)
        }
        if (!synced) {
            // the graph before this ubatch may still read and write these rows (an asynchronous backend)
            if (rkv_st && rkv_st->synchronize) {
                rkv_st->synchronize();
            }
            synced = true;
            t0 = ggml_time_us();
        }
        const int32_t victim = rkv_slot_blk[slot];
        if (victim >= 0) {
            rkv_blk_move((uint32_t) victim, (uint32_t) slot, false);
            rkv_blk_slot[victim] = -1;
            demoted += 1;
        }
        if (used[b]) {
            rkv_blk_move(b, (uint32_t) slot, true);
            promoted += 1;
        }
        rkv_blk_slot[b]    = slot;
        rkv_slot_blk[slot] = (int32_t) b;
        changed = true;
    }

    if (!rkv_live || !changed) {
        return;
    }
    uint64_t cell_bytes = 0; // one row of every split layer's K and V
    for (const auto & layer : layers) {
        cell_bytes += layer.k->nb[1] + (layer.v ? layer.v->nb[1] : 0);
    }
    uint32_t n_dev = 0;
    for (const int32_t b : rkv_slot_blk) {
        n_dev += b >= 0 ? 1 : 0;
    }
    std::lock_guard<std::mutex> lock(rkv_live->mtx);
    llama_rkv_live & lv = *rkv_live;
    lv.promoted_cells += promoted*LLAMA_RKV_BLK;
    lv.demoted_cells  += demoted*LLAMA_RKV_BLK;
    lv.moved_bytes    += (promoted + demoted)*LLAMA_RKV_BLK*cell_bytes;
    lv.rebalances     += promoted + demoted > 0 ? 1 : 0;
    lv.move_ms        += synced ? (ggml_time_us() - t0)/1000.0 : 0.0;
    lv.window_cells.assign(1, n_dev*LLAMA_RKV_BLK);
}

// the block map of the op (logical block -> physical block of [window pool ; tail]): a block on the device is its slot,
// one in the tail the pool's blocks plus its own index (the tail holds a row for every cell)
void llama_kv_split::rkv_blk_set_input_map(ggml_tensor * map) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(map->buffer) && map->type == GGML_TYPE_I32);
    const int32_t pool_n = (int32_t) rkv_blk_pool_n();
    int32_t * data = (int32_t *) map->data;
    for (int64_t b = 0; b < map->ne[0]; ++b) {
        const int32_t slot = b < (int64_t) rkv_blk_slot.size() ? rkv_blk_slot[b] : -1;
        data[b] = slot >= 0 ? slot : pool_n + (int32_t) b;
    }
}

template <typename T>
static void llama_rkv_blk_scatter(const T * logical, T * dst, int64_t n_rows, int64_t n_kv, int64_t pool_n,
        const std::vector<int32_t> & blk_slot, const std::vector<int32_t> & slot_blk, T drop) {
    const int64_t B    = LLAMA_RKV_BLK;
    const int64_t cols = pool_n*B + n_kv;
    for (int64_t r = 0; r < n_rows; ++r) {
        const T * src = logical + r*n_kv;
        T       * out = dst + r*cols;
        for (int64_t s = 0; s < pool_n; ++s) {
            const int32_t b = slot_blk[s];
            if (b >= 0 && (b + 1)*B <= n_kv) {
                memcpy(out + s*B, src + b*B, B*sizeof(T));
            } else {
                std::fill(out + s*B, out + (s + 1)*B, drop);
            }
        }
        T * tail = out + pool_n*B;
        for (int64_t b0 = 0; b0 < n_kv; b0 += B) {
            const int64_t n = std::min(B, n_kv - b0);
            if (blk_slot[b0/B] >= 0) {
                std::fill(tail + b0, tail + b0 + n, drop);
            } else {
                memcpy(tail + b0, src + b0, n*sizeof(T));
            }
        }
    }
}

bool llama_kv_split::rkv_set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, bool causal_attn) const {
    if (!rkv_blocks || rkv_blk_logical) {
        return false;
    }
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    const int64_t pool_n = rkv_blk_pool_n();
    const int64_t n_kv   = dst->ne[0] - pool_n*LLAMA_RKV_BLK;
    GGML_ASSERT(n_kv > 0 && n_kv % LLAMA_RKV_BLK == 0 && dst->ne[3] == 1 && ggml_is_contiguous(dst));

    // upstream's mask over the logical cells, into a scratch tensor, then its columns in the op's key order: the pool's
    // slots (a slot's block, or masked), then the tail's cells (masked where the block is on the device)
    static thread_local std::vector<uint8_t> scratch;
    const size_t es = ggml_element_size(dst);
    scratch.resize((size_t) n_kv*dst->ne[1]*dst->ne[2]*es);
    ggml_tensor logical = *dst;
    logical.ne[0] = n_kv;
    logical.nb[1] = logical.nb[0]*n_kv;
    logical.nb[2] = logical.nb[1]*logical.ne[1];
    logical.nb[3] = logical.nb[2]*logical.ne[2];
    logical.data  = scratch.data();
    rkv_blk_logical = true;
    cache.set_input_kq_mask(&logical, ubatch, causal_attn);
    rkv_blk_logical = false;

    // a prompt's ubatch moves ~n_tokens x (pool + n_kv) values (128 MiB at 512 x 128k): on several threads, where a
    // single one would add ~20 ms to a step the GPU runs in ~100 (measured on an H100 host: +12 % prompt time)
    const int64_t n_rows = dst->ne[1]*dst->ne[2];
    const uint8_t * logical_data = scratch.data(); // (scratch is thread-local: the workers take its pointer)
    const auto scatter = [&](int64_t r0, int64_t r1) {
        if (dst->type == GGML_TYPE_F16) {
            llama_rkv_blk_scatter((const ggml_fp16_t *) logical_data + r0*n_kv,
                    (ggml_fp16_t *) dst->data + r0*dst->ne[0], r1 - r0, n_kv, pool_n, rkv_blk_slot, rkv_slot_blk,
                    ggml_fp32_to_fp16(-INFINITY));
        } else {
            llama_rkv_blk_scatter((const float *) logical_data + r0*n_kv, (float *) dst->data + r0*dst->ne[0],
                    r1 - r0, n_kv, pool_n, rkv_blk_slot, rkv_slot_blk, -INFINITY);
        }
    };
    const int64_t work = n_rows*dst->ne[0];
    const int n_thr = (int) std::min<int64_t>({ (int64_t) std::max(1u, std::thread::hardware_concurrency()), 8,
                                                n_rows, work/(1 << 18) + 1 });
    if (n_thr <= 1) {
        scatter(0, n_rows);
        return true;
    }
    std::vector<std::thread> workers;
    const int64_t per = (n_rows + n_thr - 1)/n_thr;
    for (int t = 1; t < n_thr; ++t) {
        if (t*per < n_rows) {
            workers.emplace_back(scatter, t*per, std::min(n_rows, (t + 1)*per));
        }
    }
    scatter(0, std::min(n_rows, per));
    for (auto & w : workers) {
        w.join();
    }
    return true;
}
