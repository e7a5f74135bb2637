// rollingkv: public extension API of the patched libllama.
//
// Kept out of llama.h on purpose: llama-cpp-python 0.3.36 mirrors llama_context_params field by
// field and passes it by value, so our parameters travel through new functions, never new fields.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Version of the extension API below; bumped on any change to it.
#define LLAMA_ROLLING_KV_API_VERSION 11

// API 7: type_k_tail / type_v_tail may ask the planner to choose the tail's type (opt-in: a compressed tail is lossy).
// When the plan spills, each axis asked for gets q8_0 where the window is f32/f16/bf16 (the floor) and the window's own
// type otherwise, or q4_0 (for windows wider than q4_0) where the tail at those types would take longer over the link
// than a token's resident part times LLAMA_RKV_AUTO_TAIL_Q4_RATIO (llama-kv-residency.h); nothing spills: the window's
// type. The plan JSON's "tail_types" says what was chosen and why. Refused with mode off, with window_cells that leave
// no tail and with a requested head split whose host heads the type's blocks do not divide.
#define LLAMA_ROLLING_KV_TAIL_TYPE_AUTO ((enum ggml_type) (GGML_TYPE_COUNT + 1))

// "rollingkv api=<n> pin=<llama.cpp commit> series=<patch series hash>": identifies the build.
LLAMA_API const char * llama_rolling_kv_build_info(void);

LLAMA_API int32_t llama_rolling_kv_api_version(void);

// sizeof() of the structs llama-cpp-python mirrors in ctypes: lets bindings prove the layout matches.
LLAMA_API size_t llama_rolling_kv_sizeof_context_params(void);
LLAMA_API size_t llama_rolling_kv_sizeof_model_params(void);

//
// KV residency: each attention layer's cache split by key position into a device-resident window
// (cells [0, wc)) and a tail in pinned host memory (cells [wc, kv_size)), possibly of another type (window mode),
// or by KV head: heads [0, h) of every cell on the device, the others in pinned host memory (head mode).
//

enum llama_kv_residency_mode {
    LLAMA_KV_RESIDENCY_OFF    = 0, // the upstream cache, untouched (bit-identical to an unpatched build)
    LLAMA_KV_RESIDENCY_AUTO   = 1, // resident when the KV fits the budget, else window or head, whichever costs less
                                   // (API 5)
    LLAMA_KV_RESIDENCY_HEAD   = 2, // always split by KV head: each layer's first heads on the device, the rest in host
                                   // memory
    LLAMA_KV_RESIDENCY_WINDOW = 3, // always split: device window + host tail
};

// API 7: how the windows of a window split with several streams (llama-server's slots without a unified cache) share
// the device cells
enum llama_kv_window_policy {
    // one pool of n_stream * window cells that follows the load: a stream's window grows into cells other streams do
    // not use (its oldest tail blocks promoted), shrinks to the cells its sequence uses, and an idle stream's window is
    // demoted to host memory when an active one needs the room. Exact between rows of one type; a quantized tail's rows
    // are converted (quantized when demoted, dequantized when promoted). One stream (a unified cache): static
    LLAMA_KV_WINDOWS_ELASTIC = 0,
    LLAMA_KV_WINDOWS_STATIC  = 1, // every stream keeps its own window of window cells, used or not
    // block residency (opt-in): one stream holding several sequences (a unified cache) keeps its window as a pool of
    // 256-cell slots, and the blocks its ubatches write and read move onto the device, idle ones back to the host
    // (llama-kv-cache-blocks.cpp); several streams: as elastic
    LLAMA_KV_WINDOWS_BLOCKS  = 2,
};

// API 11: where a cache whose one stream holds several sequences (a unified cache: llama-server's default) puts a
// ubatch's tokens. Upstream's find_slot takes the first free cells from the stream's head, so the sequences decoding
// side by side share every 256-cell block; a split cache reads, streams and moves whole blocks, so each sequence's own
// blocks are what keeps a ubatch's traffic to its own sequences' cells (llama-kv-cache-placement.cpp). The same
// tokens and masks either way; on the CPU the rounding follows the cells' order, so a resident reference of a placed
// split asks for SEQUENCES.
enum llama_kv_placement {
    LLAMA_KV_PLACEMENT_AUTO      = 0, // SEQUENCES for a window split, upstream's otherwise (the default)
    LLAMA_KV_PLACEMENT_UPSTREAM  = 1, // upstream's find_slot
    LLAMA_KV_PLACEMENT_SEQUENCES = 2, // each sequence's cells in blocks of its own, in any cache (a split one or not)
};

