// rolling-KV: CUDA forward for GGML_OP_STREAMING_FLASH_ATTN
//
// The op is ggml_flash_attn_ext over concat(window, tail) along the KV cells, without the concatenation.
// Each non-empty part (window = cells [0, n_win), tail = [n_win, n_win + n_tail)) runs through the stock
// FlashAttention dispatch (ggml_cuda_flash_attn_ext) as a "shadow" GGML_OP_FLASH_ATTN_EXT tensor that
// lives only on the host stack: same Q, the part's K/V, the part's mask columns, no sinks. Its op_params
// carry a pointer (slots GGML_CUDA_FATTN_OP_PARAM_LSE) to which the kernels write the per-row
// log-sum-exp of the part. rkv_merge then combines the normalized part outputs exactly in f32:
//
//   O = sum_p O_p*exp(lse_p - M) / sum_p exp(lse_p - M),   lse = M + log(sum_p exp(lse_p - M))
//
// applies the sinks once (O *= e^lse / (e^lse + e^sink)), and writes 0 for rows where every part is
// fully masked (lse = -inf; the stock kernels write 0/0 there), matching the CPU op
// (ggml-cpu/rolling-kv-fa.cpp). A part's O is never read when its lse is -inf.
//
// A single part with sinks needs no LSE: the shadow takes the sinks itself (identical to stock FA).
//
// The part outputs are written straight into dst when the kernel needs no f16 K/V scratch behind its
// output (ggml_cuda_flash_attn_ext_get_alloc_size == nbytes), otherwise into a pool buffer sized for it.
// Mask columns are passed as a view of the op's mask when the kernels can read it in place (16-byte
// aligned column offset; the vector kernel indexes mask rows by ne11, so n_q > 1 needs the full width),
// otherwise they are compacted into a pool buffer.
//
// Parts whose cell count is not a multiple of 256 cannot use the vector kernel, which stock FA picks
// for n_q <= 2 with quantized K/V (Q quantized to q8_1, in-type dot products), while MMA (f16 Q and K)
// gives results ~1e-6 NMSE away. To compute such a part with the same kernel as the concatenated
// reference, its K/V rows are copied into a zero-padded buffer of a multiple of 256 cells and its mask
// is padded with -inf (or synthesized, if the op has none). Parts built by the rolling-KV cache are
// 256-aligned, so this exactness fallback is not on the hot path.
//
// All tails are device memory here (host-resident tails: see docs/design/cuda-streaming-fa.md §2).

#include "rolling-kv-fa.cuh"

#include "fattn-common.cuh"
#include "fattn.cuh"
#include "ggml-rolling-kv.h"

#include <cstring>

static_assert(GGML_MAX_OP_PARAMS >= (GGML_CUDA_FATTN_OP_PARAM_LSE + 2)*sizeof(int32_t), "no room for the LSE pointer");

namespace {

struct rkv_part {
    const ggml_tensor * k;
    const ggml_tensor * v;
    int64_t             n;    // KV cells
    int64_t             col0; // first mask column
};

static int rkv_get_parts(const ggml_tensor * dst, rkv_part parts[2]) {
    const ggml_tensor * kw = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * vw = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * kt = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];

    const int64_t n_win = kw ? kw->ne[1] : 0;

    int np = 0;
    if (kw && vw && n_win > 0) {
        parts[np++] = { kw, vw, n_win, 0 };
    }
    if (kt && vt && kt->ne[1] > 0) {
        parts[np++] = { kt, vt, kt->ne[1], n_win };
    }
    return np;
}

// padded copy of a part's K or V: [D, n_pad, nh, ne3], contiguous, same type
static void rkv_padded_header(ggml_tensor & t, const ggml_tensor * src, int64_t n_pad) {
    t = *src;
    t.op        = GGML_OP_NONE;
    t.view_src  = nullptr;
    t.view_offs = 0;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        t.src[i] = nullptr;
    }
    t.ne[1] = n_pad;
    t.nb[0] = ggml_type_size(t.type);
    t.nb[1] = ggml_row_size(t.type, t.ne[0]);
    t.nb[2] = t.nb[1]*t.ne[1];
    t.nb[3] = t.nb[2]*t.ne[2];
    t.data  = nullptr;
}

