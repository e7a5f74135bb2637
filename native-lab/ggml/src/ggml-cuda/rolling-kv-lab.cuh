// rolling-KV lab switches: the lab series only (native-lab/, applied by `rollingkv build --lab`; a product build has
// neither these switches nor the code they select)
//
// Every switch is an environment variable read ONCE per process, on the first call of ggml_cuda_rkv_lab() (as the
// product's knobs, ggml-rolling-kv-impl.h); unset or empty: off. ROLLINGKV_DEBUG_SKIP_COPY=1 speed probe, WRONG
// outputs: issue no tail copies (the attention reads stale slots)
//   ROLLINGKV_DEBUG_SKIP_TAIL_ATTN=1    speed probe, WRONG outputs: copy the tail but attend over none of its chunks
//   ROLLINGKV_DEBUG_NO_RUNAHEAD=1       A/B: each op streams only its own tail (no copy plan across the graph's ops)
//   ROLLINGKV_DEBUG_NO_PRELAUNCH=1      A/B: no tail copies before a graph is launched, all are forked inside it
//   ROLLINGKV_DEBUG_CHUNK_CELLS=N the op copies a host tail in chunks of N cells (rounded up to 256) instead of as
//                                       few as the slots hold: many chunks, slot reuse and copies running ahead across
//                                       ops on small tails (0, the default: off)
//   ROLLINGKV_DEBUG_PROFILE=1           the GPU timeline profile (rolling-kv-profile.cu; its hooks: lab patches)
//   ROLLINGKV_DEBUG_PROFILE_HOLD_US=N   how long the profile holds an eager graph on the GPU (default 20000)
#pragma once

#include <cstdint>

struct ggml_cuda_rkv_lab_knobs {
    bool    skip_copy;       // ROLLINGKV_DEBUG_SKIP_COPY
    bool    skip_tail_attn;  // ROLLINGKV_DEBUG_SKIP_TAIL_ATTN
    bool    no_runahead;     // ROLLINGKV_DEBUG_NO_RUNAHEAD
    bool    no_prelaunch;    // ROLLINGKV_DEBUG_NO_PRELAUNCH
    int64_t chunk_cells;     // ROLLINGKV_DEBUG_CHUNK_CELLS; 0: off
    bool    profile;         // ROLLINGKV_DEBUG_PROFILE
    int64_t profile_hold_us; // ROLLINGKV_DEBUG_PROFILE_HOLD_US
};

// the lab switches of this process, read from the environment on the first call (thread-safe)
const ggml_cuda_rkv_lab_knobs & ggml_cuda_rkv_lab();
