// rollingkv extension API: implementation (see include/llama-rolling-kv.h).
#include "llama-rolling-kv.h"

#ifndef ROLLINGKV_PIN
#define ROLLINGKV_PIN "unknown"
#endif
#ifndef ROLLINGKV_SERIES
#define ROLLINGKV_SERIES "unknown"
#endif

#define RKV_STR2(x) #x
#define RKV_STR(x) RKV_STR2(x)

const char * llama_rolling_kv_build_info(void) {
    return "rollingkv api=" RKV_STR(LLAMA_ROLLING_KV_API_VERSION) " pin=" ROLLINGKV_PIN " series=" ROLLINGKV_SERIES;
}

int32_t llama_rolling_kv_api_version(void) {
    return LLAMA_ROLLING_KV_API_VERSION;
}

size_t llama_rolling_kv_sizeof_context_params(void) {
    return sizeof(struct llama_context_params);
}

size_t llama_rolling_kv_sizeof_model_params(void) {
    return sizeof(struct llama_model_params);
}
