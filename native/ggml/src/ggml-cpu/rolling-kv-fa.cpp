// rolling-KV: CPU forward for GGML_OP_STREAMING_FLASH_ATTN
//
// The op is flash attention over the virtual concatenation [window ; tail] of two K/V tensors (see ggml-rolling-kv.h).
// It runs ggml's own CPU flash attention (ggml-cpu/ops.cpp, ggml_compute_forward_flash_attn_ext_src): the kernels
// that ggml_flash_attn_ext runs, reading their keys from spans of rows of several K/V tensors (struct ggml_fa_src,
// ops.h). This file only describes the op's keys to them and picks what upstream has no rule for:
//  - the spans: the window's rows, then the tail's (the tail runs of ggml_streaming_flash_attn_set_tail_runs: the
//    tail's rows in them, and between them spans without data, masked for every row, never read), each of its own
//    types; the block map (src 7) as the kernels' map; the test hook tail_perturb x as the tail spans' score factor
//    1 + x; ref_streams as the sequence count the kernel path is chosen for (a stream's op of a multi-stream batch
//    takes the path of the whole batch's).
//  - mixed types in prefill-sized batches (below).
//
// Same-type parts (window and tail have the same K type and the same V type, or one part is empty): the kernels and
// the thread partition are ggml_flash_attn_ext's, chosen on the full shape (split-KV decode, tiled, one_chunk; a
// split-KV chunk or a KV tile that straddles the split reads both parts), so the output is BIT-IDENTICAL to
// ggml_flash_attn_ext over the concatenated K/V on the CPU backend with the same thread count. With a block map the
// keys are the logical ones (the split-KV chunks and the KV tile grid are those of ggml_flash_attn_ext over them),
// logical key ic being the physical key p = 256*map[ic/256] + ic%256 (its K/V row, its mask column).
//
// Mixed types (window and tail differ in K or V type): there is no single-pass upstream reference. The kernels run
// one_chunk: the running softmax state continues across the parts, each key with its own part's arithmetic (Q
// converted to each part's vec_dot type; V accumulated in f16 if both V parts are F16, like upstream, else in f32
// with each part's to_float). Exception, in prefill-sized batches over an F16/F32 window (K type == V type, no map):
// Q tiles whose rows all mask the tail (the queries before the window boundary) run the tiled kernel over the window
// alone, which is what upstream runs on the resident cache of the window's type for them, so those rows are
// bit-identical to it (rkv_fa_mixed_tiles); the other tiles run one_chunk over both parts.
//
// Fully masked rows give 0 and sinks are applied once, as ggml's. The test hook (the must-fail controls of the gates
// and the op test): the op's tail_perturb parameter x (ggml_streaming_flash_attn_set_tail_perturb) multiplies every
// tail key's attention score (after scale, softcap and mask) by (1 + x) before the softmax, so that `rollingkv gate
// equiv` and the op test can prove they fail on a wrong window/tail merge; the CUDA forward perturbs its tail parts
// the same way.

#include "rolling-kv-fa.h"

#include "ggml-rolling-kv.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "common.h"
#include "ops.h"
#include "simd-mappings.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// the block map: entries in [0, the physical blocks wholly inside the window or the tail), distinct. A block index
// below n_win/256 is in the window, one from it up to floor((n_win + n_tail)/256) in the tail (n_win % 256 == 0)
static void rkv_fa_check_map(const ggml_tensor * map, int64_t n_win, int64_t n_keys) {
    GGML_ASSERT(map->type == GGML_TYPE_I32 && ggml_is_contiguous(map) && "streaming_flash_attn: the block map is I32");
    GGML_ASSERT((!map->buffer || ggml_backend_buffer_is_host(map->buffer)) &&
            "streaming_flash_attn: the block map is not in host memory");
    GGML_ASSERT(n_win % 256 == 0 && "streaming_flash_attn: a block map needs a window of whole 256-cell blocks");
    const int64_t   n_blocks = ggml_nelements(map);
    const int64_t   n_phys   = n_keys/256;
    const int32_t * m        = (const int32_t *) map->data;
    uint64_t              seen_small[64];
    std::vector<uint64_t> seen_large;
    uint64_t * seen = seen_small;
    const size_t n_words = (size_t) (n_phys + 63)/64;
    if (n_words > 64) {
        seen_large.resize(n_words);
        seen = seen_large.data();
    }
    memset(seen, 0, n_words*sizeof(uint64_t));
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t pb = m[b];
        GGML_ASSERT(pb >= 0 && pb < n_phys &&
                "streaming_flash_attn: a block map entry outside the window and the tail, or across them");
        GGML_ASSERT(!(seen[pb/64] >> (pb%64) & 1) && "streaming_flash_attn: a block map entry twice");
        seen[pb/64] |= (uint64_t) 1 << (pb%64);
    }
}