static bool rkv_mask_view_ok(const ggml_tensor * q, const ggml_tensor * mask, const rkv_part & p) {
    return p.col0 % 8 == 0 && mask->nb[1] % 16 == 0 && (uintptr_t) mask->data % 16 == 0 &&
        (q->ne[1] == 1 || p.n == mask->ne[0]);
}

// the part's mask columns [col0, col0 + n) as a tensor header; data set by the caller (view or compact copy)
static void rkv_mask_header(ggml_tensor & m, const ggml_tensor * mask, const rkv_part & p, bool view, int64_t n_cols) {
    m = *mask;
    m.op       = GGML_OP_NONE;
    m.view_src = nullptr;
    m.view_offs = 0;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        m.src[i] = nullptr;
    }
    m.ne[0] = n_cols;
    if (view) {
        m.data = (char *) mask->data + p.col0*mask->nb[0];
    } else {
        const int64_t n_pad = GGML_PAD(n_cols, 8);
        m.nb[0] = sizeof(half);
        m.nb[1] = n_pad*sizeof(half);
        m.nb[2] = m.nb[1]*m.ne[1];
        m.nb[3] = m.nb[2]*m.ne[2];
        m.data  = nullptr;
    }
}

static void rkv_shadow(ggml_tensor & s, const ggml_tensor * dst, const rkv_part & p, ggml_tensor * mask_part,
        ggml_tensor * sinks, void * data, float * lse) {
    memset(&s, 0, sizeof(s));
    s.type   = GGML_TYPE_F32;
    s.op     = GGML_OP_FLASH_ATTN_EXT;
    s.buffer = dst->buffer;
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        s.ne[i] = dst->ne[i];
    }
    s.nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; ++i) {
        s.nb[i] = s.nb[i-1]*s.ne[i-1];
    }
    // scale, max_bias, logit_softcap, prec as in the op; [4] n_kv_max = 0 (no sparse MMA)
    memcpy(s.op_params, dst->op_params, 4*sizeof(int32_t));
    memcpy((int32_t *) s.op_params + GGML_CUDA_FATTN_OP_PARAM_LSE, &lse, sizeof(lse));
    s.src[0] = dst->src[GGML_STREAMING_FA_SRC_Q];
    s.src[1] = const_cast<ggml_tensor *>(p.k);
    s.src[2] = const_cast<ggml_tensor *>(p.v);
    s.src[3] = mask_part;
    s.src[4] = sinks;
    s.data   = data;
    ggml_format_name(&s, "rkv_part");
}

} // namespace

static __global__ void rkv_mask_slice(const half * __restrict__ src, half * __restrict__ dst,
        const int64_t src_stride, const int64_t col0, const int n, const int n_pad, const int64_t nrows) {
    for (int64_t r = blockIdx.y; r < nrows; r += gridDim.y) {
        for (int c = blockIdx.x*blockDim.x + threadIdx.x; c < n_pad; c += gridDim.x*blockDim.x) {
            dst[r*n_pad + c] = c < n ? (src ? src[r*src_stride + col0 + c] : __float2half(0.0f)) : __float2half(-INFINITY);
        }
    }
}

template <int nparts>
static __global__ void rkv_merge(
        const float * O0, const float * __restrict__ lse0,   // O0 may be dst itself (window written in place)
        const float * __restrict__ O1, const float * __restrict__ lse1,
        const float * __restrict__ sinks, float * dst, const int DV, const int n_head) {
    const int64_t row = blockIdx.x;

    const float la = lse0[row];
    const float lb = nparts == 2 ? lse1[row] : -INFINITY;

    float wa = 0.0f;
    float wb = 0.0f;
    float l  = -INFINITY;
    if (la != -INFINITY && lb != -INFINITY) {
        const float m  = fmaxf(la, lb);
        const float ea = expf(la - m);
        const float eb = expf(lb - m);
        const float s  = ea + eb;
        wa = ea/s;
        wb = eb/s;
        l  = m + logf(s);
    } else if (la != -INFINITY) {
        wa = 1.0f;
        l  = la;
    } else if (lb != -INFINITY) {
        wb = 1.0f;
        l  = lb;
    }

    // sinks, counted once (a fully masked row stays 0, as in the CPU op)
    float so = 1.0f;
    if (sinks && l != -INFINITY) {
        const float sk = sinks[row % n_head];
        const float m  = fmaxf(l, sk);
        const float el = expf(l - m);
        so = el/(el + expf(sk - m));
    }

    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float o = 0.0f;
        if (wa != 0.0f) {
            o += wa*O0[row*DV + d];
        }
        if (nparts == 2 && wb != 0.0f) {
            o += wb*O1[row*DV + d];
        }
        dst[row*DV + d] = o*so;
    }
}

