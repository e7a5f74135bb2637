// rolling-KV: streaming a pinned-host tail through the device (see rolling-kv-stream.cuh)

#include "rolling-kv-stream.cuh"
#include "rolling-kv-hybrid.cuh"

#include "ggml-rolling-kv.h"

#include <atomic>
#include <climits>
#include <cstring>

static_assert(GGML_CUDA_RKV_CHUNK_ALIGN == 256,
              "chunks are multiples of the vector kernel's KV stride (FATTN_KQ_STRIDE)");

// the knobs, read once (ggml-rolling-kv-impl.h)
static const ggml_rkv_knobs & rkv_knobs() {
    static const ggml_rkv_knobs * knobs = ggml_rkv_get_knobs();
    return *knobs;
}

// The capture queries (cudaStreamIsCapturing, cudaEventWaitExternal) exist only with CUDA graphs, and vendors/hip.h and
// vendors/musa.h do not (all) map them. A captured graph waits for the copies issued before its launch as external
// events, so where graphs exist without the queries (HIP, MUSA) nothing is copied before the launch: every copy is
// forked inside the graph (exact either way).
#if defined(USE_CUDA_GRAPH) && !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
#define RKV_CAPTURE_QUERY 1
#else
#define RKV_CAPTURE_QUERY 0
#endif
#if defined(USE_CUDA_GRAPH) && !RKV_CAPTURE_QUERY
#define RKV_PRELAUNCH 0
#else
#define RKV_PRELAUNCH 1
#endif

struct ggml_cuda_rkv_ring {
    int         n_slots    = 0;
    size_t      slot_bytes = 0;
    char      * base       = nullptr;
    cudaEvent_t copy_done[GGML_RKV_MAX_SLOTS] = {};
    cudaEvent_t slot_free[GGML_RKV_MAX_SLOTS] = {};
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
    cudaEvent_t pre_done[GGML_RKV_MAX_SLOTS] = {};
    cudaEvent_t ev_pre = nullptr;

    ggml_cuda_rkv_hybrid * hybrid = nullptr; // the CPU parts (rolling-kv-hybrid.cu)
};

static cudaStream_t rkv_copy_stream(ggml_backend_cuda_context & ctx) {
    return ctx.stream(ctx.device, GGML_CUDA_RKV_COPY_STREAM);
}

void ggml_cuda_rkv_free(ggml_backend_cuda_context & ctx) {
    ggml_cuda_rkv_ring * r = ctx.rkv_ring;
    if (!r) {
        return;
    }
    ggml_cuda_set_device(ctx.device);
    // the compute stream too: a CPU part's wait kernel there needs the hybrid's agent until it is done
    for (const int s : { 0, GGML_CUDA_RKV_COPY_STREAM, GGML_CUDA_RKV_CPU_STREAM }) {
        if (ctx.streams[ctx.device][s]) {
            CUDA_CHECK(cudaStreamSynchronize(ctx.streams[ctx.device][s]));
        }
    }
    ggml_cuda_rkv_hybrid_free(r->hybrid);
    for (int i = 0; i < GGML_RKV_MAX_SLOTS; ++i) {
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
        r->n_slots = rkv_knobs().ring_slots;
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
    const size_t want = std::max(need, rkv_knobs().ring_slot_bytes);
    if (r.slot_bytes < need) {
#if RKV_CAPTURE_QUERY
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &cs));
        GGML_ASSERT(cs == cudaStreamCaptureStatusNone &&
                    "rolling-KV: the tail slot ring must grow while a CUDA graph is captured");
#endif // RKV_CAPTURE_QUERY
        if (r.base) {
            CUDA_CHECK(cudaStreamSynchronize(rkv_copy_stream(ctx)));
            CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
            CUDA_CHECK(cudaFree(r.base));
            r.base = nullptr;
        }
        CUDA_CHECK(cudaMalloc((void **) &r.base, want*r.n_slots));
        r.slot_bytes = want;
        GGML_LOG_INFO("%s: rolling KV: tail slot ring on %s: %d x %.1f MiB\n", __func__, ctx.name.c_str(), r.n_slots,
                      want/1024.0/1024.0);
    }
    return r;
}

