// rolling-KV: what the CUDA backend spends on GGML_OP_STREAMING_FLASH_ATTN beyond its tensors (private to ggml-cuda)
//
// The device ring through which the op streams a host tail (rolling-kv-stream.cu allocates exactly this), and the
// memory of the CUDA runtime itself. Plain C++, no CUDA: the op, the backend's ggml_backend_rkv_dev_budget (asked by
// llama's planner through the registry, see ggml-rolling-kv.h) and the planner's test harness
// (rollingkv/plan-simulate.cpp, which models a CUDA device on given figures) read the same definitions.
#pragma once

#include "../ggml-rolling-kv-impl.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

// a part's cell count is a multiple of this (the vector kernel's KV stride, FATTN_KQ_STRIDE): the smallest chunk
#define GGML_CUDA_RKV_CHUNK_ALIGN 256

// The device memory of the CUDA runtime that no ggml buffer accounts for: the CUDA context and its kernel modules,
// cuBLAS handles and workspaces, the CUDA pool's growth. A vram_target is a per-process cap as NVML measures it, so it
// counts against the target. Measured with CUDA 13 on an H200: llama-server's NVML peak was 653 MiB above weights +
// compute estimate + ring + window (docs/perf/2026-11-30-gpu-gates/vram-*.json). ROLLINGKV_RUNTIME_MIB overrides it.
#define GGML_CUDA_RKV_RUNTIME_MIB 640

// bytes a slot needs for n_cells cells of every stream of a tail: the K rows (padded to 256 bytes), then the V rows,
// plus 256 (row_k/row_v: bytes of one cell's K/V row in one stream)
static inline size_t ggml_cuda_rkv_slot_need(size_t row_k, size_t row_v, int64_t n_stream, int64_t n_cells) {
    return GGML_PAD((size_t) n_cells*row_k*(size_t) n_stream, 256) + (size_t) n_cells*row_v*(size_t) n_stream + 256;
}

// the ring the op allocates for tails whose widest layer has these rows, and the runtime's memory
static inline void ggml_cuda_rkv_dev_budget_of(size_t row_k_tail, size_t row_v_tail, int64_t n_stream,
                                               ggml_rkv_dev_budget * out) {
    const ggml_rkv_knobs * knobs = ggml_rkv_get_knobs();
    const size_t min_slot = row_k_tail == 0 && row_v_tail == 0 ? 0 :
        ggml_cuda_rkv_slot_need(row_k_tail, row_v_tail, n_stream, GGML_CUDA_RKV_CHUNK_ALIGN);
    out->ring_slots      = knobs->ring_slots;
    out->ring_slot_bytes = std::max(knobs->ring_slot_bytes, min_slot);
    out->runtime_bytes   = (size_t) (knobs->runtime_mib >= 0 ? knobs->runtime_mib
                                     : GGML_CUDA_RKV_RUNTIME_MIB)*1024*1024;
}
