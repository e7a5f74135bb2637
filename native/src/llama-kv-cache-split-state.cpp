// rollingkv: the state I/O of a split llama_kv_cache (see llama-kv-cache-split.cpp for the layout): a layer's K/V
// rows written from and read into its window and tail (or device and host heads), converting what differs.
#include "llama-kv-cache-split.h"

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
#include <thread>

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

// cells [from, to) of a stream whose cells on the device (on_dev) come first in the range (static and elastic windows:
// [0, wc); block residency: a range within one block), at win_off(c) and tail_off(c)
template <typename D, typename F, typename G>
static void llama_rkv_write_rows(llama_io_write_i & io, ggml_tensor * win, ggml_tensor * tail, D on_dev,
        uint32_t from, uint32_t to, bool mixed, F win_off, G tail_off) {
    const size_t row_w = win->nb[1];
    const size_t row_t = tail->nb[1];

    uint32_t w1 = from;                                // window cells [from, w1)
    while (w1 < to && on_dev(w1)) {
        ++w1;
    }
    const uint32_t t0 = w1;                            // tail cells   [t0, to)

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

// the header of whole rows of one type, as upstream's state writes it (its type, then its row size)
static void llama_rkv_write_rows_header(llama_io_write_i & io, ggml_type type, uint64_t size_row) {
    const int32_t type_i = (int32_t) type;
    io.write(&type_i, sizeof(type_i));
    io.write(&size_row, sizeof(size_row));
}

// a head split's rows [from, to) of stream strm: the device part's and the host part's (tail may be null: a layer whole
// on the device), as whole rows (same type: the bytes of an unsplit cache) or part after part (two types)
static void llama_rkv_write_heads(llama_io_write_i & io, ggml_tensor * dev, ggml_tensor * host, uint32_t strm,
        const std::vector<std::pair<uint32_t, uint32_t>> & ranges) {
    const bool   mixed = host && host->type != dev->type;
    const size_t row_d = dev->nb[1];
    const size_t row_h = host ? host->nb[1] : 0;

    if (!mixed) {
        llama_rkv_write_rows_header(io, dev->type, row_d + row_h);
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

// one layer's K or V of a window split (window win, tail tail; cells [0, wc) of the stream in the window, at win_off(c)
// and tail_off(c)): its type (or the mixed marker and both types), then the rows of every range
template <typename D, typename F, typename G>
static void llama_rkv_write_window(llama_io_write_i & io, ggml_tensor * win, ggml_tensor * tail,
        const std::vector<std::pair<uint32_t, uint32_t>> & ranges, D on_dev, F win_off, G tail_off) {
    const bool mixed = win->type != tail->type;

    if (!mixed) {
        llama_rkv_write_rows_header(io, win->type, win->nb[1]);
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

    for (const auto & range : ranges) {
        llama_rkv_write_rows(io, win, tail, on_dev, range.first, range.second, mixed, win_off, tail_off);
    }
}

void llama_kv_split::rkv_state_write_data(llama_io_write_i & io, const cell_ranges_t & cr) const {
    const uint32_t v_trans = this->v_trans ? 1 : 0;
    const uint32_t n_layer = layers.size();

    io.write(&v_trans, sizeof(v_trans));
    io.write(&n_layer, sizeof(n_layer));

    const uint32_t strm = cr.strm;
    for (int kv = 0; kv < 2; ++kv) {
        for (const auto & layer : layers) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }
            if (rkv_head) {
                llama_rkv_write_heads(io, win, tail, strm, cr.data);
            } else if (rkv_blocks) {
                // each range cut at the blocks, each piece's rows from where its block lives: one type, the rows of an
                // unsplit cache; two, the pieces as a window split's mixed ranges (a piece is all window or all tail)
                std::vector<std::pair<uint32_t, uint32_t>> pieces;
                for (const auto & range : cr.data) {
                    for (uint32_t c = range.first; c < range.second; c = std::min(range.second, (c/256 + 1)*256)) {
                        pieces.push_back({ c, std::min(range.second, (c/256 + 1)*256) });
                    }
                }
                llama_rkv_write_window(io, win, tail, pieces, [&](uint32_t c) { return rkv_on_dev(strm, c); },
                        [&](uint32_t c) { return rkv_win_off(win, strm, c); },
                        [&](uint32_t c) { return rkv_tail_off(tail, strm, c); });
            } else {
                const uint32_t wc = rkv_win_cells(strm);
                llama_rkv_write_window(io, win, tail, cr.data, [wc](uint32_t c) { return c < wc; },
                        [&](uint32_t c) { return rkv_win_off(win, strm, c); },
                        [&](uint32_t c) { return rkv_tail_off(tail, strm, c); });
            }
        }
    }
}

// convert n rows of type src_type (row size of n_per_row elements) into dst_type (llama-kv-residency.h). Rows are
// converted independently, so the bytes do not depend on how the rows are shared out: a move between a window and a
// quantized tail converts whole blocks of every layer, and ggml-base's converters are scalar, so the host's threads
// share them (one thread converted ~0.5 GB/s on the H100's host: 23 s of a two-minute load went to moves).
bool llama_rkv_convert_rows(ggml_type src_type, ggml_type dst_type, const void * src, void * dst, int64_t n_rows,
                            int64_t n_per_row, int max_threads) {
    const auto * traits = ggml_get_type_traits(src_type);
    if (!traits->to_float && src_type != GGML_TYPE_F32) {
        return false;
    }
    if (ggml_quantize_requires_imatrix(dst_type)) {
        return false;
    }
    const size_t src_row = ggml_row_size(src_type, n_per_row);
    const size_t dst_row = ggml_row_size(dst_type, n_per_row);
    // through f32 a few rows at a time (64 KiB of them: the f32 rows stay in the cache, and a large range allocates
    // no large buffer); each row is converted on its own, so the chunks do not change the result
    const int64_t chunk = std::max<int64_t>(1, 16384/std::max<int64_t>(1, n_per_row));
    auto convert = [&](int64_t r0, int64_t r1) {
        std::vector<float> tmp(src_type == GGML_TYPE_F32 ? 0 : std::min(chunk, r1 - r0)*n_per_row);
        for (int64_t a = r0; a < r1; a += chunk) {
            const int64_t b = std::min(r1, a + chunk);
            const int64_t n = (b - a)*n_per_row;
            const char * s = (const char *) src + a*src_row;
            char * d = (char *) dst + a*dst_row;
            const float * f = src_type == GGML_TYPE_F32 ? (const float *) s : tmp.data();
            if (src_type != GGML_TYPE_F32) {
                traits->to_float(s, tmp.data(), n);
            }
            if (dst_type == GGML_TYPE_F32) {
                memcpy(d, f, n*sizeof(float));
            } else {
                ggml_quantize_chunk(dst_type, f, d, 0, b - a, n_per_row, nullptr);
            }
        }
    };
    // a thread for at least 64k elements (a 256-cell block of 256 elements a row), at most 16 (or max_threads)
    const int64_t min_rows = std::max<int64_t>(1, 65536/std::max<int64_t>(1, n_per_row));
    const int64_t nth = std::min<int64_t>({ (int64_t) std::max(1u, std::thread::hardware_concurrency()), 16,
                                            max_threads > 0 ? max_threads : 16, n_rows/min_rows });
    if (nth <= 1) {
        convert(0, n_rows);
        return true;
    }
    std::vector<std::thread> workers;
    for (int64_t t = 1; t < nth; ++t) {
        workers.emplace_back(convert, n_rows*t/nth, n_rows*(t + 1)/nth);
    }
    convert(0, n_rows/nth);
    for (auto & w : workers) {
        w.join();
    }
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

// the layout of one layer's K or V rows in a state: rows of part a (type sa, na elements) followed by part b (sb, nb;
// 0: whole rows), as a whole row (ROWS), a window split's mixed state (WINDOW: window rows and tail rows per range) or
// a head split's state with two types (HEADS: the device and host parts of each row)
struct llama_rkv_state_layout {
    enum { ROWS, WINDOW, HEADS } kind = ROWS;
    ggml_type sa = GGML_TYPE_COUNT;
    ggml_type sb = GGML_TYPE_COUNT;
    int64_t   na = 0;
    int64_t   nb = 0;
};

// reads the layout of a layer's rows of n_embd elements from the state (its type, or a marker and its parts' types and
// sizes); "" or why the state is refused
static std::string llama_rkv_read_layout(llama_io_read_i & io, int64_t n_embd, int32_t il, const char * what,
        llama_rkv_state_layout & src) {
    char buf[256];

    int32_t type_i;
    io.read(&type_i, sizeof(type_i));

    src.na = n_embd;
    src.nb = 0;
    if (type_i >= 0 && type_i < GGML_TYPE_COUNT) {
        uint64_t size_row;
        io.read(&size_row, sizeof(size_row));
        src.kind = llama_rkv_state_layout::ROWS;
        src.sa = src.sb = (ggml_type) type_i;
        if (size_row != ggml_row_size(src.sa, n_embd)) {
            snprintf(buf, sizeof(buf), "mismatched %s row size (%zu != %zu, layer %d)", what,
                    ggml_row_size(src.sa, n_embd), (size_t) size_row, il);
            return buf;
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
            snprintf(buf, sizeof(buf), "invalid rolling-KV %s layout in the state (layer %d)", what, il);
            return buf;
        }
        src.kind = llama_rkv_state_layout::WINDOW;
        src.sa = (ggml_type) tw;
        src.sb = (ggml_type) tt;
    } else if (type_i == LLAMA_RKV_STATE_HEADS) {
        int32_t ta, tb;
        uint64_t ua, ub, ra, rb;
        io.read(&ta, sizeof(ta));
        io.read(&tb, sizeof(tb));
        io.read(&ua, sizeof(ua));
        io.read(&ub, sizeof(ub));
        io.read(&ra, sizeof(ra));
        io.read(&rb, sizeof(rb));
        if (ta < 0 || ta >= GGML_TYPE_COUNT || tb < 0 || tb >= GGML_TYPE_COUNT || ua + ub != (uint64_t) n_embd ||
                ua == 0 || ub == 0 || ua % ggml_blck_size((ggml_type) ta) != 0 ||
                ub % ggml_blck_size((ggml_type) tb) != 0 || ra != ggml_row_size((ggml_type) ta, ua) ||
                rb != ggml_row_size((ggml_type) tb, ub)) {
            snprintf(buf, sizeof(buf), "invalid rolling-KV head-split %s layout in the state (layer %d)", what, il);
            return buf;
        }
        src.kind = llama_rkv_state_layout::HEADS;
        src.sa = (ggml_type) ta;
        src.sb = (ggml_type) tb;
        src.na = (int64_t) ua;
        src.nb = (int64_t) ub;
    } else {
        snprintf(buf, sizeof(buf), "invalid %s type %d in the state (layer %d)", what, type_i, il);
        return buf;
    }
    return "";
}

// where a head split's state rows land: the device part dev (its first dev->ne[0] elements of a row) and the host part
// host (the rest; null: a layer whole on the device) of stream strm, at destination cells idxs
struct llama_rkv_heads_dst {
    ggml_tensor * dev;
    ggml_tensor * host;
    uint32_t      strm;
    const std::vector<uint32_t> & idxs;

    llama_rkv_heads_dst(ggml_tensor * d, ggml_tensor * h, uint32_t s, const std::vector<uint32_t> & ix) :
        dev(d), host(h), strm(s), idxs(ix) {}

    const int64_t   n_d    = dev->ne[0];
    const int64_t   n_h    = host ? host->ne[0] : 0;
    const int64_t   n_embd = n_d + n_h;
    const ggml_type td     = dev->type;
    const ggml_type th     = host ? host->type : dev->type;
    const size_t    row_d  = dev->nb[1];
    const size_t    row_h  = host ? host->nb[1] : 0;

    // the rows at the destination's types and cut, device and host part
    std::vector<uint8_t> bd, bh;
    std::vector<float>   f, tmp;

    // n source rows (part a in pa: type ta, ua elements; part b in pb: tb, ub, 0: whole rows in pa) into the cells
    // idxs[i0 ...]; false when a part cannot be converted
    bool place(const std::vector<uint8_t> & pa, const std::vector<uint8_t> & pb, uint32_t i0, uint32_t n,
            ggml_type ta, int64_t ua, ggml_type tb, int64_t ub) {
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
        } else if (!convert(pa, pb, n, ta, ua, tb, ub)) {
            return false;
        }
        write(i0, n);
        return true;
    }

    // through f32: whole rows, then each part at its type
    bool convert(const std::vector<uint8_t> & pa, const std::vector<uint8_t> & pb, uint32_t n,
            ggml_type ta, int64_t ua, ggml_type tb, int64_t ub) {
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
            if (!llama_rkv_convert_rows(GGML_TYPE_F32, part == 0 ? td : th, tmp.data(),
                                        part == 0 ? bd.data() : bh.data(), n, w)) {
                return false;
            }
        }
        return true;
    }

    // the n rows of bd/bh into the cells idxs[i0 ...], each run of consecutive destination cells at once
    void write(uint32_t i0, uint32_t n) {
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
    }
};

// cell_count rows of one layer's K or V from the state into a head split's device part dev (its first dev->ne[0]
// elements of a row) and host part host (the rest; null: a layer whole on the device), at destination cells idxs: an
// unsplit state, a window split's mixed state or a head split's state with two types, converted through f32 where the
// types or the cut differ
static bool llama_rkv_read_heads(llama_io_read_i & io, ggml_tensor * dev, ggml_tensor * host, uint32_t strm,
        uint32_t cell_count, const std::vector<uint32_t> & idxs, int32_t il, const char * what) {
    llama_rkv_heads_dst dst(dev, host, strm, idxs);
    const int64_t   n_embd = dst.n_embd;
    const ggml_type td     = dst.td;
    const ggml_type th     = dst.th;

    llama_rkv_state_layout src;
    const std::string err = llama_rkv_read_layout(io, n_embd, il, what, src);
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.c_str());
        return false;
    }
    const ggml_type sa = src.sa, sb = src.sb;

    for (ggml_type s : { sa, sb }) {
        for (ggml_type d : { td, th }) {
            if (!llama_rkv_convertible(s, d)) {
                LLAMA_LOG_ERROR("%s: the state's %s type %s cannot be converted to this cache's %s (layer %d)\n",
                        __func__, what, ggml_type_name(s), ggml_type_name(d), il);
                return false;
            }
        }
    }

    std::vector<uint8_t> pa, pb;

    // whole rows of type t for the cells [i0, i0 + n), in chunks
    auto rows = [&](uint32_t i0, uint32_t n, ggml_type t) -> bool {
        for (uint32_t k = 0; k < n; k += LLAMA_RKV_STATE_CHUNK) {
            const uint32_t m = std::min(n - k, LLAMA_RKV_STATE_CHUNK);
            pa.resize(m*ggml_row_size(t, n_embd));
            io.read(pa.data(), pa.size());
            if (!dst.place(pa, pb, i0 + k, m, t, n_embd, t, 0)) {
                return false;
            }
        }
        return true;
    };

    bool ok = true;
    if (src.kind == llama_rkv_state_layout::ROWS) {
        ok = rows(0, cell_count, sa);
    } else {
        uint32_t done = 0;
        while (ok && done < cell_count) {
            uint32_t n_a, n_b = 0;
            io.read(&n_a, sizeof(n_a));
            if (src.kind == llama_rkv_state_layout::WINDOW) {
                io.read(&n_b, sizeof(n_b));
            }
            if (n_a + n_b == 0 || done + n_a + n_b > cell_count ||
                (src.kind == llama_rkv_state_layout::HEADS && n_a > LLAMA_RKV_STATE_CHUNK)) {
                LLAMA_LOG_ERROR("%s: corrupt rolling-KV %s ranges in the state (layer %d)\n", __func__, what, il);
                return false;
            }
            if (src.kind == llama_rkv_state_layout::WINDOW) {
                ok = rows(done, n_a, sa) && rows(done + n_a, n_b, sb);
            } else {
                pa.resize(n_a*ggml_row_size(sa, src.na));
                pb.resize(n_a*ggml_row_size(sb, src.nb));
                io.read(pa.data(), pa.size());
                io.read(pb.data(), pb.size());
                ok = dst.place(pa, pb, done, n_a, sa, src.na, sb, src.nb);
            }
            done += n_a + n_b;
        }
    }
    if (!ok) {
        LLAMA_LOG_ERROR("%s: the state's %s rows could not be converted to this cache's types (layer %d)\n", __func__,
                        what, il);
    }
    return ok;
}