struct llama_rolling_kv_params {
    enum llama_kv_residency_mode mode;
    // total MiB this process may use on each device that holds KV layers: weights + KV + compute buffers +
    // the streaming op's staging ring; <= 0: the free VRAM when the cache is created, minus a reserve
    int64_t        vram_target_mib;
    int64_t        window_cells;    // > 0: explicit window size in cells per stream; 0: the planner decides
    enum ggml_type type_k_tail;     // GGML_TYPE_COUNT: same type as the window's K; LLAMA_ROLLING_KV_TAIL_TYPE_AUTO:
                                    // the planner's (API 7)
    enum ggml_type type_v_tail;     // GGML_TYPE_COUNT: same type as the window's V; LLAMA_ROLLING_KV_TAIL_TYPE_AUTO:
                                    // the planner's (API 7)
    float          pcie_bw_gbps;    // host->device bandwidth for the planner; <= 0: unknown (auto measures it)
    // the hybrid tail: the share of each split layer's tail cells (its far end, in 256-cell steps) that a GPU
    // attends on the CPU while it streams the rest. < 0: auto (the planner picks it from the link and CPU attention
    // bandwidths and the per-layer cost of a CPU part; the default: none where it would gain < 3 %); 0: off; 1: the
    // whole tail on the CPU. Decode batches only; exact either way.
    float          tail_cpu_frac;
    float          cpu_attn_gbps;   // the CPU part's attention bandwidth (GB/s) for auto; <= 0: measured at plan time
    // API 5: the head split. > 0: KV heads of every layer kept on the device (min(device_heads, the layer's KV heads);
    // the others in pinned host memory, at the tail types); with auto it means head mode. 0: the planner decides (head
    // mode: from the budget, per layer). Refused with window mode, with window_cells and with off.
    int32_t        device_heads;
    enum llama_kv_window_policy windows; // API 7 (default: elastic)
    enum llama_kv_placement     placement; // API 11 (default: auto)
};

LLAMA_API struct llama_rolling_kv_params llama_rolling_kv_default_params(void);

// llama_init_from_model with residency parameters (rkv == NULL: defaults). Returns NULL on failure,
// e.g. an impossible window, an unsupported tail type or a vram_target below the minimum, after logging
// why (llama_rolling_kv_last_error returns the message).
// API 8: the test hooks (llama_rolling_kv_test_hooks, below) are read once here, from the environment, so that every
// tool that creates its context through this function (llama-server, llama-bench, the gates' runners) takes them
// without a flag of its own: ROLLINGKV_DEBUG_PERTURB_TAIL=x (perturb_tail) and ROLLINGKV_DEBUG_PERTURB_MOVE=1|2
// (perturb_move); unset or empty: off; a value that is not one of those: NULL, with the variable named in the error.
LLAMA_API struct llama_context * llama_init_from_model_rolling_kv(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv);

// API 8: test hooks, for the must-fail controls of the tests and gates. Each makes a split cache's outputs WRONG on
// purpose, so that a comparison with the resident cache can prove it fails; none has any other use. They are
// parameters of a context, fixed for its lifetime (no kernel reads the environment).
struct llama_rolling_kv_test_hooks {
    // every tail key's attention score (after scale, softcap and mask) times (1 + perturb_tail) before the softmax, in
    // every split layer's streaming op (its tail_perturb parameter, ggml_streaming_flash_attn_set_tail_perturb), on
    // every backend; finite and > -1; 0: off
    float   perturb_tail;
    // block residency (LLAMA_KV_WINDOWS_BLOCKS): every block promotion writes K rows wrong on the device: 1, the
    // block's second row takes its first one's; 2, every row takes the next one's (an offset bug); 0: off
    int32_t perturb_move;
};

// llama_init_from_model_rolling_kv with test hooks (test == NULL: none). A hook out of range: NULL, and
// llama_rolling_kv_last_error says which.
LLAMA_API struct llama_context * llama_init_from_model_rolling_kv_test(
        struct llama_model * model,
        struct llama_context_params params,
        const struct llama_rolling_kv_params * rkv,
        const struct llama_rolling_kv_test_hooks * test);

