// rolling-KV: CPU forward for GGML_OP_STREAMING_FLASH_ATTN
//
// For every (q row, head) the window and the tail are each reduced with the same
// online-softmax arithmetic as ggml's CPU flash attention (ops.cpp, *_one_chunk):
// Q converted to K's vec_dot_type, kq = dot*scale, optional softcap, + slope*mask,
// -inf entries skipped. Each part yields (M, S, unnormalized VKQ); the two are merged
// exactly in f32 (a part with S == 0 contributes nothing), sinks are applied once,
// and the result is VKQ/S (0 when S == 0), written in ggml_flash_attn_ext's layout.
//
// V is always accumulated in f32 (V rows converted with to_float), also for F16 V.
// ops.cpp's one_chunk accumulates F16 V in an f16 buffer, which makes its result
// depend on how the KV range is partitioned (its own decode split-KV path differs
// from its single-chunk path by NMSE ~1e-5), so no two-part reduction can reproduce
// it; f32 accumulation is what ops.cpp's tiled (prefill) path does and is exact to
// f32 rounding against flash_attn_ext given a lossless F32 copy of V.

#include "rolling-kv-fa.h"

#include "ggml-rolling-kv.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "ops.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

struct sfa_part {
    const ggml_tensor * k;
    const ggml_tensor * v;
    int64_t             n;       // number of KV cells in this part
    int64_t             col0;    // first mask column of this part

    ggml_type         k_vec_dot_type;
    ggml_from_float_t q_to_vec_dot;
    ggml_vec_dot_t    kq_vec_dot;
    ggml_to_float_t   v_to_float;
};

static void sfa_init_part(sfa_part & p, const ggml_tensor * k, const ggml_tensor * v, int64_t col0) {
    p.k    = k;
    p.v    = v;
    p.n    = k ? k->ne[1] : 0;
    p.col0 = col0;
    p.q_to_vec_dot = nullptr;
    p.kq_vec_dot   = nullptr;
    p.v_to_float   = nullptr;
    p.k_vec_dot_type = GGML_TYPE_COUNT;
    if (!k || p.n == 0) {
        p.n = 0;
        return;
    }
    p.k_vec_dot_type = ggml_get_type_traits_cpu(k->type)->vec_dot_type;
    p.q_to_vec_dot   = ggml_get_type_traits_cpu(p.k_vec_dot_type)->from_float;
    p.kq_vec_dot     = ggml_get_type_traits_cpu(k->type)->vec_dot;
    p.v_to_float     = ggml_get_type_traits(v->type)->to_float;

    GGML_ASSERT(p.q_to_vec_dot && p.kq_vec_dot && "streaming_flash_attn: unsupported K type");
    GGML_ASSERT((v->type == GGML_TYPE_F32 || p.v_to_float) && "streaming_flash_attn: unsupported V type");
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type));
    GGML_ASSERT(v->nb[0] == ggml_type_size(v->type));
}

