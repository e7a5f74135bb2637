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
// (ggml-cpu/rolling-kv-fa.cpp). A part's O is never read when its lse is -inf. Only the VEC and MMA
// kernels write the LSE: supports_op refuses the op where the dispatch would pick TILE for a part (head
// sizes 40 and 72 everywhere, small batches before Turing and on AMD), and the scheduler runs it on the CPU.
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
// A tail in pinned host memory is streamed through the device in chunks (rolling-kv-stream.cu); each chunk
// is one more part. Its far end may be attended on the CPU meanwhile (the hybrid tail, rolling-kv-hybrid.cu): one
// more part, the last, whose output and LSE the host computes and copies back.
//
// Test hook, the op's tail_perturb x (ggml_streaming_flash_attn_set_tail_perturb), as in the CPU forward: every tail
// key's score (after scale, softcap and mask) is multiplied by (1 + x). The tail parts' shadows get scale*(1 + x) (and
// softcap*(1 + x), which keeps the kernel's scale/softcap inside tanh), and their mask columns are compacted with every
// value times (1 + x) (0 and -inf stay; finite ALiBi/bias values are rounded to f16 once more). Off (the default),
// nothing of this runs.
//
// The forward: rkv_collect (the parts), rkv_plan (per part: padding, mask, shadow, output buffer), rkv_run_part
// (per part: wait for its chunk, mask and padding copies, the stock kernel), rkv_merge_part (into dst).

#include "rolling-kv-fa.cuh"
#include "rolling-kv-stream.cuh"
#include "rolling-kv-hybrid.cuh"

#include "fattn-common.cuh"
#include "fattn.cuh"
#include "ggml-rolling-kv.h"

#include <climits>
#include <cstring>

static_assert(GGML_MAX_OP_PARAMS >= (GGML_CUDA_FATTN_OP_PARAM_LSE + 2)*sizeof(int32_t), "no room for the LSE pointer");
static_assert(GGML_CUDA_RKV_CHUNK_ALIGN == FATTN_KQ_STRIDE,
              "streamed chunks are multiples of the vector kernel's KV stride");

namespace {

struct rkv_part {
    const ggml_tensor * k;
    const ggml_tensor * v;
    int64_t             n;    // KV cells
    int64_t             col0; // first mask column
    bool                tail; // a part of the tail (the whole device tail, a streamed chunk or the CPU part)
    bool                cpu = false; // the CPU part of a host tail (its far end): attended on the host
};

static int rkv_get_parts(const ggml_tensor * dst, rkv_part parts[2]) {
    const ggml_tensor * kw = dst->src[GGML_STREAMING_FA_SRC_K_WIN];
    const ggml_tensor * vw = dst->src[GGML_STREAMING_FA_SRC_V_WIN];
    const ggml_tensor * kt = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];

    const int64_t n_win = kw ? kw->ne[1] : 0;

    int np = 0;
    if (kw && vw && n_win > 0) {
        parts[np++] = { kw, vw, n_win, 0, false };
    }
    if (kt && vt && kt->ne[1] > 0) {
        parts[np++] = { kt, vt, kt->ne[1], n_win, true };
    }
    return np;
}

// the test hook's factor (1 + the op's tail_perturb); 1: off
static float rkv_perturb_mul(const ggml_tensor * dst) {
    return 1.0f + ggml_streaming_flash_attn_get_tail_perturb(dst);
}

