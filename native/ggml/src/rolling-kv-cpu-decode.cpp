// rolling-KV: CPU decode attention for the CPU part of a hybrid tail (see rolling-kv-cpu-decode.h).
//
// The kernel body (rolling-kv-cpu-decode-impl.inc) is compiled four times, for AVX-512 with VNNI, AVX-512
// (F/BW/VL/DQ), AVX2+FMA+F16C and plain C++, each time over a 16-lane f32 vector type of that instruction
// set and that set's integer dot product of quantized K with the quantized query; the CPU's own features
// pick one at run time, so one build runs on any x86-64 CPU (and elsewhere on the scalar path). Only the
// functions below carry the instruction set (target pragmas): nothing needs -m flags.

#include "rolling-kv-cpu-decode.h"

#include <algorithm>
#include <alloca.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define RKV_X86 1
// a region of functions compiled for an instruction set (GCC: target pragmas; clang: the attribute on each function)
#define RKV_STR(x) #x
#if defined(__clang__)
#define RKV_TARGET_BEGIN(t) _Pragma(RKV_STR(clang attribute push(__attribute__((target(t))), apply_to = function)))
#define RKV_TARGET_END _Pragma("clang attribute pop")
#else
#define RKV_TARGET_BEGIN(t) _Pragma("GCC push_options") _Pragma(RKV_STR(GCC target(t)))
#define RKV_TARGET_END _Pragma("GCC pop_options")
#endif
#endif

namespace {

constexpr int RKV_TYPE_F16  = 1;  // ggml_type values (ggml.h)
constexpr int RKV_TYPE_Q4_0 = 2;
constexpr int RKV_TYPE_Q8_0 = 8;

inline float rkv_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000) << 16;
    uint32_t exp  = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Cephes' expf polynomial on [-ln2/2, ln2/2]; inputs here are <= 0 (score minus running max), and
// anything below -87.3 (the f32 underflow) is 0, -inf included.
constexpr float EXP_LO = -87.3f, LOG2E = 1.44269504088896341f, C1 = 0.693359375f, C2 = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

} // namespace

// ---------------------------------------------------------------- scalar
namespace rkv_scalar_vec {
struct V16 { float v[16]; };
static inline V16 zero() { V16 r; for (float & x : r.v) x = 0.0f; return r; }
static inline V16 set1(float a) { V16 r; for (float & x : r.v) x = a; return r; }
static inline V16 load(const float * p) { V16 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void store(float * p, V16 a) { memcpy(p, a.v, sizeof a.v); }
static inline V16 fmadd(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]); return c; }
static inline V16 mul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
static inline float hsum(V16 a) { float s = 0.0f; for (float x : a.v) s += x; return s; }
static inline float hmax(V16 a) { float m = -INFINITY; for (float x : a.v) m = std::max(m, x); return m; }
static inline V16 vmax(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
// out[i] = the sum (the max) of the 16 floats m[16i..16i+16)
static inline void hsum16x16(const float * m, float * out) {
    for (int i = 0; i < 16; ++i) {
        float s = 0.0f;
        for (int l = 0; l < 16; ++l) s += m[16 * i + l];
        out[i] = s;
    }
}
static inline void hmax16x16(const float * m, float * out) {
    for (int i = 0; i < 16; ++i) {
        float s = -INFINITY;
        for (int l = 0; l < 16; ++l) s = std::max(s, m[16 * i + l]);
        out[i] = s;
    }
}
static inline V16 vexp(V16 a) { for (float & x : a.v) x = x < EXP_LO ? 0.0f : expf(x); return a; }
static inline V16 from_f16(const uint16_t * p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = rkv_f16_to_f32(p[i]); return r; }
static inline float f16s(uint16_t h) { return rkv_f16_to_f32(h); }
static inline void prefetch(const void * p) { __builtin_prefetch(p); }
static inline void prefetch_l2(const void * p) { __builtin_prefetch(p, 0, 2); }
// out[i] = the 2 bytes at p + i*stride for i < n, 0 for n <= i < 16
static inline void gather16_u16(const uint8_t * p, size_t stride, int n, uint16_t * out) {
    for (int i = 0; i < 16; ++i) {
        out[i] = 0;
        if (i < n) memcpy(&out[i], p + i * stride, 2);
    }
}
// the 32 values of a Q8_0 / Q4_0 block's quants (qs) as f32, unscaled; Q4_0: nibble - 8
static inline void vblock_q8(const uint8_t * qs, V16 & lo, V16 & hi) {
    for (int i = 0; i < 16; ++i) {
        lo.v[i] = (float) (int8_t) qs[i];
        hi.v[i] = (float) (int8_t) qs[16 + i];
    }
}
static inline void vblock_q4(const uint8_t * qs, V16 & lo, V16 & hi) {
    for (int i = 0; i < 16; ++i) {
        lo.v[i] = (float) ((qs[i] & 0x0f) - 8);
        hi.v[i] = (float) ((qs[i] >> 4) - 8);
    }
}
} // namespace rkv_scalar_vec

