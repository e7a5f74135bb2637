#pragma once

// rolling-KV extensions to ggml.
//
// GGML_OP_STREAMING_FLASH_ATTN: flash attention over two KV segments (a rolling
// "window" and a "tail") without concatenating them. Semantically identical to
//
//   ggml_flash_attn_ext(q, concat(k_window, k_tail), concat(v_window, v_tail), mask, ...)
//
// where the concatenation is along the KV-cell dimension (ne[1]). The window and the
// tail may have different types (and K and V may differ too), each one of the types
// ggml_rkv_tail_type_supported accepts. Either segment may be empty: pass NULL for its K and V. With a block map
// (ggml_streaming_flash_attn_set_block_map) the keys are attended in the map's logical order instead.
//
//   q        : [DK, n_q, n_head, ne3]                      f32
//   k_window : [DK, n_win,  n_head_kv, ne3]   (or NULL)   same conventions as ggml_flash_attn_ext's k
//   v_window : [DV, n_win,  n_head_kv, ne3]   (or NULL)
//   k_tail   : [DK, n_tail, n_head_kv, ne3]   (or NULL)
//   v_tail   : [DV, n_tail, n_head_kv, ne3]   (or NULL)
//   mask     : [n_win + n_tail, >= n_q, ne2-bcast, ne3-bcast] f16, contiguous (or NULL)
//              columns [0, n_win) apply to the window, [n_win, n_win + n_tail) to the tail (physical, map or not)
//   sinks    : [n_head] f32 (optional, ggml_streaming_flash_attn_add_sinks)
//   map      : [n_blocks] i32 (optional, ggml_streaming_flash_attn_set_block_map): the keys' logical order
//   result   : [DV, n_head, n_q, ne3] f32 (same as ggml_flash_attn_ext)
//
// srcs: 0 q, 1 k_window, 2 v_window, 3 k_tail, 4 v_tail, 5 mask, 6 sinks, 7 map
// op params: f32 scale, f32 max_bias, f32 logit_softcap, i32 prec, i32 n_win, i32 tail_cpu_cells, i32 ref_streams,
//            f32 tail_perturb, then one i32 for each of at most GGML_RKV_MAX_TAIL_RUNS runs, the runs in use first:
//            its first 256-cell block in the low 16 bits, its blocks in the high 16 (a run has at least one, so the
//            count is that of the nonzero entries; a run's last block may end with the tail, short of 256 cells)
//
// The knobs of the rolling-KV code (ROLLINGKV_* environment variables, read once per process) are listed and
// documented in one place: ggml/src/ggml-rolling-kv-impl.h. The op's test hook is a parameter of the op, never a knob
// (ggml_streaming_flash_attn_set_tail_perturb).

#include "ggml.h"
#include "ggml-backend.h"

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
#define GGML_STREAMING_FA_SRC_MAP    7

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

    // number of window cells (k_window->ne[1], or 0 when the window is empty)
    GGML_API int64_t ggml_streaming_flash_attn_get_n_win(const struct ggml_tensor * a);

    // The hybrid tail: the cells at the far end of a streamed host tail that a GPU backend attends on the CPU, directly
    // from the pinned host rows, while it streams the rest. Decided once, by whoever builds the graph (llama's planner:
    // ggml_rkv_tail_cpu_cells turns its share into cells): 0 (the default) or n_tail (the whole tail on the CPU), or a
    // count that leaves the streamed part [0, n_tail - n) a multiple of 256 cells (the streamed chunks' alignment); the
    // setter refuses anything else. A hint, never a change of the result: a backend that cannot use it for a batch
    // (more than GGML_RKV_CPU_PART_MAX_Q query rows per stream, a tail type the CPU part does not read, a device tail,
    // the CPU backend itself) streams or attends the whole tail as before, and the parts merge exactly either way.
    GGML_API void    ggml_streaming_flash_attn_set_tail_cpu_cells(struct ggml_tensor * a, int64_t n_cells);
    GGML_API int64_t ggml_streaming_flash_attn_get_tail_cpu_cells(const struct ggml_tensor * a);

    // A batch of several streams may attend as one op per stream, each over its own occupied cells (a stream's
    // cells past its own are all masked for it): ref_streams is the batch's stream count, so that a backend picks
    // the kernel it would pick for the whole batch in one op (the CPU's single-stream split-KV decode path is not
    // the multi-stream one) and a resident run of the same batch stays the reference bit for bit. 0: this op's own.
    GGML_API void    ggml_streaming_flash_attn_set_ref_streams(struct ggml_tensor * a, int32_t n_streams);
    GGML_API int32_t ggml_streaming_flash_attn_get_ref_streams(const struct ggml_tensor * a);

    // The tail cells the op reads: runs of cells [first, first + n) of the tail, sorted and apart. A tail cell outside
    // every run must be masked for every query row of the op (a unified cache's cells of sequences that are not in the
    // batch, or holes): it is then neither attended nor, by a GPU backend, streamed. Every backend treats such a cell
    // as masked, so a run list that leaves out a cell some row can see changes the result (the CPU forward is the
    // reference). Starts are multiples of 256 (the streamed chunks' alignment), as are lengths except that of a run
    // ending at the tail's end. 0 runs (the default): the whole tail. Needs a mask, and a tail of at most 65535 blocks
    // of 256 cells (GGML_RKV_MAX_TAIL_RUN_BLOCKS: a run is one op parameter, in blocks).