ggml_cuda_rkv_hybrid *& ggml_cuda_rkv_hybrid_of(ggml_backend_cuda_context & ctx) {
    return rkv_ring(ctx, 0).hybrid; // need 0: no slots are allocated for it
}

void ggml_cuda_rkv_dev_budget(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail, int64_t n_stream,
                              ggml_rkv_dev_budget * out) {
    GGML_UNUSED(dev);
    ggml_cuda_rkv_dev_budget_of(row_k_tail, row_v_tail, n_stream, out);
}

// the bytes the copy plans put on the link (GGML_RKV_STREAMED_BYTES_PROC)
static std::atomic<uint64_t> g_rkv_plan_bytes_total{0};
static std::atomic<uint64_t> g_rkv_plan_bytes_last{0};
static std::atomic<uint64_t> g_rkv_plans{0};

static uint64_t rkv_chunk_bytes(const ggml_tensor * kt, const ggml_tensor * vt, const rkv_fifo_chunk & ch) {
    return (uint64_t) ch.n*(kt->nb[1] + vt->nb[1])*(uint64_t) kt->ne[3]; // as rkv_copy_cells copies them
}

// a plan about to be issued: count its bytes
static void rkv_count_plan(const std::vector<rkv_fifo_op> & ops, const std::vector<rkv_fifo_chunk> & fifo) {
    uint64_t bytes = 0;
    for (const rkv_fifo_chunk & ch : fifo) {
        const ggml_tensor * node = ops[ch.op].node;
        bytes += rkv_chunk_bytes(node->src[GGML_STREAMING_FA_SRC_K_TAIL], node->src[GGML_STREAMING_FA_SRC_V_TAIL], ch);
    }
    if (bytes > 0) {
        g_rkv_plan_bytes_total += bytes;
        g_rkv_plan_bytes_last   = bytes;
        g_rkv_plans            += 1;
    }
}

static void rkv_streamed_bytes(uint64_t * total, uint64_t * last, uint64_t * plans) {
    *total = g_rkv_plan_bytes_total.load();
    *last  = g_rkv_plan_bytes_last.load();
    *plans = g_rkv_plans.load();
}

void * ggml_cuda_rkv_get_proc_address(const char * name) {
    if (strcmp(name, GGML_RKV_DEV_BUDGET_PROC) == 0) {
        return (void *) ggml_cuda_rkv_dev_budget;
    }
    if (strcmp(name, GGML_RKV_HOST_ALLOC_PROC) == 0) {
        return (void *) ggml_cuda_rkv_host_buffer_alloc;
    }
    if (strcmp(name, GGML_RKV_CPU_PART_LATENCY_PROC) == 0) {
        return (void *) ggml_cuda_rkv_cpu_part_latency;
    }
    if (strcmp(name, GGML_RKV_STREAMED_BYTES_PROC) == 0) {
        static const ggml_backend_rkv_streamed_bytes_t fn = rkv_streamed_bytes;
        return (void *) fn;
    }
    return nullptr;
}

bool ggml_cuda_rkv_is_host(const ggml_tensor * t) {
    const ggml_tensor * root = t->view_src ? t->view_src : t;
    return root->buffer && ggml_backend_buffer_is_host(root->buffer);
}

bool ggml_cuda_rkv_rows_contiguous(const ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type) && t->nb[2] == ggml_row_size(t->type, t->ne[0]) &&
           t->nb[1] == t->ne[2]*t->nb[2];
}

bool ggml_cuda_rkv_streams_tail(const ggml_tensor * op) {
    const ggml_tensor * kt = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = op->src[GGML_STREAMING_FA_SRC_V_TAIL];
    return kt && vt && kt->ne[1] > 0 && ggml_cuda_rkv_is_host(kt) && ggml_cuda_rkv_is_host(vt) &&
           ggml_cuda_rkv_tail_stream_cells(op) > 0;
}

