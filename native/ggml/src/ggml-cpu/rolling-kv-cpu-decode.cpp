// rolling-KV: CPU decode attention for the CPU part of a hybrid tail (see rolling-kv-cpu-decode.h).
//
// The kernel body (rolling-kv-cpu-decode-impl.inc) is compiled once per instruction set, each time over a 16-lane f32
// vector type of that set and that set's integer dot product of quantized K with the quantized query:
//   x86-64: AVX-512 with VNNI, AVX-512 (F/BW/VL/DQ), AVX2+FMA+F16C and plain C++;
//   AArch64: NEON (the integer dot by vdotq_s32 where the compiler targets the dot-product extension, else vmull/vpadal);
//   elsewhere: plain C++.
//
// Where the paths are picked. This file is part of the CPU backend (ggml-cpu), which ggml compiles per instruction set
// (GGML_NATIVE, or one library per variant with GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS), and on ARM (and with MSVC)
// that compile-time choice is the one taken: the paths whose ISA macros the compiler defines are built, and the best of
// them runs. On x86-64 with GCC or clang, though, every x86 path is compiled into every build, each function of a path
// with its instruction set (target pragmas: nothing needs -m flags), and the CPU's own features pick one at run time
// (RKV_X86_DISPATCH). The reason is the CUDA build: the GPU hosts' CPUs have AVX-512 with VNNI, but our CUDA builds
// compile ggml-cpu for AVX2 only (scripts/cross-build-cuda.sh: GGML_NATIVE=OFF, a binary for any x86-64 host), and the
// AVX-512/VNNI path is what makes the hybrid tail pay there (the CPU part is memory-bound only when its quantized dot
// products keep up with the memory). MSVC has no per-function target, so it builds the compile-time paths only.
//
// f16 values come through ggml-cpu's conversion (GGML_CPU_FP16_TO_FP32, simd-mappings.h) on the scalar and NEON paths
// and through F16C conversions on the x86 vector paths (their own target: GGML_CPU_FP16_TO_FP32 follows the
// backend's compile flags, which may lack F16C).

#include "rolling-kv-cpu-decode.h"

#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#include <immintrin.h>
#if defined(__GNUC__) || defined(__clang__)
#include <cpuid.h>
// run-time pick among the x86 paths, all compiled (see above)
#define RKV_X86_DISPATCH 1
#define RKV_HAS_AVX2 1
#define RKV_HAS_AVX512 1
#define RKV_HAS_AVX512VNNI 1
// a region of functions compiled for an instruction set (GCC: target pragmas; clang: the attribute on each function)
#define RKV_STR(x) #x
#if defined(__clang__)
#define RKV_TARGET_BEGIN(t) _Pragma(RKV_STR(clang attribute push(__attribute__((target(t))), apply_to = function)))
#define RKV_TARGET_END _Pragma("clang attribute pop")
#else
#define RKV_TARGET_BEGIN(t) _Pragma("GCC push_options") _Pragma(RKV_STR(GCC target(t)))
#define RKV_TARGET_END _Pragma("GCC pop_options")
#endif
#define RKV_VINLINE static inline __attribute__((always_inline))
#else
// MSVC and others: the paths the compile flags allow, the best one taken
#if defined(__AVX2__)
#define RKV_HAS_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define RKV_HAS_AVX512 1
#if defined(__AVX512VNNI__)
#define RKV_HAS_AVX512VNNI 1
#endif
#endif
#define RKV_TARGET_BEGIN(t)
#define RKV_TARGET_END
#if defined(_MSC_VER)
#define RKV_VINLINE static __forceinline
#else
#define RKV_VINLINE static inline
#endif
#endif
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define RKV_HAS_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define RKV_NEON_NAME "neon-dotprod"
#else
#define RKV_NEON_NAME "neon"
#endif
#endif