#define GGML_RKV_MAX_TAIL_RUNS 8
#define GGML_RKV_MAX_TAIL_RUN_BLOCKS 65535
    GGML_API void ggml_streaming_flash_attn_set_tail_runs(struct ggml_tensor * a, int n_runs, const int32_t * first,
                                                          const int32_t * n);
    // the runs into first/n (GGML_RKV_MAX_TAIL_RUNS each); returns their count (0: the whole tail)
    GGML_API int  ggml_streaming_flash_attn_get_tail_runs(const struct ggml_tensor * a, int32_t * first, int32_t * n);

    // The logical order of the keys (a unified cache whose 256-cell blocks move between the window and the tail): map
    // is an I32 tensor [n_blocks], contiguous, in host memory for the CPU backend. Logical key 256*b + i (b < n_blocks,
    // i < 256) is the physical key 256*map[b] + i of the concatenation [window ; tail]: its K/V row and its mask
    // column. The op is then flash attention over the logical keys [0, 256*n_blocks) in that order. Requirements:
    // n_win % 256 == 0, entries distinct, each block wholly inside the window or the tail (checked by the CPU forward,
    // which reads the map). A physical key that no logical key maps to must be masked (-inf) for every row: a backend
    // that ignores the map (a GPU, attending the physical keys in their own order) then attends the same keys, so the
    // result differs only in summation order; the CPU forward follows the map, and is bit-identical to
    // ggml_flash_attn_ext over the logical K/V and mask when window and tail share types. Tail runs (set_tail_runs)
    // stay in physical tail cells. NULL removes the map.
    GGML_API void ggml_streaming_flash_attn_set_block_map(struct ggml_tensor * a, struct ggml_tensor * map);

    // Test hook, for the must-fail controls of the tests and gates: every tail key's attention score (after scale,
    // softcap and mask) is multiplied by (1 + x) before the softmax, on every backend alike (the CPU part of a hybrid
    // tail too), so that a comparison with the resident attention can prove it fails on a wrong merge. The outputs are
    // WRONG on purpose. x > -1 and finite (the setter refuses anything else); 0 (the default): off, and then it costs
    // the CPU forward one predictable branch per key or KV tile and the CUDA forward nothing. Set by whoever builds the
    // graph: the op test directly, libllama from its context's test hooks (llama-rolling-kv.h).
    GGML_API void  ggml_streaming_flash_attn_set_tail_perturb(struct ggml_tensor * a, float x);
    GGML_API float ggml_streaming_flash_attn_get_tail_perturb(const struct ggml_tensor * a);