// padded copy of a part's K or V: [D, n_pad, nh, ne3], contiguous, same type
static void rkv_padded_header(ggml_tensor & t, const ggml_tensor * src, int64_t n_pad) {
    ggml_cuda_rkv_detached_header(t, src);
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
    ggml_cuda_rkv_detached_header(m, mask);
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

// test hook: a tail part's scores times mul (scale and softcap of its shadow; the mask columns are scaled when
// compacted)
static void rkv_shadow_perturb(ggml_tensor & s, float mul) {
    float scale, softcap;
    memcpy(&scale,   (const float *) s.op_params + 0, sizeof(float));
    memcpy(&softcap, (const float *) s.op_params + 2, sizeof(float));
    scale *= mul;
    if (softcap != 0.0f) {
        softcap *= mul; // the kernels compute softcap*tanh(qk*scale/softcap)
    }
    memcpy((float *) s.op_params + 0, &scale,   sizeof(float));
    memcpy((float *) s.op_params + 2, &softcap, sizeof(float));
}

// how one part is computed (headers only; nothing is launched while planning)
struct rkv_part_plan {
    bool        pad       = false; // K/V copied into a zero-padded buffer of a multiple of 256 cells
    bool        has_mask  = false;
    bool        mask_view = true;  // the mask part is a view of the op's mask (else a compact copy)
    float       mask_mul  = 1.0f;  // the compact copy's values times this (test hook; 1: a plain copy)
    bool        direct    = false; // the kernel writes into dst (first part only)
    size_t      O_size    = 0;     // else: the pool buffer its output needs
    ggml_tensor k_pad, v_pad, mask_part, shadow;
};

// the op being computed: its parts, in merge order (the window, then the tail, whole or as streamed chunks)
struct rkv_fwd {
    ggml_tensor       * dst   = nullptr;
    const ggml_tensor * q     = nullptr;
    const ggml_tensor * mask  = nullptr;
    ggml_tensor       * sinks = nullptr;

    int64_t DV     = 0;
    int64_t nrows  = 0;
    size_t  nbytes = 0;
    int     n_head = 0;

    std::vector<rkv_part> parts;
    ggml_tensor run_k[GGML_RKV_MAX_TAIL_RUNS], run_v[GGML_RKV_MAX_TAIL_RUNS]; // a device tail's runs (tail runs set)
    int  p_chunk     = 0;     // parts [p_chunk, p_chunk + ts.n_chunks()) are the chunks of the streamed host tail
    bool host_tail   = false; // the tail streams (some of its cells go through the ring)
    int64_t n_cpu    = 0;     // cells of the tail's CPU part (the last part), 0: none
    bool fused_sinks = false; // a single part with sinks: the stock kernels apply them, no LSE or merge
    ggml_cuda_rkv_tail_stream ts;

    ggml_tensor mask_synth;   // stands in for a missing mask of a padded part: [n_q, 1, 1] rows
    std::vector<rkv_part_plan> pl;
    size_t O_max = 0;
};

// buffers shared by all parts (pool, stream-ordered on the compute stream)
struct rkv_bufs {
    ggml_cuda_pool_alloc<float> lse_acc;
    ggml_cuda_pool_alloc<float> lse_tmp;
    ggml_cuda_pool_alloc<float> O_tmp;
    ggml_cuda_rkv_cpu_part cpu;          // the CPU part: its output rows, then its LSEs (pinned host memory, read in
                                         // place), and what the merge waits for
    explicit rkv_bufs(ggml_cuda_pool & pool) : lse_acc(pool), lse_tmp(pool), O_tmp(pool) {}
};

} // namespace

static __global__ void rkv_mask_slice(const half * __restrict__ src, half * __restrict__ dst,
        const int64_t src_stride, const int64_t col0, const int n, const int n_pad, const int64_t nrows,
        const float mul) {
    for (int64_t r = blockIdx.y; r < nrows; r += gridDim.y) {
        for (int c = blockIdx.x*blockDim.x + threadIdx.x; c < n_pad; c += gridDim.x*blockDim.x) {
            half v = c < n ? (src ? src[r*src_stride + col0 + c] : __float2half(0.0f)) : __float2half(-INFINITY);
            if (mul != 1.0f) {
                v = __float2half(__half2float(v)*mul); // test hook (ROLLINGKV_DEBUG_PERTURB_TAIL): 0 and -inf stay
            }
            dst[r*n_pad + c] = v;
        }
    }
}