// a software prefetch where the compiler has one (a hint: nothing else depends on it)
#if defined(__GNUC__) || defined(__clang__)
#define RKV_PREFETCH(p) __builtin_prefetch((p))
#define RKV_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#elif defined(_M_X64) || defined(_M_IX86)
#define RKV_PREFETCH(p) _mm_prefetch((const char *) (p), _MM_HINT_T0)
#define RKV_PREFETCH_L2(p) _mm_prefetch((const char *) (p), _MM_HINT_T1)
#else
#define RKV_PREFETCH(p) ((void) (p))
#define RKV_PREFETCH_L2(p) ((void) (p))
#endif

namespace {

constexpr int RKV_TYPE_F16  = 1;  // ggml_type values (ggml.h)
constexpr int RKV_TYPE_Q4_0 = 2;
constexpr int RKV_TYPE_Q8_0 = 8;

// one f16 to f32 with ggml-cpu's conversion
inline float rkv_f16_to_f32(uint16_t h) { return GGML_CPU_FP16_TO_FP32((ggml_fp16_t) h); }

// the scratch of one walk (rkv_cpu_decode_range): per calling thread, grown, never shrunk (its size follows the rows,
// heads and head sizes of the calls; a walk does not call another)
uint8_t * walk_scratch(size_t bytes) {
    static thread_local std::vector<uint8_t> buf;
    if (buf.size() < bytes) {
        buf.resize(bytes);
    }
    return buf.data();
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
static inline void prefetch(const void * p) { RKV_PREFETCH(p); }
static inline void prefetch_l2(const void * p) { RKV_PREFETCH_L2(p); }
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

#if defined(RKV_HAS_AVX2)
// ---------------------------------------------------------------- AVX2 + FMA + F16C
RKV_TARGET_BEGIN("avx2,fma,f16c")
// one f16 to f32 (the F16C form every x86 compiler has)
static inline float rkv_cvtsh_ss(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
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
static inline float f16s(uint16_t h) { return rkv_cvtsh_ss(h); }
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
            const float dk = rkv_cvtsh_ss(dkh[b * 16 + i]);
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
#endif // RKV_HAS_AVX2

#if defined(RKV_HAS_AVX512)
// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ): the f32 vector and the K loads
// (always inlined: the VNNI variant below uses them too, from its own target)
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
RKV_VINLINE float f16s(uint16_t h) { return rkv_cvtsh_ss(h); }
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
#endif // RKV_HAS_AVX512

#if defined(RKV_HAS_AVX512VNNI)
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
#endif // RKV_HAS_AVX512VNNI

#if defined(RKV_HAS_NEON)
// ---------------------------------------------------------------- AArch64 NEON
// The f32 vector is four float32x4_t. f16 rows widen to f32 (vcvt_f32_f16) and are dotted and accumulated in f32, as
// on every other path (vfmaq_f16 would accumulate in f16: another result, outside the reference's tolerance). A
// quantized K is dotted in integers: vdotq_s32 with the dot-product extension (__ARM_FEATURE_DOTPROD: armv8.2-a+dotprod
// and later), else widening multiplies (vmull_s8) summed pairwise into 32 bits (vpadalq_s16).
namespace rkv_neon {
struct V16 { float32x4_t v[4]; };
static inline V16 zero() { const float32x4_t z = vdupq_n_f32(0.0f); return { { z, z, z, z } }; }
static inline V16 set1(float a) { const float32x4_t x = vdupq_n_f32(a); return { { x, x, x, x } }; }
static inline V16 load(const float * p) { return { { vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12) } }; }
static inline void store(float * p, V16 a) { vst1q_f32(p, a.v[0]); vst1q_f32(p + 4, a.v[1]); vst1q_f32(p + 8, a.v[2]); vst1q_f32(p + 12, a.v[3]); }
static inline V16 fmadd(V16 a, V16 b, V16 c) {
    for (int i = 0; i < 4; ++i) c.v[i] = vfmaq_f32(c.v[i], a.v[i], b.v[i]);
    return c;
}
static inline V16 mul(V16 a, V16 b) {
    for (int i = 0; i < 4; ++i) a.v[i] = vmulq_f32(a.v[i], b.v[i]);
    return a;
}
static inline float hsum(V16 a) { return vaddvq_f32(vaddq_f32(vaddq_f32(a.v[0], a.v[1]), vaddq_f32(a.v[2], a.v[3]))); }
static inline float hmax(V16 a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3]))); }
static inline V16 vmax(V16 a, V16 b) {
    for (int i = 0; i < 4; ++i) a.v[i] = vmaxq_f32(a.v[i], b.v[i]);
    return a;
}
// out[i] = the sum (the max) of the 16 floats m[16i..16i+16): pairwise reductions, four rows per vector
static inline void hsum16x16(const float * m, float * out) {
    for (int i = 0; i < 16; i += 4) {
        float32x4_t r[4];
        for (int k = 0; k < 4; ++k) {
            const float * x = m + 16 * (i + k);
            r[k] = vaddq_f32(vaddq_f32(vld1q_f32(x), vld1q_f32(x + 4)), vaddq_f32(vld1q_f32(x + 8), vld1q_f32(x + 12)));
        }
        vst1q_f32(out + i, vpaddq_f32(vpaddq_f32(r[0], r[1]), vpaddq_f32(r[2], r[3])));
    }
}
static inline void hmax16x16(const float * m, float * out) {
    for (int i = 0; i < 16; i += 4) {
        float32x4_t r[4];
        for (int k = 0; k < 4; ++k) {
            const float * x = m + 16 * (i + k);
            r[k] = vmaxq_f32(vmaxq_f32(vld1q_f32(x), vld1q_f32(x + 4)), vmaxq_f32(vld1q_f32(x + 8), vld1q_f32(x + 12)));
        }
        vst1q_f32(out + i, vpmaxq_f32(vpmaxq_f32(r[0], r[1]), vpmaxq_f32(r[2], r[3])));
    }
}
// the x86 paths' Cephes exp, four lanes at a time (round to nearest even as they do)
static inline float32x4_t exp4(float32x4_t x) {
    const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(EXP_LO));
    x = vmaxq_f32(x, vdupq_n_f32(EXP_LO));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(C1));
    r = vfmsq_f32(r, n, vdupq_n_f32(C2));
    float32x4_t y = vdupq_n_f32(P0);
    y = vfmaq_f32(vdupq_n_f32(P1), y, r);
    y = vfmaq_f32(vdupq_n_f32(P2), y, r);
    y = vfmaq_f32(vdupq_n_f32(P3), y, r);
    y = vfmaq_f32(vdupq_n_f32(P4), y, r);
    y = vfmaq_f32(vdupq_n_f32(P5), y, r);
    y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), y, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t v = vmulq_f32(y, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), under));
}
static inline V16 vexp(V16 a) {
    for (int i = 0; i < 4; ++i) a.v[i] = exp4(a.v[i]);
    return a;
}
static inline float32x4_t f16x4(const uint16_t * p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline V16 from_f16(const uint16_t * p) { return { { f16x4(p), f16x4(p + 4), f16x4(p + 8), f16x4(p + 12) } }; }
static inline float f16s(uint16_t h) { return rkv_f16_to_f32(h); }
static inline void prefetch(const void * p) { RKV_PREFETCH(p); }
static inline void prefetch_l2(const void * p) { RKV_PREFETCH_L2(p); }
static inline void gather16_u16(const uint8_t * p, size_t stride, int n, uint16_t * out) {
    for (int i = 0; i < 16; ++i) {
        out[i] = 0;
        if (i < n) memcpy(&out[i], p + i * stride, 2);
    }
}
// 16 int8 to 16 f32
static inline V16 s8x16_to_f32(int8x16_t b) {
    const int16x8_t l = vmovl_s8(vget_low_s8(b)), h = vmovl_s8(vget_high_s8(b));
    return { { vcvtq_f32_s32(vmovl_s16(vget_low_s16(l))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(l))),
               vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(h))) } };
}
static inline void vblock_q8(const uint8_t * qs, V16 & lo, V16 & hi) {
    lo = s8x16_to_f32(vld1q_s8((const int8_t *) qs));
    hi = s8x16_to_f32(vld1q_s8((const int8_t *) qs + 16));
}
// a Q4_0 block's 32 values (nibble - 8): the low nibbles are values 0..15, the high ones 16..31
static inline void q4_unpack(const uint8_t * qs, int8x16_t & lo, int8x16_t & hi) {
    const uint8x16_t b = vld1q_u8(qs);
    const int8x16_t e = vdupq_n_s8(8);
    lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0f))), e);
    hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), e);
}
static inline void vblock_q4(const uint8_t * qs, V16 & lo, V16 & hi) {
    int8x16_t l, h;
    q4_unpack(qs, l, h);
    lo = s8x16_to_f32(l);
    hi = s8x16_to_f32(h);
}
static inline float quant32(const float * x, int8_t * q) {
    float32x4_t v[8];
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; ++i) {
        v[i] = vld1q_f32(x + 4 * i);
        m = vmaxq_f32(m, vabsq_f32(v[i]));
    }
    const float d = vmaxvq_f32(m) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 8; i += 2) {  // to nearest, ties to even (fcvtns), as the other paths
        const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[i], id)), b = vcvtnq_s32_f32(vmulq_n_f32(v[i + 1], id));
        vst1_s8(q + 4 * i, vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))));
    }
    return d;
}
constexpr int Q8_OFF = 0, Q4_OFF = 0;  // signed K values (Q4_0: nibble - 8) against the signed query
// the integer dot of 32 K values (two vectors) with 32 query values
static inline int32_t idot32(int8x16_t k0, int8x16_t k1, const int8_t * q) {
    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
#if defined(__ARM_FEATURE_DOTPROD)
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), k0, q0), k1, q1));
#else
    // products <= 128 * 127: a pair of them fits in 16 bits
    const int16x8_t a = vmlal_s8(vmull_s8(vget_low_s8(k0), vget_low_s8(q0)), vget_high_s8(k0), vget_high_s8(q0));
    const int16x8_t b = vmlal_s8(vmull_s8(vget_low_s8(k1), vget_low_s8(q1)), vget_high_s8(k1), vget_high_s8(q1));
    return vaddvq_s32(vpadalq_s16(vpaddlq_s16(a), b));