#define GGML_RKV_CPU_PART_MAX_Q 8 // query rows per stream up to which the CPU part is used (decode batches)

    // cells at the far end of an n_tail-cell tail that the CPU attends for a share frac: the streamed part
    // [0, n_tail - n) keeps a multiple of 256 cells (the streamed chunks' alignment), rounded to the nearest. The one
    // rounding of a share into cells (ggml_streaming_flash_attn_set_tail_cpu_cells takes its result)
    GGML_API int64_t ggml_rkv_tail_cpu_cells(int64_t n_tail, float frac);

    // The CPU part of a hybrid tail lives in the CPU backend (ggml-cpu/rolling-kv-cpu-part.cpp). Other backends and
    // libllama reach it through the CPU backend's registry, never by symbol (backends may be modules, GGML_BACKEND_DL):
    // ggml_backend_reg_get_proc_address(the CPU backend's registry, NAME) for the names below; NULL where the CPU
    // backend lacks one (then: no CPU part). A backend, which links ggml-base only (the registry lookups are
    // libggml's), takes the CPU backend's registry from ggml_rkv_cpu_backend_reg().

    // threads of the CPU part (process-wide: ROLLINGKV_CPU_PART_THREADS, else every CPU the process may use but one),
    // at most the CPUs of the process's affinity (taskset, numactl), on which its threads run. The thread that runs a
    // part is one of them.
    typedef int (*ggml_rkv_get_cpu_threads_t)(void);
#define GGML_RKV_GET_CPU_THREADS_PROC "ggml_rkv_get_cpu_threads"
    // CPU parts of ops run so far in this process, by every backend (the proof that a hybrid tail's CPU part ran); the
    // planner's calibration and a backend's latency probe run parts of their own, counted apart (a job's calib flag)
    typedef uint64_t (*ggml_rkv_cpu_part_runs_t)(void);
#define GGML_RKV_CPU_PART_RUNS_PROC "ggml_rkv_cpu_part_runs"
#define GGML_RKV_CPU_PART_CALIB_RUNS_PROC "ggml_rkv_cpu_part_calib_runs"
    // the CPU part's attention bandwidth on this machine: GB/s (10^9 B/s) of K+V rows read, measured over a
    // synthetic tail of `bytes` bytes (0: 256 MiB) of type `type` (f16, q8_0, q4_0 for K and V) on n_threads
    // threads (<= 0: the CPU part's) for n_rows query rows that each see every cell (1: one decode row; up to
    // GGML_RKV_CPU_PART_MAX_Q: a step of several sequences over a shared prefix, each row read once and dotted once per
    // query row); best of a few runs. < 0: the type is not one the CPU part reads, or n_rows out of range.
    typedef double (*ggml_rkv_cpu_attn_measure_gbps_t)(int n_threads, enum ggml_type type, size_t bytes, int n_rows);
#define GGML_RKV_CPU_ATTN_MEASURE_GBPS_PROC "ggml_rkv_cpu_attn_measure_gbps"
    // whether the CPU part reads these K/V types and head sizes
    typedef bool (*ggml_rkv_cpu_part_supported_t)(enum ggml_type type_k, enum ggml_type type_v, int64_t DK, int64_t DV);
#define GGML_RKV_CPU_PART_SUPPORTED_PROC "ggml_rkv_cpu_part_supported"
    // a GPU backend's part (struct rkv_cpu_part_job, ggml/src/ggml-cpu/rolling-kv-cpu-part.h): run it on the part's
    // pool, the calling thread one of its workers; and make the pool's threads for n_threads (<= 0: the part's) now, on
    // the calling thread (not a GPU runtime's callback thread)
    struct rkv_cpu_part_job;
    typedef void (*ggml_rkv_cpu_part_run_t)(const struct rkv_cpu_part_job * job);
#define GGML_RKV_CPU_PART_RUN_PROC "ggml_rkv_cpu_part_run"
    typedef void (*ggml_rkv_cpu_part_prepare_t)(int n_threads);
