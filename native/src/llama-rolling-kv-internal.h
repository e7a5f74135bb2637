// rollingkv: the internal side of the extension API (llama-rolling-kv.cpp): how a residency request reaches the
// context, and the plan as JSON.
#pragma once

#include "llama-kv-residency.h"

#include <memory>
#include <string>

// the request llama_init_from_model_rolling_kv hands to the llama_context being constructed on this thread (its
// constructor takes it into cparams.rkv); null when the context was created otherwise
void llama_rkv_set_pending(std::shared_ptr<llama_rkv_state> st);
std::shared_ptr<llama_rkv_state> llama_rkv_take_pending();

// the plan as llama_rolling_kv_plan_json writes it (st nullptr: a context created without residency parameters)
std::string llama_rkv_plan_to_json(const llama_rkv_state * st);
