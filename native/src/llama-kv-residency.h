// rollingkv: the KV residency planner and the state it shares with the context.
//
// A residency request (llama_rolling_kv_params) travels from llama_init_from_model_rolling_kv into the
// context's llama_cparams (cparams.rkv, see llama-rolling-kv-internal.h) and from there to the KV cache
// constructor, which asks the planner (llama_rkv_plan_cache) whether to split each attention layer's cache by
// cell index into a device window (cells [0, wc)) and a host tail (cells [wc, kv_size)). The outcome (the plan)
// is recorded in the same state, for llama_rolling_kv_plan_json and the logs.
//
// The budget (per device that holds KV layers; the target is per device):
//
//   with vram_target:    avail = min(vram_target - weights, free)
//   without:             avail = free - reserve
//
// where free is the device's free memory when the cache constructor runs. The constructor runs after the model weights
// were loaded, so free already excludes them: they are subtracted from the target only, never from free. Out of avail
// come the compute buffers (not allocated yet: an estimate, see llama_rkv_compute_estimate), the caches that never
// split (the SWA cache of an iSWA model, allocated after the planning cache; the recurrent state of a hybrid model, see
// llama_rkv_note_recurrent), with a target the device runtime's own memory, and, when the cache splits, the ring
// through which the device streams the tail. The last two are the backend's figures (ggml_rkv_dev_budget,
// ggml-rolling-kv.h): the planner knows no backend. The whole KV fits: resident (the upstream cache, no ring);
// otherwise the largest window of a multiple of 256 cells that fits every device. A target that cannot hold even a
// 256-cell window is refused with the minimum, in MiB.
//
// The expected time per token of a split (the link model, at full context):
//   t_token ~ (weights + window KV + other KV) / mem_bw + tail KV / link_bw
// with mem_bw measured at plan time (a 256 MiB copy inside the device through ggml-backend) and link_bw the
// request's pcie_bw_gbps (from `rollingkv probe pcie`).
//
// The head split (head mode, llama_rkv_plan_heads): KV heads [0, h_l) of layer l on the device for every cell, heads
// [h_l, n_head_kv) in pinned host memory at the tail types. With a budget: every layer first gets one device head (a
// budget that does not hold that is refused with the head split's minimum), then heads are added one at a time to the
// layer with the fewest while they fit; all heads on the device is the resident cache. An explicit device_heads N:
// h_l = min(N, n_head_kv of l). Not for ALiBi (its slopes depend on the head index and count), layers with one KV head
// (MQA), or head sizes that are not a multiple of a cache type's block size.
//
// auto between window and head (llama_rkv_auto_compare): for the same budget both keep about the same bytes on the
// device and move the rest per token, but the window streams max(0, n_kv - wc) cells of every head and nothing while a
// sequence fits its window, and the head split streams its host heads of all n_kv cells from the first token on. The
// two tie at full context apart from each tactic's granularity (a 256-cell window step, one head of one layer); at any
// shorter n_kv the window streams less. auto compares the link model below at full context (the plan's t_token; bytes
// when a bandwidth is unknown) and averaged over a sequence that grows to full context (the window: mean max(0, n - wc)
// cells, the head split: half its host heads' cells), and takes head only when it is more than 3 % cheaper on both (and
// window wherever head cannot split; head where no window fits and the head split does), so in practice it takes the
// window.
//
// The hybrid tail (llama_rkv_plan_tail_cpu): a GPU may attend a share f of every split layer's tail (its far end)
// on the CPU while it streams the rest. The streamed part's copies run ahead across layers, overlapping everything;
// the CPU part of a layer can only start once the layer's Q exists and the layer's merge waits for it, so it adds
// to the device's own time:
//   t_token(f) ~ max(t_resident + n_layer*t_layer + f*tail/cpu_bw + n_layer*t_cpu_part_latency, (1 - f)*tail/link_bw)
// (t_resident: the device's bytes over its bandwidth; t_layer: what a layer's decode takes beyond that)
// with cpu_bw the CPU part's attention bandwidth (the request's cpu_attn_gbps, or a short calibration at plan
// time). auto takes the f (in steps of 1/64) that minimizes it, none when that gains less than 3 %. The tail grows
// with the context while the latency term does not, so auto's share is chosen again for the tail in use whenever a
// graph is built (llama_rkv_tail_cpu_frac_at: the same model with the tail's terms scaled to its cells): no CPU part
// while the tail is too short to pay for one, the full-context share once the tail is whole.
//
// Auto tail types (llama_rkv_choose_tail_types; a request's LLAMA_ROLLING_KV_TAIL_TYPE_AUTO, opt-in because a
// compressed tail is lossy): the cache describes itself and the budget is made at the window's types (the window's
// bytes, and a ring for rows never narrower than the chosen tail's), then, once the split is chosen, each auto axis
// gets:
//   nothing spills (resident):                                 the window's type
//   the floor: q8_0 for an f32/f16/bf16 window, else the window's own type (q8_0, q5_*, q4_*: compact already)
//   q4_0 (for windows wider than q4_0) where   t_link(floor) > LLAMA_RKV_AUTO_TAIL_Q4_RATIO x t_resident
// with t_link(floor) the link-only time of the split's tail at full context at the floor types (an explicit axis at its
// own type) and t_resident the device's bytes over its bandwidth (the link model above): where the link would still
// take longer than everything the device reads, q4_0 halves it again (q4_0 moves 0.53x the bytes of q8_0). A bandwidth
// unknown: the floor, saying so. A candidate type whose blocks do not divide the rows (a window split) or the KV heads
// (a head split), or that the device's streaming op does not run, falls back to the next (q4_0 -> floor -> the window's
// type). The choice is made with every plan (each context, each llama-bench instance, each simulation) from that plan's
// split, and the tail is allocated at it for the cache's life. Refused (st.error): auto with mode off, with an explicit
// window that leaves no tail, with a requested head split (mode head, device_heads) whose host heads the candidate's
// blocks do not divide.
#pragma once