void ggml_cuda_rkv_detached_header(ggml_tensor & t, const ggml_tensor * src) {
    t = *src;
    t.op        = GGML_OP_NONE;
    t.view_src  = nullptr;
    t.view_offs = 0;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        t.src[i] = nullptr;
    }
}

//
// the copy plan
//

// the cells per chunk: as many as fit a slot, a multiple of 256 (the vector kernel's KV stride)
static int64_t rkv_chunk_cells(const ggml_tensor * kt, const ggml_tensor * vt, int64_t n_stream, size_t slot_bytes) {
    const size_t  cell  = (kt->nb[1] + vt->nb[1])*kt->ne[3];
    const int64_t fit   = (int64_t) ((slot_bytes - 512)/cell);
    const int64_t n = std::max<int64_t>(GGML_CUDA_RKV_CHUNK_ALIGN,
                                        fit/GGML_CUDA_RKV_CHUNK_ALIGN*GGML_CUDA_RKV_CHUNK_ALIGN);
    return std::min<int64_t>(n, n_stream);
}

// the chunks of a run of a tail's streamed cells [first, first + n): as few as the slot allows, of balanced sizes (a
// multiple of 256 except the last)
static void rkv_make_chunks(const ggml_tensor * kt, const ggml_tensor * vt, int64_t first, int64_t n_run,
                            size_t slot_bytes, int op, std::vector<rkv_fifo_chunk> & out) {
    const int64_t n_max  = rkv_chunk_cells(kt, vt, n_run, slot_bytes);
    const int64_t n_ch   = (n_run + n_max - 1)/n_max;
    const int64_t n_c    = std::min<int64_t>(n_max, GGML_PAD((n_run + n_ch - 1)/n_ch, GGML_CUDA_RKV_CHUNK_ALIGN));
    for (int64_t c0 = 0; c0 < n_run; c0 += n_c) {
        out.push_back({ op, first + c0, std::min(n_c, n_run - c0) });
    }
}

// append a streaming op with a host tail and its chunks to a copy plan; returns the slot size the chunks need
// (the first chunk is the largest)
static size_t rkv_plan_tail(const ggml_tensor * node, size_t slot_bytes, std::vector<rkv_fifo_chunk> & fifo,
                            std::vector<rkv_fifo_op> & ops) {
    const ggml_tensor * kt = node->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const ggml_tensor * vt = node->src[GGML_STREAMING_FA_SRC_V_TAIL];
    rkv_fifo_op o;
    o.node  = node;
    o.first = (int) fifo.size();
    // only the runs of cells the op reads: a unified cache's cells of sequences outside the batch never cross the link
    int64_t first[GGML_RKV_MAX_TAIL_RUNS], n[GGML_RKV_MAX_TAIL_RUNS];
    const int n_runs = ggml_cuda_rkv_tail_stream_runs(node, first, n);
    for (int r = 0; r < n_runs; ++r) {
        rkv_make_chunks(kt, vt, first[r], n[r], slot_bytes, (int) ops.size(), fifo);
    }
    o.count = (int) fifo.size() - o.first;
    GGML_ASSERT(o.count > 0 && "rolling-KV: a planned host tail with no cells to stream");
    size_t need = 0;
    for (int c = o.first; c < (int) fifo.size(); ++c) {
        need = std::max(need, ggml_cuda_rkv_slot_need(kt->nb[1], vt->nb[1], kt->ne[3], fifo[c].n));
    }
    ops.push_back(std::move(o));
    return need;
}

// slot header: the tail view's layout, cells [0, n) of each stream packed per stream
static void rkv_slot_header(ggml_tensor & t, const ggml_tensor * src, int64_t n, void * data,
                            ggml_backend_buffer_t buffer) {
    ggml_cuda_rkv_detached_header(t, src);
    t.ne[1]  = n;
    t.nb[3]  = n*t.nb[1];
    t.data   = data;
    t.buffer = buffer;
}