// the op's keys as the kernels' spans (the window's, then the tail's), its map and its path rule
static ggml_fa_src rkv_fa_src(const ggml_tensor * dst) {
    const ggml_tensor * k_win  = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * v_win  = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * k_tail = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * v_tail = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];

    const int64_t n_win  = k_win  ? k_win->ne[1]  : 0;
    const int64_t n_tail = k_tail ? k_tail->ne[1] : 0;
    GGML_ASSERT(n_win == ggml_get_op_params_i32(dst, 4));
    GGML_ASSERT((n_win  == 0 || (v_win  && v_win->ne[1]  == n_win))  && "streaming_flash_attn: window K/V rows differ");
    GGML_ASSERT((n_tail == 0 || (v_tail && v_tail->ne[1] == n_tail)) && "streaming_flash_attn: tail K/V rows differ");

    ggml_fa_src src = {};
    src.q     = dst->src[GGML_STREAMING_FA_SRC_Q];
    src.mask  = dst->src[GGML_STREAMING_FA_SRC_MASK];
    src.sinks = dst->src[GGML_STREAMING_FA_SRC_SINKS];
    src.n_seq = ggml_streaming_flash_attn_get_ref_streams(dst);

    if (n_win > 0) {
        src.span[src.n_spans++] = { k_win, v_win, 0, n_win, 1.0f };
    }
    if (n_tail > 0) {
        const float mul = 1.0f + ggml_streaming_flash_attn_get_tail_perturb(dst); // the test hook; 1: off
        int32_t first[GGML_RKV_MAX_TAIL_RUNS], n[GGML_RKV_MAX_TAIL_RUNS];
        const int n_runs = ggml_streaming_flash_attn_get_tail_runs(dst, first, n);
        if (n_runs == 0) {
            src.span[src.n_spans++] = { k_tail, v_tail, 0, n_tail, mul };
        }
        // the tail runs, and between them keys masked for every row (sorted and apart: setter's check)
        int64_t end = 0;
        for (int r = 0; r < n_runs; ++r) {
            if (first[r] > end) {
                src.span[src.n_spans++] = { nullptr, nullptr, end, first[r] - end, 1.0f };
            }
            src.span[src.n_spans++] = { k_tail, v_tail, first[r], n[r], mul };
            end = first[r] + (int64_t) n[r];
        }
        if (n_runs > 0 && end < n_tail) {
            src.span[src.n_spans++] = { nullptr, nullptr, end, n_tail - end, 1.0f };
        }
    }
    static_assert(1 + 2*GGML_RKV_MAX_TAIL_RUNS + 1 <= GGML_FA_MAX_SPANS, "the op's spans do not fit ggml_fa_src");

    src.n_kv = n_win + n_tail;
    if (const ggml_tensor * map = dst->src[GGML_STREAMING_FA_SRC_MAP]) {
        rkv_fa_check_map(map, n_win, src.n_kv);
        src.map  = (const int32_t *) map->data;
        src.n_kv = 256*ggml_nelements(map);
    }
    return src;
}