bool ggml_cuda_streaming_flash_attn_supported(int device, const ggml_tensor * op) {
    const ggml_tensor * q     = op->src[GGML_STREAMING_FA_SRC_Q];
    const ggml_tensor * mask  = op->src[GGML_STREAMING_FA_SRC_MASK];
    const ggml_tensor * sinks = op->src[GGML_STREAMING_FA_SRC_SINKS];

    if (!q || q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32 || !ggml_is_contiguous(op)) {
        return false;
    }
    if (mask && (mask->type != GGML_TYPE_F16 || !ggml_is_contiguous(mask))) {
        return false;
    }
    if (sinks && sinks->type != GGML_TYPE_F32) {
        return false;
    }

    rkv_part parts[2];
    const int np = rkv_get_parts(op, parts);
    for (int i = 0; i < np; ++i) {
        if (parts[i].v->ne[0] != op->ne[0]) {
            return false;
        }
        // F32 K/V parts: on the H200 an F32 prefill case (n_q 100, parts of 170 + 130 cells) hit a device
        // trap inside the stock MMA kernel (compute-sanitizer, docs/perf/2026-11-30-gpu-session.md). Not
        // understood yet, so F32 caches (never a default) run the op on the CPU instead.
        if (parts[i].k->type == GGML_TYPE_F32 || parts[i].v->type == GGML_TYPE_F32) {
            return false;
        }
        ggml_tensor m;
        if (mask) {
            rkv_mask_header(m, mask, parts[i], false, parts[i].n);
        }
        ggml_tensor s;
        rkv_shadow(s, op, parts[i], mask ? &m : nullptr, nullptr, nullptr, nullptr);
        if (!ggml_cuda_flash_attn_ext_supported(device, &s)) {
            return false;
        }
    }
    return true;
}

