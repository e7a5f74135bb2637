// rollingkv: each sequence's cells in blocks of its own, for a unified cache (llama-kv-cache-placement.cpp)
#pragma once

#include "llama-kv-cache.h"

struct llama_rkv_state;
class  llama_kv_split;

struct llama_rkv_placement {
    using slot_info = llama_kv_cache::slot_info;

    // whether a cache of n_stream streams (for n_seq_max sequences), split as `split` (null: whole), places by sequence
    // for the request st (null: no residency parameters, upstream's placement); records it in st
    static bool wanted(llama_rkv_state * st, const llama_kv_split * split, uint32_t n_stream, uint32_t n_seq_max);

    // find_slot for one stream placed by sequence (a dry run, as upstream's: nothing in kv changes); false: upstream's
    // placement for this ubatch (several streams, or a token with no free cell in its sequence's newest block and no
    // free block left)
    static bool find_slot(const llama_kv_cache & kv, const llama_ubatch & ubatch, slot_info & res);
};
