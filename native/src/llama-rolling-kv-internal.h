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