#include "llama-rolling-kv.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-rolling-kv.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

struct llama_model;

// constants of the planner (not knobs)
static const size_t   LLAMA_RKV_MIB          = 1024ull*1024;
inline double llama_rkv_mib(size_t bytes) {
    return bytes/(double) LLAMA_RKV_MIB;
}
// reserve kept free on the device when the budget is the free VRAM (no vram_target): what the compute
// estimate does not cover (cuBLAS workspaces, the CUDA pool's growth for dequantized weights in large
// batches, fragmentation, other processes starting later)
static const size_t   LLAMA_RKV_VRAM_RESERVE = 1024*LLAMA_RKV_MIB;
// n_kv grows in steps of 256 cells (llama_kv_cache::get_n_kv) and the GPU kernels split the parts at
// 256-cell boundaries: a window of a multiple of 256 cells keeps whole n_kv steps on one side
static const uint32_t LLAMA_RKV_WINDOW_ALIGN = 256;
// per split layer and token, what the CPU part costs beyond its attention: Q and the mask to the host, the hand-off,
// the pool's start and merge, the result back. Measured at plan time by the device's backend
// (llama_rkv_measure_cpu_part_latency_ms); this figure, the H200's with the first hand-off (docs/perf/
// 2026-12-03-h200-hybrid-tail: 96 us per layer), only where the backend cannot measure it
static const double   LLAMA_RKV_CPU_PART_LATENCY_MS = 0.09;
// per layer and token, what a GPU's decode takes beyond reading its bytes (kernel launches, small kernels, matrices
// too small for the memory's peak): the hybrid tail's model adds it to t_resident, since a CPU part waits for its
// layer's query and the merge for it. Measured at plan time on the layer's device (llama_rkv_measure_layer_decode_ms);
// this figure, the H200's for the synthetic 28-layer model (3.45 ms resident where its bytes take 1.77 ms: docs/perf/
// 2026-12-03-h200-head-split), only where it cannot be. Without it the model thought a q4_0 tail's CPU part free and
// auto lost 23 %.
static const double   LLAMA_RKV_LAYER_DECODE_MS = 0.06;
// the small kernels of a llama-type decode layer besides its matrix products (norms, RoPE, the K/V writes, residual
// adds, the GLU, the attention's own), which the layer probe launches after the layer's matrices
static const int      LLAMA_RKV_LAYER_SMALL_KERNELS = 12;
// auto tail types: q4_0 where the tail's link-only time at the floor types exceeds this multiple of the resident time,
// i.e. where the link would still dominate the token (q4_0 then saves at least 0.47/2 = 23 % of it over q8_0)
static const double   LLAMA_RKV_AUTO_TAIL_Q4_RATIO = 1.0;

// "off", "auto", "head", "window" (llama_kv_residency_mode_name)
const char * llama_rkv_mode_name(enum llama_kv_residency_mode mode);

struct llama_rkv_layer_plan {
    int32_t  il;
    uint32_t window_cells; // per stream (kv_size when not split)
    uint32_t tail_cells;   // per stream (0 when not split)
    size_t   device_bytes; // bytes of this layer's K/V in the device (or the layer's) buffer
    size_t   host_bytes;   // bytes of this layer's K/V tail in host memory
    bool     split;
    uint32_t n_head_kv    = 0; // the layer's KV heads
    uint32_t device_heads = 0; // of them on the device (n_head_kv unless head-split)
};

// one KV layer of the planning cache as the head split sees it: the inputs, then the plan
struct llama_rkv_head_layer {
    int32_t  il                = 0;
    int32_t  dev               = -1; // index in st.devs of the budget that holds it; -1: none (the layer stays whole)
    uint32_t n_head_kv         = 0;
    size_t   head_bytes_window = 0;  // K+V bytes of one KV head for one cell and stream, at the device (window) types
    size_t   head_bytes_tail   = 0;  // the same at the tail types
    size_t   conv_head_bytes   = 0;  // f16 copy of one head's K/V per cell and stream that CUDA flash attention makes
                                     // of non-f16 K/V (GPU devices only; see llama_rkv_dev_budget::conv_cell_bytes)
    uint32_t device_heads      = 0;  // outcome: KV heads on the device (n_head_kv: not split)
    uint32_t head_k            = 0;  // K and V elements of one KV head (the planner's, for auto tail types; 0: unknown)
    uint32_t head_v            = 0;
};

// one tactic's cost for auto (llama_rkv_auto_compare), at full context
struct llama_rkv_tactic_cost {
    bool        valid             = false;
    std::string why_not;                 // why the tactic is not a candidate
    double      device_bytes      = 0.0; // read from device memory per token (weights + other KV + the device's KV)
    double      tail_bytes        = 0.0; // streamed per token at full context
    double      device_bytes_mean = 0.0; // the same averaged over a sequence that grows from 0 to full context
    double      tail_bytes_mean   = 0.0;
    double      t_token_ms        = -1.0; // the link model at full context (< 0: a bandwidth is unknown)
    double      t_token_mean_ms   = -1.0; // and averaged over the sequence
};

