// rollingkv: the internal side of the extension API (llama-rolling-kv.cpp): how a residency request reaches the
// context, and the plan as JSON.
#pragma once

#include "llama-kv-residency.h"

#include <cstdio>
#include <memory>
#include <string>

// the request llama_init_from_model_rolling_kv hands to the llama_context being constructed on this thread (its
// constructor takes it into cparams.rkv); null when the context was created otherwise
void llama_rkv_set_pending(std::shared_ptr<llama_rkv_state> st);
std::shared_ptr<llama_rkv_state> llama_rkv_take_pending();

// graph nodes a split cache adds beyond upstream's estimate: a ubatch of several streams attends one op per stream and
// split layer (views of q, K/V window and tail, mask, the op, the concatenation of the outputs)
inline uint32_t llama_rkv_graph_extra_nodes(const llama_rkv_state * st) {
    if (!st || !llama_rkv_is_split(*st) || st->n_stream < 2) {
        return 0;
    }
    uint32_t n_split = 0;
    for (const auto & l : st->layers) {
        n_split += l.split ? 1 : 0;
    }
    return n_split*st->n_stream*16;
}

// the plan as llama_rolling_kv_plan_json writes it (st nullptr: a context created without residency parameters)
std::string llama_rkv_plan_to_json(const llama_rkv_state * st);

// s as a JSON string literal (quotes, backslash, newline and the other control characters escaped): the plan's JSON
// (llama-rolling-kv.cpp) and the planner simulation (rollingkv/plan-simulate.cpp)
inline std::string llama_rkv_json_str(const std::string & s) {
    std::string res = "\"";
    for (const char c : s) {
        switch (c) {
            case '"':  res += "\\\""; break;
            case '\\': res += "\\\\"; break;
            case '\n': res += "\\n";  break;
            default:
                if ((unsigned char) c < 0x20) {
                    char buf[8];
                    snprintf(buf, sizeof(buf), "\\u%04x", c);
                    res += buf;
                } else {
                    res += c;
                }
        }
    }
    return res + "\"";
}
