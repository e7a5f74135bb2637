// rolling-KV: CPU forward for GGML_OP_STREAMING_FLASH_ATTN
//
// The op is flash attention over the virtual concatenation [window ; tail] of two K/V
// tensors (see ggml-rolling-kv.h). A key accessor (sfa_rows) maps an absolute key index
// ic in [0, n_win + n_tail) to the row of the part that holds it, and the kernels below
// are ggml's CPU flash attention (ggml-cpu/ops.cpp, ggml_compute_forward_flash_attn_ext_f16
// and the functions it calls) with every "k->data + ic*nbk1 + ..." replaced by that accessor.
//
// Same-type parts (window and tail have the same K type and the same V type, or one part
// is empty): the output is BIT-IDENTICAL to ggml_flash_attn_ext over the concatenated K/V
// on the CPU backend with the same thread count. The path is chosen with ops.cpp's exact
// conditions evaluated on the full shape (nek1 = n_win + n_tail, the parts' common types):
//  (a) split-KV decode (n_q == 1, ne3 == 1, K/V f32|f16, K type == V type, nek1 >= 512):
//      the full key range is cut into nth chunks of ceil(nek1/nth) keys; each thread runs
//      one_chunk over its range for all heads (a chunk that straddles the split continues
//      its running state across the boundary), then the partials are reduced in chunk order.
//  (b) tiled (K/V f32|f16, K type == V type, n_q >= GGML_FA_TILE_Q): the KV tile grid is
//      over absolute key indices; a tile that straddles the split packs keys from both parts.
//  (c) one_chunk otherwise: per-key online softmax over the full range in key order; Q is
//      converted to K's vec_dot type, F16 V is accumulated in f16 (VKQ16), other V in f32.
// Rows are distributed over threads with ops.cpp's chunking (ggml_threadpool_chunk_*).
//
// Mixed types (window and tail differ in K or V type): there is no single-pass upstream
// reference; path (c) is used with per-key continuation of the running softmax state across
// the boundary, each key using its own part's arithmetic (Q converted to each part's
// vec_dot type; V accumulated in f16 if both V parts are F16, like upstream, else in f32
// with each part's to_float). Fully masked rows give 0, sinks are applied once. Exception, in
// prefill-sized batches over an F16/F32 window (K type == V type): Q tiles whose rows all mask
// the tail (the queries before the window boundary) run path (b) over the window alone, which
// is what upstream runs on the resident cache of the window's type for them, so those rows are
// bit-identical to it (sfa_mixed_tiles); the other tiles run (c).
//
// Block map (src 7, ggml_streaming_flash_attn_set_block_map): every path iterates the logical keys [0, 256*n_blocks),
// so the split-KV chunks and the KV tile grid are those of ggml_flash_attn_ext over them; logical key ic is the
// physical key p = 256*map[ic/256] + ic%256 (its K/V row, its mask column; tail runs and the test hook's tail are
// physical). one_chunk walks the keys block by block, each block wholly in one part; a KV tile (64 keys) lies in one
// block, so it is one physical range. Mixed types with a map run one_chunk (never sfa_mixed_tiles).
//
// Test hook (the must-fail controls of the gates and the op test): the op's tail_perturb parameter x
// (ggml_streaming_flash_attn_set_tail_perturb) multiplies every tail key's attention score (after scale, softcap and
// mask) by (1 + x) before the softmax. It exists only so that `rollingkv gate equiv` and the op test can prove they
// fail on a wrong window/tail merge; x > -1. The CUDA forward perturbs its tail parts the same way. Off (0) by
// default, and then it costs one predictable branch per key (one_chunk) or per KV tile (tiled).

#include "rolling-kv-fa.h"

#include "ggml-rolling-kv.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "common.h"
#include "ops.h"
#include "simd-gemm.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// one K/V part of the virtual concatenation
struct sfa_part {
    const ggml_tensor * k;
    const ggml_tensor * v;
    int64_t             n;    // number of KV cells in this part (0: empty)
    int64_t             c0;   // absolute index of its first key (= its first mask column)

    ggml_type         k_vec_dot_type;
    ggml_from_float_t q_to_vec_dot;
    ggml_vec_dot_t    kq_vec_dot;
    ggml_to_float_t   v_to_float;
};

