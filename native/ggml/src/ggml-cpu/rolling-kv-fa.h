#pragma once

// rolling-KV: CPU kernel for GGML_OP_STREAMING_FLASH_ATTN (see ggml-rolling-kv.h)

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void   ggml_compute_forward_streaming_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// per-graph work buffer bytes needed by the op when run with n_tasks threads
size_t ggml_streaming_flash_attn_work_size(const struct ggml_tensor * node, int n_tasks);

// whether the CPU kernel handles the op's K/V types
bool   ggml_streaming_flash_attn_cpu_supported(const struct ggml_tensor * op);

#ifdef __cplusplus
}
#endif