// the V rows of a chunk follow its K rows in the slot, 256-byte aligned
static size_t rkv_slot_v_offset(const ggml_tensor * kt, int64_t n) {
    return GGML_PAD(n*kt->nb[1]*kt->ne[3], 256);
}

// the first n cells of chunk ch of every stream (of n3) into its slot: K rows into slot, V rows into v_slot
static void rkv_copy_cells(cudaStream_t cs, char * slot, char * v_slot, const ggml_tensor * kt, const ggml_tensor * vt,
        const rkv_fifo_chunk & ch, int64_t n3, int64_t n) {
    for (int64_t i3 = 0; i3 < n3; ++i3) {
        CUDA_CHECK(cudaMemcpyAsync(slot + i3*ch.n*kt->nb[1], (const char *) kt->data + i3*kt->nb[3] + ch.c0*kt->nb[1],
            n*kt->nb[1], cudaMemcpyHostToDevice, cs));
    }
    for (int64_t i3 = 0; i3 < n3; ++i3) {
        CUDA_CHECK(cudaMemcpyAsync(v_slot + i3*ch.n*vt->nb[1], (const char *) vt->data + i3*vt->nb[3] + ch.c0*vt->nb[1],
            n*vt->nb[1], cudaMemcpyHostToDevice, cs));
    }
}

// ROLLINGKV_SIMULATE_LINK_SLOWDOWN=x: the chunk's copies again, (x - 1) times their bytes (the same rows into the same
// slot, so the outputs do not change), before its slot is marked ready: a link x times slower for the copies, the
// CPU part reading host memory at its own speed, as on a host with a slower PCIe link
static void rkv_simulate_slow_link(cudaStream_t cs, char * slot, char * v_slot, const ggml_tensor * kt,
        const ggml_tensor * vt, const rkv_fifo_chunk & ch, int64_t n3) {
    for (double left = rkv_knobs().link_slowdown - 1.0; left > 0.0; left -= 1.0) {
        const int64_t n = std::min<int64_t>(ch.n, (int64_t) (std::min(1.0, left)*ch.n + 0.5));
        if (n > 0) {
            rkv_copy_cells(cs, slot, v_slot, kt, vt, ch, n3, n);
        }
    }
}

// copy chunk i of a plan into its slot on the copy stream cs and record `done` (the slot's copy_done by default)
static void rkv_issue_copy(ggml_cuda_rkv_ring & r, cudaStream_t cs, const ggml_tensor * kt,
        const ggml_tensor * vt, const rkv_fifo_chunk & ch, int i, cudaEvent_t done = nullptr) {
    const int s = i % r.n_slots;
    if (i >= r.n_slots) {
        // the attention over chunk i - n_slots (already enqueued on the compute stream) must be done with this slot
        CUDA_CHECK(cudaStreamWaitEvent(cs, r.slot_free[s], 0));
    }
    char * slot   = r.base + (size_t) s*r.slot_bytes;
    char * v_slot = slot + rkv_slot_v_offset(kt, ch.n);
    const int64_t n3 = kt->ne[3];
    rkv_copy_cells(cs, slot, v_slot, kt, vt, ch, n3, ch.n);
    rkv_simulate_slow_link(cs, slot, v_slot, kt, vt, ch, n3);
    CUDA_CHECK(cudaEventRecord(done ? done : r.copy_done[s], cs));
}

static void rkv_issue_chunk(ggml_cuda_rkv_tail_stream & ts, int i) {
    const rkv_fifo_chunk & ch = (*ts.fifo)[i];
    const ggml_tensor * node = (*ts.ops)[ch.op].node;
    rkv_issue_copy(*ts.ring, ts.cstream, node->src[GGML_STREAMING_FA_SRC_K_TAIL],
                   node->src[GGML_STREAMING_FA_SRC_V_TAIL], ch, i);
}

//
// rows written after their chunk was copied ahead
//

