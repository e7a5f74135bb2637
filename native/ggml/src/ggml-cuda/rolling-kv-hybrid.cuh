// rolling-KV: the CPU part of a hybrid tail on a CUDA device (rolling-kv-hybrid.cu)
//
// A streamed host tail may leave its far end (ggml_rkv_tail_cpu_cells, ggml-rolling-kv.h) to the CPU. Per op, on a
// stream of its own that forks from the compute stream where the op starts (its Q and this step's tail rows are
// written by then):
//   1. a kernel writes Q and the part's mask columns into pinned host staging (a few KiB, through unified addressing);
//   2. a one-thread kernel rings the part's bell in mapped memory; a host thread (the agent, spinning while the graph
//      has parts to come) sees it, attends the part's cells on the host's thread pool straight from the pinned tail
//      rows (rolling-kv-cpu-part.h) and sets the bell's done flag;
//   3. a one-thread kernel on the compute stream waits for that flag only before the last merge, where the CPU part
//      is merged like any other part (exact online-softmax combine, sinks once), reading the output and per-row LSE
//      from the staging in place (no copy back).
// Meanwhile the compute stream attends the window and the streamed chunks. ROLLINGKV_CPU_PART_HANDOFF=host keeps the
// first design for 2-3: a stream-ordered host function (cudaLaunchHostFunc) and an event the compute stream waits for.
// Both are kernels or host nodes a CUDA graph captures.
//
// The host function reads a job (shapes, host addresses) that is never changed once made: a replayed graph finds
// the job of its capture. The pinned staging of the k-th CPU part of a graph is shared by all graphs (they run one
// after another on the compute stream) and only grows; a buffer that grew is kept until the context is freed, since
// a captured graph may still copy through it.
#pragma once

#include "common.cuh"

#include <cstdint>

// The stream of the CPU parts: not the compute stream (0), not one of ggml's concurrent-event branches (1..3), not
// the tail copy stream (the last one).
#define GGML_CUDA_RKV_CPU_STREAM (GGML_CUDA_MAX_STREAMS - 2)
static_assert(GGML_CUDA_RKV_CPU_STREAM > 3,
              "the rolling-KV CPU-part stream must not be a concurrent-event branch stream");

struct ggml_cuda_rkv_hybrid; // a backend context's CPU-part state (staging, which carries the jobs, slopes, events)
void ggml_cuda_rkv_hybrid_free(ggml_cuda_rkv_hybrid * h);

#include <vector>

// before a graph is evaluated (eager or captured, and before a replay), with the graph's ops that have a CPU part in
// graph order, nullptr where the graph writes a streamed tail between two of them: its CPU parts take staging buffers
// from the first again; a part starts the agent that serves the bells, or tells it to expect them. Ops of a run that
// read one query and one tail with no write between them (the per-stream ops of a layer) are a group whose first op
// hands over every member's part, so that the host attends the streams back to back while the device attends theirs
void ggml_cuda_rkv_hybrid_graph_begin(ggml_cuda_rkv_hybrid *& h, const std::vector<const ggml_tensor *> & cpu_ops);

// a CPU part handed over: where its result will be (pinned host memory the device reads in place once
// ggml_cuda_rkv_cpu_part_wait has ordered it: [rows][DV] floats, then [rows] LSEs, rows = DV-rows of dst), and what
// the compute stream waits for (the part's bell, or none with the host function; the event that joins its stream)
struct ggml_cuda_rkv_cpu_part {
    const float * out  = nullptr;
    void *        bell = nullptr;
    cudaEvent_t   done = nullptr;
};

// cells of op's host tail that the CPU attends (its far end), 0 when op has no CPU part: a pinned-host tail, a
// tail_cpu_cells > 0, at most GGML_RKV_CPU_PART_MAX_Q query rows per stream, K/V types and head sizes the CPU part
// reads, Q heads contiguous, a mask that does not vary per head
int64_t ggml_cuda_rkv_tail_cpu_cells(const ggml_tensor * op);

// the end of op's host tail part that streams through the device: [0, end) is the tail minus its CPU part
int64_t ggml_cuda_rkv_tail_stream_end(const ggml_tensor * op);

// the runs of cells of that part the op reads (ggml_streaming_flash_attn_set_tail_runs; all of it without runs), into
// first/n (GGML_RKV_MAX_TAIL_RUNS each): only these stream. Returns their count
int ggml_cuda_rkv_tail_stream_runs(const ggml_tensor * op, int64_t * first, int64_t * n);

// the cells of op's host tail that stream through the device: its runs' cells within the tail minus its CPU part
int64_t ggml_cuda_rkv_tail_stream_cells(const ggml_tensor * op);

// op's CPU part over its last n_cpu tail cells (first mask column col0): handed over on the CPU-part stream now, or
// already by the first op of its group; the first op of a group hands over the later members' parts too
ggml_cuda_rkv_cpu_part ggml_cuda_rkv_cpu_part_launch(ggml_backend_cuda_context & ctx, const ggml_tensor * op,
                                                     int64_t n_cpu, int64_t col0);
// the compute stream waits for this CPU part
void ggml_cuda_rkv_cpu_part_wait(ggml_backend_cuda_context & ctx, const ggml_cuda_rkv_cpu_part & part);