namespace rkv_scalar {
using namespace rkv_scalar_vec;
// the query's quantization (see prepare_q in the impl): round to nearest even, as the vector paths' conversion
static inline float quant32(const float * x, int8_t * q) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) q[i] = (int8_t) nearbyintf(x[i] * id);
    return d;
}
constexpr int Q8_OFF = 0, Q4_OFF = 0;  // the K values enter the dot as they are (Q4_0: nibble - 8)
// the raw scores (sum over blocks of d_k d_q (K . q + corr)) of 16 cells (K head rows rows[i]) for G heads
template <int T, int G>
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    constexpr int bb = T == RKV_TYPE_Q8_0 ? 34 : 18;
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < G; ++j) {
            float s = 0.0f;
            for (int b = 0; b < nblk; ++b) {
                const uint8_t * qs = rows[i] + b * bb + 2;
                const int8_t * qj = q + (size_t) j * D + 32 * b;
                int32_t dot = corr[j * nblk + b];
                for (int e = 0; e < 16; ++e) {
                    if (T == RKV_TYPE_Q8_0) {
                        dot += (int8_t) qs[e] * qj[e] + (int8_t) qs[16 + e] * qj[16 + e];
                    } else {
                        dot += ((qs[e] & 0x0f) - 8) * qj[e] + ((qs[e] >> 4) - 8) * qj[16 + e];
                    }
                }
                s += (float) dot * (rkv_f16_to_f32(dkh[b * 16 + i]) * dq[j * nblk + b]);
            }
            out[j * 16 + i] = s;
        }
    }
}
#define RKV_NS rkv_scalar_impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_scalar

#ifdef RKV_X86
// ---------------------------------------------------------------- AVX2 + FMA + F16C
RKV_TARGET_BEGIN("avx2,fma,f16c")
namespace rkv_avx2 {
struct V16 { __m256 a, b; };
static inline V16 zero() { return { _mm256_setzero_ps(), _mm256_setzero_ps() }; }
static inline V16 set1(float x) { return { _mm256_set1_ps(x), _mm256_set1_ps(x) }; }
static inline V16 load(const float * p) { return { _mm256_loadu_ps(p), _mm256_loadu_ps(p + 8) }; }
static inline void store(float * p, V16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline V16 fmadd(V16 x, V16 y, V16 z) { return { _mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b) }; }
static inline V16 mul(V16 x, V16 y) { return { _mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b) }; }
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float hsum(V16 x) { return hsum8(_mm256_add_ps(x.a, x.b)); }
static inline float hmax(V16 x) {
    __m256 m = _mm256_max_ps(x.a, x.b);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline V16 vmax(V16 x, V16 y) { return { _mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b) }; }
