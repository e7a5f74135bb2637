// rollingkv: the values of the KV residency flags, parsed once for every tool (common/arg.cpp for llama-server and the
// other common-based tools, llama-bench for each value of its comma-separated lists).
//
// A C++ companion of llama-rolling-kv.h, as ggml-cpp.h is of ggml.h: header-only inline functions over the extension
// API, no symbols of their own, so the library's ABI and LLAMA_ROLLING_KV_API_VERSION do not depend on it. Each parser
// returns the value for llama_rolling_kv_params, or throws std::invalid_argument with the message the tools print.
#pragma once

#ifndef __cplusplus
#error "llama-rolling-kv-arg.h is C++ only"
#endif

#include "llama-rolling-kv.h"
#include "ggml-rolling-kv.h"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

// --kv-residency-mode {auto,head,window,off}
inline enum llama_kv_residency_mode llama_rolling_kv_arg_mode(const std::string & value) {
    const int32_t mode = llama_kv_residency_mode_from_str(value.c_str());
    if (mode < 0) {
        throw std::invalid_argument("unknown KV residency mode: " + value + " (allowed: auto, head, window, off)");
    }
    return (enum llama_kv_residency_mode) mode;
}

// an integer >= 0 (--vram-target, --kv-window-cells); flag names it in the message
inline int64_t llama_rolling_kv_arg_count(const std::string & value, const char * flag) {
    size_t pos = 0;
    long long v = 0;
    try {
        v = std::stoll(value, &pos);
    } catch (const std::exception &) {
        pos = 0;
    }
    if (pos != value.size() || value.empty()) {
        throw std::invalid_argument(std::string(flag) + ": not an integer: " + value);
    }
    if (v < 0) {
        throw std::invalid_argument(std::string(flag) + " must be >= 0, got " + value);
    }
    return v;
}

// --kv-device-heads N: the KV heads of each layer on the device. zero_ok: 0 (the planner decides) is a value, as in
// llama-bench's lists, which sweep it; otherwise it is refused (llama-server: leave the flag out instead)
inline int32_t llama_rolling_kv_arg_device_heads(const std::string & value, bool zero_ok) {
    const int64_t n = llama_rolling_kv_arg_count(value, "--kv-device-heads");
    if (zero_ok) {
        if (n > INT32_MAX) {
            throw std::invalid_argument("--kv-device-heads is too large: " + value);
        }
    } else if (n == 0 || n > INT32_MAX) {
        throw std::invalid_argument("--kv-device-heads must be a number of KV heads >= 1, got " + value);
    }
    return (int32_t) n;
}

// one of a flag's named values (--kv-windows, --kv-placement): the value of the name given, or the message naming the
// flag and every name it takes
template <typename E, size_t N>
inline E llama_rolling_kv_arg_choice(const std::string & value, const char * flag, const std::pair<const char *, E> (&choices)[N]) {
    std::string allowed;
    for (const auto & choice : choices) {
        if (value == choice.first) {
            return choice.second;
        }
        allowed += (allowed.empty() ? "" : ", ") + std::string(choice.first);
    }
    throw std::invalid_argument("unknown " + std::string(flag) + " " + value + " (allowed: " + allowed + ")");
}

// --kv-windows {elastic,static,blocks}
inline enum llama_kv_window_policy llama_rolling_kv_arg_windows(const std::string & value) {
    static const std::pair<const char *, enum llama_kv_window_policy> choices[] = {
        { "elastic", LLAMA_KV_WINDOWS_ELASTIC }, { "static", LLAMA_KV_WINDOWS_STATIC }, { "blocks", LLAMA_KV_WINDOWS_BLOCKS },
    };
    return llama_rolling_kv_arg_choice(value, "--kv-windows", choices);
}

// --kv-placement {auto,upstream,sequences}
inline enum llama_kv_placement llama_rolling_kv_arg_placement(const std::string & value) {
    static const std::pair<const char *, enum llama_kv_placement> choices[] = {
        { "auto", LLAMA_KV_PLACEMENT_AUTO }, { "upstream", LLAMA_KV_PLACEMENT_UPSTREAM },
        { "sequences", LLAMA_KV_PLACEMENT_SEQUENCES },
    };
    return llama_rolling_kv_arg_choice(value, "--kv-placement", choices);
}

// -ctkt/-ctvt: a type of the op's list (ggml_rkv_tail_type_from_name), or "auto": the planner chooses the tail's type
// when the cache spills (LLAMA_ROLLING_KV_TAIL_TYPE_AUTO, lossy: opt-in)
inline enum ggml_type llama_rolling_kv_arg_tail_type(const std::string & value) {
    if (value == "auto") {
        return LLAMA_ROLLING_KV_TAIL_TYPE_AUTO;
    }
    const enum ggml_type type = ggml_rkv_tail_type_from_name(value.c_str());
    if (type == GGML_TYPE_COUNT) {
        throw std::invalid_argument("unsupported KV tail type: " + value + " (allowed: " + ggml_rkv_tail_type_names() +
                                    ", auto)");
    }
    return type;
}

// a float that is the whole of value (std::stof, nothing left over): true and *v set, else false; the callers check
// the bounds and word the message
inline bool llama_rolling_kv_arg_parse_float(const std::string & value, float * v) {
    size_t pos = 0;
    try {
        *v = std::stof(value, &pos);
    } catch (const std::exception &) {
        return false;
    }
    return !value.empty() && pos == value.size();
}

// a number >= 0 (--pcie-bw-gbps, --cpu-attn-gbps; 0: unknown); flag names it in the message
inline float llama_rolling_kv_arg_gbps(const std::string & value, const char * flag) {
    float v = 0.0f;
    if (!llama_rolling_kv_arg_parse_float(value, &v) || !(v >= 0.0f)) {
        throw std::invalid_argument(std::string(flag) + " must be a number >= 0, got " + value);
    }
    return v;
}

// --kv-tail-cpu-frac auto|F: F in [0, 1], auto -1 (the planner picks the share)
inline float llama_rolling_kv_arg_tail_cpu_frac(const std::string & value) {
    if (value == "auto") {
        return -1.0f;
    }
    float v = 0.0f;
    if (!llama_rolling_kv_arg_parse_float(value, &v) || !(v >= 0.0f && v <= 1.0f)) {
        throw std::invalid_argument("--kv-tail-cpu-frac must be auto or a number in [0, 1], got " + value);
    }
    return v;
}