// one device whose memory the planner budgets: the inputs, then what the planner made of them
struct llama_rkv_dev_budget {
    std::string name;
    bool     host_memory      = false; // the "device" is host memory (CPU-only run with a vram_target)
    uint32_t n_layer          = 0;     // KV layers of the planning cache on this device
    size_t   free             = 0;     // free memory at plan time (weights already excluded)
    size_t   weights          = 0;     // model weights on this device
    size_t   compute          = 0;     // compute buffer estimate (stream_masks included)
    size_t   stream_masks     = 0;     // of compute: the per-stream attention's copy of the KQ mask beyond the
                                       // estimate's (GPU, several streams: llama_rkv_stream_mask_bytes)
    size_t   other_kv         = 0;     // caches on this device that never split (the SWA cache of an iSWA model, the
                                       // recurrent state of a hybrid model)
    size_t   recurrent        = 0;     // of other_kv: the recurrent state of a hybrid model (llama_rkv_note_recurrent)
    size_t   ring             = 0;     // the device's tail ring (the backend's figure), counted only when the cache
                                       // splits
    size_t   runtime          = 0;     // the device runtime's own memory (the backend's figure: context, library
                                       // handles, pool growth): counted against a vram_target only (NVML counts it
                                       // per process)
    size_t   row_bytes_window = 0;     // K+V bytes of one cell of one stream over this device's layers, window types
    size_t   row_bytes_tail   = 0;     // the same at the tail types
    size_t   conv_cell_bytes  = 0;     // f16 copy of one cell of one layer's K/V that flash attention makes of
                                       // non-f16 K/V (CUDA pool, one layer at a time), per stream

    // outcome
    size_t   avail            = 0;     // what KV + compute + other KV + ring may use here
    size_t   kv_budget        = 0;     // avail - compute - other KV - ring: the window's share
    size_t   kv_resident      = 0;     // the whole KV of these layers (+ flash-attention conversion)
    size_t   cell_bytes       = 0;     // device bytes per window cell, all streams
    uint32_t fit_cells        = 0;     // largest window (cells per stream) the budget holds, before alignment
    int64_t  min_target_mib   = 0;     // the smallest vram_target that gives a plan on this device
    size_t   head_kv_bytes    = 0;     // the head split: device bytes of its KV (+ flash-attention conversion)
    int64_t  min_target_mib_head = 0;  // the smallest vram_target for a head split (one KV head of every layer)
};

// the hybrid tail's share for the life of a cache (llama_kv_split::rkv_cpu): a requested share as is, or auto's model
// above, evaluated at the tail in use (llama_rkv_tail_cpu_frac_at)
struct llama_rkv_tail_cpu {
    float    frac       = 0.0f;  // the share at full context (the plan's tail_cpu_frac)
    bool     is_auto    = false; // re-chosen for the tail in use
    double   t_res_ms   = 0.0;   // the model's terms at full context
    double   t_link_ms  = 0.0;
    double   t_cpu_ms   = 0.0;
    double   latency_ms = 0.0;   // n_layer x the CPU part's latency per layer (measured, else
                                 // LLAMA_RKV_CPU_PART_LATENCY_MS)
    uint32_t tail_cells = 0;     // per stream, at full context
    // the CPU part's time for r query rows that see each cell, against one row's: slow[r - 1] (>= 1; measured for 2, 4
    // and 8 rows, between them interpolated). A decode step of several sequences over a shared prefix dots each of its
    // cells once per row: the part turns from reading memory to computing, and takes a smaller share
    float    slow[GGML_RKV_CPU_PART_MAX_Q] = { 1, 1, 1, 1, 1, 1, 1, 1 };
};
static_assert(GGML_RKV_CPU_PART_MAX_Q == 8, "llama_rkv_tail_cpu::slow lists a slowdown per row count");

// auto's share for terms t_res, t_link, t_cpu and the latency: the f in steps of 1/64 minimizing
// max(t_res + f*t_cpu + latency, (1 - f)*t_link), 0 when that gains less than 3 % over f = 0
double llama_rkv_tail_cpu_best(double t_res_ms, double t_link_ms, double t_cpu_ms, double latency_ms);

// the share of a tail of tail_cells cells (per stream) to attend on the CPU: m.frac for a request, for auto the model
// at the tail terms scaled by tail_cells/m.tail_cells (0 for an empty tail)
float llama_rkv_tail_cpu_frac_at(const llama_rkv_tail_cpu & m, uint32_t tail_cells, double rows = 1.0);

// the shortest tail (per stream, in steps of LLAMA_RKV_WINDOW_ALIGN cells, as n_kv grows) with a CPU part; 0: none
uint32_t llama_rkv_tail_cpu_from_cells(const llama_rkv_tail_cpu & m);

// the context's evaluations of one kind (llama_rkv_live::evals): an evaluation is what llama_decode queued from one
// synchronization to the next (llama-server: one batch of its loop), timed from the first decode to the synchronize
// that waited for it; the split cache's counters over the same span (zero where nothing split)
struct llama_rkv_eval_kind {
    uint64_t evals          = 0;
    uint64_t prompt_tokens  = 0;   // tokens of sequences with more than one token in the evaluation
    uint64_t decode_tokens  = 0;   // tokens of sequences with one
    uint64_t us             = 0;   // wall time, first decode to synchronized
    uint64_t steps          = 0;   // ubatches that attended a tail
    uint64_t tail_bytes     = 0;
    uint64_t streamed_bytes = 0;
    double   move_ms        = 0.0;
};

