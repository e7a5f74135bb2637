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
#define LLAMA_ROLLING_KV_API_VERSION 1

// "rollingkv api=<n> pin=<llama.cpp commit> series=<patch series hash>": identifies the build.
LLAMA_API const char * llama_rolling_kv_build_info(void);

LLAMA_API int32_t llama_rolling_kv_api_version(void);

#ifdef __cplusplus
}
#endif