// Mixed types in a prefill-sized batch: upstream's tiled path over a resident cache of the window's type skips KV
// tiles that every row of a Q tile masks, so a Q tile whose rows all mask the tail is computed there exactly as the
// tiled path over the window alone (the KV tile that straddles the split adds exact zeros either way). Those tiles (the
// queries before the window boundary) run that way here, bit-identical to the resident run; the others, which read the
// tail, run one_chunk over both parts. Rows are chunked over the threads as ops.cpp chunks them, and Q tiles formed as
// its tiled kernel forms them (tile size, chunk and head boundaries).
static bool rkv_fa_tail_masked(const ggml_fa_src & src, int64_t n_win, int64_t iq1, int64_t iq2, int64_t iq3,
                               int tile_rows) {
    const ggml_tensor * mask = src.mask;
    for (int tq = 0; tq < tile_rows; tq++) {
        const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) mask->data + (iq1 + tq)*mask->nb[1] +
                (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]);
        int64_t p = 0;
        for (int s = 0; s < src.n_spans; p += src.span[s++].n) {
            if (p < n_win || !src.span[s].k) {
                continue; // the window, or tail keys the op does not read (masked for every row)
            }
            for (int64_t j = 0; j < src.span[s].n; j++) {
                if (GGML_CPU_FP16_TO_FP32(mp[p + j]) != -INFINITY) {
                    return false;
                }
            }
        }
    }
    return true;
}

static void rkv_fa_mixed_tiles(const ggml_compute_params * params, ggml_tensor * dst, const ggml_fa_src & src,
                               int64_t n_win) {
    const ggml_tensor * q = src.q;
    const int64_t neq1 = q->ne[1];
    const int64_t neq2 = q->ne[2];
    const int64_t nr   = neq1*neq2*q->ne[3];

    const int ith = params->ith;
    const int nth = params->nth;

    // the window alone, as the resident cache of its type
    ggml_fa_src win = src;
    win.n_spans = 1;
    win.n_kv    = n_win;

    // the two kernels run at once on different threads: one scratch stride for both (the tiled one's is the larger)
    const size_t stride = std::max(ggml_flash_attn_ext_work_floats(q->ne[0], dst->ne[0], true),
                                   ggml_flash_attn_ext_work_floats(q->ne[0], dst->ne[0], false));
    float * work = (float *) params->wdata + ith*stride;

    // ops.cpp's row chunks: 4x chunks per thread, none with NUMA
    const int nth_scaled = nth * 4;
    const int64_t chunk_size = (nr + nth_scaled - 1) / nth_scaled;
    int64_t nchunk = (nr + chunk_size - 1) / chunk_size;
    if (nth == 1 || nchunk < nth || ggml_is_numa()) {
        nchunk = nth;
    }
    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);
    const int64_t dr = (nr + nchunk - 1) / nchunk;

    static constexpr int Q_TILE_SZ = ggml_fa_tile_config::Q;
    for (int64_t chunk = ith; chunk < nchunk; chunk = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t ir1 = std::min(dr*chunk + dr, nr);
        for (int64_t ir = dr*chunk; ir < ir1; ) {
            const int64_t iq3 = ir/(neq2*neq1);
            const int64_t iq2 = (ir - iq3*neq2*neq1)/neq1;
            const int64_t iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);
            const int tile_rows = (int) std::min<int64_t>(Q_TILE_SZ, std::min(ir1 - ir, neq1 - iq1));
            if (rkv_fa_tail_masked(src, n_win, iq1, iq2, iq3, tile_rows)) {
                ggml_compute_forward_flash_attn_ext_src_rows(params, dst, &win, true, ir, ir + tile_rows, work);
            } else {
                ggml_compute_forward_flash_attn_ext_src_rows(params, dst, &src, false, ir, ir + tile_rows, work);
            }
            ir += tile_rows;
        }
    }
}

} // namespace