// (O_acc, lse_acc) <- (O_acc, lse_acc) (+) (O_p, lse_p), exactly, in f32. `first`: the accumulator is empty (its
// contents are not read). O_p == nullptr: nothing to add (finalization of a single part). `last`: apply the sinks
// once and write 0 for rows that every part masked (lse -inf; stock kernels leave 0/0 there). A part's O is never
// read when its lse is -inf. For two parts this is the arithmetic the op has always used (bit-identical results).
template <bool first, bool last>
// lse_p may be lse_acc
static __global__ void rkv_merge(float * O_acc, float * lse_acc, const float * __restrict__ O_p, const float * lse_p,
        const float * __restrict__ sinks, const int DV, const int n_head) {
    const int64_t row = blockIdx.x;

    const float la = first ? -INFINITY : lse_acc[row];
    const float lb = O_p ? lse_p[row] : -INFINITY;

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
    if (last && sinks && l != -INFINITY) {
        const float sk = sinks[row % n_head];
        const float m  = fmaxf(l, sk);
        const float el = expf(l - m);
        so = el/(el + expf(sk - m));
    }

    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float o = 0.0f;
        if (wa != 0.0f) {
            o += wa*O_acc[row*DV + d];
        }
        if (wb != 0.0f) {
            o += wb*O_p[row*DV + d];
        }
        O_acc[row*DV + d] = last ? o*so : o;
    }
    if (!last) {
        __syncthreads(); // every thread has read la
        if (threadIdx.x == 0) {
            lse_acc[row] = l;
        }
    }
}

//
// supports_op
//

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
        // trap inside the stock MMA kernel (compute-sanitizer, docs/perf/2026-11-30-gpu-session/README.md). Not
        // understood yet, so F32 caches (never a default) run the op on the CPU instead.
        if (parts[i].k->type == GGML_TYPE_F32 || parts[i].v->type == GGML_TYPE_F32) {
            return false;
        }
        const bool host_k = ggml_cuda_rkv_is_host(parts[i].k);
        const bool host_v = ggml_cuda_rkv_is_host(parts[i].v);
        if (host_k != host_v) {
            return false;
        }
        if (host_k) {
            // a host window is not streamed; a host tail is, in contiguous cell ranges
            if (!parts[i].tail) {
                return false;
            }
            if (!ggml_cuda_rkv_rows_contiguous(parts[i].k) || !ggml_cuda_rkv_rows_contiguous(parts[i].v) ||
                    parts[i].k->ne[3] != parts[i].v->ne[3]) {
                return false;
            }
        }
        // The part as the dispatch sees it: whole, or, streamed from host memory, as 256-aligned chunks plus a last one
        // of the part's residue mod 256 (the kernel choice depends on the cell count only through that residue and
        // size thresholds). The stock dispatch must run each on a kernel that writes the LSE the merge reads: TILE
        // writes none (head sizes 40 and 72 on every GPU; small batches before Turing and on AMD). A padded part
        // (see the top of the file) is padded only for VEC. The scheduler then runs the op on the CPU.
        // (a device tail with runs is attended as parts of whole blocks too, the last one ending with the tail)
        int32_t rf[GGML_RKV_MAX_TAIL_RUNS], rn[GGML_RKV_MAX_TAIL_RUNS];
        const bool streamed = host_k || (parts[i].tail && ggml_streaming_flash_attn_get_tail_runs(op, rf, rn) > 0);
        for (const int64_t n : { parts[i].n, streamed ? (int64_t) FATTN_KQ_STRIDE : parts[i].n }) {
            ggml_tensor k = *parts[i].k;
            ggml_tensor v = *parts[i].v;
            k.ne[1] = n;
            v.ne[1] = n;
            const rkv_part p = { &k, &v, n, parts[i].col0, parts[i].tail };
            ggml_tensor m;
            if (mask) {
                rkv_mask_header(m, mask, p, false, n);
            }
            ggml_tensor s;
            rkv_shadow(s, op, p, mask ? &m : nullptr, nullptr, nullptr, nullptr);
            if (!ggml_cuda_flash_attn_ext_supported(device, &s) || !ggml_cuda_flash_attn_ext_writes_lse(device, &s)) {
                return false;
            }
        }
    }
    return true;
}

