// rolling-KV: CPU decode attention for the CPU part of a hybrid tail (see rolling-kv-cpu-decode.h).
//
// The kernel body (rolling-kv-cpu-decode-impl.inc) is compiled three times, for AVX-512, AVX2+FMA+F16C
// and plain C++, each time over a 16-lane f32 vector type of that instruction set; the CPU's own
// features pick one at run time, so one build runs on any x86-64 CPU (and elsewhere on the scalar path).

#include "rolling-kv-cpu-decode.h"

#include <algorithm>
#include <alloca.h>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RKV_X86 1
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
static inline V16 vexp(V16 a) { for (float & x : a.v) x = x < EXP_LO ? 0.0f : expf(x); return a; }
static inline V16 from_f16(const uint16_t * p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = rkv_f16_to_f32(p[i]); return r; }
static inline V16 from_i8(const int8_t * p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = (float) p[i]; return r; }
static inline V16 from_nibbles(const uint8_t * qs, bool high) {
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = (float) ((high ? qs[i] >> 4 : qs[i] & 0x0f) - 8);
    return r;
}
static inline float f16s(uint16_t h) { return rkv_f16_to_f32(h); }
static inline void prefetch(const void * p) { __builtin_prefetch(p); }
} // namespace rkv_scalar_vec

namespace rkv_scalar {
using namespace rkv_scalar_vec;
#define RKV_NS rkv_scalar_impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_scalar

#ifdef RKV_X86
// ---------------------------------------------------------------- AVX2 + FMA + F16C
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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
static inline V16 from_i8(const int8_t * p) {
    return { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) p))),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (p + 8)))) };
}
static inline V16 from_nibbles(const uint8_t * qs, bool high) {
    __m128i b = _mm_loadu_si128((const __m128i *) qs);
    b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
    const __m256i eight = _mm256_set1_epi32(8);
    return { _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), eight)),
             _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), eight)) };
}
static inline float f16s(uint16_t h) { return _cvtsh_ss(h); }
static inline void prefetch(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T0); }
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
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace rkv_avx512 {
struct V16 { __m512 a; };
static inline V16 zero() { return { _mm512_setzero_ps() }; }
static inline V16 set1(float x) { return { _mm512_set1_ps(x) }; }
static inline V16 load(const float * p) { return { _mm512_loadu_ps(p) }; }
static inline void store(float * p, V16 x) { _mm512_storeu_ps(p, x.a); }
static inline V16 fmadd(V16 x, V16 y, V16 z) { return { _mm512_fmadd_ps(x.a, y.a, z.a) }; }
static inline V16 mul(V16 x, V16 y) { return { _mm512_mul_ps(x.a, y.a) }; }
static inline float hsum(V16 x) { return _mm512_reduce_add_ps(x.a); }
static inline float hmax(V16 x) { return _mm512_reduce_max_ps(x.a); }
static inline V16 vexp(V16 v) {
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
static inline V16 from_f16(const uint16_t * p) { return { _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)) }; }
static inline V16 from_i8(const int8_t * p) { return { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) p))) }; }
static inline V16 from_nibbles(const uint8_t * qs, bool high) {
    __m128i b = _mm_loadu_si128((const __m128i *) qs);
    b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
    return { _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(8))) };
}
static inline float f16s(uint16_t h) { return _cvtsh_ss(h); }
static inline void prefetch(const void * p) { _mm_prefetch((const char *) p, _MM_HINT_T0); }
#define RKV_NS impl
#include "rolling-kv-cpu-decode-impl.inc"
#undef RKV_NS
} // namespace rkv_avx512
#pragma GCC pop_options
#endif // RKV_X86

namespace {

enum class isa { scalar, avx2, avx512 };

isa detect() {
#ifdef RKV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
        return isa::avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
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
    if (strcmp(name, "avx512") == 0) want = isa::avx512;
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

namespace {
} // namespace

size_t rkv_cpu_decode_part_floats(const rkv_cpu_decode_params & p) {
    return (size_t) p.n_head * (2 + (size_t) p.DV);
}

bool rkv_cpu_decode_supported(int k_type, int v_type, int D, int DV) {
    auto ok = [](int t) { return t == RKV_TYPE_F16 || t == RKV_TYPE_Q8_0 || t == RKV_TYPE_Q4_0; };
    return ok(k_type) && ok(v_type) && D > 0 && DV > 0 && D % 32 == 0 && DV % 32 == 0;
}

void rkv_cpu_decode_range(const rkv_cpu_decode_params & p, int64_t c0, int64_t c1, float * part) {
    switch (selected()) {
#ifdef RKV_X86
        case isa::avx512: rkv_avx512::impl::range(p, c0, c1, part); return;
        case isa::avx2:   rkv_avx2::impl::range(p, c0, c1, part); return;
#endif
        default:          rkv_scalar::rkv_scalar_impl::range(p, c0, c1, part); return;
    }
}

const char * rkv_cpu_decode_isa(void) {
    switch (selected()) {
        case isa::avx512: return "avx512";
        case isa::avx2:   return "avx2";
        default:          return "scalar";
    }
}

void rkv_cpu_decode_merge(const rkv_cpu_decode_params & p, const float * parts, int n_parts, float * o, float * lse) {
    const size_t stride = 2 + (size_t) p.DV;
    const size_t part_floats = rkv_cpu_decode_part_floats(p);
    for (int h = 0; h < p.n_head; ++h) {
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