static inline void hsum16x16(const float * m, float * out) {
    for (int i = 0; i < 16; ++i) out[i] = hsum(load(m + 16 * i));
}
static inline void hmax16x16(const float * m, float * out) {
    for (int i = 0; i < 16; ++i) out[i] = hmax(load(m + 16 * i));
}
static inline __m256 exp8(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C2), r);
    __m256 y = _mm256_set1_ps(P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
static inline V16 vexp(V16 x) { return { exp8(x.a), exp8(x.b) }; }
static inline V16 from_f16(const uint16_t * p) {
    return { _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 8))) };
}
static inline float f16s(uint16_t h) { return _cvtsh_ss(h); }
static inline void prefetch(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T0); }
static inline void prefetch_l2(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T1); }
static inline void gather16_u16(const uint8_t * p, size_t stride, int n, uint16_t * out) {
    for (int i = 0; i < 16; ++i) {
        out[i] = 0;
        if (i < n) memcpy(&out[i], p + i * stride, 2);
    }
}
static inline void vblock_q8(const uint8_t * qs, V16 & lo, V16 & hi) {
    lo = { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) qs))),
           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8)))) };
    hi = { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 16)))),
           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 24)))) };
}
static inline void vblock_q4(const uint8_t * qs, V16 & lo, V16 & hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *) qs), m = _mm_set1_epi8(0x0f), e = _mm_set1_epi8(8);
    const __m128i l = _mm_sub_epi8(_mm_and_si128(b, m), e), h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), e);
    lo = { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8))) };
    hi = { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h, 8))) };
}
static inline float quant32(const float * x, int8_t * q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    const float d = _mm_cvtss_f32(s) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i iv[4];
    for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // nearest even
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256((__m256i *) q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}
constexpr int Q8_OFF = 0, Q4_OFF = 0;  // signed K values (Q4_0: nibble - 8): magnitudes against the query with K's signs
// the raw scores of 16 cells for G heads (see the scalar path): per cell, block and head one 8-lane integer dot
// (maddubs of |k| with sign(k) q: pair sums <= 2 * 128 * 127, no saturation), scaled and summed in f32
template <int T, int G>
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    constexpr int bb = T == RKV_TYPE_Q8_0 ? 34 : 18;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 16; ++i) {
        __m256 acc[G];
        float cs[G];
        for (int j = 0; j < G; ++j) {
            acc[j] = _mm256_setzero_ps();
            cs[j] = 0.0f;
        }
        for (int b = 0; b < nblk; ++b) {
            const uint8_t * qs = rows[i] + b * bb + 2;
            __m256i k;
            if (T == RKV_TYPE_Q8_0) {
                k = _mm256_loadu_si256((const __m256i *) qs);
            } else {
                const __m128i x = _mm_loadu_si128((const __m128i *) qs), m = _mm_set1_epi8(0x0f), e = _mm_set1_epi8(8);
                k = _mm256_set_m128i(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m), e), _mm_sub_epi8(_mm_and_si128(x, m), e));
            }
            const __m256i u = _mm256_abs_epi8(k);
            const float dk = _cvtsh_ss(dkh[b * 16 + i]);
            for (int j = 0; j < G; ++j) {
                const __m256i qj = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *) (q + (size_t) j * D + 32 * b)), k);
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qj), ones));
                const float w = dk * dq[j * nblk + b];
                acc[j] = _mm256_fmadd_ps(f, _mm256_set1_ps(w), acc[j]);
                cs[j] += (float) corr[j * nblk + b] * w;
            }
        }
        for (int j = 0; j < G; ++j) {
            out[j * 16 + i] = hsum8(acc[j]) + cs[j];
        }
    }
}
#define RKV_NS impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_avx2

// a memory-bound read of [c0, c1) of every buffer: two 32-byte loads per line, OR-reduced (not a scalar sum,
// which is compute-bound)
static uint64_t read_scan_avx2(const uint8_t * const * bufs, int n_bufs, size_t c0, size_t c1) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int k = 0; k < n_bufs; ++k) {
        for (size_t i = c0; i < c1; i += 64) {
            a = _mm256_or_si256(a, _mm256_loadu_si256((const __m256i *) (bufs[k] + i)));
            b = _mm256_or_si256(b, _mm256_loadu_si256((const __m256i *) (bufs[k] + i + 32)));
        }
    }
    return (uint64_t) _mm256_extract_epi64(_mm256_or_si256(a, b), 0);
}
RKV_TARGET_END

// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ): the f32 vector and the K loads
// (always inlined: the VNNI variant below uses them too, from its own target)
#define RKV_VINLINE static inline __attribute__((always_inline))
RKV_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace rkv_avx512_vec {
struct V16 { __m512 a; };
RKV_VINLINE V16 zero() { return { _mm512_setzero_ps() }; }
RKV_VINLINE V16 set1(float x) { return { _mm512_set1_ps(x) }; }
RKV_VINLINE V16 load(const float * p) { return { _mm512_loadu_ps(p) }; }
RKV_VINLINE void store(float * p, V16 x) { _mm512_storeu_ps(p, x.a); }
RKV_VINLINE V16 fmadd(V16 x, V16 y, V16 z) { return { _mm512_fmadd_ps(x.a, y.a, z.a) }; }
RKV_VINLINE V16 mul(V16 x, V16 y) { return { _mm512_mul_ps(x.a, y.a) }; }
RKV_VINLINE float hsum(V16 x) { return _mm512_reduce_add_ps(x.a); }
RKV_VINLINE float hmax(V16 x) { return _mm512_reduce_max_ps(x.a); }
RKV_VINLINE V16 vmax(V16 x, V16 y) { return { _mm512_max_ps(x.a, y.a) }; }
// 16 rows of 16 floats to their 16 sums (maxima): pairs of rows halved four times (45 instructions, not 16
// reductions of 8). After the four steps lane 4a+b holds row SLOT[4a+b]; the rows are read in that order so that
// lane i is row i.
template <bool MAX> RKV_VINLINE __m512 hred_op(__m512 a, __m512 b) { return MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); }
template <bool MAX>
RKV_VINLINE void hred16x16(const float * m, float * out) {
    static constexpr int SLOT[16] = { 0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15 };  // an involution
    constexpr auto op = hred_op<MAX>;
    __m512 t[8];
    for (int i = 0; i < 8; ++i) {  // rows i, i+8: lanes 0-7 | 8-15 hold 8 partials each
        const __m512 a = _mm512_loadu_ps(m + 16 * SLOT[i]), b = _mm512_loadu_ps(m + 16 * SLOT[i + 8]);
        t[i] = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    __m512 u[4];
    for (int i = 0; i < 4; ++i) {  // quarters: rows i, i+8, i+4, i+12, 4 partials each
        u[i] = op(_mm512_shuffle_f32x4(t[i], t[i + 4], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(t[i], t[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    __m512 w[2];
    for (int i = 0; i < 2; ++i) {  // per quarter: 2 partials of row i's part, 2 of row i+2's
        w[i] = op(_mm512_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    _mm512_storeu_ps(out, op(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1))));
}
RKV_VINLINE void hsum16x16(const float * m, float * out) { hred16x16<false>(m, out); }
RKV_VINLINE void hmax16x16(const float * m, float * out) { hred16x16<true>(m, out); }
RKV_VINLINE V16 vexp(V16 v) {
    __m512 x = v.a;
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C1), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C2), r);
    __m512 y = _mm512_set1_ps(P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return { _mm512_maskz_mul_ps((__mmask16) ~under, y, _mm512_castsi512_ps(e)) };
}
RKV_VINLINE V16 from_f16(const uint16_t * p) { return { _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)) }; }
RKV_VINLINE float f16s(uint16_t h) { return _cvtsh_ss(h); }
RKV_VINLINE void prefetch(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T0); }
RKV_VINLINE void prefetch_l2(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T1); }
// out[i] = the 2 bytes at p + i*stride for i < n, 0 for n <= i < 16 (scalar loads: a vector gather is slower on
// some CPUs, and these run on the integer ports beside the vector work)
RKV_VINLINE void gather16_u16(const uint8_t * p, size_t stride, int n, uint16_t * out) {
    if (n == 16) {
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) memcpy(&out[i], p + i * stride, 2);
        return;
    }
    for (int i = 0; i < 16; ++i) {
        out[i] = 0;
        if (i < n) memcpy(&out[i], p + i * stride, 2);
    }
}
RKV_VINLINE void vblock_q8(const uint8_t * qs, V16 & lo, V16 & hi) {
    lo = { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) qs))) };
    hi = { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (qs + 16)))) };
}
// a nibble to f32 by a 16-entry table (the low 4 bits of each lane index it; -8 is in the table): no conversion,
// no masking
RKV_VINLINE void vblock_q4(const uint8_t * qs, V16 & lo, V16 & hi) {
    const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) qs));
    lo = { _mm512_permutexvar_ps(b, tbl) };
    hi = { _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tbl) };
}
RKV_VINLINE float quant32(const float * x, int8_t * q) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    _mm_storeu_si128((__m128i *) q, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));  // nearest even
    _mm_storeu_si128((__m128i *) (q + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
    return d;
}
// 16 bytes at offset off of the 16 rows, transposed to 4 vectors of the 16 cells: r[k] lane i = bytes 4k..4k+3
// of rows[i] (each of 4 vectors takes rows c, c+4, c+8, c+12 in its 128-bit lanes; a 4x4 transpose of 32-bit
// values within the lanes then leaves the cells in order)
RKV_VINLINE void kload16(const uint8_t * const * rows, int off, __m512i * r) {
    __m512i z[4];
    for (int c = 0; c < 4; ++c) {
        z[c] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *) (rows[c] + off)));
        z[c] = _mm512_inserti32x4(z[c], _mm_loadu_si128((const __m128i *) (rows[c + 4] + off)), 1);
        z[c] = _mm512_inserti32x4(z[c], _mm_loadu_si128((const __m128i *) (rows[c + 8] + off)), 2);
        z[c] = _mm512_inserti32x4(z[c], _mm_loadu_si128((const __m128i *) (rows[c + 12] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    r[0] = _mm512_unpacklo_epi64(t0, t2);
    r[1] = _mm512_unpackhi_epi64(t0, t2);
    r[2] = _mm512_unpacklo_epi64(t1, t3);
    r[3] = _mm512_unpackhi_epi64(t1, t3);
}
// 4 bytes of the query, on every lane
RKV_VINLINE __m512i qbcast(const int8_t * q) {
    int32_t x;
    memcpy(&x, q, 4);
    return _mm512_set1_epi32(x);
}
// The raw scores (sum over blocks of d_k d_q (K . q + corr)) of 16 cells for G heads, with the cells on the lanes:
// per block the 16 rows' quants are transposed (kload16) so that each 32-bit lane holds 4 quants of one cell,
// and dot4(acc, u, q, ...) adds the products of 4 K values (u) with 4 query values (broadcast) to each lane;
// a lane then holds its cell's exact block dot, scaled once per block.
template <int T, int G, class DOT>
RKV_VINLINE void kscores_t(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    constexpr int bb = T == RKV_TYPE_Q8_0 ? 34 : 18;
    __m512 s[G];
    #pragma GCC unroll 8
    for (int j = 0; j < G; ++j) s[j] = _mm512_setzero_ps();
    for (int b = 0; b < nblk; ++b) {
        typename DOT::acc a[G];
        #pragma GCC unroll 8
        for (int j = 0; j < G; ++j) a[j] = DOT::init();
        __m512i r[4];
        if (T == RKV_TYPE_Q4_0) {
            kload16(rows, b * bb + 2, r);
            const __m512i m = _mm512_set1_epi8(0x0f);
            #pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) {
                const typename DOT::kv lo = DOT::template prep<T>(_mm512_and_si512(r[k], m));
                const typename DOT::kv hi = DOT::template prep<T>(_mm512_and_si512(_mm512_srli_epi16(r[k], 4), m));
                #pragma GCC unroll 8
                for (int j = 0; j < G; ++j) {
                    const int8_t * qj = q + (size_t) j * D + 32 * b + 4 * k;
                    DOT::template dot4<T>(a[j], lo, qbcast(qj));
                    DOT::template dot4<T>(a[j], hi, qbcast(qj + 16));
                }
            }
        } else {
            #pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                kload16(rows, b * bb + 2 + 16 * h, r);
                #pragma GCC unroll 4
                for (int k = 0; k < 4; ++k) {
                    const typename DOT::kv u = DOT::template prep<T>(r[k]);
                    #pragma GCC unroll 8
                    for (int j = 0; j < G; ++j) {
                        DOT::template dot4<T>(a[j], u, qbcast(q + (size_t) j * D + 32 * b + 16 * h + 4 * k));
                    }
                }
            }
        }
        const __m512 dk = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (dkh + b * 16)));
        #pragma GCC unroll 8
        for (int j = 0; j < G; ++j) {
            const __m512i t = _mm512_add_epi32(DOT::finish(a[j]), _mm512_set1_epi32(corr[j * nblk + b]));
            s[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), dk), _mm512_set1_ps(dq[j * nblk + b]), s[j]);
        }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(out + j * 16, s[j]);
}
} // namespace rkv_avx512_vec
#undef RKV_VINLINE