// cell_count rows of one layer's K or V from the state into a window split's window win and tail tail (cells on_dev(c)
// of the stream in the window, at win_off(c) and tail_off(c)), at destination cells idxs: an unsplit state or a window
// split's mixed one, converted through f32 where the types differ; a head split's state with two types is refused
template <typename D, typename F, typename G>
static bool llama_rkv_read_window(llama_io_read_i & io, ggml_tensor * win, ggml_tensor * tail, D on_dev,
        uint32_t cell_count, const std::vector<uint32_t> & idxs, int32_t il, const char * what, F win_off, G tail_off) {
    const int64_t n_embd = win->ne[0];

    std::vector<uint8_t> buf_src;
    std::vector<uint8_t> buf_dst;

    llama_rkv_state_layout layout;
    const std::string err = llama_rkv_read_layout(io, n_embd, il, what, layout);
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.c_str());
        return false;
    }
    if (layout.kind == llama_rkv_state_layout::HEADS) {
        LLAMA_LOG_ERROR("%s: the state was saved by a cache split by KV head with two %s types (device and host): a "
                "window split cannot read it; load it into a head split, or save it with one type (-ctkt/-ctvt as "
                "-ctk/-ctv)\n", __func__, what);
        return false;
    }
    const bool      mixed = layout.kind == llama_rkv_state_layout::WINDOW;
    const ggml_type src_w = layout.sa;
    const ggml_type src_t = layout.sb;

    for (ggml_type src : { src_w, src_t }) {
        for (ggml_type dst : { win->type, tail->type }) {
            if (!llama_rkv_convertible(src, dst)) {
                LLAMA_LOG_ERROR("%s: the state's %s type %s cannot be converted to this cache's %s (layer %d)\n",
                        __func__, what, ggml_type_name(src), ggml_type_name(dst), il);
                return false;
            }
        }
    }

    // place source rows [i0, i0 + n) of type src into the destination cells idxs[i0 ...]
    auto place = [&](uint32_t i0, uint32_t n, ggml_type src) -> bool {
        const size_t row_src = ggml_row_size(src, n_embd);
        uint32_t i = i0;
        while (i < i0 + n) {
            const uint32_t c0      = idxs[i];
            const bool     in_tail = !on_dev(c0);
            ggml_tensor *  dst_t   = in_tail ? tail : win;

            // extend the run while the destination cells stay consecutive in the same region, and their rows too (block
            // residency: consecutive blocks may sit in any slots)
            uint32_t j = i + 1;
            while (j < i0 + n && idxs[j] == idxs[j - 1] + 1 && !on_dev(idxs[j]) == in_tail &&
                   (in_tail || idxs[j] % 256 != 0 || win_off(idxs[j]) == win_off(idxs[j - 1]) + win->nb[1])) {
                ++j;
            }
            const uint32_t n_run = j - i;
            const size_t   off   = in_tail ? tail_off(c0) : win_off(c0);

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
                LLAMA_LOG_ERROR("%s: corrupt rolling-KV %s ranges in the state (layer %d)\n", __func__, what, il);
                return false;
            }
            if (!place(done, n_w, src_w) || !place(done + n_w, n_t, src_t)) {
                return false;
            }
            done += n_w + n_t;
        }
    }
    return true;
}

