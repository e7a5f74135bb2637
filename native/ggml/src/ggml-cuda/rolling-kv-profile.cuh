// rolling-KV: GPU timeline profile of eagerly evaluated graphs (debug; GGML_RKV_PROFILE=1 with GGML_CUDA_DISABLE_GRAPHS=1)
//
// Where does a decode token's time go when the tail streams? Each graph is held on the GPU by a spin kernel
// (GGML_RKV_PROFILE_HOLD_US, 20000 by default) while the host enqueues every node with a timing event after it, so
// the events measure back-to-back GPU execution as a CUDA graph replay would, not the host's launch rate. The time
// between two events on the compute stream is charged to the later mark (a node's op, or a step inside the
// streaming op); the tail copies are timed on the copy stream. The summary (per ubatch size: GPU span, the host's
// time between graphs, copy busy/lead/trail/stall, the costliest steps) goes to stderr when the context is freed.
#pragma once

#include "common.cuh"

bool ggml_cuda_rkv_prof_enabled(); // GGML_RKV_PROFILE=1, read once

// all no-ops unless a profiled graph is being evaluated on this context
void ggml_cuda_rkv_prof_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, bool eager);
void ggml_cuda_rkv_prof_node(ggml_backend_cuda_context & ctx, const ggml_tensor * node, int n_fused);
void ggml_cuda_rkv_prof_mark(ggml_backend_cuda_context & ctx, const char * label);           // on ctx.stream()
void ggml_cuda_rkv_prof_copy(ggml_backend_cuda_context & ctx, cudaStream_t cs, size_t bytes); // bytes 0: start, else end
void ggml_cuda_rkv_prof_graph_end(ggml_backend_cuda_context & ctx);
void ggml_cuda_rkv_prof_free(ggml_backend_cuda_context & ctx); // prints the summary
