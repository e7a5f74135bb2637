// rolling-KV: graph constructors for GGML_OP_STREAMING_FLASH_ATTN (see ggml-rolling-kv.h)

#include "ggml-rolling-kv.h"
#include "ggml-rolling-kv-impl.h"
#include "ggml-impl.h"
#include "ggml-threading.h"

#include <errno.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void ggml_streaming_fa_check_part(
        const struct ggml_tensor * q,
        const struct ggml_tensor * k,
        const struct ggml_tensor * v) {
    GGML_ASSERT((k == NULL) == (v == NULL) &&
                "streaming_flash_attn: K and V of a part must both be set or both be NULL");
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
    ggml_set_op_params_i32(result, 5, 0);    // tail_cpu_cells
    ggml_set_op_params_i32(result, 6, 0);    // ref_streams
    ggml_set_op_params_f32(result, 7, 0.0f); // tail_perturb: off
    // runs (8..15): none, the whole tail

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

int64_t ggml_streaming_flash_attn_get_n_win(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return ggml_get_op_params_i32(a, 4);
}

void ggml_streaming_flash_attn_set_tail_cpu_cells(struct ggml_tensor * a, int64_t n_cells) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    const struct ggml_tensor * kt = a->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const int64_t n_tail = kt ? kt->ne[1] : 0;
    GGML_ASSERT(n_cells >= 0 && n_cells <= n_tail && n_cells <= INT32_MAX &&
            "streaming_flash_attn: tail_cpu_cells must be in [0, the tail's cells]");
    GGML_ASSERT((n_cells == 0 || n_cells == n_tail || (n_tail - n_cells) % 256 == 0) &&
            "streaming_flash_attn: tail_cpu_cells must leave the streamed part a multiple of 256 cells "
            "(ggml_rkv_tail_cpu_cells)");
    ggml_set_op_params_i32(a, 5, (int32_t) n_cells);
}

int64_t ggml_streaming_flash_attn_get_tail_cpu_cells(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return ggml_get_op_params_i32(a, 5);
}

void ggml_streaming_flash_attn_set_ref_streams(struct ggml_tensor * a, int32_t n_streams) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    GGML_ASSERT(n_streams >= 0);
    ggml_set_op_params_i32(a, 6, n_streams);
}

int32_t ggml_streaming_flash_attn_get_ref_streams(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return ggml_get_op_params_i32(a, 6);
}

void ggml_streaming_flash_attn_set_tail_runs(struct ggml_tensor * a, int n_runs, const int32_t * first,
                                             const int32_t * n) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    GGML_ASSERT(n_runs >= 0 && n_runs <= GGML_RKV_MAX_TAIL_RUNS && "streaming_flash_attn: too many tail runs");
    const struct ggml_tensor * kt = a->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const int64_t n_tail = kt ? kt->ne[1] : 0;
    GGML_ASSERT((n_runs == 0 || a->src[GGML_STREAMING_FA_SRC_MASK]) && "streaming_flash_attn: tail runs need a mask");
    int64_t end = 0;
    for (int i = 0; i < n_runs; ++i) {
        GGML_ASSERT(first[i] >= end && n[i] > 0 && first[i] + (int64_t) n[i] <= n_tail &&
                "streaming_flash_attn: tail runs must be sorted, apart, non-empty and within the tail");
        GGML_ASSERT(first[i] % 256 == 0 && (n[i] % 256 == 0 || first[i] + (int64_t) n[i] == n_tail) &&
                "streaming_flash_attn: tail runs start at a multiple of 256 cells and are multiples of 256 cells long, "
                "but for one at the tail's end");
        end = first[i] + (int64_t) n[i] + 1; // apart: adjacent runs are one run
    }
    GGML_ASSERT((n_runs == 0 || (n_tail + 255)/256 <= GGML_RKV_MAX_TAIL_RUN_BLOCKS) &&
            "streaming_flash_attn: tail runs need a tail of at most GGML_RKV_MAX_TAIL_RUN_BLOCKS blocks");
    for (int i = 0; i < GGML_RKV_MAX_TAIL_RUNS; ++i) {
        // a run in one parameter: its first block, its blocks (the last one ends with the tail where it reaches it)
        const uint32_t packed = i < n_runs ? (uint32_t) (first[i]/256) | (uint32_t) ((n[i] + 255)/256) << 16 : 0;
        ggml_set_op_params_i32(a, 8 + i, (int32_t) packed);
    }
}

int ggml_streaming_flash_attn_get_tail_runs(const struct ggml_tensor * a, int32_t * first, int32_t * n) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    // the runs in use come first, each of at least one block: the count is that of the nonzero parameters
    const struct ggml_tensor * kt = a->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const int64_t n_tail = kt ? kt->ne[1] : 0;
    int n_runs = 0;
    while (n_runs < GGML_RKV_MAX_TAIL_RUNS && ggml_get_op_params_i32(a, 8 + n_runs) != 0) {
        const uint32_t packed = (uint32_t) ggml_get_op_params_i32(a, 8 + n_runs);
        const int64_t  f      = 256*(int64_t) (packed & 0xFFFF);
        const int64_t  cells  = 256*(int64_t) (packed >> 16); // the last block may end with the tail
        first[n_runs] = (int32_t) f;
        n[n_runs]     = (int32_t) (cells < n_tail - f ? cells : n_tail - f);
        n_runs++;
    }
    return n_runs;
}

