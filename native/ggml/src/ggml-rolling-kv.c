// rolling-KV: graph constructors for GGML_OP_STREAMING_FLASH_ATTN (see ggml-rolling-kv.h)

#include "ggml-rolling-kv.h"
#include "ggml-impl.h"

#include <stdlib.h>

static void ggml_streaming_fa_check_part(
        const struct ggml_tensor * q,
        const struct ggml_tensor * k,
        const struct ggml_tensor * v) {
    GGML_ASSERT((k == NULL) == (v == NULL) && "streaming_flash_attn: K and V of a part must both be set or both be NULL");
    if (k == NULL) {
        return;
    }
    GGML_ASSERT(k->ne[0] == q->ne[0]); // DK
    GGML_ASSERT(k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0); // GQA broadcast
    GGML_ASSERT(k->ne[1] == v->ne[1]);
    GGML_ASSERT(q->ne[3] == k->ne[3]);
    GGML_ASSERT(q->ne[3] == v->ne[3]);
    GGML_ASSERT(v->ne[2] > 0 && q->ne[2] % v->ne[2] == 0);
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type)); // rows must be contiguous
    GGML_ASSERT(v->nb[0] == ggml_type_size(v->type));
}

struct ggml_tensor * ggml_streaming_flash_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_window,
        struct ggml_tensor  * v_window,
        struct ggml_tensor  * k_tail,
        struct ggml_tensor  * v_tail,
        struct ggml_tensor  * mask,
        float                 scale,
        float                 max_bias,
        float                 logit_softcap) {
    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT((k_window != NULL || k_tail != NULL) && "streaming_flash_attn: window and tail cannot both be empty");

    ggml_streaming_fa_check_part(q, k_window, v_window);
    ggml_streaming_fa_check_part(q, k_tail,   v_tail);

    if (k_window && k_tail) {
        GGML_ASSERT(v_window->ne[0] == v_tail->ne[0]); // same DV
    }

    const struct ggml_tensor * v_any = v_window ? v_window : v_tail;

    const int64_t n_win  = k_window ? k_window->ne[1] : 0;
    const int64_t n_tail = k_tail   ? k_tail->ne[1]   : 0;

    if (mask) {
        GGML_ASSERT(mask->type == GGML_TYPE_F16);
        GGML_ASSERT(ggml_is_contiguous(mask));
        GGML_ASSERT(mask->ne[0] >= n_win + n_tail);
        GGML_ASSERT(mask->ne[1] >= q->ne[1]);
        GGML_ASSERT(q->ne[2] % mask->ne[2] == 0);
        GGML_ASSERT(q->ne[3] % mask->ne[3] == 0);
    }

    if (max_bias > 0.0f) {
        GGML_ASSERT(mask);
    }

    // permute(0, 2, 1, 3), as ggml_flash_attn_ext
    int64_t ne[4] = { v_any->ne[0], q->ne[2], q->ne[1], q->ne[3] };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    ggml_set_op_params_f32(result, 0, scale);
    ggml_set_op_params_f32(result, 1, max_bias);
    ggml_set_op_params_f32(result, 2, logit_softcap);
    ggml_set_op_params_i32(result, 3, (int32_t) GGML_PREC_DEFAULT);
    ggml_set_op_params_i32(result, 4, (int32_t) n_win);

    result->op = GGML_OP_STREAMING_FLASH_ATTN;
    result->src[GGML_STREAMING_FA_SRC_Q]      = q;
    result->src[GGML_STREAMING_FA_SRC_K_WIN]  = k_window;
    result->src[GGML_STREAMING_FA_SRC_V_WIN]  = v_window;
    result->src[GGML_STREAMING_FA_SRC_K_TAIL] = k_tail;
    result->src[GGML_STREAMING_FA_SRC_V_TAIL] = v_tail;
    result->src[GGML_STREAMING_FA_SRC_MASK]   = mask;
    result->src[GGML_STREAMING_FA_SRC_SINKS]  = NULL;

    return result;
}

void ggml_streaming_flash_attn_add_sinks(
        struct ggml_tensor * a,
        struct ggml_tensor * sinks) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    if (!sinks) {
        a->src[GGML_STREAMING_FA_SRC_SINKS] = NULL;
        return;
    }
    GGML_ASSERT(a->src[GGML_STREAMING_FA_SRC_SINKS] == NULL);
    GGML_ASSERT(sinks->type == GGML_TYPE_F32);
    GGML_ASSERT(a->src[GGML_STREAMING_FA_SRC_Q]->ne[2] == sinks->ne[0]);

    a->src[GGML_STREAMING_FA_SRC_SINKS] = sinks;
}

void ggml_streaming_flash_attn_set_prec(
        struct ggml_tensor * a,
        enum ggml_prec       prec) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    ggml_set_op_params_i32(a, 3, (int32_t) prec);
}

enum ggml_prec ggml_streaming_flash_attn_get_prec(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return (enum ggml_prec) ggml_get_op_params_i32(a, 3);
}

int64_t ggml_streaming_flash_attn_get_n_win(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return ggml_get_op_params_i32(a, 4);
}

void ggml_set_streamed(struct ggml_tensor * t) {
    GGML_ASSERT(t->view_src == NULL && "set the streamed flag on the allocated tensor, not on a view");
    t->flags |= GGML_TENSOR_FLAG_STREAMED;
}

bool ggml_is_streamed(const struct ggml_tensor * t) {
    const struct ggml_tensor * root = t->view_src ? t->view_src : t;
    return (root->flags & GGML_TENSOR_FLAG_STREAMED) != 0;
}

bool ggml_streaming_flash_attn_cpu_type_supported(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
            return true;
        default:
            return false;
    }
}

static int ggml_streaming_fa_env_int(const char * name, int def, int lo, int hi) {
    const char * v = getenv(name);
    if (!v || !*v) {
        return def;
    }
    const int x = atoi(v);
    return x < lo ? lo : x > hi ? hi : x;
}

int ggml_streaming_flash_attn_ring_slots(void) {
    return ggml_streaming_fa_env_int("GGML_RKV_SLOTS", 3, 2, GGML_STREAMING_FA_MAX_SLOTS);
}

size_t ggml_streaming_flash_attn_ring_slot_bytes(void) {
    return (size_t) ggml_streaming_fa_env_int("GGML_RKV_SLOT_MIB", 32, 1, 4096)*1024*1024;
}

size_t ggml_streaming_flash_attn_slot_need(size_t row_k, size_t row_v, int64_t n_stream, int64_t n_cells) {
    return GGML_PAD((size_t) n_cells*row_k*(size_t) n_stream, 256) + (size_t) n_cells*row_v*(size_t) n_stream + 256;
}
