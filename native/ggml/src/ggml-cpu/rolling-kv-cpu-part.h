// rolling-KV: the CPU part of a hybrid tail, run on a pool of host threads (rolling-kv-cpu-part.cpp).
//
// Part of the CPU backend (ggml-cpu). Other backends and libllama never call these functions by symbol (the backends
// may be modules, GGML_BACKEND_DL): the CPU backend's registry answers their names (ggml_rkv_cpu_get_proc_address,
// below, through ggml_backend_reg_get_proc_address; GGML_RKV_CPU_*_PROC in ggml-rolling-kv.h), and a GPU backend
// includes this header for struct rkv_cpu_part_job alone.
//
// A GPU backend that streams a pinned-host tail may leave the tail's far end to the CPU (ggml_rkv_tail_cpu_cells,
// ggml-rolling-kv.h): its Q and mask columns come to the host with small copies, this attends the part's cells for
// every query row of every stream, the rows of a stream in one walk of the cells (groups of RKV_CPU_DECODE_MAX_ROWS),
// split over the pool's threads by cells (rkv_cpu_decode_range, the partials merged in range order: the result does
// not depend on timing), and leaves the normalised output and the per-row LSE that
// the backend merges with its other parts. Sinks are not applied here (the final merge counts them once).

#pragma once

#include "rolling-kv-cpu-decode.h"

#include <cstddef>
#include <cstdint>
#include <functional>

struct rkv_cpu_part_job {
    int32_t n_head;
    int32_t n_head_kv;
    int32_t D;
    int32_t DV;
    int32_t k_type;    // ggml_type (rkv_cpu_decode_supported)
    int32_t v_type;
    int64_t n_q;       // query rows per stream
    int64_t n_stream;  // streams (ne[3])
    int64_t n_cells;   // cells of the part

    // Q of row t of stream s at q + t*q_nb1 + s*q_nb3: n_head rows of D floats, contiguous
    const uint8_t * q;
    size_t q_nb1, q_nb3;
    // cell c, KV head g, stream s at k + c*k_nb1 + g*k_nb2 + s*k_nb3 (the part's first cell at k)
    const uint8_t * k;
    size_t k_nb1, k_nb2, k_nb3;
    const uint8_t * v;
    size_t v_nb1, v_nb2, v_nb3;
    // [n_mask_planes][n_q][n_cells] f16; stream s reads plane s % n_mask_planes. nullptr: no mask
    const uint16_t * mask;
    int64_t n_mask_planes;
    const float * slope;  // [n_head]: a mask value is added times its head's slope (ALiBi); nullptr: 1
    float scale;
    float softcap;

    // out: o [n_stream][n_q][n_head][DV], lse [n_stream][n_q][n_head] (the rows in the op's dst order)
    float * o;
    float * lse;

    int n_threads;  // <= 0: ggml_rkv_get_cpu_threads()
    int calib;      // a calibration or probe part, not an op's: counted apart, left out of the statistics
};

// run the job on the process's pool (one job at a time; the calling thread is one of the workers)
void rkv_cpu_part_run(const rkv_cpu_part_job & job);

// fn(ith) for ith in [0, nth) on the pool the CPU part runs on (the caller is 0), one task at a time; returns when all
// are done. The bench times the attention and the memory-bound runs it is compared with on these same threads.
void rkv_cpu_pool_run(int nth, const std::function<void(int)> & fn);

// the pool's workers asleep now (their spin ran out; the test of the bounded spin)
int rkv_cpu_pool_sleepers(void);

// make the pool's threads for a job of n_threads (<= 0: ggml_rkv_get_cpu_threads()) now, on the calling thread: a
// backend calls it where it issues a CPU part, so that the workers do not start from its runtime's callback thread
void rkv_cpu_part_prepare(int n_threads);

// ops' jobs run so far in this process (the op test shows which cases a backend attended partly on the CPU), and the
// calibration and probe jobs
uint64_t rkv_cpu_part_runs(void);
uint64_t rkv_cpu_part_calib_runs(void);

// The CPU part's functions by name, for the CPU backend's ggml_backend_reg_get_proc_address (ggml-cpu.cpp): the
// public ones (GGML_RKV_CPU_*_PROC, ggml-rolling-kv.h: ggml_rkv_get_cpu_threads, ggml_rkv_cpu_part_runs,
// ggml_rkv_cpu_attn_measure_gbps, ggml_rkv_cpu_part_supported, ggml_rkv_cpu_part_run, ggml_rkv_cpu_part_prepare), and
// for test-rolling-kv-cpu-decode, which runs the backend's own code through them, the functions of this header and of
// rolling-kv-cpu-decode.h under their own names ("rkv_cpu_decode_range", ..., typed as declared here). NULL: no such
// name.
void * ggml_rkv_cpu_get_proc_address(const char * name);
