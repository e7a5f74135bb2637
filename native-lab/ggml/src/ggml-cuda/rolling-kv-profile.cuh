// rolling-KV: GPU timeline profile of graph evaluations (a lab instrument: the lab series only,
// `rollingkv build --lab`)
//
// Compiled on CUDA (it reads the %globaltimer register, which HIP and MUSA do not have); there every function below is
// an empty inline and the lab's profile hooks compile to nothing. With ROLLINGKV_DEBUG_PROFILE=1 (rolling-kv-lab.cuh):
//
// Where does a decode token's time go when the tail streams? With GGML_CUDA_DISABLE_GRAPHS=1, each graph is held on the
// GPU by a spin kernel (ROLLINGKV_DEBUG_PROFILE_HOLD_US, 20000 by default) while the host enqueues every node with a
// timing event after it, so that the events time back-to-back GPU execution rather than the host's launch rate (the
// events themselves add a few us each, and a queue that fills before the hold ends is reported). The time between two
// events on the compute stream is charged to the later mark (a node's op, or a step inside the streaming op); tail
// copies are timed on the copy stream. With CUDA graphs on, only each graph launch is timed: next to llama-bench's time
// per token it gives the host's share. The summary goes to stderr when the context is freed.
#pragma once

#include "common.cuh"

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
#define GGML_CUDA_RKV_PROFILE
#endif

#ifdef GGML_CUDA_RKV_PROFILE

bool ggml_cuda_rkv_prof_enabled(); // ROLLINGKV_DEBUG_PROFILE=1, read once

// all no-ops unless a profiled graph is being evaluated on this context
void ggml_cuda_rkv_prof_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, bool eager);
void ggml_cuda_rkv_prof_node(ggml_backend_cuda_context & ctx, const ggml_tensor * node, int n_fused);
void ggml_cuda_rkv_prof_mark(ggml_backend_cuda_context & ctx, const char * label);           // on ctx.stream()
// bytes 0: start, else end
void ggml_cuda_rkv_prof_copy(ggml_backend_cuda_context & ctx, cudaStream_t cs, size_t bytes);
void ggml_cuda_rkv_prof_graph_end(ggml_backend_cuda_context & ctx);
// with CUDA graphs on: events around each graph launch only (after = false before it); the launches' GPU time,
// next to llama-bench's time per token, gives the host's share of a token
void ggml_cuda_rkv_prof_replay(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, bool after);
// a host timestamp at a named point (graph_compute entry, before/after the launch, synchronized): the host time
// between consecutive points is charged to the later one, summed per graph, medians in the summary
// (cgraph: at graph_compute entry, where a new graph starts)
void ggml_cuda_rkv_prof_host(ggml_backend_cuda_context & ctx, const char * point, const ggml_cgraph * cgraph = nullptr);
void ggml_cuda_rkv_prof_free(ggml_backend_cuda_context & ctx); // prints the summary

#else

static inline void ggml_cuda_rkv_prof_graph_begin(ggml_backend_cuda_context &, const ggml_cgraph *, bool) {}
static inline void ggml_cuda_rkv_prof_node(ggml_backend_cuda_context &, const ggml_tensor *, int) {}
static inline void ggml_cuda_rkv_prof_mark(ggml_backend_cuda_context &, const char *) {}
static inline void ggml_cuda_rkv_prof_copy(ggml_backend_cuda_context &, cudaStream_t, size_t) {}
static inline void ggml_cuda_rkv_prof_graph_end(ggml_backend_cuda_context &) {}
static inline void ggml_cuda_rkv_prof_replay(ggml_backend_cuda_context &, const ggml_cgraph *, bool) {}
static inline void ggml_cuda_rkv_prof_host(ggml_backend_cuda_context &, const char *, const ggml_cgraph * = nullptr) {}
static inline void ggml_cuda_rkv_prof_free(ggml_backend_cuda_context &) {}

#endif // GGML_CUDA_RKV_PROFILE