// online softmax over one part for one q row; same arithmetic as ops.cpp one_chunk.
// on return: *M_out, *S_out and VKQ32 (unnormalized, f32) hold the part's state.
static void sfa_reduce_part(
        const sfa_part & p,
        const float * pq, int64_t DK, int64_t DV,
        int64_t neq2, int64_t neq3, int64_t iq2, int64_t iq3,
        const ggml_fp16_t * mp, float slope,
        float scale, float logit_softcap,
        void * Q_q, float * VKQ32, float * V32,
        float * M_out, float * S_out) {
    float S = 0.0f;      // sum
    float M = -INFINITY; // maximum KQ value

    if (p.n == 0) {
        memset(VKQ32, 0, DV*sizeof(float));
        *M_out = M;
        *S_out = S;
        return;
    }

    const ggml_tensor * k = p.k;
    const ggml_tensor * v = p.v;

    // broadcast factors
    const int64_t rk2 = neq2/k->ne[2];
    const int64_t rk3 = neq3/k->ne[3];
    const int64_t rv2 = neq2/v->ne[2];
    const int64_t rv3 = neq3/v->ne[3];

    const int64_t ik2 = iq2/rk2;
    const int64_t ik3 = iq3/rk3;
    const int64_t iv2 = iq2/rv2;
    const int64_t iv3 = iq3/rv3;

    const char * k_base = (const char *) k->data + ik2*k->nb[2] + ik3*k->nb[3];
    const char * v_base = (const char *) v->data + iv2*v->nb[2] + iv3*v->nb[3];
    const size_t nbk1 = k->nb[1];
    const size_t nbv1 = v->nb[1];

    memset(VKQ32, 0, DV*sizeof(float));

    p.q_to_vec_dot(pq, Q_q, DK);

    const ggml_fp16_t * mpp = mp ? mp + p.col0 : nullptr;

    for (int64_t ic = 0; ic < p.n; ++ic) {
        const float mv = mpp ? slope*GGML_CPU_FP16_TO_FP32(mpp[ic]) : 0.0f;
        if (mv == -INFINITY) {
            continue;
        }

        float s; // KQ value

        const char * k_data = k_base + ic*nbk1;
        p.kq_vec_dot(DK, &s, 0, k_data, 0, Q_q, 0, 1);

        s = s*scale; // scale KQ value

        if (logit_softcap != 0.0f) {
            s = logit_softcap*tanhf(s);
        }

        s += mv; // apply mask

        const float Mold = M;

        float ms = 1.0f; // upon new higher max val, scale VKQ and KQ sum with this value
        float vs = 1.0f; // post-softmax KQ value, expf(s - M)

        const char * v_data = v_base + ic*nbv1;

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
        if (p.v_to_float) {
            p.v_to_float(v_data, V32, DV);
            ggml_vec_mad_f32(DV, VKQ32, V32, vs);
        } else {
            // V is F32
            ggml_vec_mad_f32(DV, VKQ32, (const float *) v_data, vs);
        }

        S = S*ms + vs;
    }

    *M_out = M;
    *S_out = S;
}

static bool sfa_type_supported(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
            return true;
        default:
            return false;
    }
}

static int64_t sfa_dk(const ggml_tensor * dst) {
    return dst->src[GGML_STREAMING_FA_SRC_Q]->ne[0];
}

static int64_t sfa_dv(const ggml_tensor * dst) {
    return dst->ne[0];
}

// per-thread scratch in floats: Q_q (<= DK floats for every vec_dot type), VKQ window, VKQ tail, V32
static size_t sfa_floats_per_thread(int64_t DK, int64_t DV) {
    return (size_t) (DK + 3*DV + CACHE_LINE_SIZE_F32);
}

} // namespace

extern "C" size_t ggml_streaming_flash_attn_work_size(const ggml_tensor * node, int n_tasks) {
    return sizeof(float)*sfa_floats_per_thread(sfa_dk(node), sfa_dv(node))*(size_t) n_tasks;
}

extern "C" bool ggml_streaming_flash_attn_cpu_supported(const ggml_tensor * op) {
    const ggml_tensor * q = op->src[GGML_STREAMING_FA_SRC_Q];
    if (!q || q->type != GGML_TYPE_F32) {
        return false;
    }
    for (int i : { GGML_STREAMING_FA_SRC_K_WIN, GGML_STREAMING_FA_SRC_V_WIN, GGML_STREAMING_FA_SRC_K_TAIL, GGML_STREAMING_FA_SRC_V_TAIL }) {
        const ggml_tensor * t = op->src[i];
        if (t && !sfa_type_supported(t->type)) {
            return false;
        }
    }
    const ggml_tensor * mask = op->src[GGML_STREAMING_FA_SRC_MASK];
    if (mask && mask->type != GGML_TYPE_F16) {
        return false;
    }
    const int32_t prec = ggml_get_op_params_i32(op, 3);
    return prec == GGML_PREC_DEFAULT || prec == GGML_PREC_F32;
}

