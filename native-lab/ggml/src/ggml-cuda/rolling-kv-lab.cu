// rolling-KV lab switches (see rolling-kv-lab.cuh)

#include "rolling-kv-lab.cuh"

#include "ggml-impl.h"

#include <cstdlib>

// an integer variable, atoi and clamped to [lo, hi] as the product's knobs (ggml-rolling-kv.c); unset or empty: def
static int rkv_lab_env_int(const char * name, int def, int lo, int hi) {
    const char * v = getenv(name);
    if (!v || !*v) {
        return def;
    }
    const int x = atoi(v);
    return x < lo ? lo : x > hi ? hi : x;
}

static ggml_cuda_rkv_lab_knobs rkv_lab_read() {
    ggml_cuda_rkv_lab_knobs k = {};
    k.skip_copy       = rkv_lab_env_int("ROLLINGKV_DEBUG_SKIP_COPY",       0, 0, 1) == 1;
    k.skip_tail_attn  = rkv_lab_env_int("ROLLINGKV_DEBUG_SKIP_TAIL_ATTN",  0, 0, 1) == 1;
    k.no_runahead     = rkv_lab_env_int("ROLLINGKV_DEBUG_NO_RUNAHEAD",     0, 0, 1) == 1;
    k.no_prelaunch    = rkv_lab_env_int("ROLLINGKV_DEBUG_NO_PRELAUNCH",    0, 0, 1) == 1;
    k.chunk_cells     = rkv_lab_env_int("ROLLINGKV_DEBUG_CHUNK_CELLS",     0, 0, 1 << 30);
    k.profile         = rkv_lab_env_int("ROLLINGKV_DEBUG_PROFILE",         0, 0, 1) == 1;
    k.profile_hold_us = rkv_lab_env_int("ROLLINGKV_DEBUG_PROFILE_HOLD_US", 20000, 0, 10000000);
    if (k.profile_hold_us <= 0) {
        k.profile_hold_us = 20000;
    }
    if (k.skip_copy || k.skip_tail_attn) {
        GGML_LOG_WARN("rolling KV lab: %s%s: a speed probe, the outputs of a streamed tail are WRONG\n",
                k.skip_copy ? "ROLLINGKV_DEBUG_SKIP_COPY=1 " : "",
                k.skip_tail_attn ? "ROLLINGKV_DEBUG_SKIP_TAIL_ATTN=1" : "");
    }
    return k;
}

const ggml_cuda_rkv_lab_knobs & ggml_cuda_rkv_lab() {
    static const ggml_cuda_rkv_lab_knobs knobs = rkv_lab_read(); // thread-safe (C++11 magic static)
    return knobs;
}