#define GGML_RKV_CPU_PART_PREPARE_PROC "ggml_rkv_cpu_part_prepare"

    // the CPU backend's registry, which it records when it is made (ggml_backend_cpu_reg); NULL before that. Backends
    // unloaded (ggml_backend_unload) must not be asked afterwards.
    GGML_API void               ggml_rkv_set_cpu_backend_reg(ggml_backend_reg_t reg);
    GGML_API ggml_backend_reg_t ggml_rkv_cpu_backend_reg(void);

    // The K/V types of the op's parts, and so the types a rolling-KV tail may use: f32, f16, bf16, q8_0, q4_0,
    // q4_1, q5_0, q5_1. Every backend that runs the op falls back to the CPU forward (which reads all of them)
    // for what it cannot run itself. One list for the CPU backend, libllama, common's flags and llama-bench.
    GGML_API bool ggml_rkv_tail_type_supported(enum ggml_type type);
    // the type named s ("q8_0", ...) when it is one of those, else GGML_TYPE_COUNT
    GGML_API enum ggml_type ggml_rkv_tail_type_from_name(const char * s);
    // "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1": for messages
    GGML_API const char * ggml_rkv_tail_type_names(void);

    // A "streamed" tensor is a KV tail the rolling-KV cache keeps in a GPU's pinned host memory. The backend
    // scheduler lets that GPU access it in place instead of copying the whole tensor to the device before
    // every graph: ops that write it (set_rows of the new K/V rows) run on the GPU and write through unified
    // addressing, and GGML_OP_STREAMING_FLASH_ATTN copies its cells in large blocks on its own stream.
    // The flag is GGML_TENSOR_FLAG_STREAMED of ggml_tensor.flags (ggml.h); views inherit it through view_src.
    GGML_API void ggml_set_streamed(struct ggml_tensor * t);
    GGML_API bool ggml_is_streamed(const struct ggml_tensor * t); // t or the tensor it views

    // What a device spends on the op beyond its tensors, for llama's KV residency planner: a backend that streams
    // a host tail through device memory of its own, or whose runtime holds device memory no ggml buffer accounts
    // for, exports ggml_backend_rkv_dev_budget_t under the name GGML_RKV_DEV_BUDGET_PROC through
    // ggml_backend_reg_get_proc_address. A device whose backend does not: nothing (zeros).
    struct ggml_rkv_dev_budget {
        int    ring_slots;      // slots of the device ring through which the op streams a host tail (0: none)
        size_t ring_slot_bytes; // bytes per slot: at least one chunk of the widest layer's tail
        size_t runtime_bytes;   // device memory of the backend's runtime itself (context, library handles, pools)
    };
    // row_k_tail/row_v_tail: bytes of one cell's K/V row of the widest layer's tail, per stream; n_stream streams
    typedef void (*ggml_backend_rkv_dev_budget_t)(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail,
            int64_t n_stream, struct ggml_rkv_dev_budget * out);
#define GGML_RKV_DEV_BUDGET_PROC "ggml_backend_rkv_dev_budget"

    // The memory of a streamed tail. A GPU backend that can pin host memory which the CPU also reads at full speed
    // (anonymous memory advised for 2 MiB pages, registered with the device: the CPU part of a hybrid tail reads it,
    // the copy engine streams it, kernels write new rows into it through unified addressing) exports
    // ggml_backend_rkv_host_buffer_alloc_t under GGML_RKV_HOST_ALLOC_PROC. The buffer's type is the device's pinned
    // host buffer type (ggml_backend_dev_host_buffer_type), so the scheduler's streamed-tensor rules apply to it as to
    // any pinned tail. NULL: not possible here (the caller allocates from that buffer type as before).
    typedef ggml_backend_buffer_t (*ggml_backend_rkv_host_buffer_alloc_t)(ggml_backend_dev_t dev, size_t size);
#define GGML_RKV_HOST_ALLOC_PROC "ggml_backend_rkv_host_buffer_alloc"

    // What a GPU backend's copy plans put on the link for streamed tails, counted where the copies are planned (each
    // graph evaluation's plan, a replayed captured graph's too), process-wide: the bytes of all plans, those of the
    // latest plan that streamed, and the number of plans that streamed. For the stats beside the cache's own account.
    typedef void (*ggml_backend_rkv_streamed_bytes_t)(uint64_t * total, uint64_t * last, uint64_t * plans);
#define GGML_RKV_STREAMED_BYTES_PROC "ggml_backend_rkv_streamed_bytes"

    // What a CPU part of a hybrid tail costs a decode layer on this device beyond its attention, measured here (llama's
    // planner weighs it against what the part saves): the hand-off of the part's inputs to the host, the host's thread
    // pool on a part of 256 cells, the result back and the device's wait, the way a captured decode graph runs them.
    // ms per part (< 0: not measured), and a line saying how into how[how_size].
    typedef double (*ggml_backend_rkv_cpu_part_latency_t)(ggml_backend_dev_t dev, char * how, size_t how_size);
#define GGML_RKV_CPU_PART_LATENCY_PROC "ggml_backend_rkv_cpu_part_latency"

#ifdef __cplusplus
}
#endif