// what a split cache does under load (llama_rolling_kv_stats_json): the cache writes it as it sets every ubatch's
// inputs, the context as it decodes and synchronizes (llama_rkv_note_batch, llama_rkv_note_eval); any thread may read
// it
struct llama_rkv_live {
    mutable std::mutex mtx;
    uint64_t steps           = 0; // ubatches that attended a tail
    uint64_t tail_bytes      = 0; // tail bytes those ubatches attended, all layers (streamed + the CPU part)
    uint64_t streamed_bytes  = 0; // of them, the bytes copied over the link (the rest: the CPU part)
    uint64_t occupied_bytes  = 0; // the tail bytes in use by the streams of those ubatches
    uint64_t last_tail_bytes     = 0; // the last such ubatch's
    uint64_t last_streamed_bytes = 0;
    uint64_t last_occupied_bytes = 0;
    // of those, the tail bytes of the ubatch's own sequences (one stream holding several: only the cells one of them holds;
    // a stream per sequence: its occupied bytes)
    uint64_t last_own_bytes      = 0;
    // the most any such ubatch attended beyond its own sequences' tail bytes (every step, not a sample)
    uint64_t beyond_own_bytes_max = 0;
    uint32_t last_streams        = 0; // streams of the last ubatch, and how many of them attended as one op each
    uint32_t last_per_stream_ops = 0;
    // 256 tail cells of every split layer: the padding one stream may attend beyond its cells
    uint64_t block_bytes         = 0;
    // per stream, as of its last ubatch: cells in use on the device (window) and in host memory (tail)
    std::vector<uint32_t> device_cells;
    std::vector<uint32_t> tail_cells;
    // one stream (a unified cache: every sequence in it), as of its last ubatch: each sequence's cells on the device
    // and in the tail (a cell shared by sequences counts for each), and the runs of tail cells the ubatch read
    std::vector<uint32_t> seq_device_cells;
    std::vector<uint32_t> seq_tail_cells;
    uint32_t last_tail_runs = 0; // 0: the whole tail
    // elastic windows: each stream's window (cells it may keep on the device), and the moves so far, in cells (one row
    // of every split layer's K and V) and bytes, and the time the ubatches waited for them
    std::vector<uint32_t> window_cells;
    uint64_t promoted_cells  = 0; // tail -> device
    uint64_t demoted_cells   = 0; // device -> tail
    uint64_t relocated_cells = 0; // device -> device (a window moved in the pool)
    uint64_t moved_bytes     = 0;
    uint64_t rebalances      = 0; // ubatches before which a window changed
    double   move_ms         = 0.0;
    // where a server's time goes (llama_rkv_eval_kinds: decode, prefill, mixed), the decode evaluations again by their
    // sequences (1 to 7, then 8 or more: what a step of several clients costs against one alone), and the evaluation
    // under way
    llama_rkv_eval_kind evals[3];
    llama_rkv_eval_kind decode_by_seqs[8];
    uint64_t pending_prompt = 0;
    uint64_t pending_decode = 0;
    llama_rkv_eval_kind mark; // the cache's counters at the last evaluation's end
};

// an evaluation's kind by its tokens: decode only (every sequence one token), prompt only, or both (llama-server's
// batch of the busy slots' decode tokens and a new prompt's chunk)
enum llama_rkv_eval_kinds { LLAMA_RKV_EVAL_DECODE = 0, LLAMA_RKV_EVAL_PREFILL = 1, LLAMA_RKV_EVAL_MIXED = 2 };

struct llama_rkv_state {
    llama_rolling_kv_params req;
    // the context's test hooks (llama_init_from_model_rolling_kv_test; validated there), fixed for its lifetime: the
    // graph sets every split layer's op's tail_perturb from them, block residency's promotions read perturb_move
    llama_rolling_kv_test_hooks test = {};

    // context parameters the cache constructor does not see (llama_init_from_model_rolling_kv sets them,
    // resolved as llama_context resolves them); 0: unknown
    uint32_t n_ctx      = 0;
    uint32_t n_ubatch   = 0;
    uint32_t n_seq_max  = 1;
    bool     kv_unified = false;
    bool     swa_full   = false;

    // set by the first cache that planned with this state
    bool resolved = false;
    // a cache of this context places each sequence's cells in blocks of its own (llama-kv-cache-placement.h)
    bool placed_by_seq = false;

    // a hybrid model (llama_memory_hybrid): its recurrent layers and the bytes of their state per device (nullptr: host
    // memory), recorded before the attention cache plans (llama_rkv_note_recurrent). The state stays whole where
    // llama_memory_recurrent puts it; only the attention cache may split, and the state counts against its budget.
    bool hybrid = false;
    std::vector<int32_t> recurrent_layers;
    std::vector<std::pair<ggml_backend_dev_t, size_t>> recurrent_bytes;

    enum llama_kv_residency_mode chosen = LLAMA_KV_RESIDENCY_OFF;
    std::string reason;
    bool        eligible = true; // false: the request could not be served (flash attention off, MLA, ...)
    std::string error;           // the request was refused (no context): why

    uint32_t kv_size      = 0;
    uint32_t n_stream     = 0;
    uint32_t window_cells = 0; // per stream; 0 when resident
    uint32_t tail_cells   = 0; // per stream