void ggml_cuda_streaming_flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[GGML_STREAMING_FA_SRC_Q];
    const ggml_tensor * mask  = dst->src[GGML_STREAMING_FA_SRC_MASK];
    ggml_tensor       * sinks = dst->src[GGML_STREAMING_FA_SRC_SINKS];

    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(!mask || (mask->type == GGML_TYPE_F16 && ggml_is_contiguous(mask)));

    ggml_cuda_set_device(ctx.device);
    const int      device = ctx.device;
    cudaStream_t   stream = ctx.stream();
    ggml_cuda_pool & pool = ctx.pool();

    const int64_t DV     = dst->ne[0];
    const int64_t nrows  = ggml_nrows(dst);
    const size_t  nbytes = ggml_nbytes(dst);
    const int     n_head = (int) q->ne[2];

    rkv_part parts[2];
    const int np = rkv_get_parts(dst, parts);

    if (np == 0) {
        // no KV cells at all: every row is fully masked
        CUDA_CHECK(cudaMemsetAsync(dst->data, 0, nbytes, stream));
        return;
    }

    // a single part with sinks: the stock kernels apply them, no LSE or merge needed
    const bool fused_sinks = np == 1 && sinks != nullptr;

    int64_t n_total = 0;
    for (int i = 0; i < np; ++i) {
        n_total += parts[i].n;
    }

    ggml_tensor mask_part[2];
    ggml_tensor shadow[2];
    ggml_tensor k_pad[2], v_pad[2];
    ggml_tensor mask_synth; // stands in for a missing mask of a padded part: [n_q, 1, 1] rows
    bool   pad[2]       = { false, false };
    int64_t n_cols[2]   = { 0, 0 };
    bool   has_mask[2]  = { mask != nullptr, mask != nullptr };
    bool   mask_view[2] = { true, true };
    const ggml_tensor * orig_k[2] = { nullptr, nullptr };
    const ggml_tensor * orig_v[2] = { nullptr, nullptr };
    int64_t orig_n[2] = { 0, 0 };
    bool   direct[2]    = { false, false };
    size_t O_size[2]    = { 0, 0 };

    if (!mask) {
        mask_synth = {};
        mask_synth.type  = GGML_TYPE_F16;
        mask_synth.ne[0] = 1;
        mask_synth.ne[1] = q->ne[1];
        mask_synth.ne[2] = 1;
        mask_synth.ne[3] = 1;
        mask_synth.nb[0] = sizeof(half);
        mask_synth.nb[1] = sizeof(half);
        mask_synth.nb[2] = sizeof(half)*q->ne[1];
        mask_synth.nb[3] = mask_synth.nb[2];
    }
    for (int i = 0; i < np; ++i) {
        n_cols[i] = parts[i].n;
        // vector-kernel cases of the concatenated op whose part is not 256-aligned: pad (see top of file)
        const rkv_part & p = parts[i];
        if (p.n % FATTN_KQ_STRIDE != 0 && n_total % FATTN_KQ_STRIDE == 0 && q->ne[1] <= 2 &&
                (ggml_is_quantized(p.k->type) || ggml_is_quantized(p.v->type))) {
            const int64_t n_pad = GGML_PAD(p.n, FATTN_KQ_STRIDE);
            rkv_padded_header(k_pad[i], p.k, n_pad);
            rkv_padded_header(v_pad[i], p.v, n_pad);
            const rkv_part pp = { &k_pad[i], &v_pad[i], n_pad, p.col0 };
            ggml_tensor m;
            rkv_mask_header(m, mask ? mask : &mask_synth, pp, false, n_pad);
            ggml_tensor s;
            rkv_shadow(s, dst, pp, &m, nullptr, dst->data, nullptr);
            // VEC with an in-type kernel is the only choice that needs no f16 scratch for quantized K/V
            pad[i] = ggml_cuda_flash_attn_ext_get_alloc_size(device, &s) <= nbytes;
        }
        orig_k[i] = p.k;
        orig_v[i] = p.v;
        orig_n[i] = p.n;
        if (pad[i]) {
            n_cols[i]    = GGML_PAD(p.n, FATTN_KQ_STRIDE);
            has_mask[i]  = true;
            mask_view[i] = false;
            rkv_mask_header(mask_part[i], mask ? mask : &mask_synth, parts[i], false, n_cols[i]);
            parts[i].k = &k_pad[i];
            parts[i].v = &v_pad[i];
        } else if (mask) {
            mask_view[i] = rkv_mask_view_ok(q, mask, parts[i]);
            rkv_mask_header(mask_part[i], mask, parts[i], mask_view[i], parts[i].n);
        }
        // output straight into dst if the kernel needs no f16 K/V scratch behind it (first part only)
        rkv_shadow(shadow[i], dst, parts[i], has_mask[i] ? &mask_part[i] : nullptr, fused_sinks ? sinks : nullptr, dst->data, nullptr);
        direct[i] = i == 0 && ggml_cuda_flash_attn_ext_get_alloc_size(device, &shadow[i]) <= nbytes;
        if (!direct[i]) {
            shadow[i].data = nullptr;
            O_size[i] = ggml_cuda_flash_attn_ext_get_alloc_size(device, &shadow[i]) + 128; // + alignment of the scratch
        }
    }

    // pool buffers, allocated in declaration order so that they are freed LIFO
    ggml_cuda_pool_alloc<half>  mask_buf0(pool);
    ggml_cuda_pool_alloc<half>  mask_buf1(pool);
    ggml_cuda_pool_alloc<char>  k_pad_buf0(pool);
    ggml_cuda_pool_alloc<char>  v_pad_buf0(pool);
    ggml_cuda_pool_alloc<char>  k_pad_buf1(pool);
    ggml_cuda_pool_alloc<char>  v_pad_buf1(pool);
    ggml_cuda_pool_alloc<float> lse_buf0(pool);
    ggml_cuda_pool_alloc<float> lse_buf1(pool);
    ggml_cuda_pool_alloc<float> O_buf0(pool);
    ggml_cuda_pool_alloc<float> O_buf1(pool);
    ggml_cuda_pool_alloc<half>  * mask_buf[2] = { &mask_buf0, &mask_buf1 };
    ggml_cuda_pool_alloc<float> * lse_buf[2]  = { &lse_buf0,  &lse_buf1  };
    ggml_cuda_pool_alloc<float> * O_buf[2]    = { &O_buf0,    &O_buf1    };

    for (int i = 0; i < np; ++i) {
        if (has_mask[i] && !mask_view[i]) {
            mask_part[i].data = mask_buf[i]->alloc(mask_part[i].nb[3]*mask_part[i].ne[3]/sizeof(half));
        }
    }
    // padded K/V copies, allocated as k0, v0, k1, v1 (declaration order)
    ggml_cuda_pool_alloc<char> * pad_bufs[4] = { &k_pad_buf0, &v_pad_buf0, &k_pad_buf1, &v_pad_buf1 };
    for (int i = 0; i < np; ++i) {
        if (pad[i]) {
            k_pad[i].data = pad_bufs[2*i + 0]->alloc(ggml_nbytes(&k_pad[i]));
            v_pad[i].data = pad_bufs[2*i + 1]->alloc(ggml_nbytes(&v_pad[i]));
        }
    }
    if (!fused_sinks) {
        for (int i = 0; i < np; ++i) {
            lse_buf[i]->alloc(nrows);
            float * lse = lse_buf[i]->ptr;
            memcpy((int32_t *) shadow[i].op_params + GGML_CUDA_FATTN_OP_PARAM_LSE, &lse, sizeof(lse));
        }
    }
    for (int i = 0; i < np; ++i) {
        if (!direct[i]) {
            shadow[i].data = O_buf[i]->alloc((O_size[i] + sizeof(float) - 1)/sizeof(float));
        }
    }

    // compact (or synthesize) mask columns where the kernels cannot read a view
    for (int i = 0; i < np; ++i) {
        if (has_mask[i] && !mask_view[i]) {
            const int64_t n_real = pad[i] ? orig_n[i] : parts[i].n;
            const int64_t n_pad  = mask_part[i].nb[1]/sizeof(half);
            const int64_t mrows  = mask_part[i].ne[1]*mask_part[i].ne[2]*mask_part[i].ne[3];
            const int     nth    = 256;
            const dim3    grid((unsigned) std::min<int64_t>((n_pad + nth - 1)/nth, 1024), (unsigned) std::min<int64_t>(mrows, 65535), 1);
            rkv_mask_slice<<<grid, nth, 0, stream>>>(mask ? (const half *) mask->data : nullptr, (half *) mask_part[i].data,
                mask ? mask->nb[1]/sizeof(half) : 0, parts[i].col0, (int) n_real, (int) n_pad, mrows);
            CUDA_CHECK(cudaGetLastError());
        }
        if (pad[i]) {
            // zero-filled cells beyond the part (finite; masked with -inf above), rows copied per head and stream
            for (const ggml_tensor * src : { orig_k[i], orig_v[i] }) {
                const ggml_tensor & t = src == orig_k[i] ? k_pad[i] : v_pad[i];
                CUDA_CHECK(cudaMemsetAsync(t.data, 0, ggml_nbytes(&t), stream));
                for (int64_t i3 = 0; i3 < src->ne[3]; ++i3) {
                    for (int64_t i2 = 0; i2 < src->ne[2]; ++i2) {
                        CUDA_CHECK(cudaMemcpy2DAsync((char *) t.data + i2*t.nb[2] + i3*t.nb[3], t.nb[1],
                            (const char *) src->data + i2*src->nb[2] + i3*src->nb[3], src->nb[1],
                            t.nb[1], orig_n[i], cudaMemcpyDeviceToDevice, stream));
                    }
                }
            }
        }
    }

    for (int i = 0; i < np; ++i) {
        ggml_cuda_flash_attn_ext(ctx, &shadow[i]);
    }

    if (fused_sinks) {
        if (!direct[0]) {
            CUDA_CHECK(cudaMemcpyAsync(dst->data, shadow[0].data, nbytes, cudaMemcpyDeviceToDevice, stream));
        }
        return;
    }

    const float * sinks_d = sinks ? (const float *) sinks->data : nullptr;
    const int nth = (int) std::min<int64_t>(DV, 256);
    GGML_ASSERT(nrows <= INT_MAX);
    if (np == 1) {
        rkv_merge<1><<<(unsigned) nrows, nth, 0, stream>>>((const float *) shadow[0].data, lse_buf0.ptr, nullptr, nullptr,
            sinks_d, (float *) dst->data, (int) DV, n_head);
    } else {
        rkv_merge<2><<<(unsigned) nrows, nth, 0, stream>>>((const float *) shadow[0].data, lse_buf0.ptr,
            (const float *) shadow[1].data, lse_buf1.ptr, sinks_d, (float *) dst->data, (int) DV, n_head);
    }
    CUDA_CHECK(cudaGetLastError());
}
