// rolling-KV: streaming a pinned-host tail through the device for GGML_OP_STREAMING_FLASH_ATTN (rolling-kv-stream.cu)
//
// A tail in pinned host memory (the rolling-KV cache's tail, flagged streamed: see ggml-rolling-kv.h) is never
// copied by the scheduler. The op streams it itself: the tail cells of a layer are contiguous rows, so it copies them
// host to device in a few large cudaMemcpyAsync calls (ROLLINGKV_SLOT_MIB per slot, 32 MiB by default: copies of
// >= 8 MiB run near the link's peak, 1 MiB copies at half of it) into a ring of ROLLINGKV_SLOTS device slots (3 by
// default) on a dedicated copy stream. Per-slot events order the copies against the attention over the previous chunk
// in the same slot, so the copy of chunk i+1 overlaps the attention over chunk i; each chunk is one more part that the
// forward (rolling-kv-fa.cu) merges into its running (O, lse).
//
// Before a graph is evaluated (eagerly or captured), ggml_cuda_rkv_graph_begin plans the copies of all its host tails
// as one FIFO, so that the copy stream runs ahead across layers (the next layer's tail streams while this layer
// computes), bounded by the ring; the first ROLLINGKV_SLOTS chunks of the plan are copied before the graph is launched,
// outside any capture, and the graph waits for them as external events. The copy stream forks from the compute stream
// at the first streaming op (after this layer's new K/V rows were written into the tail) and joins it at the end of the
// last one, which keeps CUDA graph capture valid: the copies become memcpy nodes that re-read the host tail at every
// replay. Rows a graph writes into a tail after their chunk may have been copied ahead are copied again into the slot
// before the attention over it (rkv_refresh_rows).
#pragma once

#include "common.cuh"
#include "rolling-kv-budget.h"

#include <vector>

// The copy stream of the ring: the last stream of the context. Stream 0 computes, and ggml's concurrent-event branches
// use streams 1..max_fan_out (3), which ggml_backend_cuda_graph_optimize static_asserts to stay below this one.
#define GGML_CUDA_RKV_COPY_STREAM (GGML_CUDA_MAX_STREAMS - 1)
static_assert(GGML_CUDA_RKV_COPY_STREAM > 0, "the rolling-KV copy stream must not be the compute stream");

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

// the pinned-host tail streaming ring of a backend context (slots, events, the graph's copy plan, the CPU-part state of
// rolling-kv-hybrid.cu): freed with the context
struct ggml_cuda_rkv_ring;
void ggml_cuda_rkv_free(ggml_backend_cuda_context & ctx);

// the context's CPU-part state (nullptr until its first CPU part; the ring is made without slots if there is none)
struct ggml_cuda_rkv_hybrid;
ggml_cuda_rkv_hybrid *& ggml_cuda_rkv_hybrid_of(ggml_backend_cuda_context & ctx);

// before a graph is evaluated (eagerly or captured): plan the copies of all its host tails as one FIFO, so that the
// copy stream runs ahead across layers, and copy its first chunks (the lab series' A/B switches turn either off:
// native-lab/ggml/src/ggml-cuda/rolling-kv-lab.cuh)
void ggml_cuda_rkv_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph);

// the registry's rolling-KV procs (GGML_RKV_*_PROC of ggml-rolling-kv.h that this backend answers), nullptr for any
// other name
void * ggml_cuda_rkv_get_proc_address(const char * name);

// the registry's GGML_RKV_DEV_BUDGET_PROC (ggml-rolling-kv.h): the ring this backend allocates and its runtime's memory
void ggml_cuda_rkv_dev_budget(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail, int64_t n_stream,
                              ggml_rkv_dev_budget * out);

// the registry's GGML_RKV_HOST_ALLOC_PROC (ggml-rolling-kv.h): a host tail's pinned memory in 2 MiB pages
// (rolling-kv-host.cu); nullptr where that is not possible
ggml_backend_buffer_t ggml_cuda_rkv_host_buffer_alloc(ggml_backend_dev_t dev, size_t size);

// the registry's GGML_RKV_CPU_PART_LATENCY_PROC (ggml-rolling-kv.h): what a CPU part costs its decode layer beyond its
// attention on dev, measured through the flag hand-off in a captured graph (rolling-kv-hybrid.cu; ms per part, < 0: not
// measured)
double ggml_cuda_rkv_cpu_part_latency(ggml_backend_dev_t dev, char * how, size_t how_size);

bool ggml_cuda_rkv_is_host(const ggml_tensor * t);          // t (or what it views) lives in a host buffer
bool ggml_cuda_rkv_rows_contiguous(const ggml_tensor * t);  // cells of one stream are one contiguous byte range
bool ggml_cuda_rkv_streams_tail(const ggml_tensor * op);    // op's tail is in host memory and has cells to stream (the
                                                            // tail minus its CPU part, rolling-kv-hybrid.cuh)

// One op's host tail as the forward streams it: its entry in the graph's copy plan (or a plan of its own, for an op
// outside a planned graph) and a slot header per chunk, in order. The forward calls
//   ggml_cuda_rkv_tail_begin           while collecting its parts (no copy is issued yet)
//   ggml_cuda_rkv_tail_start           once, before the first part is attended (the first op of a plan forks the copy
//                                      stream and fills the ring)
//   ggml_cuda_rkv_tail_wait(ic)        before the attention over chunk ic (its copy done, written rows taken again)
//   ggml_cuda_rkv_tail_release(ic)     after it (the slot may be refilled: issues the copies this frees)
//   ggml_cuda_rkv_tail_end             after the last chunk (the last op of a plan joins the copy stream back)
struct ggml_cuda_rkv_tail_stream {
    ggml_cuda_rkv_ring * ring = nullptr;
    const ggml_tensor  * k    = nullptr; // the op's tail views (host)
    const ggml_tensor  * v    = nullptr;
    int64_t              col0 = 0;       // the tail's first mask column (n_win)

    std::vector<ggml_tensor> slot_k;     // per chunk: its slot, in the tail view's layout
    std::vector<ggml_tensor> slot_v;
    std::vector<int64_t>     chunk_col0; // per chunk: its first mask column

    int n_chunks() const { return (int) slot_k.size(); }

    // the plan this op is part of
    const std::vector<rkv_fifo_chunk> * fifo = nullptr;
    const std::vector<rkv_fifo_op>    * ops  = nullptr;
    int * next_copy = nullptr;
    int   op_idx    = -1;
    int   n_pre     = 0;     // chunks [0, n_pre) of the plan were copied before the launch
    bool  capturing = false; // the compute stream is being captured into a CUDA graph
    cudaStream_t cstream = nullptr;

    // a plan of its own (an op outside a planned graph)
    std::vector<rkv_fifo_chunk> local_fifo;
    std::vector<rkv_fifo_op>    local_ops;
    int local_next = 0;
};

void ggml_cuda_rkv_tail_begin  (ggml_backend_cuda_context & ctx, const ggml_tensor * dst,
                                ggml_cuda_rkv_tail_stream & ts);
void ggml_cuda_rkv_tail_start  (ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts);
void ggml_cuda_rkv_tail_wait   (ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts, int ic);
void ggml_cuda_rkv_tail_release(ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts, int ic);
void ggml_cuda_rkv_tail_end    (ggml_backend_cuda_context & ctx, ggml_cuda_rkv_tail_stream & ts);

// a header with src's type and shape that is not a view and not a graph node (its data is set by the caller)
void ggml_cuda_rkv_detached_header(ggml_tensor & t, const ggml_tensor * src);