    ggml_type type_k      = GGML_TYPE_COUNT;
    ggml_type type_v      = GGML_TYPE_COUNT;
    ggml_type type_k_tail = GGML_TYPE_COUNT;
    ggml_type type_v_tail = GGML_TYPE_COUNT;

    // budget (empty devs: no device was budgeted)
    bool     budgeted       = false; // the window came from the budget (not an explicit window_cells)
    size_t   reserve        = 0;
    int64_t  min_target_mib = 0;
    std::vector<llama_rkv_dev_budget> devs;
    int      ring_slots     = 0;
    size_t   ring_slot_size = 0;
    std::string compute_note; // how the compute estimate was made

    // link model (< 0: unknown)
    double      mem_bw_gbps   = -1.0;
    std::string mem_bw_source;
    double      link_bw_gbps  = -1.0;
    std::string link_bw_source;
    double      est_device_bytes = 0; // bytes read from device memory per token (weights + window + other KV)
    double      est_tail_bytes   = 0; // bytes streamed over the link per token
    double      t_resident_ms = -1.0;
    double      t_tail_ms     = -1.0;
    double      t_token_ms    = -1.0;

    // auto tail types (llama_rkv_choose_tail_types): the axes the request left to the planner (st.req holds
    // GGML_TYPE_COUNT for them, so the cache describes itself at the window's types), what the rule saw, and why
    bool        tail_auto_k      = false;
    bool        tail_auto_v      = false;
    double      tail_auto_t_res_ms  = -1.0; // t_resident and the link-only time at the floor types (< 0: unknown)
    double      tail_auto_t_link_ms = -1.0;
    std::string tail_types_reason;

    // the hybrid tail (llama_rkv_plan_tail_cpu)
    int32_t     n_threads        = 0;     // the CPU part's threads (ggml_rkv_get_cpu_threads)
    int64_t     head_k           = 0;     // K and V head sizes of the split layers (the first group's)
    int64_t     head_v           = 0;
    float       tail_cpu_frac    = 0.0f;  // the chosen share of each split layer's tail cells attended on the CPU
    std::string tail_cpu_reason;
    double      cpu_attn_gbps    = -1.0;  // the CPU part's attention bandwidth for the tail types
    double      cpu_attn_rows_gbps[3] = { -1.0, -1.0, -1.0 }; // the same at 2, 4 and 8 query rows per cell
    std::string cpu_attn_source  = "none";
    double      t_token_hybrid_ms = -1.0; // the model above at the chosen share
    double      layer_decode_ms  = -1.0;  // a decode layer's time beyond its bytes (< 0: not used yet)
    std::string layer_decode_source;
    double      cpu_part_latency_ms = -1.0; // a CPU part's cost to its layer beyond its attention (< 0: not used yet)
    std::string cpu_part_latency_source;
    llama_rkv_tail_cpu tail_cpu;          // what a cache keeps of it (llama_rkv_plan_tail_cpu)

    // the head split (head mode; auto compares it with the window)
    std::vector<llama_rkv_head_layer> head_layers; // every KV layer of the planning cache, in order
    std::string head_refuse;   // why this cache cannot split by head ("": it can)
    bool        heads_explicit = false; // device_heads came from the request
    llama_rkv_tactic_cost cost_window; // auto's comparison (valid: the tactic was a candidate)
    llama_rkv_tactic_cost cost_head;
    bool        auto_compared  = false;
    std::string auto_reason;

    std::vector<llama_rkv_layer_plan> layers;

    // elastic windows (llama-kv-window-pool.h): the streams' device cells are one pool of pool_cells
    bool     elastic    = false;
    uint32_t pool_cells = 0;
    bool     blocks     = false; // one stream's 256-cell blocks follow the load instead (llama-kv-cache-blocks.cpp)
    std::string windows_reason; // why the windows are static (a window split only)

    std::shared_ptr<llama_rkv_live> live = std::make_shared<llama_rkv_live>();

    // the context's scheduler synchronize (set by llama_context): the cache moves rows between a window and a tail
    // only after the graph before finished with them
    std::function<void()> synchronize;
};

// whether the plan splits the cache (window or head)
inline bool llama_rkv_is_split(const llama_rkv_state & st) {
    return st.chosen == LLAMA_KV_RESIDENCY_WINDOW || st.chosen == LLAMA_KV_RESIDENCY_HEAD;
}

// KV heads of layer il on the device in a head split (0: not head-split or not a layer of the plan)
uint32_t llama_rkv_device_heads(const llama_rkv_state & st, int32_t il);

// "2 of 3 KV heads on the device in 30 layers" (a head split), "" otherwise
std::string llama_rkv_heads_summary(const llama_rkv_state & st);

// layers of the planning cache on one device (dev nullptr: host memory, KV offload off)
struct llama_rkv_layer_group {
    ggml_backend_dev_t dev = nullptr;
    uint32_t n_layer          = 0;
    size_t   row_bytes_window = 0;
    size_t   row_bytes_tail   = 0;
    size_t   conv_cell_bytes  = 0; // see llama_rkv_dev_budget::conv_cell_bytes (GPU devices only)
    size_t   max_row_k_tail   = 0; // the widest layer's K and V rows at the tail types (the ring's minimum slot)
    size_t   max_row_v_tail   = 0;
    size_t   other_kv         = 0; // bytes of the caches that never split on this device (SWA cache, recurrent state)
    size_t   recurrent        = 0; // of other_kv: a hybrid model's recurrent state
    uint32_t n_kv_other       = 0; // cells per stream of those caches (their KQ mask columns)
    // shape of the group's first layer, for the flash-attention probe
    int64_t  n_embd_head_k    = 0;
    int64_t  n_embd_head_v    = 0;
    int64_t  n_head           = 0;
    int64_t  n_head_kv        = 0;
};

