// rollingkv: the internal side of the extension API (llama-rolling-kv.cpp): how a residency request reaches the
// context, and the plan as JSON.
#pragma once

#include "llama-kv-residency.h"

#include <cstdio>
#include <memory>
#include <string>

struct llama_context;
struct llama_model;

// llama_init_from_model with a residency request, which the context's constructor takes into cparams.rkv (the C API's
// llama_init_from_model passes none: the upstream cache). A C++ overload: llama_context_params stays upstream's struct,
// which llama-cpp-python mirrors field by field
llama_context * llama_init_from_model(llama_model * model, llama_context_params params,
                                      std::shared_ptr<llama_rkv_state> rkv);

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

// the context's hooks for the live stats' evaluations (llama_rkv_live::evals; st nullptr: no request, nothing kept):
// a decode's batch, counted into the evaluation under way, and the synchronize that ends it, t0_us being when its
// first decode started (llama_context's t_compute_start_us) and n_queued its tokens (0: no evaluation to end)
void llama_rkv_note_batch(llama_rkv_state * st, const llama_batch & batch);
void llama_rkv_note_eval(llama_rkv_state * st, uint32_t n_queued, int64_t t0_us);

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
