// rollingkv: elastic windows (see llama-kv-window-pool.h)
#include "llama-kv-window-pool.h"

#include <algorithm>
#include <numeric>

static uint32_t llama_rkv_pool_pad(uint32_t n) {
    return (n + LLAMA_RKV_POOL_BLOCK - 1)/LLAMA_RKV_POOL_BLOCK*LLAMA_RKV_POOL_BLOCK;
}

void llama_rkv_window_pool::init(uint32_t n_stream_, uint32_t kv_size_, uint32_t capacity_) {
    n_stream = n_stream_;
    kv_size  = kv_size_;
    capacity = capacity_;
    base.assign(n_stream, 0);
    cells.assign(n_stream, 0);
    last_used.assign(n_stream, 0);
    last_batch.assign(n_stream, 0);
    // empty windows spread evenly: the static layout
    share = n_stream ? capacity/n_stream/LLAMA_RKV_POOL_BLOCK*LLAMA_RKV_POOL_BLOCK : 0;
    for (uint32_t s = 0; s < n_stream; ++s) {
        base[s] = s*share;
    }
}

// the relocation of n cells from pool row src to row dst as copies whose source and destination never overlap: in
// pieces of |dst - src| rows, the first piece first when moving left, the last first when moving right
static void llama_rkv_pool_relocate(std::vector<llama_rkv_pool_copy> & out, uint32_t strm, uint32_t n, uint32_t src,
                                    uint32_t dst) {
    const uint32_t step = src > dst ? src - dst : dst - src;
    const uint32_t n_piece = (n + step - 1)/step;
    for (uint32_t i = 0; i < n_piece; ++i) {
        const uint32_t j  = src > dst ? i : n_piece - 1 - i;
        const uint32_t c0 = j*step;
        out.push_back({ llama_rkv_pool_copy::RELOCATE, strm, c0, std::min(step, n - c0), src + c0, dst + c0 });
    }
}

void llama_rkv_pool_begin_batch(llama_rkv_window_pool & pool, const std::vector<uint8_t> & in_batch) {
    pool.n_batch += 1;
    for (uint32_t s = 0; s < pool.n_stream; ++s) {
        if (in_batch[s]) {
            pool.last_batch[s] = pool.n_batch;
        }
    }
}