#endif
}
// the raw scores of 16 cells for G heads (see the scalar path): per cell and block the K values are loaded once and
// dotted with each head's query block in integers, then scaled in f32
template <int T, int G>
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr, const float * dq,
                           const uint16_t * dkh, float * out) {
    constexpr int bb = T == RKV_TYPE_Q8_0 ? 34 : 18;
    for (int i = 0; i < 16; ++i) {
        float s[G];
        for (int j = 0; j < G; ++j) s[j] = 0.0f;
        for (int b = 0; b < nblk; ++b) {
            const uint8_t * qs = rows[i] + b * bb + 2;
            int8x16_t k0, k1;
            if (T == RKV_TYPE_Q8_0) {
                k0 = vld1q_s8((const int8_t *) qs);
                k1 = vld1q_s8((const int8_t *) qs + 16);
            } else {
                q4_unpack(qs, k0, k1);
            }
            const float dk = rkv_f16_to_f32(dkh[b * 16 + i]);
            for (int j = 0; j < G; ++j) {
                const int32_t dot = idot32(k0, k1, q + (size_t) j * D + 32 * b) + corr[j * nblk + b];
                s[j] += (float) dot * (dk * dq[j * nblk + b]);
            }
        }
        for (int j = 0; j < G; ++j) out[j * 16 + i] = s[j];
    }
}
#define RKV_NS impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS

// a memory-bound read of [c0, c1) of every buffer: four 16-byte loads per line, OR-reduced
static uint64_t read_scan(const uint8_t * const * bufs, int n_bufs, size_t c0, size_t c1) {
    uint8x16_t a = vdupq_n_u8(0), b = a, c = a, d = a;
    for (int k = 0; k < n_bufs; ++k) {
        for (size_t i = c0; i < c1; i += 64) {
            a = vorrq_u8(a, vld1q_u8(bufs[k] + i));
            b = vorrq_u8(b, vld1q_u8(bufs[k] + i + 16));
            c = vorrq_u8(c, vld1q_u8(bufs[k] + i + 32));
            d = vorrq_u8(d, vld1q_u8(bufs[k] + i + 48));
        }
    }
    return vgetq_lane_u64(vreinterpretq_u64_u8(vorrq_u8(vorrq_u8(a, b), vorrq_u8(c, d))), 0);
}
} // namespace rkv_neon
#endif // RKV_HAS_NEON

namespace {

// the paths; on x86 each one needs the ones before it
enum class isa { scalar, avx2, avx512, avx512vnni, neon };

constexpr bool compiled(isa i) {
    return i == isa::scalar
#if defined(RKV_HAS_AVX2)
        || i == isa::avx2
#endif
#if defined(RKV_HAS_AVX512)
        || i == isa::avx512
#endif
#if defined(RKV_HAS_AVX512VNNI)
        || i == isa::avx512vnni
#endif
#if defined(RKV_HAS_NEON)
        || i == isa::neon
#endif
        ;
}

// the best path compiled here that this CPU runs
isa detect() {
#if defined(RKV_X86_DISPATCH)
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
    return isa::scalar;
#elif defined(RKV_HAS_NEON)
    return isa::neon;  // the backend was compiled for this CPU's features (ggml-cpu's own ISA choice)
#elif defined(RKV_HAS_AVX512VNNI)
    return isa::avx512vnni;
#elif defined(RKV_HAS_AVX512)
    return isa::avx512;
#elif defined(RKV_HAS_AVX2)
    return isa::avx2;
#else
    return isa::scalar;
#endif
}

isa & selected_isa() {
    static isa which = detect();
    return which;
}

isa selected() { return selected_isa(); }

const char * isa_name(isa i) {
    switch (i) {
        case isa::avx512vnni: return "avx512vnni";
        case isa::avx512:     return "avx512";
        case isa::avx2:       return "avx2";
#if defined(RKV_HAS_NEON)
        case isa::neon:       return RKV_NEON_NAME;
#endif
        default:              return "scalar";
    }
}

} // namespace

