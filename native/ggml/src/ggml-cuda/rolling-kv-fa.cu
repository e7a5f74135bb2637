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
// A tail in pinned host memory (the rolling-KV cache's tail, flagged streamed: see ggml-rolling-kv.h) is
// never copied by the scheduler. The op streams it itself: the tail cells of a layer are contiguous rows,
// so it copies them host to device in a few large cudaMemcpyAsync calls (GGML_RKV_SLOT_MIB per slot, 32 MiB
// by default: copies of >= 8 MiB run near the link's peak, 1 MiB copies at half of it) into a ring of
// GGML_RKV_SLOTS device slots (3 by default) on a dedicated copy stream. Per-slot events order the copies
// against the attention over the previous chunk in the same slot, so the copy of chunk i+1 overlaps the
// attention over chunk i; each chunk is one more part merged into the running (O, lse). The copy stream
// forks from the compute stream at the op (after this layer's new K/V rows were written into the tail)
// and joins it at the end of the op, which keeps CUDA graph capture valid: the copies become memcpy nodes
// that re-read the host tail at every replay. The first GGML_RKV_SLOTS chunks of a graph's plan are copied before the
// graph is launched, outside any capture (ggml_cuda_rkv_graph_begin); the graph waits for them as external events.

#include "rolling-kv-fa.cuh"
#include "rolling-kv-profile.cuh"

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

// a header with src's type and shape that is not a view and not a graph node (its data is set by the caller)
static void rkv_detached_header(ggml_tensor & t, const ggml_tensor * src) {
    t = *src;
    t.op        = GGML_OP_NONE;
    t.view_src  = nullptr;
    t.view_offs = 0;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        t.src[i] = nullptr;
    }
}