static void sfa_init_part(sfa_part & p, const ggml_tensor * k, const ggml_tensor * v, int64_t c0) {
    p.k    = nullptr;
    p.v    = nullptr;
    p.n    = 0;
    p.c0   = c0;
    p.k_vec_dot_type = GGML_TYPE_COUNT;
    p.q_to_vec_dot   = nullptr;
    p.kq_vec_dot     = nullptr;
    p.v_to_float     = nullptr;
    if (!k || !v || k->ne[1] == 0) {
        return;
    }
    p.k = k;
    p.v = v;
    p.n = k->ne[1];
    p.k_vec_dot_type = ggml_get_type_traits_cpu(k->type)->vec_dot_type;
    p.q_to_vec_dot   = ggml_get_type_traits_cpu(p.k_vec_dot_type)->from_float;
    p.kq_vec_dot     = ggml_get_type_traits_cpu(k->type)->vec_dot;
    p.v_to_float     = ggml_get_type_traits(v->type)->to_float;

    GGML_ASSERT((p.q_to_vec_dot && p.kq_vec_dot) && "streaming_flash_attn: unsupported K type");
    GGML_ASSERT((v->type == GGML_TYPE_F32 || p.v_to_float) && "streaming_flash_attn: unsupported V type");
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type));
    GGML_ASSERT(v->nb[0] == ggml_type_size(v->type));
    GGML_ASSERT(v->ne[1] == p.n);
}

// everything the kernels need, computed once per op invocation
struct sfa_ctx {
    const ggml_tensor * q;
    const ggml_tensor * mask;
    const ggml_tensor * sinks;
    ggml_tensor       * dst;

    sfa_part part[2];   // 0: window [0, n_win), 1: tail [n_win, n_win + n_tail)
    int64_t  n_win;
    int64_t  nek1;      // the keys attended: n_win + n_tail, or 256*n_blocks with a block map
    const int32_t * map; // the block map (src 7): logical block b is physical block map[b]; nullptr: none
    int64_t  DK, DV;

    bool      same_types; // all present K parts share one type and all present V parts share one type
    ggml_type k_type;     // the common types when same_types
    ggml_type v_type;
    bool      v_f16_acc;  // every present V part is F16: accumulate V in f16 (as ops.cpp one_chunk)

    float    scale;
    float    max_bias;
    float    logit_softcap;
    uint32_t n_head_log2;
    float    m0, m1;

    // per-thread scratch strides in wdata (floats); equal (the larger of the two) when one op runs both the tiled
    // and the one_chunk path at once, so that the threads' scratch never overlaps (sfa_mixed_tiles)
    int64_t oc_stride;
    int64_t tiled_stride;

    bool  perturb_tail;   // test hook: the op's tail_perturb x is not 0
    float perturb_mul;    // 1 + x

    // the tail keys the op reads (ggml_streaming_flash_attn_set_tail_runs): [run_lo[r], run_hi[r]) in absolute key
    // indices; a tail key outside them is masked for every row. 0 runs: every tail key is read
    int     n_runs;
    int64_t run_lo[GGML_RKV_MAX_TAIL_RUNS];
    int64_t run_hi[GGML_RKV_MAX_TAIL_RUNS];
};

// a tail key outside the op's runs: treated as masked (-inf) for every row, as a GPU backend that neither streams nor
// attends it computes
static inline bool sfa_unread(const sfa_ctx & c, int64_t ic) {
    if (c.n_runs == 0 || ic < c.n_win) {
        return false;
    }
    for (int r = 0; r < c.n_runs; ++r) {
        if (ic >= c.run_lo[r] && ic < c.run_hi[r]) {
            return false;
        }
    }
    return true;
}

// the physical key of logical key ic under the block map
static inline int64_t sfa_phys(const sfa_ctx & c, int64_t ic) {
    return 256*(int64_t) c.map[ic/256] + ic%256;
}