// AVX-512 without VNNI: the dot by maddubs/madd; Q8_0 as magnitudes against the query with K's signs (pair sums
// <= 2 * 128 * 127: no saturation), Q4_0's nibbles 0..15 (the -8 through corr) summed in 16 bits over a block
// (8 pair sums <= 8 * 2 * 15 * 127 < 2^15) before widening
namespace rkv_avx512 {
using namespace rkv_avx512_vec;
constexpr int Q8_OFF = 0, Q4_OFF = 8;
struct dot_bw {
    struct acc { __m512i i32, i16; };
    struct kv { __m512i u; __mmask64 neg; };
    static inline acc init() { return { _mm512_setzero_si512(), _mm512_setzero_si512() }; }
    template <int T> static inline kv prep(__m512i k) {
        if (T == RKV_TYPE_Q8_0) return { _mm512_abs_epi8(k), _mm512_movepi8_mask(k) };
        return { k, 0 };
    }
    template <int T> static inline void dot4(acc & a, const kv & k, __m512i q) {
        if (T == RKV_TYPE_Q8_0) {
            const __m512i p = _mm512_maddubs_epi16(k.u, _mm512_mask_sub_epi8(q, k.neg, _mm512_setzero_si512(), q));
            a.i32 = _mm512_add_epi32(a.i32, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
        } else {
            a.i16 = _mm512_add_epi16(a.i16, _mm512_maddubs_epi16(k.u, q));
        }
    }
    static inline __m512i finish(const acc & a) { return _mm512_add_epi32(a.i32, _mm512_madd_epi16(a.i16, _mm512_set1_epi16(1))); }
};
template <int T, int G>
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    kscores_t<T, G, dot_bw>(rows, nblk, q, D, corr, dq, dkh, out);
}
#define RKV_NS impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_avx512
RKV_TARGET_END

// ---------------------------------------------------------------- AVX-512 with VNNI: the dot by vpdpbusd
RKV_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace rkv_avx512vnni {
using namespace rkv_avx512_vec;
constexpr int Q8_OFF = 128, Q4_OFF = 8;  // Q8_0 K + 128 as unsigned bytes, Q4_0's nibbles 0..15: corr takes the offsets off
struct dot_vnni {
    typedef __m512i acc;
    typedef __m512i kv;
    static inline acc init() { return _mm512_setzero_si512(); }
    template <int T> static inline kv prep(__m512i k) {
        return T == RKV_TYPE_Q8_0 ? _mm512_xor_si512(k, _mm512_set1_epi8((char) 0x80)) : k;
    }
    template <int T> static inline void dot4(acc & a, kv k, __m512i q) { a = _mm512_dpbusd_epi32(a, k, q); }
    static inline __m512i finish(acc a) { return a; }
};
template <int T, int G>
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    kscores_t<T, G, dot_vnni>(rows, nblk, q, D, corr, dq, dkh, out);
}
#define RKV_NS impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_avx512vnni
RKV_TARGET_END
#endif // RKV_X86

namespace {

enum class isa { scalar, avx2, avx512, avx512vnni };  // each one needs the ones before it

isa detect() {
#ifdef RKV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
        return __builtin_cpu_supports("avx512vnni") ? isa::avx512vnni : isa::avx512;
    }
    unsigned a, b, c, d;  // F16C from CPUID (not every compiler's __builtin_cpu_supports knows it)
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
        return isa::avx2;
    }
#endif
    return isa::scalar;
}

