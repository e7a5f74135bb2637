// rollingkv: elastic windows' policy on given figures, for the tests (no model, no device).
//
// Not part of libllama: a small library of its own (librollingkv-pool-sim, built with the op tests), which the Python
// tests load through ctypes (tests/test_window_pool.py). It drives the library's own llama_rkv_pool_rebalance
// (llama-kv-window-pool.h) step by step, so that a test can replay a load (streams growing, ending, idling) and check
// the windows it gets and that the copies it is told to make keep every cell in use where the windows say it lives.
//
//   void *  rollingkv_pool_new(uint32_t n_stream, uint32_t kv_size, uint32_t capacity);
//   void    rollingkv_pool_begin_batch(void * pool, const uint8_t * in_batch);      // a batch (llama_decode) begins
//   int32_t rollingkv_pool_step(void * pool, const uint32_t * ext_old, const uint32_t * ext_new,
//                               const uint8_t * in_ubatch,
//                               uint32_t * copies, int32_t max_copies);   // 6 numbers a copy: kind, strm, cell0, n,
//                                                                         // row_src, row_dst; returns the count
//   void    rollingkv_pool_windows(void * pool, uint32_t * base, uint32_t * cells, uint64_t * epoch);
//   void    rollingkv_pool_free(void * pool);

#include "llama-kv-window-pool.h"

#include <cstdint>

#if defined(_WIN32)
#define RKV_SIM_API extern "C" __declspec(dllexport)
#else
#define RKV_SIM_API extern "C" __attribute__((visibility("default")))
#endif

RKV_SIM_API void * rollingkv_pool_new(uint32_t n_stream, uint32_t kv_size, uint32_t capacity) {
    auto * pool = new llama_rkv_window_pool();
    pool->init(n_stream, kv_size, capacity);
    return pool;
}

RKV_SIM_API void rollingkv_pool_begin_batch(void * p, const uint8_t * in_batch) {
    auto & pool = *static_cast<llama_rkv_window_pool *>(p);
    llama_rkv_pool_begin_batch(pool, std::vector<uint8_t>(in_batch, in_batch + pool.n_stream));
}

RKV_SIM_API int32_t rollingkv_pool_step(void * p, const uint32_t * ext_old, const uint32_t * ext_new,
        const uint8_t * in_ubatch, uint32_t * copies, int32_t max_copies) {
    auto & pool = *static_cast<llama_rkv_window_pool *>(p);
    const std::vector<uint32_t> eo(ext_old, ext_old + pool.n_stream);
    const std::vector<uint32_t> en(ext_new, ext_new + pool.n_stream);
    const std::vector<uint8_t>  iu(in_ubatch, in_ubatch + pool.n_stream);
    const auto out = llama_rkv_pool_rebalance(pool, eo, en, iu);
    for (int32_t i = 0; i < (int32_t) out.size() && i < max_copies; ++i) {
        const auto & c = out[i];
        uint32_t * d = copies + 6*i;
        d[0] = (uint32_t) c.kind; d[1] = c.strm; d[2] = c.cell0; d[3] = c.n; d[4] = c.row_src; d[5] = c.row_dst;
    }
    return (int32_t) out.size();
}

RKV_SIM_API void rollingkv_pool_windows(void * p, uint32_t * base, uint32_t * cells, uint64_t * epoch) {
    const auto & pool = *static_cast<llama_rkv_window_pool *>(p);
    for (uint32_t s = 0; s < pool.n_stream; ++s) {
        base[s]  = pool.base[s];
        cells[s] = pool.cells[s];
    }
    *epoch = pool.epoch;
}

RKV_SIM_API void rollingkv_pool_free(void * p) {
    delete static_cast<llama_rkv_window_pool *>(p);
}