std::vector<llama_rkv_pool_copy> llama_rkv_pool_rebalance(
        llama_rkv_window_pool & pool,
        const std::vector<uint32_t> & ext_old,
        const std::vector<uint32_t> & ext_new,
        const std::vector<uint8_t>  & in_ubatch) {
    const uint32_t ns = pool.n_stream;

    pool.n_ubatch += 1;
    for (uint32_t s = 0; s < ns; ++s) {
        if (in_ubatch[s]) {
            pool.last_used[s] = pool.n_ubatch;
        }
    }
    auto active = [&](uint32_t s) {
        return pool.last_batch[s] > 0 && pool.last_batch[s] + 1 >= pool.n_batch;
    };

    // what each stream would keep on the device: the blocks covering its cells in use
    std::vector<uint32_t> need(ns);
    for (uint32_t s = 0; s < ns; ++s) {
        need[s] = std::min(pool.kv_size, llama_rkv_pool_pad(ext_new[s]));
    }

    // 1. a window never holds more than its stream's blocks in use: the rest holds no cell and goes back to the pool
    std::vector<uint32_t> w(ns);
    for (uint32_t s = 0; s < ns; ++s) {
        w[s] = std::min(pool.cells[s], need[s]);
    }
    uint64_t used = std::accumulate(w.begin(), w.end(), (uint64_t) 0);
    uint32_t free = pool.capacity > used ? (uint32_t) (pool.capacity - used) : 0;

    // 2. the ubatch's streams whose cells outgrow their window take free blocks, the smallest deficit first; when there
    // are too few, idle streams give theirs up, the least recently used first
    std::vector<uint32_t> order;
    for (uint32_t s = 0; s < ns; ++s) {
        if (in_ubatch[s] && need[s] > w[s]) {
            order.push_back(s);
        }
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return need[a] - w[a] < need[b] - w[b]; });

    for (const uint32_t s : order) {
        const uint32_t want = need[s] - w[s];
        if (free < want) {
            std::vector<uint32_t> idle;
            for (uint32_t t = 0; t < ns; ++t) {
                if (t != s && w[t] > 0 && !active(t)) {
                    idle.push_back(t);
                }
            }
            std::stable_sort(idle.begin(), idle.end(), [&](uint32_t a, uint32_t b) {
                return pool.last_batch[a] != pool.last_batch[b] ? pool.last_batch[a] < pool.last_batch[b]
                       : pool.last_used[a] < pool.last_used[b];
            });
            for (const uint32_t t : idle) {
                if (free >= want) {
                    break;
                }
                const uint32_t take = std::min(w[t], llama_rkv_pool_pad(want - free));
                w[t] -= take;
                free += take;
            }
        }
        uint32_t grant = std::min(want, free);
        if (grant < want) {
            // a partial grant ends the window at a block boundary
            const uint32_t end = (w[s] + grant)/LLAMA_RKV_POOL_BLOCK*LLAMA_RKV_POOL_BLOCK;
            grant = end > w[s] ? end - w[s] : 0;
        }
        w[s] += grant;
        free -= grant;
    }

    // 2b. back to the static layout once the active streams fit their shares: an idle stream keeps at most its share
    // (its excess demoted once). A finished long request whose cells a slot keeps for its prompt cache would otherwise
    // hold its large window, keep the pool off the static layout, and make every ubatch of the short ones attend one op
    // per stream instead of upstream's one op over all streams (0.65x resident after the long one ended, H100
    // 2026-12-06)
    bool active_fit = true;
    for (uint32_t s = 0; s < ns && active_fit; ++s) {
        active_fit = !active(s) || std::max(w[s], in_ubatch[s] ? need[s] : 0u) <= pool.share;
    }
    if (active_fit) {
        for (uint32_t s = 0; s < ns; ++s) {
            if (!active(s) && w[s] > pool.share) {
                free += w[s] - pool.share;
                w[s]  = pool.share;
            }
        }
    }

    if (w == pool.cells) {
        return {};
    }

    // 3. placement: the static layout whenever every window fits its share (the streams' windows then sit at one
    // stride, which upstream's attention over several streams reads as one view); else each window where it is when it
    // still ends before the next one (and within the pool); else a repack in stream order with the free cells spread
    // evenly between the windows
    std::vector<uint32_t> nb = pool.base;
    bool fits_share = true;
    for (uint32_t s = 0; s < ns && fits_share; ++s) {
        fits_share = w[s] <= pool.share;
    }
    bool in_place = !fits_share;
    for (uint32_t s = 0; s < ns && in_place; ++s) {
        const uint64_t limit = s + 1 < ns ? pool.base[s + 1] : pool.capacity;
        in_place = (uint64_t) pool.base[s] + w[s] <= limit;
    }
    if (fits_share) {
        for (uint32_t s = 0; s < ns; ++s) {
            nb[s] = s*pool.share;
        }
    } else if (!in_place) {
        const uint64_t total = std::accumulate(w.begin(), w.end(), (uint64_t) 0);
        const uint32_t gap   = (uint32_t) ((pool.capacity - total)/ns/LLAMA_RKV_POOL_BLOCK*LLAMA_RKV_POOL_BLOCK);
        uint32_t pos = 0;
        for (uint32_t s = 0; s < ns; ++s) {
            nb[s] = pos;
            pos  += w[s] + gap;
        }
    }

    // 4. the copies of the cells in use: demotions from the old rows, then the windows that move (the cells each
    // keeps), then promotions into the new rows
    std::vector<llama_rkv_pool_copy> out;
    for (uint32_t s = 0; s < ns; ++s) {
        const uint32_t lo = w[s];
        const uint32_t hi = std::min(pool.cells[s], ext_old[s]);
        if (hi > lo) {
            out.push_back({ llama_rkv_pool_copy::DEMOTE, s, lo, hi - lo, pool.base[s] + lo, 0 });
            pool.demoted += hi - lo;
        }
    }
    std::vector<uint32_t> keep(ns);
    for (uint32_t s = 0; s < ns; ++s) {
        keep[s] = std::min({ pool.cells[s], w[s], ext_old[s] });
    }
    for (uint32_t s = 0; s < ns; ++s) {
        if (keep[s] > 0 && nb[s] < pool.base[s]) {
            llama_rkv_pool_relocate(out, s, keep[s], pool.base[s], nb[s]);
            pool.relocated += keep[s];
        }
    }
    for (uint32_t s = ns; s-- > 0; ) {
        if (keep[s] > 0 && nb[s] > pool.base[s]) {
            llama_rkv_pool_relocate(out, s, keep[s], pool.base[s], nb[s]);
            pool.relocated += keep[s];
        }
    }
    for (uint32_t s = 0; s < ns; ++s) {
        const uint32_t lo = pool.cells[s];
        const uint32_t hi = std::min(w[s], ext_old[s]);
        if (hi > lo) {
            out.push_back({ llama_rkv_pool_copy::PROMOTE, s, lo, hi - lo, 0, nb[s] + lo });
            pool.promoted += hi - lo;
        }
    }

    pool.cells = w;
    pool.base  = nb;
    pool.epoch += 1;
    pool.n_rebalance += 1;
    return out;
}