extern "C" void ggml_compute_forward_streaming_flash_attn(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q      = dst->src[GGML_STREAMING_FA_SRC_Q];
    const ggml_tensor * k_win  = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * v_win  = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * k_tail = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * v_tail = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];
    const ggml_tensor * mask   = dst->src[GGML_STREAMING_FA_SRC_MASK];
    const ggml_tensor * sinks  = dst->src[GGML_STREAMING_FA_SRC_SINKS];

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

    sfa_part parts[2];
    sfa_init_part(parts[0], k_win,  v_win,  0);
    sfa_init_part(parts[1], k_tail, v_tail, n_win);

    for (const sfa_part & p : parts) {
        if (p.k) {
            GGML_ASSERT(p.k->ne[0] == DK);
            GGML_ASSERT(p.v->ne[0] == DV);
        }
    }

    float scale         = 1.0f;
    float max_bias      = 0.0f;
    float logit_softcap = 0.0f;

    memcpy(&scale,         (float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (float *) dst->op_params + 2, sizeof(float));

    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));

    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    const int ith = params->ith;
    const int nth = params->nth;

    GGML_ASSERT(params->wsize >= ggml_streaming_flash_attn_work_size(dst, nth));

    float * wbase = (float *) params->wdata + ith*sfa_floats_per_thread(DK, DV);
    float       * VKQ_w = wbase;                       // window accumulator (f32), also the merged result
    float       * VKQ_t = VKQ_w + DV;                  // tail accumulator (f32)
    float       * V32   = VKQ_t + DV;                  // (temporary) f32 V row
    void        * Q_q   = V32 + DV;                    // Q converted to K's vec_dot_type (<= DK floats)

    // parallelize over q rows x heads x ne3
    const int64_t nr  = neq1*neq2*neq3;
    const int64_t dr  = (nr + nth - 1)/nth;
    const int64_t ir0 = std::min(nr, dr*ith);
    const int64_t ir1 = std::min(nr, ir0 + dr);

    for (int64_t ir = ir0; ir < ir1; ++ir) {
        const int64_t iq3 = ir/(neq2*neq1);
        const int64_t iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int64_t iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);

        const uint32_t h = iq2; // head index
        const float slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;

        const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *)((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : nullptr;

        const float * pq = (const float *) ((const char *) q->data + (iq1*nbq1 + iq2*nbq2 + iq3*nbq3));

        float M_w, S_w, M_t, S_t;
        sfa_reduce_part(parts[0], pq, DK, DV, neq2, neq3, iq2, iq3, mp, slope, scale, logit_softcap, Q_q, VKQ_w, V32, &M_w, &S_w);
        sfa_reduce_part(parts[1], pq, DK, DV, neq2, neq3, iq2, iq3, mp, slope, scale, logit_softcap, Q_q, VKQ_t, V32, &M_t, &S_t);

        // exact f32 merge of the two partial states; a part with S == 0 (empty or fully masked) contributes nothing
        float M = M_w;
        float S = S_w;
        if (S_t != 0.0f) {
            if (S_w == 0.0f) {
                M = M_t;
                S = S_t;
                memcpy(VKQ_w, VKQ_t, DV*sizeof(float));
            } else {
                M = fmaxf(M_w, M_t);
                const float scale_w = expf(M_w - M);
                const float scale_t = expf(M_t - M);
                for (int64_t d = 0; d < DV; ++d) {
                    VKQ_w[d] = VKQ_w[d]*scale_w + VKQ_t[d]*scale_t;
                }
                S = S_w*scale_w + S_t*scale_t;
            }
        } else if (S_w == 0.0f) {
            M = -INFINITY;
            S = 0.0f;
            memset(VKQ_w, 0, DV*sizeof(float));
        }

        // sinks - counted once, as in ggml_flash_attn_ext
        if (sinks) {
            const float s = ((const float *) sinks->data)[h];

            float ms = 1.0f;
            float vs = 1.0f;

            if (s > M) {
                ms = expf(M - s);
                M = s;
                ggml_vec_scale_f32(DV, VKQ_w, ms);
            } else {
                vs = expf(s - M);
            }

            S = S*ms + vs;
        }

        // V /= S
        const float S_inv = S == 0.0f ? 0.0f : 1.0f/S;
        ggml_vec_scale_f32(DV, VKQ_w, S_inv);

        // permute(0, 2, 1, 3)
        memcpy((char *) dst->data + (iq3*ne2*ne1 + iq2 + iq1*ne1)*nb1, VKQ_w, nb1);
    }
}
