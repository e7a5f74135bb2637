#pragma once

// rolling-KV: the knobs, in one place (private to ggml; parsed in ggml-rolling-kv.c).
//
// Every knob is an environment variable with the prefix ROLLINGKV_, read ONCE per process, on the first call of
// ggml_rkv_get_knobs(); later changes of the environment have no effect. Unset or empty: the default.
//
// Tuning (for users):
//   ROLLINGKV_SLOTS=N         slots of the device ring through which the CUDA op streams a host tail (atoi, clamped
//                             to [2, 8], default 3). More slots let the copies run further ahead of the attention.
//   ROLLINGKV_SLOT_MIB=N      MiB per slot (atoi, clamped to [1, 4096], default 32; a slot always holds at least one
//                             256-cell chunk of the widest layer's tail). Copies of >= 8 MiB run near the link's peak.
//                             The ring (slots x slot size) is device memory that llama's planner counts.
//   ROLLINGKV_RUNTIME_MIB=N   the device memory a GPU runtime holds that no ggml buffer accounts for (CUDA context,
//                             cuBLAS, pools), counted against a vram_target (strtoll, >= 0; default: the backend's
//                             estimate, 640 MiB for CUDA, measured with CUDA 13 on an H200). Other GPUs, drivers or
//                             CUDA versions hold more or less: the one figure a user must correct for a vram_target
//                             to hold as NVML measures it.
//   ROLLINGKV_CPU_PART_THREADS=N  threads of the CPU part of a hybrid tail (a whole number >= 0, above 1024: 1024;
//                             0 or unset: every CPU the process may use but one, the one left to the thread that
//                             launches the GPU's work; anything else: one warning line and the default). At most the
//                             CPUs of the process's affinity (taskset, numactl), on which the pool's threads run. Not
//                             the context's -t: the part is bound by memory bandwidth, which takes more threads than
//                             -t's default (a heuristic for matrix work) gives.
//   ROLLINGKV_CPU_PART_SPIN_US=N  how long the CPU part's idle workers spin for the next part before they sleep
//                             (atoi, clamped to [0, 1000000], default 300: longer than the gap between the parts of
//                             a decode's layers, short enough that an idle process leaves the CPUs to others).
//   ROLLINGKV_CPU_PART_HANDOFF=flag|host  how a CUDA device hands a CPU part to the host and waits for its result: a
//                             flag in mapped memory that a host thread (the agent) polls and a flag it sets that a
//                             one-thread kernel on the compute stream waits for (flag, the default), or a
//                             stream-ordered host function and an event (host: cudaLaunchHostFunc, the first design;
//                             kept for the A/B of the per-layer hand-off, docs/design/hybrid-tail.md). Anything else:
//                             one warning line and flag.
//   ROLLINGKV_TAIL_HOST_MEMORY=hugepages|cuda   where a GPU's host tail lives: anonymous memory advised for 2 MiB
//                             pages and registered with the device (hugepages, the default), or the runtime's own
//                             pinned allocation (cuda: cudaMallocHost). Both stream at the link's speed; the CPU part
//                             of a hybrid tail reads the first at the memory's speed (docs/design/hybrid-tail.md).
//
// Diagnostics (outputs unchanged): ROLLINGKV_CPU_PART_STATS=1 at exit, print to stderr how many CPU parts of a hybrid
// tail ran, their mean wall
//                                       time and the K+V bandwidth while they ran (rolling-kv-cpu-part.cpp): where a
//                                       hybrid decode's time goes, next to the token time llama-bench reports.
//
//   ROLLINGKV_SIMULATE_LINK_SLOWDOWN=x  a benchmark aid (x >= 1, default 1): every host-tail copy of the CUDA op is
//                                       repeated so that the link moves x times fewer tail bytes per second (55 / x
//                                       GB/s on a PCIe 5.0 x16 host: x = 2.2 for a PCIe 4.0 x16 link, 8.5 for 3.0 x8),
//                                       while the CPU part of a hybrid tail reads host memory at its own speed: what a
//                                       host with a slower link gives, measured on a faster one (with --pcie-bw-gbps
//                                       telling the planner the simulated link). One warning line when set.
//
// The op's test hook (a tail perturbation for the must-fail controls) is not a knob: it is a parameter of the op
// (ggml_streaming_flash_attn_set_tail_perturb, ggml-rolling-kv.h), set by the op test and by libllama from a context's
// test hooks (include/llama-rolling-kv.h).
//
// The lab switches (speed probes, A/B switches, forced chunk sizes, the GPU timeline profile) are not here: they exist
// only in a lab build (`rollingkv build --lab`: patches/lab/, native-lab/ggml/src/ggml-cuda/rolling-kv-lab.cuh).

#include "ggml.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_RKV_MAX_SLOTS 8 // the largest ROLLINGKV_SLOTS (the CUDA ring's fixed event arrays hold this many)

struct ggml_rkv_knobs {
    // tuning
    int     ring_slots;       // ROLLINGKV_SLOTS
    size_t  ring_slot_bytes;  // ROLLINGKV_SLOT_MIB, in bytes
    int64_t runtime_mib;      // ROLLINGKV_RUNTIME_MIB; -1: unset (the backend's estimate)
    bool    tail_cuda_alloc;  // ROLLINGKV_TAIL_HOST_MEMORY=cuda (else hugepages)
    int     cpu_part_threads; // ROLLINGKV_CPU_PART_THREADS; 0: unset
    int     cpu_part_spin_us; // ROLLINGKV_CPU_PART_SPIN_US
    bool    cpu_part_host_fn; // ROLLINGKV_CPU_PART_HANDOFF=host (else flag)

    // diagnostics
    bool    cpu_part_stats;   // ROLLINGKV_CPU_PART_STATS
    double  link_slowdown;    // ROLLINGKV_SIMULATE_LINK_SLOWDOWN; 1: off
};

// the knobs of this process, read from the environment on the first call (thread-safe)
GGML_API const struct ggml_rkv_knobs * ggml_rkv_get_knobs(void);

#ifdef __cplusplus
}
#endif