//
// the forward
//

// the parts, in merge order: the window, then the tail, either whole (device) or as chunks streamed through the slot
// ring (the same predicate as ggml_cuda_rkv_graph_begin's, so that an op streams exactly when the plan holds it)
static void rkv_collect(ggml_backend_cuda_context & ctx, rkv_fwd & f) {
    rkv_part seg[2];
    const int nseg = rkv_get_parts(f.dst, seg);

    // a tail in host memory: its streamed cells [0, n_tail - n_cpu), then its CPU part
    const bool host = nseg > 0 && seg[nseg - 1].tail && ggml_cuda_rkv_is_host(seg[nseg - 1].k);
    f.n_cpu     = host ? ggml_cuda_rkv_tail_cpu_cells(f.dst) : 0;
    f.host_tail = host && ggml_cuda_rkv_streams_tail(f.dst);
    int32_t rf[GGML_RKV_MAX_TAIL_RUNS], rn[GGML_RKV_MAX_TAIL_RUNS];
    const int n_runs = nseg > 0 && seg[nseg - 1].tail ? ggml_streaming_flash_attn_get_tail_runs(f.dst, rf, rn) : 0;
    for (int i = 0; i < nseg - (host ? 1 : 0); ++i) {
        if (!seg[i].tail || n_runs == 0) {
            f.parts.push_back(seg[i]);
            continue;
        }
        // a device tail with runs: each run one part (the cells outside them are masked for every row)
        for (int r = 0; r < n_runs; ++r) {
            for (ggml_tensor * h : { &f.run_k[r], &f.run_v[r] }) {
                const ggml_tensor * src = h == &f.run_k[r] ? seg[i].k : seg[i].v;
                ggml_cuda_rkv_detached_header(*h, src);
                h->ne[1] = rn[r];
                h->data  = (char *) src->data + (size_t) rf[r]*src->nb[1];
            }
            f.parts.push_back({ &f.run_k[r], &f.run_v[r], rn[r], seg[i].col0 + rf[r], true });
        }
    }
    f.p_chunk = (int) f.parts.size();
    if (f.host_tail) {
        ggml_cuda_rkv_tail_begin(ctx, f.dst, f.ts);
        for (int c = 0; c < f.ts.n_chunks(); ++c) {
            f.parts.push_back({ &f.ts.slot_k[c], &f.ts.slot_v[c], f.ts.slot_k[c].ne[1], f.ts.chunk_col0[c], true });
        }
    }
    if (f.n_cpu > 0) {
        const rkv_part & t = seg[nseg - 1];
        rkv_part p = { t.k, t.v, f.n_cpu, t.col0 + t.n - f.n_cpu, true };
        p.cpu = true;
        f.parts.push_back(p);
    }
    f.fused_sinks = f.parts.size() == 1 && f.sinks != nullptr && !f.parts[0].cpu;
}