void ggml_streaming_flash_attn_set_tail_perturb(struct ggml_tensor * a, float x) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    GGML_ASSERT(x > -1.0f && x <= FLT_MAX && "streaming_flash_attn: the tail perturbation must be finite and above -1");
    ggml_set_op_params_f32(a, 7, x);
}

float ggml_streaming_flash_attn_get_tail_perturb(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    return ggml_get_op_params_f32(a, 7);
}

void ggml_streaming_flash_attn_set_block_map(struct ggml_tensor * a, struct ggml_tensor * map) {
    GGML_ASSERT(a->op == GGML_OP_STREAMING_FLASH_ATTN);
    if (!map) {
        a->src[GGML_STREAMING_FA_SRC_MAP] = NULL;
        return;
    }
    const struct ggml_tensor * kt = a->src[GGML_STREAMING_FA_SRC_K_TAIL];
    const int64_t n_win  = ggml_get_op_params_i32(a, 4);
    const int64_t n_tail = kt ? kt->ne[1] : 0;
    GGML_ASSERT(a->src[GGML_STREAMING_FA_SRC_MASK] && "streaming_flash_attn: a block map needs a mask");
    GGML_ASSERT(map->type == GGML_TYPE_I32 && ggml_is_contiguous(map) &&
            "streaming_flash_attn: the block map is a contiguous I32 tensor");
    GGML_ASSERT(map->ne[0] >= 1 && map->ne[1] == 1 && map->ne[2] == 1 && map->ne[3] == 1 &&
            "streaming_flash_attn: the block map is a vector of at least one block");
    GGML_ASSERT(n_win % 256 == 0 && "streaming_flash_attn: a block map needs a window of whole 256-cell blocks");
    GGML_ASSERT(256*map->ne[0] <= n_win + n_tail &&
            "streaming_flash_attn: the block map has more keys than the window and the tail");
    a->src[GGML_STREAMING_FA_SRC_MAP] = map;
}

int64_t ggml_rkv_tail_cpu_cells(int64_t n_tail, float frac) {
    if (n_tail <= 0 || !(frac > 0.0f)) {
        return 0;
    }
    if (frac >= 1.0f) {
        return n_tail;
    }
    // the streamed part: (1 - frac)*n_tail rounded to the nearest multiple of 256, at most the tail
    int64_t n_stream = (int64_t) ((1.0 - (double) frac)*(double) n_tail/256.0 + 0.5)*256;
    if (n_stream > n_tail) {
        n_stream = n_tail;
    }
    return n_tail - n_stream;
}

void ggml_set_streamed(struct ggml_tensor * t) {
    GGML_ASSERT(t->view_src == NULL && "set the streamed flag on the allocated tensor, not on a view");
    t->flags |= GGML_TENSOR_FLAG_STREAMED;
}

bool ggml_is_streamed(const struct ggml_tensor * t) {
    const struct ggml_tensor * root = t->view_src ? t->view_src : t;
    return (root->flags & GGML_TENSOR_FLAG_STREAMED) != 0;
}

//
// the K/V types of the op's parts (= the rolling-KV tail types)
//

static const enum ggml_type ggml_rkv_tail_types[] = {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
};

bool ggml_rkv_tail_type_supported(enum ggml_type type) {
    for (size_t i = 0; i < sizeof(ggml_rkv_tail_types)/sizeof(ggml_rkv_tail_types[0]); ++i) {
        if (ggml_rkv_tail_types[i] == type) {
            return true;
        }
    }
    return false;
}

enum ggml_type ggml_rkv_tail_type_from_name(const char * s) {
    if (s) {
        for (size_t i = 0; i < sizeof(ggml_rkv_tail_types)/sizeof(ggml_rkv_tail_types[0]); ++i) {
            if (strcmp(ggml_type_name(ggml_rkv_tail_types[i]), s) == 0) {
                return ggml_rkv_tail_types[i];
            }
        }
    }
    return GGML_TYPE_COUNT;
}

const char * ggml_rkv_tail_type_names(void) {
    return "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1";
}

//
// knobs (ggml-rolling-kv-impl.h): read once
//

static const char * ggml_rkv_env(const char * name) {
    const char * v = getenv(name);
    return v && *v ? v : NULL;
}

// atoi, clamped to [lo, hi]; unset or empty: def
static int ggml_rkv_env_int(const char * name, int def, int lo, int hi) {
    const char * v = ggml_rkv_env(name);
    if (!v) {
        return def;
    }
    const int x = atoi(v);
    return x < lo ? lo : x > hi ? hi : x;
}