bool rkv_cpu_decode_force_isa(const char * name) {
    const isa best = detect();
    for (isa want : { isa::scalar, isa::avx2, isa::avx512, isa::avx512vnni, isa::neon }) {
        if (!compiled(want) || strcmp(name, isa_name(want)) != 0) {
            continue;
        }
        // scalar runs anywhere, the best path here does; on x86 also the paths below it (each needs the ones before it)
        if (want != isa::scalar && want != best && (best == isa::neon || (int) want > (int) best)) {
            return false;  // the CPU lacks it
        }
        selected_isa() = want;
        return true;
    }
    return false;
}

uint64_t rkv_cpu_decode_read_scan(const uint8_t * const * bufs, int n_bufs, size_t bytes_each, int ith, int nth) {
    const size_t c0 = bytes_each * ith / nth / 64 * 64, c1 = bytes_each * (ith + 1) / nth / 64 * 64;
    uint64_t acc = 0;
#if defined(RKV_HAS_AVX2)
    if (selected() != isa::scalar) {
        return read_scan_avx2(bufs, n_bufs, c0, c1);
    }
#endif
#if defined(RKV_HAS_NEON)
    if (selected() == isa::neon) {
        return rkv_neon::read_scan(bufs, n_bufs, c0, c1);
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
#if defined(RKV_HAS_AVX512VNNI)
        case isa::avx512vnni: rkv_avx512vnni::impl::range(p, c0, c1, part); return;
#endif
#if defined(RKV_HAS_AVX512)
        case isa::avx512:     rkv_avx512::impl::range(p, c0, c1, part); return;
#endif
#if defined(RKV_HAS_AVX2)
        case isa::avx2:       rkv_avx2::impl::range(p, c0, c1, part); return;
#endif
#if defined(RKV_HAS_NEON)
        case isa::neon:       rkv_neon::impl::range(p, c0, c1, part); return;
#endif
        default:              rkv_scalar::rkv_scalar_impl::range(p, c0, c1, part); return;
    }
}

const char * rkv_cpu_decode_isa(void) {
    return isa_name(selected());
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