// the block map: entries in [0, the physical blocks wholly inside the window or the tail), distinct. A block index
// below n_win/256 is in the window, one from it up to floor((n_win + n_tail)/256) in the tail (n_win % 256 == 0)
static void sfa_check_map(const ggml_tensor * map, int64_t n_win, int64_t n_keys) {
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

// per (head, stream) row pointers of both parts: the virtual concatenation's key accessor
struct sfa_rows {
    const char * kb[2];
    const char * vb[2];
    size_t       nbk1[2];
    size_t       nbv1[2];
    int64_t      n_win;

    inline const char * k(int64_t ic) const {
        return ic < n_win ? kb[0] + ic*nbk1[0] : kb[1] + (ic - n_win)*nbk1[1];
    }
    inline const char * v(int64_t ic) const {
        return ic < n_win ? vb[0] + ic*nbv1[0] : vb[1] + (ic - n_win)*nbv1[1];
    }
};

static sfa_rows sfa_make_rows(const sfa_ctx & c, int64_t iq2, int64_t iq3) {
    const int64_t neq2 = c.q->ne[2];
    const int64_t neq3 = c.q->ne[3];
    sfa_rows r;
    r.n_win = c.n_win;
    for (int i = 0; i < 2; ++i) {
        const sfa_part & p = c.part[i];
        r.kb[i] = nullptr;
        r.vb[i] = nullptr;
        r.nbk1[i] = 0;
        r.nbv1[i] = 0;
        if (p.n == 0) {
            continue;
        }
        // broadcast factors
        const int64_t rk2 = neq2/p.k->ne[2];
        const int64_t rk3 = neq3/p.k->ne[3];
        const int64_t rv2 = neq2/p.v->ne[2];
        const int64_t rv3 = neq3/p.v->ne[3];

        r.kb[i]   = (const char *) p.k->data + (iq2/rk2)*p.k->nb[2] + (iq3/rk3)*p.k->nb[3];
        r.vb[i]   = (const char *) p.v->data + (iq2/rv2)*p.v->nb[2] + (iq3/rv3)*p.v->nb[3];
        r.nbk1[i] = p.k->nb[1];
        r.nbv1[i] = p.v->nb[1];
    }
    return r;
}

// ---- scratch layouts (floats per thread) ----

// one_chunk: VKQ32 (DV) | V32 / VKQ16 (DV) | Q_q window (DK) | Q_q tail (DK) | pad
static int64_t sfa_oc_floats_per_thread(int64_t DK, int64_t DV) {
    return 2*DK + 2*DV + CACHE_LINE_SIZE_F32;
}

// tiled: as ops.cpp
static int64_t sfa_tiled_floats_per_thread(int64_t DK, int64_t DV) {
    const int64_t Q_TILE_SZ  = ggml_fa_tile_config::Q;
    const int64_t KV_TILE_SZ = ggml_fa_tile_config::KV;
    return Q_TILE_SZ*DK + 2*Q_TILE_SZ*KV_TILE_SZ + Q_TILE_SZ*DV + KV_TILE_SZ*DV + KV_TILE_SZ*DK + CACHE_LINE_SIZE_F32;
}

// ops.cpp ggml_compute_forward_flash_attn_ext_f16_one_chunk over the keys [ic_start, ic_end)
// of the virtual concatenation (MAPPED: the logical keys of the block map)
template <bool MAPPED>
static void sfa_one_chunk_t(
        const ggml_compute_params * params,
        const sfa_ctx & c,
        int64_t ir0, int64_t ir1,
        int64_t ic_start, int64_t ic_end,
        float * partials, int64_t partial_stride) {

    const bool write_partials = (partials != nullptr);
    const ggml_tensor * q     = c.q;
    const ggml_tensor * mask  = c.mask;
    const ggml_tensor * sinks = c.sinks;
    ggml_tensor       * dst   = c.dst;

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t DK = c.DK;
    const int64_t DV = c.DV;

    const float scale         = c.scale;
    const float max_bias      = c.max_bias;
    const float logit_softcap = c.logit_softcap;

    const uint32_t n_head_log2 = c.n_head_log2;
    const float m0 = c.m0;
    const float m1 = c.m1;

    const bool v_f16_acc = c.v_f16_acc;

    // key range of each part inside [ic_start, ic_end) (no block map)
    int64_t lo[2], hi[2];
    for (int i = 0; i < 2; ++i) {
        lo[i] = std::max(ic_start, c.part[i].c0);
        hi[i] = std::min(ic_end,   c.part[i].c0 + c.part[i].n);
    }

    const int ith = params->ith;

    for (int64_t ir = ir0; ir < ir1; ++ir) {
        // q indices
        const int iq3 = ir/(neq2*neq1);
        const int iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);

        const uint32_t h = iq2; // head index
        const float slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1)
                            : 1.0f;

        float S = 0.0f;      // sum
        float M = -INFINITY; // maximum KQ value

        float       * VKQ32 = (float       *) params->wdata + ith*c.oc_stride; // FP32 VKQ accumulator
        float       * V32   =                 (VKQ32 + 1*DV); // (temporary) FP32 V buffer
        ggml_fp16_t * VKQ16 = (ggml_fp16_t *) (VKQ32 + 1*DV); // (temporary) FP16 VKQ accumulator
        // Q converted to each part's vec_dot type
        void        * Q_q[2] = { (void *) (VKQ32 + 2*DV), (void *) (VKQ32 + 2*DV + DK) };

        if (v_f16_acc) {
            memset(VKQ16, 0, DV*sizeof(ggml_fp16_t));
        } else {
            memset(VKQ32, 0, DV*sizeof(float));
        }

        const ggml_fp16_t * mp = mask
                                 ? (ggml_fp16_t *)((char *) mask->data + iq1*mask->nb[1] +
                                                   (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3])
                                 : NULL;

        const sfa_rows rows = sfa_make_rows(c, iq2, iq3);

        const float * pq = (const float *) ((char *) q->data + (iq1*nbq1 + iq2*nbq2 + iq3*nbq3));

        if (MAPPED) {
            // Q in the vec_dot type of each part: the blocks alternate between them
            for (int ip = 0; ip < 2; ++ip) {
                if (c.part[ip].n > 0) {
                    c.part[ip].q_to_vec_dot(pq, Q_q[ip], DK);
                }
            }
        }

        // online softmax / attention over the window keys, then the tail keys (MAPPED: over the blocks in the map's
        // order, each wholly in one part): one running state (M, S, VKQ) continued across the segments
        const int64_t n_seg = MAPPED ? (ic_end + 255)/256 - ic_start/256 : 2;
        for (int64_t is = 0; is < n_seg; ++is) {
            int     ip;
            int64_t k_lo, k_hi; // the segment's physical keys
            if (MAPPED) {
                const int64_t b  = ic_start/256 + is;
                const int64_t l0 = std::max(ic_start, 256*b);
                const int64_t l1 = std::min(ic_end, 256*(b + 1));
                k_lo = sfa_phys(c, l0);
                k_hi = k_lo + (l1 - l0);
                ip   = k_lo < c.n_win ? 0 : 1;
            } else {
                ip   = (int) is;
                k_lo = lo[ip];
                k_hi = hi[ip];
                if (k_lo >= k_hi) {
                    continue;
                }
            }
            const sfa_part & p = c.part[ip];

            ggml_vec_dot_t  const kq_vec_dot = p.kq_vec_dot;
            ggml_to_float_t const v_to_float = p.v_to_float;
            void          * const Q_qp       = Q_q[ip];

            if (!MAPPED) {
                p.q_to_vec_dot(pq, Q_qp, DK);
            }

            const bool  perturb     = ip == 1 && c.perturb_tail;
            const float perturb_mul = c.perturb_mul;
            const bool  runs        = ip == 1 && c.n_runs > 0;

            const char  * kb   = rows.kb[ip];
            const char  * vb   = rows.vb[ip];
            const size_t  nbk1 = rows.nbk1[ip];
            const size_t  nbv1 = rows.nbv1[ip];
            const int64_t c0   = p.c0;

            for (int64_t ic = k_lo; ic < k_hi; ++ic) {
                const float mv = mp ? slope*GGML_CPU_FP16_TO_FP32(mp[ic]) : 0.0f;
                if (mv == -INFINITY || (runs && sfa_unread(c, ic))) {
                    continue;
                }

                float s; // KQ value

                const char * k_data = kb + (ic - c0)*nbk1;
                kq_vec_dot(DK, &s, 0, k_data, 0, Q_qp, 0, 1);

                s = s*scale; // scale KQ value

                if (logit_softcap != 0.0f) {
                    s = logit_softcap*tanhf(s);
                }

                s += mv; // apply mask

                if (perturb) {
                    s *= perturb_mul; // test hook: the op's tail_perturb
                }

                const float Mold = M;

                float ms = 1.0f; // upon new higher max val, scale VKQ and KQ sum with this value
                float vs = 1.0f; // post-softmax KQ value, expf(s - M)

                const char * v_data = vb + (ic - c0)*nbv1;

                if (v_f16_acc) {
                    if (s > M) {
                        // s is new maximum, ms < 1.0f, vs == expf(s - s) == 1.0f
                        M = s;
                        ms = expf(Mold - M);

                        // V = V*expf(Mold - M)
                        ggml_vec_scale_f16(DV, VKQ16, ms);
                    } else {
                        // no new maximum, ms == 1.0f, vs != 1.0f
                        vs = expf(s - M);
                    }

                    // V += v*expf(s - M)
                    ggml_vec_mad_f16(DV, VKQ16, (const ggml_fp16_t *) v_data, vs);
                } else {
                    if (s > M) {
                        // s is new maximum, ms < 1.0f, vs == expf(s - s) == 1.0f
                        M = s;
                        ms = expf(Mold - M);

                        // V = V*expf(Mold - M)
                        ggml_vec_scale_f32(DV, VKQ32, ms);
                    } else {
                        // no new maximum, ms == 1.0f, vs != 1.0f
                        vs = expf(s - M);
                    }

                    // V += v*expf(s - M)
                    if (v_to_float) {
                        v_to_float(v_data, V32, DV);
                        ggml_vec_mad_f32(DV, VKQ32, V32, vs);
                    } else {
                        // V is F32
                        ggml_vec_mad_f32(DV, VKQ32, (const float *) v_data, vs);
                    }
                }

                S = S*ms + vs; // scale and increment sum with partial sum
            }
        }

        if (v_f16_acc) {
            for (int64_t d = 0; d < DV; ++d) {
                VKQ32[d] = GGML_CPU_FP16_TO_FP32(VKQ16[d]);
            }
        }

        // sinks - apply only on the first kv-chunk
        if (sinks && ic_start == 0) {
            const float s = ((float *)((char *) sinks->data))[h];

            float ms = 1.0f;
            float vs = 1.0f;

            if (s > M) {
                ms = expf(M - s);
                M = s;
                ggml_vec_scale_f32(DV, VKQ32, ms);
            } else {
                vs = expf(s - M);
            }

            S = S*ms + vs;
        }

        if (write_partials) {
            // Write M, S, VKQ to partials for later reduction
            // partials layout: [M, S, VKQ[DV]] per query head
            float * partial = partials + ir * partial_stride;
            partial[0] = M;
            partial[1] = S;
            memcpy(partial + 2, VKQ32, DV * sizeof(float));
        } else {
            // V /= S
            const float S_inv = S == 0.0f ? 0.0f : 1.0f/S;
            ggml_vec_scale_f32(DV, VKQ32, S_inv);

            // dst indices
            const int i1 = iq1;
            const int i2 = iq2;
            const int i3 = iq3;

            // permute(0, 2, 1, 3)
            memcpy((char *) dst->data + (i3*ne2*ne1 + i2 + i1*ne1)*nb1, VKQ32, nb1);
        }
    }
}