isa & selected_isa() {
    static isa which = detect();
    return which;
}

isa selected() { return selected_isa(); }

} // namespace

bool rkv_cpu_decode_force_isa(const char * name) {
    const isa best = detect();
    isa want;
    if (strcmp(name, "avx512vnni") == 0) want = isa::avx512vnni;
    else if (strcmp(name, "avx512") == 0) want = isa::avx512;
    else if (strcmp(name, "avx2") == 0) want = isa::avx2;
    else if (strcmp(name, "scalar") == 0) want = isa::scalar;
    else return false;
    if ((int) want > (int) best) {
        return false;  // the CPU lacks it
    }
    selected_isa() = want;
    return true;
}

uint64_t rkv_cpu_decode_read_scan(const uint8_t * const * bufs, int n_bufs, size_t bytes_each, int ith, int nth) {
    const size_t c0 = bytes_each * ith / nth / 64 * 64, c1 = bytes_each * (ith + 1) / nth / 64 * 64;
    uint64_t acc = 0;
#ifdef RKV_X86
    if (selected() != isa::scalar) {
        return read_scan_avx2(bufs, n_bufs, c0, c1);
    }
#endif
    for (int b = 0; b < n_bufs; ++b) {
        for (size_t i = c0; i < c1; i += 8) {
            uint64_t x;
            memcpy(&x, bufs[b] + i, 8);
            acc |= x;
        }
    }
    return acc;
}

