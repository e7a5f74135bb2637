// rolling-KV: a CPU decode attention over host-resident K/V rows, for the CPU part of a hybrid tail.
//
// A few query rows of a sequence (decode: one; a batch: up to RKV_CPU_DECODE_MAX_ROWS per walk), all query heads of a
// KV group and all rows against each K/V row read once (GQA), blocks of 16 cells with one online-softmax update per
// block and a vectorised exp, split over cells (split-K): each worker attends a contiguous cell range and leaves a
// partial state (max, sum, unnormalised output) per query head; the partials are merged in range order, so the result
// does not depend on timing. K/V types: F16, Q8_0, Q4_0. An F16 K is dotted in f32. A quantized K is dotted in integers
// with the query quantized once per call (per block of 32: int8 values and an f32 scale, as ggml quantizes the
// activations for its q8_0/q4_0 dot products), then scaled by the two blocks' scales; the AVX-512 path takes 16 cells
// at once (their K bytes transposed so that each 32-bit lane is a cell, VNNI vpdpbusd where the CPU has it). A
// quantized V is widened to f32 with its block scale folded into the softmax weights (Q4_0's -8 in the widening); the
// weighted sums are accumulated in f32. On x86-64 (GCC, clang) the AVX-512 (with and without VNNI) and AVX2 paths are
// compiled into every build and chosen at run time; on AArch64 the NEON path (vdotq_s32 where the compiler targets the
// dot-product extension) as ggml-cpu is compiled; a scalar path runs anywhere.
//
// Part of the CPU backend (ggml-cpu); other backends and libllama reach what they need of it (rolling-kv-cpu-part.h)
// through the CPU backend's registry, never by symbol (ggml-rolling-kv.h, GGML_RKV_CPU_*_PROC).
//
// The result is what the other parts of the op merge with: the normalised output and the per-row LSE
// (-inf for a row whose cells are all masked; its output is then 0). Sinks are not applied here: the
// merge counts them once.

#pragma once

#include <cstddef>
#include <cstdint>

struct rkv_cpu_decode_params {
    const float * q;           // [n_head][D], f32
    int32_t       n_head;
    int32_t       n_head_kv;   // n_head % n_head_kv == 0; query head h reads KV head h / (n_head / n_head_kv)
    int32_t       D;           // K head size (multiple of 32)
    int32_t       DV;          // V head size (multiple of 32)
    int32_t       k_type;      // ggml_type: GGML_TYPE_F16, GGML_TYPE_Q8_0 or GGML_TYPE_Q4_0
    int32_t       v_type;
    const uint8_t * k;         // KV head g of cell c at k + c*k_nb1 + g*k_nb_head
    size_t        k_nb1;
    size_t        k_nb_head;
    const uint8_t * v;
    size_t        v_nb1;
    size_t        v_nb_head;
    int64_t       n_cells;
    const uint16_t * mask;     // [n_cells] f16 (0, -inf or the ALiBi distance) or null
    const float * slope;       // [n_head] ALiBi slopes (mask value times slope is added) or null (slope 1)
    float         scale;       // KQ scale
    float         softcap;     // 0: none; else s = softcap * tanh(s * scale / softcap)
    // several query rows against the same cells, in one walk of them (each block of K/V rows read once for all rows
    // and heads: a batch of a sequence's tokens, speculative or a small prefill): row r's query at q + r*q_row floats,
    // its mask at mask + r*mask_row. 0 or 1: one row. A part's state and the merged o/lse then hold n_rows*n_head
    // "heads", row-major (row r's head h is r*n_head + h).
    int32_t       n_rows;
    size_t        q_row;
    size_t        mask_row;
};

// the most rows one walk of the cells attends (its scratch grows with them); a caller splits more rows into walks
constexpr int RKV_CPU_DECODE_MAX_ROWS = 16;

// floats of one partial state: per query head (of every row), max, sum, then DV outputs
size_t rkv_cpu_decode_part_floats(const rkv_cpu_decode_params & p);

// attend cells [c0, c1) into part (rkv_cpu_decode_part_floats(p) floats)
void rkv_cpu_decode_range(const rkv_cpu_decode_params & p, int64_t c0, int64_t c1, float * part);

// merge n_parts partial states (in order) into o [n_rows][n_head][DV] (normalised) and lse [n_rows][n_head]
void rkv_cpu_decode_merge(const rkv_cpu_decode_params & p, const float * parts, int n_parts, float * o, float * lse);
// the same for heads [h0, h1) of the n_rows*n_head only (o and lse of those heads): a pool merges a part's heads in
// parallel
void rkv_cpu_decode_merge_heads(const rkv_cpu_decode_params & p, const float * parts, int n_parts, int h0, int h1,
                                float * o, float * lse);

// which path rkv_cpu_decode_range takes on this CPU: "avx512vnni", "avx512", "avx2", "neon-dotprod", "neon" or "scalar"
const char * rkv_cpu_decode_isa(void);

// test hooks: take the named path (one of those) from now on (false: not compiled here, or this CPU lacks it); a
// memory-bound read of the bytes [ith/nth, (ith+1)/nth) of each buffer with the same instruction set, the
// speed the attention is measured against
bool rkv_cpu_decode_force_isa(const char * name);
uint64_t rkv_cpu_decode_read_scan(const uint8_t * const * bufs, int n_bufs, size_t bytes_each, int ith, int nth);

// true when the types and sizes are supported
bool rkv_cpu_decode_supported(int k_type, int v_type, int D, int DV);