// per part: padding, mask, shadow and output buffer (headers only; nothing is launched yet)
static void rkv_plan(int device, rkv_fwd & f) {
    const ggml_tensor * q    = f.q;
    const ggml_tensor * mask = f.mask;
    const int np = (int) f.parts.size();

    int64_t n_total = 0;
    for (int i = 0; i < np; ++i) {
        n_total += f.parts[i].n;
    }

    if (!mask) {
        f.mask_synth = {};
        f.mask_synth.type  = GGML_TYPE_F16;
        f.mask_synth.ne[0] = 1;
        f.mask_synth.ne[1] = q->ne[1];
        f.mask_synth.ne[2] = 1;
        f.mask_synth.ne[3] = 1;
        f.mask_synth.nb[0] = sizeof(half);
        f.mask_synth.nb[1] = sizeof(half);
        f.mask_synth.nb[2] = sizeof(half)*q->ne[1];
        f.mask_synth.nb[3] = f.mask_synth.nb[2];
    }

    const float perturb = rkv_perturb_mul(f.dst); // test hook; 1: off

    f.pl.resize(np);
    f.O_max = 0;
    for (int i = 0; i < np; ++i) {
        rkv_part_plan & pp = f.pl[i];
        rkv_part p = f.parts[i];
        if (p.cpu) {
            continue; // computed on the host (rolling-kv-hybrid.cu): no shadow, its output has a buffer of its own
        }
        const bool perturbed = p.tail && perturb != 1.0f;
        pp.has_mask = mask != nullptr;
        // vector-kernel cases of the concatenated op whose part is not 256-aligned: pad (see top of file)
        if (p.n % FATTN_KQ_STRIDE != 0 && n_total % FATTN_KQ_STRIDE == 0 && q->ne[1] <= 2 &&
                (ggml_is_quantized(p.k->type) || ggml_is_quantized(p.v->type))) {
            const int64_t n_pad = GGML_PAD(p.n, FATTN_KQ_STRIDE);
            rkv_padded_header(pp.k_pad, p.k, n_pad);
            rkv_padded_header(pp.v_pad, p.v, n_pad);
            const rkv_part padded = { &pp.k_pad, &pp.v_pad, n_pad, p.col0, p.tail };
            ggml_tensor m;
            rkv_mask_header(m, mask ? mask : &f.mask_synth, padded, false, n_pad);
            ggml_tensor s;
            rkv_shadow(s, f.dst, padded, &m, nullptr, f.dst->data, nullptr);
            // VEC with an in-type kernel is the only choice that needs no f16 scratch for quantized K/V
            pp.pad = ggml_cuda_flash_attn_ext_get_alloc_size(device, &s) <= f.nbytes;
        }
        if (pp.pad) {
            pp.has_mask  = true;
            pp.mask_view = false;
            rkv_mask_header(pp.mask_part, mask ? mask : &f.mask_synth, p, false, GGML_PAD(p.n, FATTN_KQ_STRIDE));
            p.k = &pp.k_pad;
            p.v = &pp.v_pad;
        } else if (mask) {
            pp.mask_view = !perturbed && rkv_mask_view_ok(q, mask, p);
            rkv_mask_header(pp.mask_part, mask, p, pp.mask_view, p.n);
        }
        if (perturbed) {
            pp.mask_mul = perturb;
        }
        // output straight into dst if the kernel needs no f16 K/V scratch behind it (first part only)
        rkv_shadow(pp.shadow, f.dst, p, pp.has_mask ? &pp.mask_part : nullptr, f.fused_sinks ? f.sinks : nullptr,
                   f.dst->data, nullptr);
        if (perturbed) {
            rkv_shadow_perturb(pp.shadow, perturb);
        }
        pp.direct = i == 0 && ggml_cuda_flash_attn_ext_get_alloc_size(device, &pp.shadow) <= f.nbytes;
        if (!pp.direct) {
            pp.shadow.data = nullptr;
            pp.O_size = ggml_cuda_flash_attn_ext_get_alloc_size(device, &pp.shadow) + 128; // + alignment of the scratch
            f.O_max = std::max(f.O_max, pp.O_size);
        }
    }
}