// Rows of a chunk that this graph wrote (set_rows, through unified addressing) after the chunk may have been
// copied ahead: copy them again from the host tail into the slot, byte for byte. Runs on the compute stream
// after the writes and after the chunk's copy, before the attention over the slot. One block per written row:
// the row's host address (the set_rows destination's row idx) is located in the tail view (stream, cell).
template <typename idx_t>
static __global__ void rkv_refresh_rows(char * __restrict__ slot, const char * __restrict__ tail,
        const char * __restrict__ dst_rows, const char * __restrict__ idxs, const int64_t idx_stride,
        const int64_t dst_row_stride, const int64_t ns, const int64_t c0, const int64_t n, const int64_t row_bytes,
        const int64_t stream_stride) {
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

static void rkv_refresh(cudaStream_t stream, char * slot, const ggml_tensor * t, const ggml_tensor * write,
                        const rkv_fifo_chunk & ch) {
    const ggml_tensor * idxs = write->src[1]; // set_rows: src[0] the rows, src[1] their row indices in the destination
    const int64_t n_tok = ggml_nelements(idxs);
    if (n_tok == 0) {
        return;
    }
    GGML_ASSERT(n_tok <= INT_MAX && ggml_is_vector(idxs));
    GGML_ASSERT(write->nb[1] == t->nb[1] && "rolling-KV: a tail write must cover whole cell rows");
    const int64_t stride = idxs->nb[0];
    if (idxs->type == GGML_TYPE_I64) {
        rkv_refresh_rows<int64_t><<<(unsigned) n_tok, 128, 0, stream>>>(slot, (const char *) t->data,
            (const char *) write->data, (const char *) idxs->data, stride, write->nb[1], t->ne[3], ch.c0, ch.n,
            t->nb[1], t->nb[3]);
    } else {
        GGML_ASSERT(idxs->type == GGML_TYPE_I32);
        rkv_refresh_rows<int32_t><<<(unsigned) n_tok, 128, 0, stream>>>(slot, (const char *) t->data,
            (const char *) write->data, (const char *) idxs->data, stride, write->nb[1], t->ne[3], ch.c0, ch.n,
            t->nb[1], t->nb[3]);
    }
    CUDA_CHECK(cudaGetLastError());
}

//
// the graph's plan
//

void ggml_cuda_rkv_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph) {
    ggml_cuda_rkv_ring * r = ctx.rkv_ring;
    if (r) {
        r->fifo.clear();
        r->ops.clear();
        r->next_copy = 0;
        r->n_pre     = 0;
    }

    std::vector<rkv_fifo_op>    ops;
    std::vector<rkv_fifo_chunk> fifo;
    std::vector<std::pair<const ggml_tensor *, const ggml_tensor *>> writes; // (root written, set_rows node)
    const size_t slot_bytes = rkv_knobs().ring_slot_bytes;
    size_t need = 0;
    std::vector<const ggml_tensor *> cpu_ops; // ops with a CPU part (nullptr: a tail write between two), in order
    for (int i = 0; i < ggml_graph_n_nodes(const_cast<ggml_cgraph *>(cgraph)); ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(cgraph), i);
        if ((node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        if (node->op == GGML_OP_STREAMING_FLASH_ATTN && ggml_cuda_rkv_tail_cpu_cells(node) > 0) {
            cpu_ops.push_back(node);
        }
        if (node->op == GGML_OP_SET_ROWS && ggml_is_streamed(node)) {
            writes.push_back({ node->view_src ? node->view_src : node, node });
            if (!cpu_ops.empty() && cpu_ops.back()) {
                cpu_ops.push_back(nullptr); // a part handed over ahead must not miss these rows
            }
            continue;
        }
        if (node->op != GGML_OP_STREAMING_FLASH_ATTN || !ggml_cuda_rkv_streams_tail(node)) {
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
    // once per graph, after the scan (it also resets the staging index of a graph with no CPU part)
    if (r || !cpu_ops.empty()) {
        ggml_cuda_rkv_hybrid_graph_begin(ggml_cuda_rkv_hybrid_of(ctx), cpu_ops);
    }
    if (ops.empty()) {
        return;
    }
    r = &rkv_ring(ctx, need); // outside any capture: this runs before the graph is captured or replayed
    rkv_count_plan(ops, fifo);
    r->fifo = std::move(fifo);
    r->ops  = std::move(ops);

    // Copy the first chunks now, before the graph is launched, after everything already on the compute stream (a
    // previous graph may still read the slots). Exact for the run-ahead's reason: rows this graph writes before an
    // op are copied again into its slots from the host tail before the attention (writes_k/writes_v, rkv_refresh).
    if (RKV_PRELAUNCH) {
        r->n_pre = std::min<int>(r->n_slots, (int) r->fifo.size());
        cudaStream_t cs = rkv_copy_stream(ctx);
        CUDA_CHECK(cudaEventRecord(r->ev_pre, ctx.stream()));
        CUDA_CHECK(cudaStreamWaitEvent(cs, r->ev_pre, 0));
        for (int i = 0; i < r->n_pre; ++i) {
            const ggml_tensor * node = r->ops[r->fifo[i].op].node;
            rkv_issue_copy(*r, cs, node->src[GGML_STREAMING_FA_SRC_K_TAIL], node->src[GGML_STREAMING_FA_SRC_V_TAIL],
                r->fifo[i], i, r->pre_done[i]);
        }
    }
}

//
// one op's tail
//

void ggml_cuda_rkv_tail_begin(ggml_backend_cuda_context & ctx, const ggml_tensor * dst,
                              ggml_cuda_rkv_tail_stream & ts) {
    ts.k    = dst->src[GGML_STREAMING_FA_SRC_K_TAIL];
    ts.v    = dst->src[GGML_STREAMING_FA_SRC_V_TAIL];
    ts.col0 = ggml_streaming_flash_attn_get_n_win(dst);

    // this op's entry in the graph's FIFO (copies run ahead across ops), or a FIFO of its own (run-ahead off, or an
    // op outside a planned graph)
    if (ctx.rkv_ring) {
        const auto & ops = ctx.rkv_ring->ops;
        for (size_t j = 0; j < ops.size(); ++j) {
            if (ops[j].node == dst) {
                ts.op_idx = (int) j;
                break;
            }
        }
    }
    if (ts.op_idx >= 0) {
        ts.ring      = ctx.rkv_ring;
        ts.fifo      = &ts.ring->fifo;
        ts.ops       = &ts.ring->ops;
        ts.next_copy = &ts.ring->next_copy;
        ts.n_pre     = ts.ring->n_pre;
    } else {
        // the ring's slots and events are shared: an op outside the graph's plan must not stream while it runs
        GGML_ASSERT((!ctx.rkv_ring || ctx.rkv_ring->ops.empty()) &&
                    "rolling-KV: a host-tail op outside the graph's copy plan");
        ts.ring      = &rkv_ring(ctx, rkv_plan_tail(dst, rkv_knobs().ring_slot_bytes, ts.local_fifo, ts.local_ops));
        rkv_count_plan(ts.local_ops, ts.local_fifo);
        ts.fifo      = &ts.local_fifo;
        ts.ops       = &ts.local_ops;
        ts.next_copy = &ts.local_next;
        ts.op_idx    = 0;
        ts.n_pre     = 0;
    }
    ts.cstream = rkv_copy_stream(ctx);

    const rkv_fifo_op & o = (*ts.ops)[ts.op_idx];
    ts.slot_k.resize(o.count);
    ts.slot_v.resize(o.count);
    ts.chunk_col0.resize(o.count);
    for (int c = 0; c < o.count; ++c) {
        const int g = o.first + c;
        const rkv_fifo_chunk & ch = (*ts.fifo)[g];
        char * slot = ts.ring->base + (size_t) (g % ts.ring->n_slots)*ts.ring->slot_bytes;
        rkv_slot_header(ts.slot_k[c], ts.k, ch.n, slot, dst->buffer);
        rkv_slot_header(ts.slot_v[c], ts.v, ch.n, slot + rkv_slot_v_offset(ts.k, ch.n), dst->buffer);
        ts.chunk_col0[c] = ts.col0 + ch.c0;
    }
}

void ggml_cuda_rkv_tail_start(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts) {
    // chunks [0, n_pre) of the graph's plan were copied before the launch (ggml_cuda_rkv_graph_begin): their events
    // were recorded outside any capture, so a capture takes the waits as external event nodes
#if RKV_CAPTURE_QUERY
    if (ts.n_pre > 0) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &capture));
        ts.capturing = capture == cudaStreamCaptureStatusActive;
    }
#endif // RKV_CAPTURE_QUERY
    // the first streaming op of the plan forks the copy stream (everything before it on the compute stream, this
    // layer's new rows included, is ordered before the copies) and fills the ring
    if (ts.op_idx == 0) {
        CUDA_CHECK(cudaEventRecord(ts.ring->ev_fork, ctx.stream()));
        CUDA_CHECK(cudaStreamWaitEvent(ts.cstream, ts.ring->ev_fork, 0));
        *ts.next_copy = ts.n_pre;
        while (*ts.next_copy < (int) ts.fifo->size() && *ts.next_copy < ts.ring->n_slots) {
            rkv_issue_chunk(ts, (*ts.next_copy)++);
        }
    }
}