bool llama_kv_split::rkv_state_read_data(llama_io_read_i & io, uint32_t strm, uint32_t cell_count,
                                         const slot_info & sinfo) {
    uint32_t v_trans_ref;
    uint32_t n_layer;

    io.read(&v_trans_ref, sizeof(v_trans_ref));
    io.read(&n_layer, sizeof(n_layer));

    if (n_layer != layers.size()) {
        LLAMA_LOG_ERROR("%s: mismatched layer count (%u instead of %u)\n", __func__, n_layer, (uint32_t) layers.size());
        return false;
    }
    if (cell_count > get_size()) {
        LLAMA_LOG_ERROR("%s: not enough cells in kv cache to restore state (%u > %u)\n", __func__, cell_count,
                        get_size());
        return false;
    }
    if (v_trans_ref != 0) {
        LLAMA_LOG_ERROR("%s: the state has a transposed V cache (flash attention off); this split cache needs flash "
                        "attention\n", __func__);
        return false;
    }

    const auto & idxs = sinfo.idxs[0];

    for (int kv = 0; kv < 2; ++kv) {
        for (const auto & layer : layers) {
            ggml_tensor * win  = kv == 0 ? layer.k      : layer.v;
            ggml_tensor * tail = kv == 0 ? layer.k_tail : layer.v_tail;
            if (!win) {
                continue;
            }
            const char * what = kv == 0 ? "key" : "value";
            const bool ok = rkv_head
                ? llama_rkv_read_heads(io, win, tail, strm, cell_count, idxs, layer.il, what)
                : llama_rkv_read_window(io, win, tail, [&](uint32_t c) { return rkv_on_dev(strm, c); }, cell_count,
                        idxs, layer.il, what, [&](uint32_t c) { return rkv_win_off(win, strm, c); },
                        [&](uint32_t c) { return rkv_tail_off(tail, strm, c); });
            if (!ok) {
                return false;
            }
        }
    }

    return true;
}

void llama_kv_split::rkv_state_clear_data(uint32_t strm, const slot_info & sinfo) {
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
            for (const uint32_t c : sinfo.idxs[0]) {
                const bool dev = rkv_on_dev(strm, c);
                ggml_tensor * t = dev ? win : tail;
                llama_clear_tensor_data(t, dev ? rkv_win_off(t, strm, c) : rkv_tail_off(t, strm, c), t->nb[1]);
            }
        }
    }
}