// part i: wait for its chunk (streamed tail), its mask and padding copies, the stock kernel into dst or O_tmp
static void rkv_run_part(ggml_backend_cuda_context & ctx, rkv_fwd & f, rkv_bufs & b, int i) {
    cudaStream_t     stream = ctx.stream();
    ggml_cuda_pool & pool   = ctx.pool();
    rkv_part_plan  & pp     = f.pl[i];
    const rkv_part & p      = f.parts[i]; // the unpadded part (source of a padded copy)
    const ggml_tensor * mask = f.mask;
    // chunk index, or < 0
    const int ic = f.host_tail && i >= f.p_chunk && i < f.p_chunk + f.ts.n_chunks() ? i - f.p_chunk : -1;

    if (p.cpu) {
        ggml_cuda_rkv_cpu_part_wait(ctx, b.cpu); // the host's result is on the device
        return;
    }
    if (ic >= 0) {
        ggml_cuda_rkv_tail_wait(ctx, f.ts, ic);
    }

    ggml_cuda_pool_alloc<half> mask_buf(pool);
    ggml_cuda_pool_alloc<char> k_pad_buf(pool);
    ggml_cuda_pool_alloc<char> v_pad_buf(pool);

    if (pp.has_mask && !pp.mask_view) {
        pp.mask_part.data = mask_buf.alloc(pp.mask_part.nb[3]*pp.mask_part.ne[3]/sizeof(half));
        const int64_t n_pad = pp.mask_part.nb[1]/sizeof(half);
        const int64_t mrows = pp.mask_part.ne[1]*pp.mask_part.ne[2]*pp.mask_part.ne[3];
        const int     mth   = 256;
        const dim3    grid((unsigned) std::min<int64_t>((n_pad + mth - 1)/mth, 1024),
                           (unsigned) std::min<int64_t>(mrows, 65535), 1);
        rkv_mask_slice<<<grid, mth, 0, stream>>>(mask ? (const half *) mask->data : nullptr, (half *) pp.mask_part.data,
            mask ? mask->nb[1]/sizeof(half) : 0, p.col0, (int) p.n, (int) n_pad, mrows, pp.mask_mul);
        CUDA_CHECK(cudaGetLastError());
    }
    if (pp.pad) {
        pp.k_pad.data = k_pad_buf.alloc(ggml_nbytes(&pp.k_pad));
        pp.v_pad.data = v_pad_buf.alloc(ggml_nbytes(&pp.v_pad));
        // zero-filled cells beyond the part (finite; masked with -inf above), rows copied per head and stream
        for (const ggml_tensor * src : { p.k, p.v }) {
            const ggml_tensor & t = src == p.k ? pp.k_pad : pp.v_pad;
            CUDA_CHECK(cudaMemsetAsync(t.data, 0, ggml_nbytes(&t), stream));
            for (int64_t i3 = 0; i3 < src->ne[3]; ++i3) {
                for (int64_t i2 = 0; i2 < src->ne[2]; ++i2) {
                    CUDA_CHECK(cudaMemcpy2DAsync((char *) t.data + i2*t.nb[2] + i3*t.nb[3], t.nb[1],
                        (const char *) src->data + i2*src->nb[2] + i3*src->nb[3], src->nb[1],
                        t.nb[1], p.n, cudaMemcpyDeviceToDevice, stream));
                }
            }
        }
    }

    float * lse = f.fused_sinks ? nullptr : (i == 0 ? b.lse_acc.ptr : b.lse_tmp.ptr);
    memcpy((int32_t *) pp.shadow.op_params + GGML_CUDA_FATTN_OP_PARAM_LSE, &lse, sizeof(lse));
    if (!pp.direct) {
        pp.shadow.data = b.O_tmp.ptr;
    }
    ggml_cuda_flash_attn_ext(ctx, &pp.shadow);

    if (ic >= 0) {
        ggml_cuda_rkv_tail_release(ctx, f.ts, ic);
    }
}