static void sfa_one_chunk(
        const ggml_compute_params * params,
        const sfa_ctx & c,
        int64_t ir0, int64_t ir1,
        int64_t ic_start, int64_t ic_end,
        float * partials, int64_t partial_stride) {
    if (c.map) {
        sfa_one_chunk_t<true>(params, c, ir0, ir1, ic_start, ic_end, partials, partial_stride);
    } else {
        sfa_one_chunk_t<false>(params, c, ir0, ir1, ic_start, ic_end, partials, partial_stride);
    }
}

#include "rolling-kv-fa-tiled.inc"

// ops.cpp ggml_flash_attn_ext_reduce_partials: combines the per-chunk partials in chunk order
// Partials layout in wdata (after the one_chunk scratch): [n_q_heads][n_chunks][2 + DV]
static void sfa_reduce_partials(
        const ggml_compute_params * params,
        const sfa_ctx & c,
        const int64_t n_chunks,
        const int64_t chunk_size) {

    ggml_tensor * dst = c.dst;

    const int64_t DK        = c.DK;
    const int64_t DV        = c.DV;
    const int64_t nek1      = c.nek1;
    const int64_t n_q_heads = c.q->ne[2];

    const int ith = params->ith;
    const int nth = params->nth;

    const int64_t wdata_per_thread = sfa_oc_floats_per_thread(DK, DV);
    float *       thread_wdata     = (float *) params->wdata + ith * wdata_per_thread;

    const int64_t partials_offset  = nth * wdata_per_thread;
    const int64_t partial_size     = 2 + DV;
    const float * partials_base    = (const float *) params->wdata + partials_offset;

    // Output layout
    const int64_t ne1 = dst->ne[1];
    const int64_t ne2 = dst->ne[2];
    const size_t  nb1 = dst->nb[1];

    // Each thread reduces a subset of query heads
    for (int64_t q_head = ith; q_head < n_q_heads; q_head += nth) {
        float   M_final   = -INFINITY;
        float   S_final   = 0.0f;
        float * VKQ_final = thread_wdata;
        memset(VKQ_final, 0, DV * sizeof(float));

        // Combine partials from all chunks
        for (int64_t chunk_idx = 0; chunk_idx < n_chunks; ++chunk_idx) {
            const int64_t ic_start = chunk_idx * chunk_size;
            if (ic_start >= nek1) continue;

            const float * partial   = partials_base + (q_head * n_chunks + chunk_idx) * partial_size;
            const float   M_chunk   = partial[0];
            const float   S_chunk   = partial[1];
            const float * VKQ_chunk = partial + 2;

            if (S_chunk == 0.0f) continue;

            const float M_new     = fmaxf(M_final, M_chunk);
            const float scale_old = expf(M_final - M_new);
            const float scale_new = expf(M_chunk - M_new);

            for (int64_t d = 0; d < DV; ++d) {
                VKQ_final[d] = VKQ_final[d] * scale_old + VKQ_chunk[d] * scale_new;
            }
            S_final = S_final * scale_old + S_chunk * scale_new;
            M_final = M_new;
        }

        // Normalize and write to output
        if (S_final != 0.0f) {
            const float S_inv = 1.0f / S_final;
            ggml_vec_scale_f32(DV, VKQ_final, S_inv);
        }
        // iq1=0, iq3=0 for decode
        memcpy((char *) dst->data + (0*ne2*ne1 + q_head + 0*ne1)*nb1, VKQ_final, nb1);
    }
}

} // namespace