// what the KV cache constructor knows when it asks for a plan
struct llama_rkv_cache_desc {
    uint32_t  kv_size;
    uint32_t  n_stream;
    ggml_type type_k;
    ggml_type type_v;
    bool      v_trans;
    bool      offload;
    // a reason the cache must stay resident whatever the request (nullptr: none)
    const char * refuse;
    // the devices of the layers the cache holds (nullptr entries: CPU), and their K+V row bytes
    std::vector<ggml_backend_dev_t> layer_devs;
    size_t    row_bytes_window; // sum over layers of K+V row bytes at the window types
    size_t    row_bytes_tail;   // the same at the tail types
    // the same layers grouped by device, in order of first appearance
    std::vector<llama_rkv_layer_group> groups;
    // the head split: every layer (dev: its index in groups) and why this cache cannot split by head (nullptr: it can)
    std::vector<llama_rkv_head_layer> head_layers;
    const char * refuse_head = nullptr;
};

// A hybrid model's memory (llama_memory_hybrid) builds its attention cache, which may split, before its recurrent
// memory, which never does: this records in st the recurrent layers and the bytes of their state per device, as
// llama_memory_recurrent will allocate them (r and s rows, and a PLE row where the model has one, for mem_size x
// (1 + n_rs_seq) cells; filter: the recurrent layers, nullptr: hparams.is_recr), for the attention cache's plan to
// count against its budget. Returns st (nullptr stays nullptr: no request, the upstream cache).
llama_rkv_state * llama_rkv_note_recurrent(llama_rkv_state * st, const llama_model & model, ggml_type type_r,
        ggml_type type_s, bool offload, uint32_t mem_size, uint32_t n_rs_seq,
        const std::function<bool(int32_t)> & filter);

// window cells per stream for this cache (0: stay resident); fills the plan in st. Throws std::runtime_error
// (st.error) when the request is refused, e.g. a vram_target below the minimum.
uint32_t llama_rkv_plan_cache(llama_rkv_state & st, const llama_rkv_cache_desc & desc, const llama_model & model);

// the budget decision alone, without touching a device: st.req, st.kv_size, st.n_stream, st.reserve and the
// inputs of st.devs in; returns the window cells per stream, 0 when the whole KV fits, and sets st.error
// (returning 0) when even a 256-cell window does not fit. Fills the outcome fields of st.devs and
// st.min_target_mib.
uint32_t llama_rkv_plan_budget(llama_rkv_state & st);

// the head split on the budget of st.devs (llama_rkv_plan_budget ran): fills st.head_layers[].device_heads and the
// devices' head_kv_bytes/min_target_mib_head; false (st.error set) when one KV head of every layer does not fit
bool llama_rkv_plan_heads(llama_rkv_state & st);

// the link model of a split plan from st.devs, st.window_cells/tail_cells (window) or st.head_layers (head),
// st.mem_bw_gbps and the request's pcie_bw_gbps (host-memory devices: the tail is read at mem_bw); fills est_* and t_*
void llama_rkv_plan_estimate(llama_rkv_state & st);

struct llama_rkv_decide_in;

// the hybrid tail's share (st.tail_cpu_frac, its reason and t_token_hybrid_ms) for a split plan whose link model is
// made (llama_rkv_plan_estimate): the request's tail_cpu_frac, or for auto (< 0) the share that minimizes the model
// above; none without a split, on host memory, or for tail types the CPU part does not read
void llama_rkv_plan_tail_cpu(llama_rkv_state & st, const llama_rkv_decide_in & in);

// pinned host-to-device bandwidth of dev in GB/s from llama_rkv_time_link_copies (256 MiB; once per device and
// process); < 0 when it could not be measured
double llama_rkv_measure_link_bw(ggml_backend_dev_t dev, std::string * how);

// the link copies: runs per size (the median run's figure is kept), and the copies of the largest size in flight while
// under_load is called
static const int LLAMA_RKV_LINK_RUNS        = 3;
static const int LLAMA_RKV_LINK_LOAD_COPIES = 4;

// Timed copies between a GPU and its backend's pinned host memory (ggml_backend_dev_host_buffer_type, where tails
// live), through ggml-backend alone: what both the planner's link figure and llama_rolling_kv_measure_link measure.
// For each size, host-to-device (into h2d_gbps) then device-to-host (into d2h_gbps; nullptr: not timed): one warm-up
// copy, then LLAMA_RKV_LINK_RUNS runs of reps[i] copies queued back to back on one backend stream, each run ended by
// one synchronize; the median run's GB/s (10^9 B/s). Then, when under_load is given, it is called while
// LLAMA_RKV_LINK_LOAD_COPIES host-to-device copies of the largest size are in flight. *pinned: whether the host memory
// was pinned (a backend that cannot pin gives pageable memory). false with *err when nothing was measured.
bool llama_rkv_time_link_copies(ggml_backend_dev_t dev, const size_t * sizes, const int32_t * reps, size_t n_sizes,
                                double * h2d_gbps, double * d2h_gbps, void (*under_load)(void *), void * user_data,
                                bool * pinned, std::string * err);

