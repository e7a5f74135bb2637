// rolling-KV: CUDA forward for GGML_OP_STREAMING_FLASH_ATTN (see ggml-rolling-kv.h)
#pragma once

#include "common.cuh"

// Attention over the window part and the tail part of the op, each through the stock FlashAttention
// kernels (a shadow GGML_OP_FLASH_ATTN_EXT node per part that also emits per-row LSE), then an exact
// f32 merge of the parts that applies the sinks once and writes 0 for fully masked rows.
void ggml_cuda_streaming_flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// true if every non-empty part can run on the stock FlashAttention kernels of this device
bool ggml_cuda_streaming_flash_attn_supported(int device, const ggml_tensor * op);

// the pinned-host tail streaming ring of a backend context (slots, events): freed with the context
struct ggml_cuda_rkv_ring;
void ggml_cuda_rkv_free(ggml_backend_cuda_context & ctx);

// before a graph is evaluated (eagerly or captured): plan the copies of all its host tails as one FIFO, so the
// copy stream runs ahead across layers (GGML_RKV_RUNAHEAD=0: each op streams only its own tail)
void ggml_cuda_rkv_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph);