// padded copy of a part's K or V: [D, n_pad, nh, ne3], contiguous, same type
static void rkv_padded_header(ggml_tensor & t, const ggml_tensor * src, int64_t n_pad) {
    rkv_detached_header(t, src);
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
    rkv_detached_header(m, mask);
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

// (O_acc, lse_acc) <- (O_acc, lse_acc) (+) (O_p, lse_p), exactly, in f32. `first`: the accumulator is empty (its
// contents are not read). O_p == nullptr: nothing to add (finalization of a single part). `last`: apply the sinks
// once and write 0 for rows that every part masked (lse -inf; stock kernels leave 0/0 there). A part's O is never
// read when its lse is -inf. For two parts this is the arithmetic the op has always used (bit-identical results).
template <bool first, bool last>
static __global__ void rkv_merge(float * O_acc, float * lse_acc, const float * __restrict__ O_p, const float * lse_p, // lse_p may be lse_acc
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
// host tail streaming: the slot ring, the copy stream and its events (one per backend context)
//

// one H2D chunk of a host tail: cells [c0, c0 + n) of every stream of the tail of ops[op], K then V
struct rkv_fifo_chunk {
    int     op;
    int64_t c0;
    int64_t n;
};

// a streaming op with a host tail, in graph order: its chunks are fifo[first, first + count). writes: the set_rows
// nodes of the same graph that put this step's new rows into its tail (K and V), applied again to the slots
// after a chunk was copied ahead of them
struct rkv_fifo_op {
    const ggml_tensor * node;
    int first;
    int count;
    std::vector<const ggml_tensor *> writes_k;
    std::vector<const ggml_tensor *> writes_v;
};

struct ggml_cuda_rkv_ring {
    int         n_slots    = 0;
    size_t      slot_bytes = 0;
    char      * base       = nullptr;
    cudaEvent_t copy_done[GGML_STREAMING_FA_MAX_SLOTS] = {};
    cudaEvent_t slot_free[GGML_STREAMING_FA_MAX_SLOTS] = {};
    cudaEvent_t ev_fork = nullptr;
    cudaEvent_t ev_join = nullptr;

    // the copy plan of the graph being evaluated (ggml_cuda_rkv_graph_begin): one FIFO of chunks over all its
    // streaming ops, so that the copy stream runs ahead across layers (the next layer's tail streams while this
    // layer computes), bounded by the ring
    std::vector<rkv_fifo_chunk> fifo;
    std::vector<rkv_fifo_op>    ops;
    int next_copy = 0;

    // chunks [0, n_pre) of the plan are copied before the graph is launched (ggml_cuda_rkv_graph_begin, outside any
    // capture), each signalling pre_done[i]: the link is busy while the host still launches the graph and layer 0
    // computes, time a copy forked inside the graph cannot use (the launch alone is ~0.1-0.35 ms, docs/perf)
    int         n_pre = 0;
    cudaEvent_t pre_done[GGML_STREAMING_FA_MAX_SLOTS] = {};
    cudaEvent_t ev_pre = nullptr;
};

static int rkv_env_int(const char * name, int def, int lo, int hi) {
    const char * v = getenv(name);
    if (!v || !*v) {
        return def;
    }
    return std::max(lo, std::min(hi, atoi(v)));
}

void ggml_cuda_rkv_free(ggml_backend_cuda_context & ctx) {
    ggml_cuda_rkv_prof_free(ctx);
    ggml_cuda_rkv_ring * r = ctx.rkv_ring;
    if (!r) {
        return;
    }
    ggml_cuda_set_device(ctx.device);
    if (ctx.streams[ctx.device][GGML_CUDA_MAX_STREAMS - 1]) {
        CUDA_CHECK(cudaStreamSynchronize(ctx.streams[ctx.device][GGML_CUDA_MAX_STREAMS - 1]));
    }
    for (int i = 0; i < GGML_STREAMING_FA_MAX_SLOTS; ++i) {
        if (r->copy_done[i]) CUDA_CHECK(cudaEventDestroy(r->copy_done[i]));
        if (r->slot_free[i]) CUDA_CHECK(cudaEventDestroy(r->slot_free[i]));
        if (r->pre_done[i])  CUDA_CHECK(cudaEventDestroy(r->pre_done[i]));
    }
    if (r->ev_pre) CUDA_CHECK(cudaEventDestroy(r->ev_pre));
    if (r->ev_fork) CUDA_CHECK(cudaEventDestroy(r->ev_fork));
    if (r->ev_join) CUDA_CHECK(cudaEventDestroy(r->ev_join));
    if (r->base) CUDA_CHECK(cudaFree(r->base));
    delete r;
    ctx.rkv_ring = nullptr;
}

// the ring, with slots of at least `need` bytes. Allocated before the first (eager) evaluation that needs it
// (ggml never captures a graph before it ran eagerly) and it never grows for a given model, so no allocation
// happens during a capture.
static ggml_cuda_rkv_ring & rkv_ring(ggml_backend_cuda_context & ctx, size_t need) {
    if (!ctx.rkv_ring) {
        ggml_cuda_rkv_ring * r = new ggml_cuda_rkv_ring;
        r->n_slots = ggml_streaming_flash_attn_ring_slots();
        for (int i = 0; i < r->n_slots; ++i) {
            CUDA_CHECK(cudaEventCreateWithFlags(&r->copy_done[i], cudaEventDisableTiming));
            CUDA_CHECK(cudaEventCreateWithFlags(&r->slot_free[i], cudaEventDisableTiming));
            CUDA_CHECK(cudaEventCreateWithFlags(&r->pre_done[i], cudaEventDisableTiming));
        }
        CUDA_CHECK(cudaEventCreateWithFlags(&r->ev_pre, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&r->ev_fork, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&r->ev_join, cudaEventDisableTiming));
        ctx.rkv_ring = r;
    }
    ggml_cuda_rkv_ring & r = *ctx.rkv_ring;
    const size_t want = std::max(need, ggml_streaming_flash_attn_ring_slot_bytes());
    if (r.slot_bytes < need) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &cs));
        GGML_ASSERT(cs == cudaStreamCaptureStatusNone && "rolling-KV: the tail slot ring must grow while a CUDA graph is captured");
        if (r.base) {
            CUDA_CHECK(cudaStreamSynchronize(ctx.stream(ctx.device, GGML_CUDA_MAX_STREAMS - 1)));
            CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
            CUDA_CHECK(cudaFree(r.base));
            r.base = nullptr;
        }
        CUDA_CHECK(cudaMalloc((void **) &r.base, want*r.n_slots));
        r.slot_bytes = want;
        GGML_LOG_INFO("%s: rolling KV: tail slot ring on %s: %d x %.1f MiB\n", __func__, ctx.name.c_str(), r.n_slots, want/1024.0/1024.0);
    }
    return r;
}

static bool rkv_is_host(const ggml_tensor * t) {
    const ggml_tensor * root = t->view_src ? t->view_src : t;
    return root->buffer && ggml_backend_buffer_is_host(root->buffer);
}

// cells [c0, c0 + n) of one stream of a tail view are one contiguous byte range (heads packed in the cell row)
static bool rkv_rows_contiguous(const ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type) && t->nb[2] == ggml_row_size(t->type, t->ne[0]) && t->nb[1] == t->ne[2]*t->nb[2];
}

