// rolling-KV: CUDA forward for GGML_OP_STREAMING_FLASH_ATTN (see ggml-rolling-kv.h)
#pragma once

#include "common.cuh"

// Attention over the window part and the tail part of the op, each through the stock FlashAttention
// kernels (a shadow GGML_OP_FLASH_ATTN_EXT node per part that also emits per-row LSE), then an exact
// f32 merge of the parts that applies the sinks once and writes 0 for fully masked rows. A tail in pinned
// host memory is streamed through the device in chunks (rolling-kv-stream.cuh).
void ggml_cuda_streaming_flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// true if every non-empty part can run on a stock FlashAttention kernel of this device that writes the LSE
// (VEC, MMA; not TILE), as a whole or in the chunks a host tail streams in
bool ggml_cuda_streaming_flash_attn_supported(int device, const ggml_tensor * op);