// part i into dst: the first part is the accumulator (in place when direct, else moved into dst, and finalized if
// alone), every later one is merged into it, the last merge applies the sinks
static void rkv_merge_part(ggml_backend_cuda_context & ctx, rkv_fwd & f, rkv_bufs & b, int i) {
    cudaStream_t          stream = ctx.stream();
    const rkv_part_plan & pp     = f.pl[i];

    if (f.fused_sinks) {
        if (!pp.direct) {
            CUDA_CHECK(cudaMemcpyAsync(f.dst->data, pp.shadow.data, f.nbytes, cudaMemcpyDeviceToDevice, stream));
        }
        return;
    }

    const float * sinks_d = f.sinks ? (const float *) f.sinks->data : nullptr;
    const int     nth     = (int) std::min<int64_t>(f.DV, 256);
    const int     DV      = (int) f.DV;
    const dim3    grid((unsigned) f.nrows);
    float       * O_acc   = (float *) f.dst->data;
    const bool    last    = i == (int) f.parts.size() - 1;
    // the part's output and LSE: the CPU part's buffer, else the kernel's
    const float * O_p     = f.parts[i].cpu ? b.cpu.out : b.O_tmp.ptr;
    const float * lse_p   = f.parts[i].cpu ? b.cpu.out + f.nrows*f.DV : i == 0 ? b.lse_acc.ptr : b.lse_tmp.ptr;

    if (i == 0) {
        if (pp.direct && !last) {
            return; // the accumulator is already in dst
        }
        if (last) {
            if (pp.direct) {
                rkv_merge<false, true><<<grid, nth, 0, stream>>>(O_acc, b.lse_acc.ptr, nullptr, nullptr, sinks_d, DV,
                                                                 f.n_head);
            } else {
                rkv_merge<true, true><<<grid, nth, 0, stream>>>(O_acc, b.lse_acc.ptr, O_p, lse_p, sinks_d, DV,
                                                                f.n_head);
            }
        } else {
            rkv_merge<true, false><<<grid, nth, 0, stream>>>(O_acc, b.lse_acc.ptr, O_p, lse_p, sinks_d, DV, f.n_head);
        }
    } else if (last) {
        rkv_merge<false, true><<<grid, nth, 0, stream>>>(O_acc, b.lse_acc.ptr, O_p, lse_p, sinks_d, DV, f.n_head);
    } else {
        rkv_merge<false, false><<<grid, nth, 0, stream>>>(O_acc, b.lse_acc.ptr, O_p, lse_p, sinks_d, DV, f.n_head);
    }
    CUDA_CHECK(cudaGetLastError());
}

void ggml_cuda_streaming_flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    rkv_fwd f;
    f.dst   = dst;
    f.q     = dst->src[GGML_STREAMING_FA_SRC_Q];
    f.mask  = dst->src[GGML_STREAMING_FA_SRC_MASK];
    f.sinks = dst->src[GGML_STREAMING_FA_SRC_SINKS];

    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(!f.mask || (f.mask->type == GGML_TYPE_F16 && ggml_is_contiguous(f.mask)));

    ggml_cuda_set_device(ctx.device);

    f.DV     = dst->ne[0];
    f.nrows  = ggml_nrows(dst);
    f.nbytes = ggml_nbytes(dst);
    f.n_head = (int) f.q->ne[2];
    GGML_ASSERT(f.nrows <= INT_MAX);

    rkv_collect(ctx, f);

    if (f.parts.empty()) {
        // no KV cells at all: every row is fully masked
        CUDA_CHECK(cudaMemsetAsync(dst->data, 0, f.nbytes, ctx.stream()));
        return;
    }

    rkv_plan(ctx.device, f);

    // buffers shared by all parts, allocated before the per-part ones
    rkv_bufs b(ctx.pool());
    if (!f.fused_sinks) {
        b.lse_acc.alloc(f.nrows);
        if (f.parts.size() > 1) {
            b.lse_tmp.alloc(f.nrows);
        }
    }
    if (f.O_max) {
        b.O_tmp.alloc((f.O_max + sizeof(float) - 1)/sizeof(float));
    }

    // the CPU part first: it runs on the host while the device attends the window and the streamed chunks
    if (f.n_cpu > 0) {
        const rkv_part & p = f.parts.back();
        b.cpu = ggml_cuda_rkv_cpu_part_launch(ctx, f.dst, p.n, p.col0);
    }
    if (f.host_tail) {
        ggml_cuda_rkv_tail_start(ctx, f.ts);
    }
    for (int i = 0; i < (int) f.parts.size(); ++i) {
        rkv_run_part(ctx, f, b, i);
        rkv_merge_part(ctx, f, b, i);
    }
    if (f.host_tail) {
        ggml_cuda_rkv_tail_end(ctx, f.ts);
    }
}