// what dev spends on the streaming op beyond its tensors, as its backend reports it (GGML_RKV_DEV_BUDGET_PROC,
// ggml-rolling-kv.h): the ring it streams a tail through, for tails whose widest layer has these K/V rows (bytes per
// stream, n_stream streams), and its runtime's memory; zeros for host memory and for backends that report nothing
ggml_rkv_dev_budget llama_rkv_backend_budget(ggml_backend_dev_t dev, size_t row_k_tail, size_t row_v_tail,
                                             uint32_t n_stream);

// the buffer of a KV cache context: for one that holds streamed tails (a GPU's pinned host tails), the memory its
// backend offers for them (GGML_RKV_HOST_ALLOC_PROC, ggml-rolling-kv.h: 2 MiB pages the CPU part of a hybrid tail reads
// at the memory's speed), else ggml_backend_alloc_ctx_tensors_from_buft's; nullptr when neither could allocate
ggml_backend_buffer_t llama_rkv_alloc_ctx_tensors(ggml_context * ctx, ggml_backend_buffer_type_t buft);

// model weights in the buffers of dev (host memory when dev is a CPU device)
size_t llama_rkv_weights_bytes(const llama_model & model, ggml_backend_dev_t dev);

// What one op per stream (llama_rkv_build_attn_mha with a per-stream layout: several streams) adds to a GPU's compute
// buffer beyond the one KQ mask the compute estimate counts. The mask is an f16 graph input, which the scheduler keeps
// on the CPU backend; the op of stream s reads the mask's rows of s through a view, one per stream shared by every
// layer (llama_rkv_input_views), and the scheduler copies each view to the GPU once: together one mask, in place of the
// mask upstream's attention reads. A window split reads the mask only through those views (nothing more); a head
// split's device heads read it whole as well (upstream's attention), beside its host heads' views: one more mask. The
// budget is made before auto chooses between the two, so a GPU with several streams counts that one mask, n_tokens x
// n_kv f16 (n_kv: the cells per stream), either way: one mask more than a window split holds. 0 for one stream (a
// unified cache, an elastic pool of one: the op reads the mask itself) and host memory. The synthetic 28-layer model at
// -c 102400 -np 4 (25600 cells per stream), 512-token ubatches: 25 MiB. (A view per layer had made it a copy of the
// whole mask per layer: 27 x 25 MiB more.)
size_t llama_rkv_stream_mask_bytes(uint32_t n_tokens, uint32_t n_kv, uint32_t n_stream);

// the ubatch of the compute estimate: min(n_ubatch, n_ctx) of the context (512 when unknown)
uint32_t llama_rkv_estimate_tokens(const llama_rkv_state & st);

// compute buffer estimate for a device holding KV layers (see the definition for the formula)
size_t llama_rkv_compute_estimate(const llama_model & model, const llama_rkv_state & st, uint32_t n_kv,
        uint32_t n_kv_other, bool has_output, std::string * note);

// whether dev runs GGML_OP_STREAMING_FLASH_ATTN for this layer shape and these types (the scheduler would
// otherwise run it on the CPU, copying the window to the host every step); head: the head split's op (an empty window,
// a tail of n_head_kv - 1 heads of every cell)
bool llama_rkv_dev_supports_split(ggml_backend_dev_t dev, const llama_rkv_layer_group & g, uint32_t n_stream,
        uint32_t n_ubatch, ggml_type type_k, ggml_type type_v, ggml_type type_k_tail, ggml_type type_v_tail,
        bool head = false);

// device memory bandwidth in GB/s (10^9 B/s, bytes read + written) from timed copies inside dev (host memory
// for a CPU device) through ggml-backend; once per device and process; < 0 when it could not be measured
double llama_rkv_measure_mem_bw(ggml_backend_dev_t dev, std::string * how);

// the decision on budget inputs that are already known (st.devs filled, or none to budget): what the cache constructor
// (llama_rkv_plan_cache, from the devices) and the planner's test harness (on given figures) share
struct llama_rkv_decide_in {
    const char * refuse = nullptr;  // why this cache cannot split (not eligible), nullptr: eligible
    std::string  op_unsupported;    // a device that cannot run the streaming op, why ("": all can)
    std::string  head_op_unsupported; // the same for the head split's streaming op (an empty window, the host heads)
    std::string  no_device;         // why no device could be budgeted (st.devs empty)
    bool         host_memory = false; // st.devs are host memory (a run without GPU)
    bool         quiet       = false; // no logs
    size_t       reserve     = LLAMA_RKV_VRAM_RESERVE; // kept free when there is no vram_target
    std::function<double(std::string *)> measure; // device memory bandwidth; called only for a split
    // the hybrid tail's inputs when the request leaves them out: the CPU part's attention bandwidth and the link's,
    // called only for an auto split on a GPU (unset: unknown)
    std::function<double(std::string *)> measure_cpu_attn;
    std::function<double(std::string *)> measure_link;
    // the CPU part's attention bandwidth for n_rows query rows that each see every cell (unset: as one row's)
    std::function<double(int n_rows, std::string *)> measure_cpu_attn_rows;
    // and the per-layer figures of its time model (llama_rkv_measure_layer_decode_ms, _cpu_part_latency_ms; unset or
    // < 0: the constants above)
    std::function<double(std::string *)> measure_layer_decode;
    std::function<double(std::string *)> measure_cpu_part_latency;
    // auto tail types: why a device cannot run the streaming op with these tail types ("": it can; unset: every device
    // can)
    std::function<std::string(ggml_type type_k_tail, ggml_type type_v_tail, bool head)> tail_op_unsupported;
};