size_t rkv_cpu_decode_part_floats(const rkv_cpu_decode_params & p) {
    return (size_t) std::max(1, p.n_rows) * p.n_head * (2 + (size_t) p.DV);
}

bool rkv_cpu_decode_supported(int k_type, int v_type, int D, int DV) {
    auto ok = [](int t) { return t == RKV_TYPE_F16 || t == RKV_TYPE_Q8_0 || t == RKV_TYPE_Q4_0; };
    return ok(k_type) && ok(v_type) && D > 0 && DV > 0 && D % 32 == 0 && DV % 32 == 0;
}

static void range_walk(const rkv_cpu_decode_params & p, int64_t c0, int64_t c1, float * part);

void rkv_cpu_decode_range(const rkv_cpu_decode_params & p, int64_t c0, int64_t c1, float * part) {
    // more rows than one walk takes: walks of RKV_CPU_DECODE_MAX_ROWS rows, each into its rows' states
    const int R = std::max(1, p.n_rows);
    if (R <= RKV_CPU_DECODE_MAX_ROWS) {
        range_walk(p, c0, c1, part);
        return;
    }
    for (int r0 = 0; r0 < R; r0 += RKV_CPU_DECODE_MAX_ROWS) {
        rkv_cpu_decode_params w = p;
        w.n_rows = std::min(RKV_CPU_DECODE_MAX_ROWS, R - r0);
        w.q      = p.q + (size_t) r0 * p.q_row;
        w.mask   = p.mask ? p.mask + (size_t) r0 * p.mask_row : nullptr;
        range_walk(w, c0, c1, part + (size_t) r0 * p.n_head * (2 + (size_t) p.DV));
    }
}

static void range_walk(const rkv_cpu_decode_params & p, int64_t c0, int64_t c1, float * part) {
    switch (selected()) {
#ifdef RKV_X86
        case isa::avx512vnni: rkv_avx512vnni::impl::range(p, c0, c1, part); return;
        case isa::avx512: rkv_avx512::impl::range(p, c0, c1, part); return;
        case isa::avx2:   rkv_avx2::impl::range(p, c0, c1, part); return;
#endif
        default:          rkv_scalar::rkv_scalar_impl::range(p, c0, c1, part); return;
    }
}

const char * rkv_cpu_decode_isa(void) {
    switch (selected()) {
        case isa::avx512vnni: return "avx512vnni";
        case isa::avx512: return "avx512";
        case isa::avx2:   return "avx2";
        default:          return "scalar";
    }
}

void rkv_cpu_decode_merge_heads(const rkv_cpu_decode_params & p, const float * parts, int n_parts, int h0, int h1, float * o, float * lse) {
    const size_t stride = 2 + (size_t) p.DV;
    const size_t part_floats = rkv_cpu_decode_part_floats(p);
    for (int h = h0; h < h1; ++h) {
        float m = -INFINITY;
        for (int i = 0; i < n_parts; ++i) {
            m = std::max(m, parts[i * part_floats + h * stride]);
        }
        float * out = o + (size_t) h * p.DV;
        memset(out, 0, sizeof(float) * p.DV);
        if (m == -INFINITY) {
            lse[h] = -INFINITY;  // every cell masked for this row
            continue;
        }
        float s = 0.0f;
        for (int i = 0; i < n_parts; ++i) {
            const float * st = parts + i * part_floats + h * stride;
            if (st[0] == -INFINITY) {
                continue;
            }
            const float w = expf(st[0] - m);
            s += w * st[1];
            for (int d = 0; d < p.DV; ++d) {
                out[d] += w * st[2 + d];
            }
        }
        const float inv = 1.0f / s;
        for (int d = 0; d < p.DV; ++d) {
            out[d] *= inv;
        }
        lse[h] = m + logf(s);
    }
}

void rkv_cpu_decode_merge(const rkv_cpu_decode_params & p, const float * parts, int n_parts, float * o, float * lse) {
    rkv_cpu_decode_merge_heads(p, parts, n_parts, 0, std::max(1, p.n_rows) * p.n_head, o, lse);
}