extern "C" size_t ggml_streaming_flash_attn_work_size(const ggml_tensor * node, int n_tasks) {
    const int64_t neq2 = node->src[GGML_STREAMING_FA_SRC_Q]->ne[2]; // number of query heads
    const int64_t DK   = node->src[GGML_STREAMING_FA_SRC_Q]->ne[0];
    const int64_t DV   = node->ne[0];

    // tiled (prefill) path
    const size_t tiled = sizeof(float)*(size_t) sfa_tiled_floats_per_thread(DK, DV)*(size_t) n_tasks;

    // one_chunk scratch per thread + split-KV decode partials: n_kv_chunks = n_tasks
    const size_t n_chunks = (size_t) n_tasks;
    const size_t decode   = sizeof(float)*((size_t) sfa_oc_floats_per_thread(DK, DV)*(size_t) n_tasks +
                                           (size_t) neq2*n_chunks*(size_t)(2 + DV));

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
    sfa_ctx c;
    c.q     = dst->src[GGML_STREAMING_FA_SRC_Q];
    c.mask  = dst->src[GGML_STREAMING_FA_SRC_MASK];
    c.sinks = dst->src[GGML_STREAMING_FA_SRC_SINKS];
    c.dst   = dst;

    const ggml_tensor * q      = c.q;
    const ggml_tensor * k_win  = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * v_win  = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * k_tail = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * v_tail = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];

    const int32_t prec = ggml_get_op_params_i32(dst, 3);
    GGML_ASSERT((prec == GGML_PREC_DEFAULT || prec == GGML_PREC_F32) && "streaming_flash_attn: unsupported precision");

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t DK = neq0;
    const int64_t DV = ne0;
    const int64_t N  = neq1;

    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT(nbq0 == ggml_type_size(q->type));
    GGML_ASSERT(ne2 == N);
    GGML_ASSERT(ne1 == neq2);

    // dst cannot be transposed or permuted
    GGML_ASSERT(nb0 == sizeof(float));
    GGML_ASSERT(nb0 <= nb1);
    GGML_ASSERT(nb1 <= nb2);
    GGML_ASSERT(nb2 <= nb3);

    const int64_t n_win = k_win ? k_win->ne[1] : 0;
    GGML_ASSERT(n_win == ggml_get_op_params_i32(dst, 4));

    sfa_init_part(c.part[0], k_win,  v_win,  0);
    sfa_init_part(c.part[1], k_tail, v_tail, n_win);

    c.n_win = n_win;
    c.nek1  = c.part[0].n + c.part[1].n;

    // the block map: every path below iterates the logical keys
    c.map = nullptr;
    if (const ggml_tensor * map = dst->src[GGML_STREAMING_FA_SRC_MAP]) {
        sfa_check_map(map, n_win, c.nek1);
        c.map  = (const int32_t *) map->data;
        c.nek1 = 256*ggml_nelements(map);
    }

    {
        int32_t first[GGML_RKV_MAX_TAIL_RUNS], n[GGML_RKV_MAX_TAIL_RUNS];
        c.n_runs = c.part[1].n > 0 ? ggml_streaming_flash_attn_get_tail_runs(dst, first, n) : 0;
        for (int r = 0; r < c.n_runs; ++r) {
            c.run_lo[r] = n_win + first[r];
            c.run_hi[r] = n_win + first[r] + n[r];
        }
    }
    c.DK    = DK;
    c.DV    = DV;

    c.oc_stride    = sfa_oc_floats_per_thread(DK, DV);
    c.tiled_stride = sfa_tiled_floats_per_thread(DK, DV);

    c.same_types = true;
    c.k_type     = GGML_TYPE_COUNT;
    c.v_type     = GGML_TYPE_COUNT;
    c.v_f16_acc  = true;
    for (const sfa_part & p : c.part) {
        if (p.n == 0) {
            continue;
        }
        GGML_ASSERT(p.k->ne[0] == DK);
        GGML_ASSERT(p.v->ne[0] == DV);
        if (c.k_type == GGML_TYPE_COUNT) {
            c.k_type = p.k->type;
            c.v_type = p.v->type;
        } else if (c.k_type != p.k->type || c.v_type != p.v->type) {
            c.same_types = false;
        }
        c.v_f16_acc = c.v_f16_acc && p.v->type == GGML_TYPE_F16;
    }
    if (c.nek1 == 0) {
        c.v_f16_acc = false;
    }

    c.scale         = 1.0f;
    c.max_bias      = 0.0f;
    c.logit_softcap = 0.0f;

    memcpy(&c.scale,         (float *) dst->op_params + 0, sizeof(float));
    memcpy(&c.max_bias,      (float *) dst->op_params + 1, sizeof(float));
    memcpy(&c.logit_softcap, (float *) dst->op_params + 2, sizeof(float));

    if (c.logit_softcap != 0) {
        c.scale /= c.logit_softcap;
    }

    const uint32_t n_head = neq2;
    c.n_head_log2 = 1u << (uint32_t) floor(log2(n_head));

    c.m0 = powf(2.0f, -(c.max_bias       ) / c.n_head_log2);
    c.m1 = powf(2.0f, -(c.max_bias / 2.0f) / c.n_head_log2);

    const float perturb_x = ggml_streaming_flash_attn_get_tail_perturb(dst); // test hook; 0: off
    c.perturb_tail = perturb_x != 0.0f;
    c.perturb_mul  = 1.0f + perturb_x;

    const int ith = params->ith;
    const int nth = params->nth;

    GGML_ASSERT(params->wsize >= ggml_streaming_flash_attn_work_size(dst, nth));

    // upstream's path selection (ops.cpp ggml_compute_forward_flash_attn_ext_f16), evaluated on
    // the full shape; only same-type parts have a single-pass upstream equivalent
    const bool use_ref = params->use_ref;

    const int64_t nek1 = c.nek1;

    const bool kv_is_f32_or_f16 = c.same_types && (c.k_type == GGML_TYPE_F32 || c.k_type == GGML_TYPE_F16);
    // a stream's op of a multi-stream batch takes the path of the whole batch's (ref_streams)
    const int64_t neq3_ref = std::max<int64_t>(neq3, ggml_streaming_flash_attn_get_ref_streams(dst));
    const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3_ref == 1) && kv_is_f32_or_f16 &&
                                   (c.k_type == c.v_type) && q->type == GGML_TYPE_F32 && nek1 >= 512;

    if (use_split_kv_path) {
        const int64_t chunk_size = (nek1 + nth - 1) / nth;

        // Partials buffer layout: [q_head][kv_chunk][M, S, VKQ]
        const int64_t partial_size  = 2 + DV;
        float *       partials_base = (float *) params->wdata + nth * sfa_oc_floats_per_thread(DK, DV);

        const int64_t ic_start = ith * chunk_size;
        const int64_t ic_end   = std::min(ic_start + chunk_size, nek1);

        const int64_t partial_stride = nth * partial_size;
        float *       chunk_partials = partials_base + ith * partial_size;

        if (ic_start < nek1) {
            for (int64_t q_head = 0; q_head < neq2; q_head++) {
                sfa_one_chunk(params, c, q_head, q_head + 1, ic_start, ic_end, chunk_partials, partial_stride);
            }
        } else {
            for (int64_t q_head = 0; q_head < neq2; q_head++) {
                float * q_partials = chunk_partials + q_head * partial_stride;
                q_partials[0] = -INFINITY;  // M
                q_partials[1] = 0.0f;       // S
            }
        }

        ggml_barrier(params->threadpool);
        sfa_reduce_partials(params, c, nth, chunk_size);
    } else {

        // total rows in q
        const int64_t nr = neq1*neq2*neq3;

        // disable for NUMA
        const bool disable_chunking = ggml_is_numa();

        // 4x chunks per thread
        int nth_scaled = nth * 4;
        int64_t chunk_size = (nr + nth_scaled - 1) / nth_scaled;
        int64_t nchunk     = (nr + chunk_size - 1) / chunk_size;

        if (nth == 1 || nchunk < nth || disable_chunking) {
            nchunk = nth;
        }

        if (ith == 0) {
            ggml_threadpool_chunk_set(params->threadpool, nth);
        }

        ggml_barrier(params->threadpool);

        const int64_t dr = (nr + nchunk - 1) / nchunk;

        static constexpr int64_t Q_TILE_SZ  = ggml_fa_tile_config::Q;
        bool use_tiled = !use_ref &&
                               (q->type == GGML_TYPE_F32 &&
                                kv_is_f32_or_f16 &&
                                c.k_type == c.v_type &&
                                neq1 >= Q_TILE_SZ);
#if defined(GGML_SIMD) && !defined(__x86_64__) && !defined(_M_X64)
#if defined(__ARM_FEATURE_SVE)
        const int64_t f32_epr = svcntw();
#else
        const int64_t f32_epr = GGML_F32_EPR;
#endif
        use_tiled &= (DV % f32_epr == 0);
#endif
        // mixed types: the window alone as the resident cache of its type would run (see sfa_mixed_tiles)
        const sfa_part & pw = c.part[0];
        bool use_mixed_tiles = !use_ref && !c.map && !c.same_types && c.mask && pw.n > 0 && c.part[1].n > 0 &&
                               q->type == GGML_TYPE_F32 && pw.k->type == pw.v->type &&
                               (pw.k->type == GGML_TYPE_F32 || pw.k->type == GGML_TYPE_F16) &&
                               neq1 >= Q_TILE_SZ;
#if defined(GGML_SIMD) && !defined(__x86_64__) && !defined(_M_X64)
        use_mixed_tiles &= (DV % f32_epr == 0);
#endif
        if (use_mixed_tiles) {
            // both paths run at once on different threads: one scratch stride for both (within the work size,
            // which is the larger of nth x either stride)
            c.oc_stride = c.tiled_stride = std::max(c.oc_stride, c.tiled_stride);
        }
        sfa_ctx c_win = c;
        if (use_mixed_tiles) {
            sfa_init_part(c_win.part[1], nullptr, nullptr, c.n_win);
            c_win.nek1       = c.n_win;
            c_win.same_types = true;
            c_win.k_type     = pw.k->type;
            c_win.v_type     = pw.v->type;
        }
        int current_chunk = ith;

        while (current_chunk < nchunk) {
            const int64_t ir0 = dr * current_chunk;
            const int64_t ir1 = std::min(ir0 + dr, nr);

            if (use_tiled) {
                sfa_tiled(params, c, ir0, ir1);
            } else if (use_mixed_tiles) {
                sfa_mixed_tiles(params, c, c_win, ir0, ir1);
            } else {
                sfa_one_chunk(params, c, ir0, ir1, 0, nek1, nullptr, 0);
            }

            current_chunk = ggml_threadpool_chunk_add(params->threadpool, 1);
        }
    }
}