static struct ggml_rkv_knobs ggml_rkv_knobs_read(void) {
    struct ggml_rkv_knobs k;
    memset(&k, 0, sizeof(k));

    k.ring_slots      = ggml_rkv_env_int("ROLLINGKV_SLOTS", 3, 2, GGML_RKV_MAX_SLOTS);
    k.ring_slot_bytes = (size_t) ggml_rkv_env_int("ROLLINGKV_SLOT_MIB", 32, 1, 4096)*1024*1024;

    k.runtime_mib = -1;
    {
        const char * v = ggml_rkv_env("ROLLINGKV_RUNTIME_MIB");
        if (v) {
            char * end = NULL;
            const long long mib = strtoll(v, &end, 10);
            if (end && *end == '\0' && mib >= 0) {
                k.runtime_mib = mib;
            }
        }
    }

    {
        const char * v = ggml_rkv_env("ROLLINGKV_TAIL_HOST_MEMORY");
        k.tail_cuda_alloc = v && strcmp(v, "cuda") == 0;
        if (v && !k.tail_cuda_alloc && strcmp(v, "hugepages") != 0) {
            GGML_LOG_WARN("ROLLINGKV_TAIL_HOST_MEMORY=%s is neither hugepages nor cuda: using hugepages\n", v);
        }
    }

    {
        // a whole number >= 0 (0: the default), at most 1024; anything else: one warning line and the default (the CLI
        // stops on the same values, rollingkv_cli/cpu_attn.py part_threads)
        const char * v = ggml_rkv_env("ROLLINGKV_CPU_PART_THREADS");
        k.cpu_part_threads = 0;
        if (v) {
            char * end = NULL;
            errno = 0;
            const long long n = strtoll(v, &end, 10); // as Python's int(): blanks around and a sign allowed
            while (end != v && (*end == ' ' || *end == '\t' || *end == '\n')) {
                end++;
            }
            if (end == v || *end != '\0' || errno != 0 || n < 0) {
                GGML_LOG_WARN("ROLLINGKV_CPU_PART_THREADS=%s is not a whole number >= 0: the CPU part uses the default "
                              "(every CPU the process may use but one)\n", v);
            } else {
                k.cpu_part_threads = n > 1024 ? 1024 : (int) n;
            }
        }
    }
    k.cpu_part_spin_us = ggml_rkv_env_int("ROLLINGKV_CPU_PART_SPIN_US", 300, 0, 1000000);
    {
        const char * v = ggml_rkv_env("ROLLINGKV_CPU_PART_HANDOFF");
        k.cpu_part_host_fn = v && strcmp(v, "host") == 0;
        if (v && !k.cpu_part_host_fn && strcmp(v, "flag") != 0) {
            GGML_LOG_WARN("ROLLINGKV_CPU_PART_HANDOFF=%s is neither flag nor host: using flag\n", v);
        }
    }

    k.cpu_part_stats = ggml_rkv_env_int("ROLLINGKV_CPU_PART_STATS", 0, 0, 1) == 1;
    {
        const char * v = ggml_rkv_env("ROLLINGKV_SIMULATE_LINK_SLOWDOWN");
        char * end = NULL;
        const double x = v ? strtod(v, &end) : 1.0;
        k.link_slowdown = 1.0;
        if (v && (end == v || *end != '\0' || !(x >= 1.0 && x <= 100.0))) {
            GGML_LOG_WARN("ROLLINGKV_SIMULATE_LINK_SLOWDOWN=%s is not a number from 1 to 100: the link is not slowed\n",
                          v);
        } else if (v && x > 1.0) {
            k.link_slowdown = x;
            GGML_LOG_WARN("ROLLINGKV_SIMULATE_LINK_SLOWDOWN=%s: every host-tail copy is repeated to simulate a link "
                          "%.2fx slower (a benchmark aid: unset it for real use)\n", v, x);
        }
    }

    return k;
}

// read under ggml's critical section, once; callers keep the pointer (the struct never changes after that)
const struct ggml_rkv_knobs * ggml_rkv_get_knobs(void) {
    static struct ggml_rkv_knobs knobs;
    static bool                  done = false;
    ggml_critical_section_start();
    if (!done) {
        knobs = ggml_rkv_knobs_read();
        done  = true;
    }
    ggml_critical_section_end();
    return &knobs;
}

// the CPU backend's registry (ggml-rolling-kv.h): the CPU part's functions are asked of it by name
static ggml_backend_reg_t g_rkv_cpu_reg = NULL;

void ggml_rkv_set_cpu_backend_reg(ggml_backend_reg_t reg) {
    ggml_critical_section_start();
    g_rkv_cpu_reg = reg;
    ggml_critical_section_end();
}

ggml_backend_reg_t ggml_rkv_cpu_backend_reg(void) {
    ggml_critical_section_start();
    ggml_backend_reg_t reg = g_rkv_cpu_reg;
    ggml_critical_section_end();
    return reg;
}