extern "C" size_t ggml_streaming_flash_attn_work_size(const ggml_tensor * node, int n_tasks) {
    const int64_t neq2 = node->src[GGML_STREAMING_FA_SRC_Q]->ne[2]; // number of query heads
    const int64_t DK   = node->src[GGML_STREAMING_FA_SRC_Q]->ne[0];
    const int64_t DV   = node->ne[0];

    // the kernels' scratch per thread (ops.cpp): the tiled (prefill) path's, and the one_chunk path's with the
    // split-KV decode partials (n_kv_chunks = n_tasks)
    const size_t tiled  = sizeof(float)*ggml_flash_attn_ext_work_floats(DK, DV, true)*(size_t) n_tasks;
    const size_t decode = sizeof(float)*(ggml_flash_attn_ext_work_floats(DK, DV, false)*(size_t) n_tasks +
                                         (size_t) neq2*(size_t) n_tasks*(size_t)(2 + DV));
    return std::max(tiled, decode);
}

extern "C" bool ggml_streaming_flash_attn_cpu_supported(const ggml_tensor * op) {
    const ggml_tensor * q = op->src[GGML_STREAMING_FA_SRC_Q];
    if (!q || q->type != GGML_TYPE_F32) {
        return false;
    }
    for (int i : { GGML_STREAMING_FA_SRC_K_WIN, GGML_STREAMING_FA_SRC_V_WIN, GGML_STREAMING_FA_SRC_K_TAIL,
                  GGML_STREAMING_FA_SRC_V_TAIL }) {
        const ggml_tensor * t = op->src[i];
        if (t && !ggml_rkv_tail_type_supported(t->type)) {
            return false;
        }
    }
    const ggml_tensor * mask = op->src[GGML_STREAMING_FA_SRC_MASK];
    if (mask && mask->type != GGML_TYPE_F16) {
        return false;
    }
    const ggml_tensor * map = op->src[GGML_STREAMING_FA_SRC_MAP];
    if (map && map->type != GGML_TYPE_I32) {
        return false;
    }
    const int32_t prec = ggml_get_op_params_i32(op, 3);
    return prec == GGML_PREC_DEFAULT || prec == GGML_PREC_F32;
}

extern "C" void ggml_compute_forward_streaming_flash_attn(const ggml_compute_params * params, ggml_tensor * dst) {
    const int32_t prec = ggml_get_op_params_i32(dst, 3);
    GGML_ASSERT((prec == GGML_PREC_DEFAULT || prec == GGML_PREC_F32) && "streaming_flash_attn: unsupported precision");
    GGML_ASSERT(params->wsize >= ggml_streaming_flash_attn_work_size(dst, params->nth));

    const ggml_fa_src src = rkv_fa_src(dst);

    // mixed types in a prefill-sized batch over an F16/F32 window (rkv_fa_mixed_tiles)
    const ggml_tensor * q      = src.q;
    const ggml_tensor * k_win  = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * v_win  = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * k_tail = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * v_tail = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];
    const int64_t n_win = k_win ? k_win->ne[1] : 0;
    bool mixed_tiles = !params->use_ref && !src.map && src.mask && n_win > 0 && k_tail && k_tail->ne[1] > 0 &&
                       (k_win->type != k_tail->type || v_win->type != v_tail->type) && q->type == GGML_TYPE_F32 &&
                       k_win->type == v_win->type && (k_win->type == GGML_TYPE_F32 || k_win->type == GGML_TYPE_F16) &&
                       q->ne[1] >= (int64_t) ggml_fa_tile_config::Q;
#if defined(GGML_SIMD) && !defined(__x86_64__) && !defined(_M_X64)
    // ops.cpp's condition for its tiled kernel
#if defined(__ARM_FEATURE_SVE)
    const int64_t f32_epr = svcntw();
#else
    const int64_t f32_epr = GGML_F32_EPR;
#endif
    mixed_tiles &= (dst->ne[0] % f32_epr == 0);
#endif
    if (mixed_tiles) {
        rkv_fa_mixed_tiles(params, dst, src, n_win);
    } else {
        ggml_compute_forward_flash_attn_ext_src(params, dst, &src);
    }
}
