#pragma once

// rolling-KV extensions to ggml.
//
// GGML_OP_STREAMING_FLASH_ATTN: flash attention over two KV segments (a rolling
// "window" and a "tail") without concatenating them. Semantically identical to
//
//   ggml_flash_attn_ext(q, concat(k_window, k_tail), concat(v_window, v_tail), mask, ...)
//
// where the concatenation is along the KV-cell dimension (ne[1]). The window and the
// tail may have different types (and K and V may differ too), exactly as accepted by
// ggml_flash_attn_ext. Either segment may be empty: pass NULL for its K and V.
//
//   q        : [DK, n_q, n_head, ne3]                      f32
//   k_window : [DK, n_win,  n_head_kv, ne3]   (or NULL)   same conventions as ggml_flash_attn_ext's k
//   v_window : [DV, n_win,  n_head_kv, ne3]   (or NULL)
//   k_tail   : [DK, n_tail, n_head_kv, ne3]   (or NULL)
//   v_tail   : [DV, n_tail, n_head_kv, ne3]   (or NULL)
//   mask     : [n_win + n_tail, >= n_q, ne2-bcast, ne3-bcast] f16, contiguous (or NULL)
//              columns [0, n_win) apply to the window, [n_win, n_win + n_tail) to the tail
//   sinks    : [n_head] f32 (optional, ggml_streaming_flash_attn_add_sinks)
//   result   : [DV, n_head, n_q, ne3] f32 (same as ggml_flash_attn_ext)
//
// srcs: 0 q, 1 k_window, 2 v_window, 3 k_tail, 4 v_tail, 5 mask, 6 sinks
// op params: f32 scale, f32 max_bias, f32 logit_softcap, i32 prec, i32 n_win

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_STREAMING_FA_SRC_Q      0
#define GGML_STREAMING_FA_SRC_K_WIN  1
#define GGML_STREAMING_FA_SRC_V_WIN  2
#define GGML_STREAMING_FA_SRC_K_TAIL 3
#define GGML_STREAMING_FA_SRC_V_TAIL 4
#define GGML_STREAMING_FA_SRC_MASK   5
#define GGML_STREAMING_FA_SRC_SINKS  6

    GGML_API struct ggml_tensor * ggml_streaming_flash_attn(
            struct ggml_context * ctx,
            struct ggml_tensor  * q,
            struct ggml_tensor  * k_window,
            struct ggml_tensor  * v_window,
            struct ggml_tensor  * k_tail,
            struct ggml_tensor  * v_tail,
            struct ggml_tensor  * mask,
            float                 scale,
            float                 max_bias,
            float                 logit_softcap);

    // sinks: f32 [n_head], counted once (as in ggml_flash_attn_ext_add_sinks); NULL removes them
    GGML_API void ggml_streaming_flash_attn_add_sinks(
            struct ggml_tensor * a,
            struct ggml_tensor * sinks);

    GGML_API void ggml_streaming_flash_attn_set_prec(
            struct ggml_tensor * a,
            enum ggml_prec       prec);

    GGML_API enum ggml_prec ggml_streaming_flash_attn_get_prec(const struct ggml_tensor * a);

    // number of window cells (k_window->ne[1], or 0 when the window is empty)
    GGML_API int64_t ggml_streaming_flash_attn_get_n_win(const struct ggml_tensor * a);

    // A "streamed" tensor is a KV tail the rolling-KV cache keeps in a GPU's pinned host memory. The backend
    // scheduler lets that GPU access it in place instead of copying the whole tensor to the device before
    // every graph: ops that write it (set_rows of the new K/V rows) run on the GPU and write through unified
    // addressing, and GGML_OP_STREAMING_FLASH_ATTN copies its cells in large blocks on its own stream.
    // Stored as a bit of ggml_tensor.flags far above ggml's own flags; views inherit it through view_src.
#define GGML_TENSOR_FLAG_STREAMED (1 << 24)

    GGML_API void ggml_set_streamed(struct ggml_tensor * t);
    GGML_API bool ggml_is_streamed(const struct ggml_tensor * t); // t or the tensor it views

    // the K/V types the op's CPU forward reads (in either part); the rolling-KV cache accepts them as tail types
    GGML_API bool ggml_streaming_flash_attn_cpu_type_supported(enum ggml_type type);

    // The device ring through which a GPU backend streams a host tail, one definition for the op and for llama's
    // planner (which must count what the op allocates): GGML_RKV_SLOTS slots (atoi, clamped to [2, 8], default 3)
    // of GGML_RKV_SLOT_MIB MiB (atoi, clamped to [1, 4096], default 32), read from the environment at each call.
#define GGML_STREAMING_FA_MAX_SLOTS 8
    GGML_API int    ggml_streaming_flash_attn_ring_slots(void);
    GGML_API size_t ggml_streaming_flash_attn_ring_slot_bytes(void);
    // bytes a slot needs for n_cells cells of every stream of a tail: the K rows padded to 256 bytes, then the V
    // rows, plus 256 (row_k/row_v: bytes of one cell's K/V row in one stream)
    GGML_API size_t ggml_streaming_flash_attn_slot_need(size_t row_k, size_t row_v, int64_t n_stream, int64_t n_cells);

#ifdef __cplusplus
}
#endif