// the cells per chunk: as many as fit a slot, a multiple of 256 (the vector kernel's KV stride)
static int64_t rkv_chunk_cells(const ggml_tensor * kt, const ggml_tensor * vt, size_t slot_bytes) {
    const size_t  cell  = (kt->nb[1] + vt->nb[1])*kt->ne[3];
    const int64_t fit   = (int64_t) ((slot_bytes - 512)/cell);
    int64_t n = std::max<int64_t>(FATTN_KQ_STRIDE, fit/FATTN_KQ_STRIDE*FATTN_KQ_STRIDE);
    // test lever: force small chunks (many chunks, slot reuse) on small tails
    const int forced = rkv_env_int("GGML_RKV_CHUNK_CELLS", 0, 0, 1 << 30);
    if (forced > 0) {
        n = GGML_PAD(forced, FATTN_KQ_STRIDE);
    }
    return std::min<int64_t>(n, kt->ne[1]);
}

// the chunks of a tail: as few as the slot allows, of balanced sizes (a multiple of 256 except the last)
static void rkv_make_chunks(const ggml_tensor * kt, const ggml_tensor * vt, size_t slot_bytes, int op, std::vector<rkv_fifo_chunk> & out) {
    const int64_t n_tail = kt->ne[1];
    const int64_t n_max  = rkv_chunk_cells(kt, vt, slot_bytes);
    const int64_t n_ch   = (n_tail + n_max - 1)/n_max;
    const int64_t n_c    = std::min<int64_t>(n_max, GGML_PAD((n_tail + n_ch - 1)/n_ch, FATTN_KQ_STRIDE));
    for (int64_t c0 = 0; c0 < n_tail; c0 += n_c) {
        out.push_back({ op, c0, std::min(n_c, n_tail - c0) });
    }
}

static size_t rkv_slot_need(const ggml_tensor * kt, const ggml_tensor * vt, int64_t n_c) {
    return ggml_streaming_flash_attn_slot_need(kt->nb[1], vt->nb[1], kt->ne[3], n_c);
}

// append a streaming op with a host tail and its chunks to a copy plan; returns the slot size the chunks need
// (the first chunk is the largest)
static size_t rkv_plan_tail(const ggml_tensor * node, size_t slot_bytes, std::vector<rkv_fifo_chunk> & fifo, std::vector<rkv_fifo_op> & ops) {
    const ggml_tensor * kt = node->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = node->src[GGML_STREAMING_FA_SRC_V_TAIL];
    rkv_fifo_op o;
    o.node  = node;
    o.first = (int) fifo.size();
    rkv_make_chunks(kt, vt, slot_bytes, (int) ops.size(), fifo);
    o.count = (int) fifo.size() - o.first;
    ops.push_back(std::move(o));
    return rkv_slot_need(kt, vt, fifo[ops.back().first].n);
}

// slot header: the tail view's layout, cells [0, n) of each stream packed per stream
static void rkv_slot_header(ggml_tensor & t, const ggml_tensor * src, int64_t n, void * data, ggml_backend_buffer_t buffer) {
    rkv_detached_header(t, src);
    t.ne[1]  = n;
    t.nb[3]  = n*t.nb[1];
    t.data   = data;
    t.buffer = buffer;
}

// Speed probes, for measuring where a token's time goes (docs/perf); the outputs are WRONG with either set:
// GGML_RKV_DEBUG_SKIP_COPY=1 issues no tail copies (the attention reads whatever the slots hold), and
// GGML_RKV_DEBUG_SKIP_TAIL_ATTN=1 copies the tail but runs no attention over its chunks. Events and merges stay.
static bool rkv_debug_skip(const char * name) {
    return rkv_env_int(name, 0, 0, 1) == 1;
}

// copy chunk i of a plan into its slot on the copy stream cs and record `done` (the slot's copy_done by default)
static void rkv_issue_copy(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_ring & r, cudaStream_t cs, const ggml_tensor * kt,
        const ggml_tensor * vt, const rkv_fifo_chunk & ch, int i, cudaEvent_t done = nullptr) {
    const int s = i % r.n_slots;
    if (i >= r.n_slots) {
        // the attention over chunk i - n_slots (already enqueued on the compute stream) must be done with this slot
        CUDA_CHECK(cudaStreamWaitEvent(cs, r.slot_free[s], 0));
    }
    char * slot = r.base + (size_t) s*r.slot_bytes;
    char * v_slot = slot + GGML_PAD(ch.n*kt->nb[1]*kt->ne[3], 256);
    const int64_t n3 = rkv_debug_skip("GGML_RKV_DEBUG_SKIP_COPY") ? 0 : kt->ne[3];
    ggml_cuda_rkv_prof_copy(ctx, cs, 0);
    for (int64_t i3 = 0; i3 < n3; ++i3) {
        CUDA_CHECK(cudaMemcpyAsync(slot + i3*ch.n*kt->nb[1], (const char *) kt->data + i3*kt->nb[3] + ch.c0*kt->nb[1],
            ch.n*kt->nb[1], cudaMemcpyHostToDevice, cs));
    }
    for (int64_t i3 = 0; i3 < n3; ++i3) {
        CUDA_CHECK(cudaMemcpyAsync(v_slot + i3*ch.n*vt->nb[1], (const char *) vt->data + i3*vt->nb[3] + ch.c0*vt->nb[1],
            ch.n*vt->nb[1], cudaMemcpyHostToDevice, cs));
    }
    ggml_cuda_rkv_prof_copy(ctx, cs, std::max<size_t>(1, (size_t) (n3*ch.n*(kt->nb[1] + vt->nb[1]))));
    CUDA_CHECK(cudaEventRecord(done ? done : r.copy_done[s], cs));
}

