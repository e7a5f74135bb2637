// rolling-KV: CPU decode attention for the CPU part of a hybrid tail (see rolling-kv-cpu-decode.h).
//
// The kernel body (rolling-kv-cpu-decode-impl.inc) is compiled once per instruction set, each time over a 16-lane f32
// vector type of that set and that set's integer dot product of quantized K with the quantized query:
//   x86-64: AVX-512 with VNNI, AVX-512 (F/BW/VL/DQ), AVX2+FMA+F16C and plain C++;
//   AArch64: NEON (the integer dot by vdotq_s32 where the compiler targets the dot-product extension, else
//   vmull/vpadal); elsewhere: plain C++.
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
static inline V16 fmadd(V16 a, V16 b, V16 c) {
    for (int i = 0; i < 16; ++i) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
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
static inline V16 from_f16(const uint16_t * p) {
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = rkv_f16_to_f32(p[i]);
    return r;
}
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
static inline void kscores(const uint8_t * const * rows, int nblk, const int8_t * q, int D, const int32_t * corr,
                           const float * dq, const uint16_t * dkh, float * out) {
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

// the x86 paths (their own target each) and the NEON path, one translation unit with the scalar path
#include "rolling-kv-cpu-decode-x86.inc"
#include "rolling-kv-cpu-decode-neon.inc"

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

void rkv_cpu_decode_merge_heads(const rkv_cpu_decode_params & p, const float * parts, int n_parts, int h0, int h1,
                                float * o, float * lse) {
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