// moves a request's LLAMA_ROLLING_KV_TAIL_TYPE_AUTO axes into st.tail_auto_k/v (st.req then holds GGML_TYPE_COUNT for
// them: the window's type until the planner chooses); before the cache describes itself
void llama_rkv_take_auto_tail(llama_rkv_state & st);

// the tail types of a split plan for the axes the request left to the planner (see the header), with st.type_k_tail/
// type_v_tail, the devices' row_bytes_tail and the head layers' head_bytes_tail set to them; false (st.error) when a
// requested head split's host heads cannot take the type
bool llama_rkv_choose_tail_types(llama_rkv_state & st, const llama_rkv_decide_in & in);

// st.req, st.kv_size, st.n_stream, st.type_k/v and the inputs of st.devs in: the window cells per stream (0:
// resident), the plan in st (st.error set, 0 returned, when the request is refused)
uint32_t llama_rkv_decide(llama_rkv_state & st, const llama_rkv_decide_in & in);

//
// the planner's pieces shared between its files (llama-kv-residency*.cpp), not called from elsewhere
//

// a GPU or an integrated GPU (not the CPU, not null)
bool llama_rkv_dev_is_gpu(ggml_backend_dev_t dev);

// The hybrid tail's CPU part lives in the CPU backend: libllama asks the CPU backend's registry for its functions by
// name (GGML_RKV_CPU_*_PROC, ggml-rolling-kv.h), one lookup for all of them (llama-kv-residency-probe.cpp): it links no
// CPU code, and the CPU backend may be a module. Without them (no CPU backend registered yet, or one without the CPU
// part) there is no CPU part: not available, 0 threads, 0 runs, nothing supported, a bandwidth of -1.
bool     llama_rkv_cpu_part_available();
int      llama_rkv_cpu_threads();        // ggml_rkv_get_cpu_threads
uint64_t llama_rkv_cpu_part_runs();      // ggml_rkv_cpu_part_runs
// what the GPU backends' copy plans streamed (GGML_RKV_STREAMED_BYTES_PROC), summed over the backends that count it
struct llama_rkv_plan_bytes {
    bool     available = false; // some backend counts them (none: a CPU build)
    uint64_t total = 0, last = 0, plans = 0;
};
llama_rkv_plan_bytes llama_rkv_streamed_plan_bytes();
bool     llama_rkv_cpu_part_supported(ggml_type type_k, ggml_type type_v, int64_t DK, int64_t DV);
double   llama_rkv_cpu_attn_measure_gbps(int n_threads, ggml_type type, size_t bytes, int n_rows = 1);

// the CPU part's attention bandwidth for a tail type on n_threads threads (<= 0: llama_rkv_cpu_threads), once per
// process for each (ggml_rkv_cpu_attn_measure_gbps)
double llama_rkv_measure_cpu_attn_bw(int n_threads, ggml_type type, std::string * how, int n_rows = 1);

// a decode layer's time beyond reading its bytes on dev (the layer il's weight matrices times one token, and the small
// kernels), in ms at the memory bandwidth mem_bw_gbps; < 0: not measured (how says why). Once per process per layer
double llama_rkv_measure_layer_decode_ms(const llama_model & model, int il, ggml_backend_dev_t dev, double mem_bw_gbps,
        std::string * how);

// a CPU part's cost to its decode layer beyond its attention on dev, by its backend (GGML_RKV_CPU_PART_LATENCY_PROC);
// < 0: the backend cannot measure it. Once per process per device
double llama_rkv_measure_cpu_part_latency_ms(ggml_backend_dev_t dev, std::string * how);

// bytes read from device memory and streamed over the link per token at n_kv cells of every stream, for a window of wc
// cells (window) or the head split of st.head_layers (head), over the budgeted devices; mean: averaged over a sequence
// that grows from 0 to n_kv cells instead
void llama_rkv_token_bytes(const llama_rkv_state & st, bool head, uint32_t wc, double n_kv, double & device,
        double & tail, bool mean = false);

// ms per token for the bytes of llama_rkv_token_bytes (< 0: a bandwidth is unknown)
double llama_rkv_token_ms(double device, double tail, double mem_bw, double link_bw);

// st.link_bw_gbps and its source from the request (pcie_bw_gbps) or, on host memory, the memory bandwidth
void llama_rkv_link_source(llama_rkv_state & st);

// every layer's KV heads on the device (no head split)
void llama_rkv_heads_whole(llama_rkv_state & st);

// device bytes of the head split's KV on device di (+ the f16 copy flash attention makes of one layer's device heads)
size_t llama_rkv_head_dev_bytes(const llama_rkv_state & st, int32_t di);

// n_rows rows of n_per_row elements from src_type into dst_type, through f32 (state I/O, and the moves of rows between
// a window and a tail of other types), on up to max_threads threads (0: up to 16, as the rows allow); false: a type that
// cannot be converted so
bool llama_rkv_convert_rows(ggml_type src_type, ggml_type dst_type, const void * src, void * dst, int64_t n_rows,
                            int64_t n_per_row, int max_threads = 0);


// the plan's tail-dependent figures at tail types tk/tv (auto tail types)
void llama_rkv_retype_tail(llama_rkv_state & st, ggml_type tk, ggml_type tv);