// Why the last llama_init_from_model_rolling_kv(_test) of this thread returned NULL, or (API 9) why its last
// llama_rolling_kv_measure_link did not measure ("" after a success).
LLAMA_API const char * llama_rolling_kv_last_error(void);

// The residency plan of a context as JSON: mode requested and chosen ("off": the upstream cache,
// "resident": the whole cache on the device, "window" or "head": split), the reason, eligibility, window and tail
// cells and types, the head split (KV heads on the device and in host memory per layer), bytes on device and on
// host per layer, auto's comparison of the two splits, the budget terms (target, free, weights,
// compute estimate, other caches, staging ring, reserve, minimum target) per device, the measured device
// memory bandwidth, the link bandwidth and the expected ms/token of a split. Writes at most buf_size
// bytes including the terminating NUL; returns the full length (excluding NUL), or -1 if ctx is NULL.
LLAMA_API int32_t llama_rolling_kv_plan_json(const struct llama_context * ctx, char * buf, size_t buf_size);

// API 6: what a split cache does under load, as JSON (safe to call from any thread while the context decodes):
// {"split":bool,"window_cells":n,"n_stream":n,"steps":n (ubatches that attended a tail),"tail_bytes_total":n,
// "streamed_bytes_total":n,"occupied_bytes_total":n (the tail bytes in use by those ubatches' streams),
// "last":{"streams":n,"per_stream_ops":n,"tail_bytes":n,"streamed_bytes":n,"occupied_bytes":n},"block_bytes":n
// (256 tail cells of every split layer),"windows":"elastic"|"static","pool_cells":n,"moves":{"rebalances":n,
// "promoted_cells":n,"demoted_cells":n,"relocated_cells":n,"bytes":n,"ms":x} (API 7: elastic windows' moves so far),
// "slots":[{"stream":i,"device_cells":n,"tail_cells":n,"window_cells":n}, ...],"seqs":[{"seq":i,"device_cells":n,
// "tail_cells":n}, ...] (one stream: each sequence's cells), "evals":{KIND:{...}, ...}}. A batch of several streams
// attends one op per stream over that stream's own cells, so tail_bytes exceeds occupied_bytes by less than block_bytes
// per stream. API 10: "evals" says where the context's time went, for every context with residency parameters (a
// resident one too): an evaluation is what llama_decode queued between two synchronizations (llama-server: one batch of
// its loop), of KIND "decode" (every sequence of it one token), "prefill" (none one token) or "mixed" (both: busy
// slots' decode tokens beside a new prompt's chunk), each {"evals":n,"prompt_tokens":n,"decode_tokens":n,"ms":x (first
// decode to synchronized),"steps":n,"tail_bytes":n,"streamed_bytes":n,"move_ms":x (the split cache's counters over
// those evaluations)}, and beside the kinds "decode_by_seqs":[8 of the same] (the decode evaluations of 1, 2, ... 7,
// then 8 or more sequences). API 11: "last" also has "own_bytes", the tail bytes of the ubatch's own sequences (one
// stream holding several: the tail cells one of them holds; else its streams' occupied bytes): what its runs must read;
// and "beyond_own_bytes_max" beside it, the most any ubatch attended beyond its own (every ubatch, not a sample).
// Same return convention as llama_rolling_kv_plan_json.
LLAMA_API int32_t llama_rolling_kv_stats_json(const struct llama_context * ctx, char * buf, size_t buf_size);