void ggml_cuda_rkv_tail_wait(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts, int ic) {
    cudaStream_t stream = ctx.stream();
    const rkv_fifo_op & o = (*ts.ops)[ts.op_idx];
    const int g = o.first + ic;
    GGML_ASSERT(g < *ts.next_copy && "rolling-KV: a chunk is attended before its copy was issued");
    if (g < ts.n_pre) {
#if RKV_CAPTURE_QUERY
        CUDA_CHECK(cudaStreamWaitEvent(stream, ts.ring->pre_done[g],
                                       ts.capturing ? cudaEventWaitExternal : cudaEventWaitDefault));
#else
        CUDA_CHECK(cudaStreamWaitEvent(stream, ts.ring->pre_done[g], 0)); // no graphs: nothing is captured
#endif // RKV_CAPTURE_QUERY
    } else {
        CUDA_CHECK(cudaStreamWaitEvent(stream, ts.ring->copy_done[g % ts.ring->n_slots], 0));
    }
    // rows written by this graph after the chunk may have been copied: take them again from the host tail
    for (const ggml_tensor * w : o.writes_k) {
        rkv_refresh(stream, (char *) ts.slot_k[ic].data, ts.k, w, (*ts.fifo)[g]);
    }
    for (const ggml_tensor * w : o.writes_v) {
        rkv_refresh(stream, (char *) ts.slot_v[ic].data, ts.v, w, (*ts.fifo)[g]);
    }
}

void ggml_cuda_rkv_tail_release(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts, int ic) {
    // the slot may be refilled as soon as the attention over it is done: queue the copies that this frees, which may
    // belong to the next ops (the copy stream runs ahead across layers)
    const int g = (*ts.ops)[ts.op_idx].first + ic;
    CUDA_CHECK(cudaEventRecord(ts.ring->slot_free[g % ts.ring->n_slots], ctx.stream()));
    while (*ts.next_copy < (int) ts.fifo->size() && *ts.next_copy <= g + ts.ring->n_slots) {
        rkv_issue_chunk(ts, (*ts.next_copy)++);
    }
}

void ggml_cuda_rkv_tail_end(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts) {
    if (ts.op_idx == (int) ts.ops->size() - 1) {
        // the last streaming op joins the copy stream back (required to end a CUDA graph capture)
        GGML_ASSERT(*ts.next_copy == (int) ts.fifo->size());
        CUDA_CHECK(cudaEventRecord(ts.ring->ev_join, ts.cstream));
        CUDA_CHECK(cudaStreamWaitEvent(ctx.stream(), ts.ring->ev_join, 0));
    }
}