// Rows of a chunk that this graph wrote (set_rows, through unified addressing) after the chunk may have been
// copied ahead: copy them again from the host tail into the slot, byte for byte. Runs on the compute stream
// after the writes and after the chunk's copy, before the attention over the slot. One block per written row:
// the row's host address (the set_rows destination's row idx) is located in the tail view (stream, cell).
template <typename idx_t>
static __global__ void rkv_refresh_rows(char * __restrict__ slot, const char * __restrict__ tail, const char * __restrict__ dst_rows,
        const char * __restrict__ idxs, const int64_t idx_stride, const int64_t dst_row_stride, const int64_t ns,
        const int64_t c0, const int64_t n, const int64_t row_bytes, const int64_t stream_stride) {
    const int64_t r = (int64_t) *(const idx_t *) (idxs + blockIdx.x*idx_stride);
    const int64_t d = (dst_rows + r*dst_row_stride) - tail; // offset of the written row from the tail view's first cell
    if (d < 0) {
        return;
    }
    const int64_t strm = d/stream_stride;
    const int64_t rem  = d%stream_stride;
    const int64_t row  = rem/row_bytes - c0;
    if (strm >= ns || rem % row_bytes != 0 || row < 0 || row >= n) {
        return; // another chunk, the window's rows of the trash row, or beyond the cells in use
    }
    const char * src = tail + strm*stream_stride + (c0 + row)*row_bytes;
    char       * dst = slot + (strm*n + row)*row_bytes;
    if (row_bytes % 4 == 0) {
        for (int64_t b = threadIdx.x; b < row_bytes/4; b += blockDim.x) {
            ((int *) dst)[b] = ((const int *) src)[b];
        }
    } else {
        for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) {
            dst[b] = src[b];
        }
    }
}

static void rkv_refresh(cudaStream_t stream, char * slot, const ggml_tensor * t, const ggml_tensor * write, const rkv_fifo_chunk & ch) {
    const ggml_tensor * idxs = write->src[1]; // set_rows: src[0] the rows, src[1] their row indices in the destination
    const int64_t n_tok = ggml_nelements(idxs);
    if (n_tok == 0) {
        return;
    }
    GGML_ASSERT(n_tok <= INT_MAX && ggml_is_vector(idxs));
    GGML_ASSERT(write->nb[1] == t->nb[1] && "rolling-KV: a tail write must cover whole cell rows");
    const int64_t stride = idxs->nb[0];
    if (idxs->type == GGML_TYPE_I64) {
        rkv_refresh_rows<int64_t><<<(unsigned) n_tok, 128, 0, stream>>>(slot, (const char *) t->data, (const char *) write->data,
            (const char *) idxs->data, stride, write->nb[1], t->ne[3], ch.c0, ch.n, t->nb[1], t->nb[3]);
    } else {
        GGML_ASSERT(idxs->type == GGML_TYPE_I32);
        rkv_refresh_rows<int32_t><<<(unsigned) n_tok, 128, 0, stream>>>(slot, (const char *) t->data, (const char *) write->data,
            (const char *) idxs->data, stride, write->nb[1], t->ne[3], ch.c0, ch.n, t->nb[1], t->nb[3]);
    }
    CUDA_CHECK(cudaGetLastError());
}

static bool rkv_streams_tail(const ggml_tensor * op) {
    const ggml_tensor * kt = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = op->src[GGML_STREAMING_FA_SRC_V_TAIL];
    return kt && vt && kt->ne[1] > 0 && rkv_is_host(kt) && rkv_is_host(vt);
}