// The plan's main figures without JSON (for tools such as llama-bench): what llama_rolling_kv_plan_json reports at
// its top level. Returns false if ctx or info is NULL. A context created without residency parameters reports
// mode_requested and mode_chosen "off", nothing split.
struct llama_rolling_kv_plan_info {
    enum llama_kv_residency_mode mode_requested;
    const char *   mode_chosen;    // "off" (the upstream cache), "resident", "window" or "head" (split), "refused";
                                   // static storage
    bool           split;          // window or head
    uint32_t       kv_size;        // cells per stream
    uint32_t       n_stream;
    uint32_t       window_cells;   // per stream; 0 when not split
    uint32_t       tail_cells;     // per stream; 0 when not split
    enum ggml_type type_k_tail;    // GGML_TYPE_COUNT when unknown; the chosen type for an auto request
    enum ggml_type type_v_tail;
    size_t         device_bytes;   // K/V bytes of all layers in their device (window) buffers
    size_t         host_bytes;     // K/V bytes of all layers' tails in host memory
    float          tail_cpu_frac;  // the chosen share of each tail attended on the CPU (0: none)
    // API 5: a head split (0 and 0 otherwise), summed over the cache's layers
    uint32_t       heads_device;   // KV heads kept on the device
    uint32_t       heads_host;     // KV heads in host memory (every cell of them is "tail")
};

LLAMA_API bool llama_rolling_kv_plan_get(const struct llama_context * ctx, struct llama_rolling_kv_plan_info * info);

// The CPU part's attention bandwidth on this machine, as the planner's auto split measures it: GB/s of K+V rows
// read over a 256 MiB synthetic tail of `type` (f16, q8_0 or q4_0) on n_threads threads (<= 0: the hardware's
// concurrency, at most 16). < 0 when the CPU part does not read that type.
LLAMA_API double llama_rolling_kv_measure_cpu_attn_gbps(int32_t n_threads, enum ggml_type type);

// API 9: a GPU's host<->device link as a split cache uses it: copies between the device and its backend's pinned host
// memory (the memory a host tail lives in), timed through ggml-backend (the copies the planner times for its own link
// figure; no backend-specific code). For each size, host-to-device for every size first, then device-to-host: one
// warm-up copy, then 3 runs of reps[i] copies queued back to back on one backend stream, each run ended by one
// synchronize; the median run's GB/s (10^9 B/s).
enum llama_rolling_kv_link_status {
    LLAMA_ROLLING_KV_LINK_OK        = 0,
    LLAMA_ROLLING_KV_LINK_NO_GPU    = 1, // the library sees no GPU (a build without a GPU backend, no driver, or every
                                         // device hidden, e.g. CUDA_VISIBLE_DEVICES=)
    LLAMA_ROLLING_KV_LINK_NOT_FOUND = 2, // GPUs, but none is `device`
    LLAMA_ROLLING_KV_LINK_FAILED    = 3, // bad arguments, no pinned host memory, no room on the device for the copies
};

#define LLAMA_ROLLING_KV_LINK_MAX_SIZES 8

struct llama_rolling_kv_link_figures {
    char   device[64];       // the ggml device measured ("CUDA0")
    char   description[128]; // its description ("NVIDIA H100 80GB HBM3")
    char   device_id[64];    // its PCI bus id as the backend reports it ("0000:3b:00.0"); "" when it reports none
    double h2d_gbps[LLAMA_ROLLING_KV_LINK_MAX_SIZES]; // per size, in the order of sizes; 0 past n_sizes
    double d2h_gbps[LLAMA_ROLLING_KV_LINK_MAX_SIZES];
};

// device: a GPU's ggml name ("CUDA0") or its PCI bus id ("0000:3b:00.0", either case); NULL or "": the first GPU.
// sizes[i] bytes per copy and reps[i] >= 1 copies per run, for 1 to LLAMA_ROLLING_KV_LINK_MAX_SIZES sizes.
// under_load (NULL: none) is called once, after the timed copies, while 4 host-to-device copies of the largest size
// are in flight: GPUs lower their link's generation when idle, so a caller reads the link's state there (NVML).
// Returns an llama_rolling_kv_link_status; other than OK, out holds no figures and llama_rolling_kv_last_error says
// why. A backend failing a copy (a lost device) may end the process, as any ggml-backend call can.
LLAMA_API int32_t llama_rolling_kv_measure_link(
        const char    * device,
        const size_t  * sizes,
        const int32_t * reps,
        int32_t         n_sizes,
        void         (* under_load)(void * user_data),
        void          * user_data,
        struct llama_rolling_kv_link_figures * out);

LLAMA_API const char * llama_kv_residency_mode_name(enum llama_kv_residency_mode mode);
// -1 when s names no mode ("off", "auto", "head", "window")
LLAMA_API int32_t llama_kv_residency_mode_from_str(const char * s);

#ifdef __cplusplus
}
#endif