void ggml_cuda_rkv_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph) {
    ggml_cuda_rkv_ring * r = ctx.rkv_ring;
    if (r) {
        r->fifo.clear();
        r->ops.clear();
        r->next_copy = 0;
        r->n_pre     = 0;
    }
    if (rkv_env_int("GGML_RKV_RUNAHEAD", 1, 0, 1) == 0) {
        return; // every op streams its own tail only (copies overlap that op's attention, not other layers)
    }

    std::vector<rkv_fifo_op>    ops;
    std::vector<rkv_fifo_chunk> fifo;
    std::vector<std::pair<const ggml_tensor *, const ggml_tensor *>> writes; // (root written, set_rows node)
    const size_t slot_bytes = ggml_streaming_flash_attn_ring_slot_bytes();
    size_t need = 0;
    for (int i = 0; i < ggml_graph_n_nodes(const_cast<ggml_cgraph *>(cgraph)); ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(cgraph), i);
        if ((node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        if (node->op == GGML_OP_SET_ROWS && ggml_is_streamed(node)) {
            writes.push_back({ node->view_src ? node->view_src : node, node });
            continue;
        }
        if (node->op != GGML_OP_STREAMING_FLASH_ATTN || !rkv_streams_tail(node)) {
            continue;
        }
        need = std::max(need, rkv_plan_tail(node, slot_bytes, fifo, ops));
        const ggml_tensor * kt = node->src[GGML_STREAMING_FA_SRC_K_TAIL];
        const ggml_tensor * vt = node->src[GGML_STREAMING_FA_SRC_V_TAIL];
        const ggml_tensor * kroot = kt->view_src ? kt->view_src : kt;
        const ggml_tensor * vroot = vt->view_src ? vt->view_src : vt;
        for (const auto & w : writes) {
            if (w.first == kroot) ops.back().writes_k.push_back(w.second);
            if (w.first == vroot) ops.back().writes_v.push_back(w.second);
        }
    }
    if (ops.empty()) {
        return;
    }
    r = &rkv_ring(ctx, need); // outside any capture: this runs before the graph is captured or replayed
    r->fifo = std::move(fifo);
    r->ops  = std::move(ops);

    // Copy the first chunks now, before the graph is launched, after everything already on the compute stream (a
    // previous graph may still read the slots). Exact for the run-ahead's reason: rows this graph writes before an
    // op are copied again into its slots from the host tail before the attention (writes_k/writes_v, rkv_refresh).
    // GGML_RKV_PRELAUNCH=0: every copy is forked inside the graph.
    if (rkv_env_int("GGML_RKV_PRELAUNCH", 1, 0, 1) == 1) {
        r->n_pre = std::min<int>(r->n_slots, (int) r->fifo.size());
        cudaStream_t cs = ctx.stream(ctx.device, GGML_CUDA_MAX_STREAMS - 1);
        CUDA_CHECK(cudaEventRecord(r->ev_pre, ctx.stream()));
        CUDA_CHECK(cudaStreamWaitEvent(cs, r->ev_pre, 0));
        for (int i = 0; i < r->n_pre; ++i) {
            const ggml_tensor * node = r->ops[r->fifo[i].op].node;
            rkv_issue_copy(ctx, *r, cs, node->src[GGML_STREAMING_FA_SRC_K_TAIL], node->src[GGML_STREAMING_FA_SRC_V_TAIL],
                r->fifo[i], i, r->pre_done[i]);
        }
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
        const bool host_k = rkv_is_host(parts[i].k);
        const bool host_v = rkv_is_host(parts[i].v);
        if (host_k != host_v) {
            return false;
        }
        if (host_k) {
            // a host window is not streamed; a host tail is, in contiguous cell ranges
            if (i == 0 && op->src[GGML_STREAMING_FA_SRC_K_WIN] && parts[i].k == op->src[GGML_STREAMING_FA_SRC_K_WIN]) {
                return false;
            }
            if (!rkv_rows_contiguous(parts[i].k) || !rkv_rows_contiguous(parts[i].v) || parts[i].k->ne[3] != parts[i].v->ne[3]) {
                return false;
            }
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

    rkv_part seg[2];
    const int nseg = rkv_get_parts(dst, seg);

    if (nseg == 0) {
        // no KV cells at all: every row is fully masked
        CUDA_CHECK(cudaMemsetAsync(dst->data, 0, nbytes, stream));
        return;
    }

    // the parts: the window, then the tail, either whole (device) or as chunks streamed through the slot ring
    // (the same predicate as ggml_cuda_rkv_graph_begin's, so that an op streams exactly when the plan holds it)
    const bool host_tail = rkv_streams_tail(dst);

    std::vector<rkv_part>  parts;
    std::vector<ggml_tensor> slot_k, slot_v;
    ggml_cuda_rkv_ring * ring = nullptr;
    cudaStream_t cstream = nullptr;

    // the copy plan of a host tail: this op's entry in the graph's FIFO (copies run ahead across ops), or a FIFO of
    // its own (run-ahead off, or an op outside a planned graph)
    std::vector<rkv_fifo_chunk> local_fifo;
    std::vector<rkv_fifo_op>    local_ops;
    int local_next = 0;
    const std::vector<rkv_fifo_chunk> * fifo = nullptr;
    const std::vector<rkv_fifo_op>    * fops = nullptr;
    int * next_copy = nullptr;
    int   op_idx    = -1;

    for (int i = 0; i < nseg - (host_tail ? 1 : 0); ++i) {
        parts.push_back(seg[i]);
    }
    if (host_tail) {
        const rkv_part & t = seg[nseg - 1];
        if (ctx.rkv_ring) {
            const auto & ops = ctx.rkv_ring->ops;
            for (size_t j = 0; j < ops.size(); ++j) {
                if (ops[j].node == dst) {
                    op_idx = (int) j;
                    break;
                }
            }
        }
        if (op_idx >= 0) {
            ring      = ctx.rkv_ring;
            fifo      = &ring->fifo;
            fops      = &ring->ops;
            next_copy = &ring->next_copy;
        } else {
            // the ring's slots and events are shared: an op outside the graph's plan must not stream while it runs
            GGML_ASSERT((!ctx.rkv_ring || ctx.rkv_ring->ops.empty()) && "rolling-KV: a host-tail op outside the graph's copy plan");
            ring      = &rkv_ring(ctx, rkv_plan_tail(dst, ggml_streaming_flash_attn_ring_slot_bytes(), local_fifo, local_ops));
            fifo      = &local_fifo;
            fops      = &local_ops;
            next_copy = &local_next;
            op_idx    = 0;
        }
        cstream = ctx.stream(device, GGML_CUDA_MAX_STREAMS - 1);
        const rkv_fifo_op & o = (*fops)[op_idx];
        slot_k.resize(o.count);
        slot_v.resize(o.count);
        for (int c = 0; c < o.count; ++c) {
            const int g = o.first + c;
            const rkv_fifo_chunk & ch = (*fifo)[g];
            char * slot = ring->base + (size_t) (g % ring->n_slots)*ring->slot_bytes;
            rkv_slot_header(slot_k[c], t.k, ch.n, slot, dst->buffer);
            rkv_slot_header(slot_v[c], t.v, ch.n, slot + GGML_PAD(ch.n*t.k->nb[1]*t.k->ne[3], 256), dst->buffer);
            parts.push_back({ &slot_k[c], &slot_v[c], ch.n, t.col0 + ch.c0 });
        }
    }
    const int np      = (int) parts.size();
    const int p_chunk = np - (int) slot_k.size(); // parts [p_chunk, np) are streamed chunks

    // a single part with sinks: the stock kernels apply them, no LSE or merge needed
    const bool fused_sinks = np == 1 && sinks != nullptr;

    int64_t n_total = 0;
    for (int i = 0; i < np; ++i) {
        n_total += parts[i].n;
    }

    ggml_tensor mask_synth; // stands in for a missing mask of a padded part: [n_q, 1, 1] rows
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

    // per-part plan (headers only; nothing is launched yet)
    struct part_plan {
        bool        pad       = false;
        bool        has_mask  = false;
        bool        mask_view = true;
        bool        direct    = false;
        size_t      O_size    = 0;
        ggml_tensor k_pad, v_pad, mask_part, shadow;
    };
    std::vector<part_plan> pl(np);
    size_t O_max = 0;
    for (int i = 0; i < np; ++i) {
        part_plan & pp = pl[i];
        rkv_part p = parts[i];
        pp.has_mask = mask != nullptr;
        // vector-kernel cases of the concatenated op whose part is not 256-aligned: pad (see top of file)
        if (p.n % FATTN_KQ_STRIDE != 0 && n_total % FATTN_KQ_STRIDE == 0 && q->ne[1] <= 2 &&
                (ggml_is_quantized(p.k->type) || ggml_is_quantized(p.v->type))) {
            const int64_t n_pad = GGML_PAD(p.n, FATTN_KQ_STRIDE);
            rkv_padded_header(pp.k_pad, p.k, n_pad);
            rkv_padded_header(pp.v_pad, p.v, n_pad);
            const rkv_part padded = { &pp.k_pad, &pp.v_pad, n_pad, p.col0 };
            ggml_tensor m;
            rkv_mask_header(m, mask ? mask : &mask_synth, padded, false, n_pad);
            ggml_tensor s;
            rkv_shadow(s, dst, padded, &m, nullptr, dst->data, nullptr);
            // VEC with an in-type kernel is the only choice that needs no f16 scratch for quantized K/V
            pp.pad = ggml_cuda_flash_attn_ext_get_alloc_size(device, &s) <= nbytes;
        }
        if (pp.pad) {
            pp.has_mask  = true;
            pp.mask_view = false;
            rkv_mask_header(pp.mask_part, mask ? mask : &mask_synth, p, false, GGML_PAD(p.n, FATTN_KQ_STRIDE));
            p.k = &pp.k_pad;
            p.v = &pp.v_pad;
        } else if (mask) {
            pp.mask_view = rkv_mask_view_ok(q, mask, p);
            rkv_mask_header(pp.mask_part, mask, p, pp.mask_view, p.n);
        }
        // output straight into dst if the kernel needs no f16 K/V scratch behind it (first part only)
        rkv_shadow(pp.shadow, dst, p, pp.has_mask ? &pp.mask_part : nullptr, fused_sinks ? sinks : nullptr, dst->data, nullptr);
        pp.direct = i == 0 && ggml_cuda_flash_attn_ext_get_alloc_size(device, &pp.shadow) <= nbytes;
        if (!pp.direct) {
            pp.shadow.data = nullptr;
            pp.O_size = ggml_cuda_flash_attn_ext_get_alloc_size(device, &pp.shadow) + 128; // + alignment of the scratch
            O_max = std::max(O_max, pp.O_size);
        }
    }

    // buffers shared by all parts (pool, stream-ordered on the compute stream), allocated before the per-part ones
    ggml_cuda_pool_alloc<float> lse_acc(pool);
    ggml_cuda_pool_alloc<float> lse_tmp(pool);
    ggml_cuda_pool_alloc<float> O_tmp(pool);
    if (!fused_sinks) {
        lse_acc.alloc(nrows);
        if (np > 1) {
            lse_tmp.alloc(nrows);
        }
    }
    if (O_max) {
        O_tmp.alloc((O_max + sizeof(float) - 1)/sizeof(float));
    }

    // host tail: the first streaming op of the plan forks the copy stream (everything before it on the compute
    // stream, this layer's new rows included, is ordered before the copies) and fills the ring
    auto issue = [&](int i) {
        const rkv_fifo_chunk & ch = (*fifo)[i];
        const ggml_tensor * node = (*fops)[ch.op].node;
        rkv_issue_copy(ctx, *ring, cstream, node->src[GGML_STREAMING_FA_SRC_K_TAIL], node->src[GGML_STREAMING_FA_SRC_V_TAIL], ch, i);
    };
    // chunks [0, n_pre) of the graph's plan were copied before the launch (ggml_cuda_rkv_graph_begin): their events
    // were recorded outside any capture, so a capture takes the waits as external event nodes
    const int n_pre = ring && fifo == &ring->fifo ? ring->n_pre : 0;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (n_pre > 0) {
        CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    }
    if (ring && op_idx == 0) {
        CUDA_CHECK(cudaEventRecord(ring->ev_fork, stream));
        CUDA_CHECK(cudaStreamWaitEvent(cstream, ring->ev_fork, 0));
        *next_copy = n_pre;
        while (*next_copy < (int) fifo->size() && *next_copy < ring->n_slots) {
            issue((*next_copy)++);
        }
    }

    const float * sinks_d = sinks ? (const float *) sinks->data : nullptr;
    const int nth = (int) std::min<int64_t>(DV, 256);
    const bool skip_tail_attn = ring && rkv_debug_skip("GGML_RKV_DEBUG_SKIP_TAIL_ATTN");
    GGML_ASSERT(nrows <= INT_MAX);

    for (int i = 0; i < np; ++i) {
        part_plan & pp = pl[i];
        const rkv_part & p = parts[i]; // the unpadded part (source of a padded copy)
        const int ic = i - p_chunk;     // chunk index, or < 0

        if (ic >= 0) {
            const rkv_fifo_op & o = (*fops)[op_idx];
            const int g = o.first + ic;
            GGML_ASSERT(g < *next_copy && "rolling-KV: a chunk is attended before its copy was issued");
            if (g < n_pre) {
                CUDA_CHECK(cudaStreamWaitEvent(stream, ring->pre_done[g],
                    capture == cudaStreamCaptureStatusActive ? cudaEventWaitExternal : cudaEventWaitDefault));
            } else {
                CUDA_CHECK(cudaStreamWaitEvent(stream, ring->copy_done[g % ring->n_slots], 0));
            }
            ggml_cuda_rkv_prof_mark(ctx, "rkv wait for chunk copy");
            // rows written by this graph after the chunk may have been copied: take them again from the host tail
            for (const ggml_tensor * w : o.writes_k) {
                rkv_refresh(stream, (char *) slot_k[ic].data, seg[nseg - 1].k, w, (*fifo)[g]);
            }
            for (const ggml_tensor * w : o.writes_v) {
                rkv_refresh(stream, (char *) slot_v[ic].data, seg[nseg - 1].v, w, (*fifo)[g]);
            }
            ggml_cuda_rkv_prof_mark(ctx, "rkv refresh written rows");
        }

        ggml_cuda_pool_alloc<half> mask_buf(pool);
        ggml_cuda_pool_alloc<char> k_pad_buf(pool);
        ggml_cuda_pool_alloc<char> v_pad_buf(pool);

        if (pp.has_mask && !pp.mask_view) {
            pp.mask_part.data = mask_buf.alloc(pp.mask_part.nb[3]*pp.mask_part.ne[3]/sizeof(half));
            const int64_t n_pad = pp.mask_part.nb[1]/sizeof(half);
            const int64_t mrows = pp.mask_part.ne[1]*pp.mask_part.ne[2]*pp.mask_part.ne[3];
            const int     mth   = 256;
            const dim3    grid((unsigned) std::min<int64_t>((n_pad + mth - 1)/mth, 1024), (unsigned) std::min<int64_t>(mrows, 65535), 1);
            rkv_mask_slice<<<grid, mth, 0, stream>>>(mask ? (const half *) mask->data : nullptr, (half *) pp.mask_part.data,
                mask ? mask->nb[1]/sizeof(half) : 0, p.col0, (int) p.n, (int) n_pad, mrows);
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

        float * lse = fused_sinks ? nullptr : (i == 0 ? lse_acc.ptr : lse_tmp.ptr);
        memcpy((int32_t *) pp.shadow.op_params + GGML_CUDA_FATTN_OP_PARAM_LSE, &lse, sizeof(lse));
        if (!pp.direct) {
            pp.shadow.data = O_tmp.ptr;
        }
        ggml_cuda_rkv_prof_mark(ctx, "rkv mask/pad");
        if (!(ic >= 0 && skip_tail_attn)) {
            ggml_cuda_flash_attn_ext(ctx, &pp.shadow);
        }
        ggml_cuda_rkv_prof_mark(ctx, ic >= 0 ? "rkv FA chunk" : i == 0 ? "rkv FA window" : "rkv FA device tail");

        if (ic >= 0) {
            // the slot may be refilled as soon as the attention over it is done: queue the copies that this frees,
            // which may belong to the next ops (the copy stream runs ahead across layers)
            const int g = (*fops)[op_idx].first + ic;
            CUDA_CHECK(cudaEventRecord(ring->slot_free[g % ring->n_slots], stream));
            while (*next_copy < (int) fifo->size() && *next_copy <= g + ring->n_slots) {
                issue((*next_copy)++);
            }
        }

        if (fused_sinks) {
            if (!pp.direct) {
                CUDA_CHECK(cudaMemcpyAsync(dst->data, pp.shadow.data, nbytes, cudaMemcpyDeviceToDevice, stream));
            }
            continue;
        }

        float * O_acc = (float *) dst->data;
        const bool last = i == np - 1;
        if (i == 0) {
            // the first part is the accumulator: in place when direct, else moved into dst (and finalized if alone)
            if (!pp.direct || last) {
                if (last) {
                    if (pp.direct) {
                        rkv_merge<false, true><<<(unsigned) nrows, nth, 0, stream>>>(O_acc, lse_acc.ptr, nullptr, nullptr, sinks_d, (int) DV, n_head);
                    } else {
                        rkv_merge<true, true><<<(unsigned) nrows, nth, 0, stream>>>(O_acc, lse_acc.ptr, O_tmp.ptr, lse_acc.ptr, sinks_d, (int) DV, n_head);
                    }
                } else {
                    rkv_merge<true, false><<<(unsigned) nrows, nth, 0, stream>>>(O_acc, lse_acc.ptr, O_tmp.ptr, lse_acc.ptr, sinks_d, (int) DV, n_head);
                }
                CUDA_CHECK(cudaGetLastError());
                ggml_cuda_rkv_prof_mark(ctx, "rkv merge");
            }
            continue;
        }
        if (last) {
            rkv_merge<false, true><<<(unsigned) nrows, nth, 0, stream>>>(O_acc, lse_acc.ptr, O_tmp.ptr, lse_tmp.ptr, sinks_d, (int) DV, n_head);
        } else {
            rkv_merge<false, false><<<(unsigned) nrows, nth, 0, stream>>>(O_acc, lse_acc.ptr, O_tmp.ptr, lse_tmp.ptr, sinks_d, (int) DV, n_head);
        }
        CUDA_CHECK(cudaGetLastError());
        ggml_cuda_rkv_prof_mark(ctx, "rkv merge");
    }

    if (ring && op_idx == (int) fops->size() - 1) {
        // the last streaming op joins the copy stream back (required to end a CUDA graph capture)
        GGML_ASSERT(*next_copy == (int) fifo->size());
        CUDA_CHECK(cudaEventRecord(ring->ev_join, cstream));
        CUDA_CHECK(cudaStreamWaitEvent(stream, ring->ev_join, 0));
    }
}
