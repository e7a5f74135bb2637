// rolling-KV: the CPU decode attention of a hybrid tail (ggml/src/ggml-cpu/rolling-kv-cpu-decode.h), checked and timed
//
// The kernel and its pool are the CPU backend's code: this test reaches them through the CPU backend's registry by name
// (ggml_rkv_cpu_get_proc_address, rolling-kv-cpu-part.h), so it runs the backend as built, also when the backends are
// modules (GGML_BACKEND_DL). Compiled with RKV_CPU_DECODE_STANDALONE (scripts/check-neon.sh: cross-compiled for AArch64
// with the kernel's sources and ggml-base, run under emulation) it calls them directly and has no --bench.
//
//   test-rolling-kv-cpu-decode [--isa avx512vnni|avx512|avx2|neon-dotprod|neon|scalar]
//       every case (K/V types f16, q8_0, q4_0 in all pairs; head sizes 64, 128, 256; GQA ratios 1, 3, 4, 8;
//       masks with holes and a fully masked row, the masked cells' rows all NaN; ALiBi; softcap; uneven and empty cell
//       ranges merged) against attention in double precision over the same (dequantised) rows; each ISA this CPU has,
//       or the one named. With a quantized K the kernel takes integer dot products with the query quantized per block
//       of 32 (int8 and an f32 scale); the reference quantizes the query the same way and scores the dequantised query.
//       Prints the path this CPU takes ("default isa: NAME"), one line per failing case and "N passed, M failed"; exit
//       1 on failure. --perturb-ref X multiplies the reference's scores by (1 + X): the self-check that the comparison
//       bites (X = 1e-4 must fail every case with a visible cell).
//   test-rolling-kv-cpu-decode --bench [-t THREADS] [--layers L] [--cells N] [--type f16|q8_0|q4_0] [--reps R]
//                              [--rows R]
//       one decode token of the synthetic 28-layer shape (8 KV heads, 24 query heads, head size 128) over L layers of
//       N cells: this attention on T threads (split over cells, merged), against, in the same run and on the same
//       bytes, a memory-bound read (vector loads), a copy, and ggml_flash_attn_ext on the CPU backend with T threads
//       (what vanilla llama.cpp runs for -nkvo). Prints GB/s of K+V for each and the ratios.
//       --alloc A[,B...]: where the K/V bytes live, each timed in turn (the copy and ggml_flash_attn_ext on the first):
//       cpu (the CPU backend's buffer, the default), cudahost (cudaMallocHost through the GPU's pinned host buffer
//       type), thp (anonymous memory advised for 2 MiB pages), tail (the memory a rolling-KV tail lives in: the GPU
//       backend's GGML_RKV_HOST_ALLOC_PROC, 2 MiB pages registered with the device). --rows R: R query rows per layer
//       (a batch of one sequence), in one walk of the cells, and also one by one. --beside-copy: also time the
//       attention while a thread copies pinned host memory to the GPU (the link's traffic of a hybrid decode), and
//       report both rates.
//   test-rolling-kv-cpu-decode --pool-stress SECONDS
//       the CPU part's pool: tasks of changing widths back to back on 8 threads; each must run exactly once per id
//       below its width, never late. Prints one line; exit 1 on a wrong or late call.
//   test-rolling-kv-cpu-decode --pool-affinity N
//       the pool's threads against this process's CPUs (taskset): one JSON line with the CPUs the process may use, the
//       part's thread count, and the CPUs each of the N-1 workers may use, made from a thread confined to one CPU.
//   test-rolling-kv-cpu-decode --pool-idle N
//       the pool between tasks: the workers asleep 100 ms after a task on N threads and the CPU time the process spent
//       meanwhile (the workers' bounded spin before they sleep). One JSON line.
//   test-rolling-kv-cpu-decode --part-counts
//       the CPU backend's counts of the parts run (GGML_RKV_CPU_PART_RUNS_PROC, GGML_RKV_CPU_PART_CALIB_RUNS_PROC)
//       before and after the planner's calibration of the CPU attention (GGML_RKV_CPU_ATTN_MEASURE_GBPS_PROC), an op's
//       part and a part flagged calib. One JSON line.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rolling-kv.h"
#include "rolling-kv-cpu-decode.h"
#include "rolling-kv-cpu-part.h" // rkv_cpu_pool_run: the CPU part's own threads, for every timed run

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <atomic>

namespace {

// the CPU part's functions: the CPU backend's, by name (or, standalone, these very functions)
struct cpu_api {
    decltype(&::rkv_cpu_decode_part_floats) rkv_cpu_decode_part_floats;
    decltype(&::rkv_cpu_decode_range)       rkv_cpu_decode_range;
    decltype(&::rkv_cpu_decode_merge)       rkv_cpu_decode_merge;
    decltype(&::rkv_cpu_decode_isa)         rkv_cpu_decode_isa;
    decltype(&::rkv_cpu_decode_force_isa)   rkv_cpu_decode_force_isa;
    decltype(&::rkv_cpu_decode_read_scan)   rkv_cpu_decode_read_scan;
    decltype(&::rkv_cpu_part_run)           rkv_cpu_part_run;
    decltype(&::rkv_cpu_pool_run)           rkv_cpu_pool_run;
    decltype(&::rkv_cpu_pool_sleepers)      rkv_cpu_pool_sleepers;
    ggml_rkv_get_cpu_threads_t              get_cpu_threads;
};
cpu_api A;

// false (and a line on stderr) when the CPU backend lacks one of them
bool api_init() {
#ifdef RKV_CPU_DECODE_STANDALONE
    A = { &::rkv_cpu_decode_part_floats, &::rkv_cpu_decode_range, &::rkv_cpu_decode_merge, &::rkv_cpu_decode_isa,
          &::rkv_cpu_decode_force_isa, &::rkv_cpu_decode_read_scan, &::rkv_cpu_part_run, &::rkv_cpu_pool_run,
          &::rkv_cpu_pool_sleepers,
          (ggml_rkv_get_cpu_threads_t) ggml_rkv_cpu_get_proc_address(GGML_RKV_GET_CPU_THREADS_PROC) };
    return true;
#else
    ggml_backend_load_all();  // a no-op unless the backends are modules
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    bool ok = reg != nullptr;
    auto get = [&](auto & fn, const char * name) {
        fn = reg ? (std::remove_reference_t<decltype(fn)>) ggml_backend_reg_get_proc_address(reg, name) : nullptr;
        if (!fn) {
            fprintf(stderr, "the CPU backend does not offer %s\n", name);
            ok = false;
        }
    };
    get(A.rkv_cpu_decode_part_floats, "rkv_cpu_decode_part_floats");
    get(A.rkv_cpu_decode_range, "rkv_cpu_decode_range");
    get(A.rkv_cpu_decode_merge, "rkv_cpu_decode_merge");
    get(A.rkv_cpu_decode_isa, "rkv_cpu_decode_isa");
    get(A.rkv_cpu_decode_force_isa, "rkv_cpu_decode_force_isa");
    get(A.rkv_cpu_decode_read_scan, "rkv_cpu_decode_read_scan");
    get(A.rkv_cpu_part_run, "rkv_cpu_part_run");
    get(A.rkv_cpu_pool_run, "rkv_cpu_pool_run");
    get(A.rkv_cpu_pool_sleepers, "rkv_cpu_pool_sleepers");
    get(A.get_cpu_threads, GGML_RKV_GET_CPU_THREADS_PROC);
    return ok;
#endif
}

size_t row_bytes(ggml_type t, int n) { return ggml_row_size(t, n); }

void fill_row(ggml_type t, const float * x, int n, uint8_t * dst) {
    if (t == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(x, (ggml_fp16_t *) dst, n);
    } else {
        ggml_quantize_chunk(t, x, dst, 0, 1, n, nullptr);
    }
}

void dequant_ref(ggml_type t, const uint8_t * src, int n, double * dst) {
    std::vector<float> f(n);
    if (t == GGML_TYPE_F16) {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) src, f.data(), n);
    } else {
        ggml_get_type_traits(t)->to_float(src, f.data(), n);
    }
    for (int i = 0; i < n; ++i) {
        dst[i] = f[i];
    }
}

// the query's quantization for a quantized K (the kernel's quant32): per block of 32, d = max|x| / 127 in f32,
// q = x * (1/d) in f32 rounded to nearest even (0 when d is 0); out: q * d, the values the integer dot multiplies
void quantize_query_ref(const float * x, int n, double * out) {
    for (int b = 0; b < n; b += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, fabsf(x[b + i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; ++i) out[b + i] = (double) nearbyintf(x[b + i] * id) * (double) d;
    }
}

struct test_case {
    int n_head, n_head_kv, D;
    ggml_type kt, vt;
    int64_t n;
    int mask_kind;  // 0 none, 1 holes and a masked end, 2 every cell masked
    bool alibi;
    float softcap;
    int parts;
};

// failing rows of a case (0: pass); worst: the largest relative error seen
double g_perturb_ref = 0.0;

int run_case(const test_case & c, std::mt19937 & rng, double & worst) {
    std::normal_distribution<float> N(0, 1);
    const int D = c.D, DV = c.D;
    const size_t kh = row_bytes(c.kt, D), vh = row_bytes(c.vt, DV);
    const size_t knb1 = kh * c.n_head_kv + 64, vnb1 = vh * c.n_head_kv + 32;  // padded rows: strides are honoured
    std::vector<uint8_t> K(knb1 * c.n + 64), V(vnb1 * c.n + 64);
    std::vector<float> tmp(std::max(D, DV));
    for (int64_t i = 0; i < c.n; ++i) {
        for (int g = 0; g < c.n_head_kv; ++g) {
            for (int d = 0; d < D; ++d) tmp[d] = N(rng);
            fill_row(c.kt, tmp.data(), D, K.data() + i * knb1 + g * kh);
            for (int d = 0; d < DV; ++d) tmp[d] = N(rng);
            fill_row(c.vt, tmp.data(), DV, V.data() + i * vnb1 + g * vh);
        }
    }
    std::vector<float> q((size_t) c.n_head * D);
    for (float & x : q) x = N(rng) * 2.0f;
    std::vector<ggml_fp16_t> mask(c.n);
    for (int64_t i = 0; i < c.n; ++i) {
        float mv = 0;
        if (c.mask_kind == 1) mv = (i % 7 == 3 || i > c.n * 3 / 4) ? -INFINITY : 0;
        if (c.mask_kind == 2) mv = -INFINITY;
        if (c.alibi && mv == 0) mv = -(float) (c.n - 1 - i);
        mask[i] = ggml_fp32_to_fp16(mv);
    }
    // a masked cell's rows are never read for the result: fill them with 0xff (NaN scales and values), which must not
    // leak
    for (int64_t i = 0; i < c.n; ++i) {
        if (ggml_fp16_to_fp32(mask[i]) == -INFINITY) {
            memset(K.data() + i * knb1, 0xff, kh * c.n_head_kv);
            memset(V.data() + i * vnb1, 0xff, vh * c.n_head_kv);
        }
    }
    std::vector<float> slope(c.n_head);
    for (int h = 0; h < c.n_head; ++h) slope[h] = powf(2.f, -8.f * (h + 1) / c.n_head);

    const int n_q = c.n % 3 == 0 ? 2 : c.n % 3 == 1 ? 5 : 19;
    std::vector<float> qj((size_t) n_q * c.n_head * D);
    std::copy(q.begin(), q.end(), qj.begin());
    for (size_t i = q.size(); i < qj.size(); ++i) qj[i] = N(rng) * 2.0f;
    std::vector<ggml_fp16_t> maskj((size_t) n_q * c.n);
    for (int t = 0; t < n_q; ++t) {
        for (int64_t i = 0; i < c.n; ++i) {
            // row 1 keeps row 0's mask: rows that see the same cells share the V pass
            const bool off = (t > 1 && i % (4 + t) == 1) || (t == 2 && c.mask_kind) ||
                             (t == 3 && c.mask_kind && i < 32);
            maskj[(size_t) t * c.n + i] = off ? ggml_fp32_to_fp16(-INFINITY) : mask[i];
        }
    }
    rkv_cpu_decode_params p{};
    p.q = q.data(); p.n_head = c.n_head; p.n_head_kv = c.n_head_kv; p.D = D; p.DV = DV; p.k_type = c.kt;
    p.v_type = c.vt;
    p.k = K.data(); p.k_nb1 = knb1; p.k_nb_head = kh; p.v = V.data(); p.v_nb1 = vnb1; p.v_nb_head = vh; p.n_cells = c.n;
    p.mask = c.mask_kind || c.alibi ? (const uint16_t *) mask.data() : nullptr;
    p.slope = c.alibi ? slope.data() : nullptr;
    p.scale = 1.0f / sqrtf((float) D); p.softcap = c.softcap;
    // rkv_cpu_decode_range itself: one row, or (odd part counts) all the rows in one walk of each range (19 rows:
    // walks of 16 and 3)
    const int n_direct = c.parts % 2 ? n_q : 1;
    p.n_rows = n_direct; p.q = qj.data(); p.q_row = (size_t) c.n_head * D;
    p.mask = p.mask ? (const uint16_t *) maskj.data() : nullptr; p.mask_row = (size_t) c.n;

    const size_t pf = A.rkv_cpu_decode_part_floats(p);
    std::vector<float> parts(pf * c.parts), o((size_t) n_direct * c.n_head * DV), lse((size_t) n_direct * c.n_head);
    std::vector<int64_t> b(c.parts + 1);
    for (int i = 0; i <= c.parts; ++i) b[i] = c.n * i / c.parts;
    if (c.parts >= 3) b[2] = b[1];  // range 1 empty, range 2 covers its cells
    for (int i = 0; i < c.parts; ++i) A.rkv_cpu_decode_range(p, b[i], b[i + 1], parts.data() + i * pf);
    A.rkv_cpu_decode_merge(p, parts.data(), c.parts, o.data(), lse.data());

    // the same cells through the CPU part's job (rkv_cpu_part_run: chunks claimed by the pool's threads, merged in
    // order), several query rows of one stream, walked together (2, 5 or 19 rows: one walk, or walks of 16 and 3): row
    // 0 as above, the others with queries of their own, row 1 with row 0's mask, the others with masks of their own
    // (row 0's, with more cells masked: a mixed-up row of the mask shows); with a mask, row 2 sees no cell at all and
    // row 3 none of the first two blocks (a row that skips a block the others attend). Twice, which must give the same
    // bits (the result may not depend on which thread took which chunk). The reference scores a quantized K against the
    // query quantized as the kernel does.
    rkv_cpu_part_job j{};
    j.n_head = c.n_head; j.n_head_kv = c.n_head_kv; j.D = D; j.DV = DV; j.k_type = c.kt; j.v_type = c.vt;
    j.n_q = n_q; j.n_stream = 1; j.n_cells = c.n;
    j.q = (const uint8_t *) qj.data(); j.q_nb1 = q.size() * sizeof(float); j.q_nb3 = qj.size() * sizeof(float);
    j.k = K.data(); j.k_nb1 = knb1; j.k_nb2 = kh; j.k_nb3 = K.size();
    j.v = V.data(); j.v_nb1 = vnb1; j.v_nb2 = vh; j.v_nb3 = V.size();
    j.mask = p.mask ? (const uint16_t *) maskj.data() : nullptr; j.n_mask_planes = 1;
    j.slope = p.slope; j.scale = p.scale; j.softcap = p.softcap;
    j.n_threads = 1 + (int) (c.n % 7);  // 1..7 threads: several chunkings
    std::vector<float> oj((size_t) n_q * c.n_head * DV), lsej((size_t) n_q * c.n_head), oj2(oj.size()),
            lsej2(lsej.size());
    j.o = oj.data(); j.lse = lsej.data();
    A.rkv_cpu_part_run(j);
    j.o = oj2.data(); j.lse = lsej2.data();
    A.rkv_cpu_part_run(j);
    int bad = memcmp(oj.data(), oj2.data(), oj.size() * sizeof(float)) != 0 ||
              memcmp(lsej.data(), lsej2.data(), lsej.size() * sizeof(float)) != 0;
    // the rows as streams of one row each (the same K/V for every stream, mask plane s for stream s): each row's
    // arithmetic does not depend on the rows walked beside it, so the bits are the same
    j.n_stream = n_q; j.n_q = 1; j.q_nb3 = j.q_nb1; j.k_nb3 = 0; j.v_nb3 = 0; j.n_mask_planes = n_q;
    j.o = oj2.data(); j.lse = lsej2.data();
    A.rkv_cpu_part_run(j);
    bad += memcmp(oj.data(), oj2.data(), oj.size() * sizeof(float)) != 0 ||
           memcmp(lsej.data(), lsej2.data(), lsej.size() * sizeof(float)) != 0;

    // attention in double precision over the same (dequantised) rows for one query row; err of (o, lse) against it
    const int G = c.n_head / c.n_head_kv;
    std::vector<double> kd(D), vd(DV), s(c.n), od(DV), qr(D);
    // (o2, lse2: a second result of the same row, checked against the same reference; nullptr: none)
    auto compare = [&](const float * qrow, const ggml_fp16_t * mrow, const float * o_, const float * lse_,
                       const float * o2, const float * lse2) {
        int n_bad = 0;
        for (int h = 0; h < c.n_head; ++h) {
            const int g = h / G;
            if (c.kt != GGML_TYPE_F16) {
                quantize_query_ref(qrow + (size_t) h * D, D, qr.data());
            } else {
                for (int d = 0; d < D; ++d) qr[d] = qrow[(size_t) h * D + d];
            }
            double m = -INFINITY;
            for (int64_t i = 0; i < c.n; ++i) {
                const double mv = p.mask ? ggml_fp16_to_fp32(mrow[i]) : 0;
                if (mv == -INFINITY) { s[i] = -INFINITY; continue; }
                dequant_ref(c.kt, K.data() + i * knb1 + g * kh, D, kd.data());
                double dot = 0;
                for (int d = 0; d < D; ++d) dot += qr[d] * kd[d];
                dot *= p.scale * (1.0 + g_perturb_ref);
                if (c.softcap) dot = c.softcap * tanh(dot / c.softcap);
                s[i] = dot + (c.alibi ? slope[h] : 1.0) * mv;
                m = std::max(m, s[i]);
            }
            if (m == -INFINITY) {  // every cell masked: LSE -inf, output 0
                for (int w = 0; w < (o2 ? 2 : 1); ++w) {
                    const float * ow = w ? o2 : o_, * lw = w ? lse2 : lse_;
                    n_bad += lw[h] != -INFINITY;
                    for (int d = 0; d < DV; ++d) if (ow[(size_t) h * DV + d] != 0.0f) { n_bad++; break; }
                }
                continue;
            }
            std::fill(od.begin(), od.end(), 0.0);
            double sum = 0;
            for (int64_t i = 0; i < c.n; ++i) {
                if (s[i] == -INFINITY) continue;
                const double w = exp(s[i] - m);
                sum += w;
                dequant_ref(c.vt, V.data() + i * vnb1 + g * vh, DV, vd.data());
                for (int d = 0; d < DV; ++d) od[d] += w * vd[d];
            }
            const double lref = m + log(sum);
            for (int w = 0; w < (o2 ? 2 : 1); ++w) {
                const float * ow = w ? o2 : o_, * lw = w ? lse2 : lse_;
                double err = fabs(lw[h] - lref) / std::max(1.0, fabs(lref));
                double num = 0, den = 0;
                for (int d = 0; d < DV; ++d) {
                    const double r = od[d] / sum, e = ow[(size_t) h * DV + d] - r;
                    num += e * e;
                    den += r * r;
                }
                err = std::max(err, sqrt(num / std::max(den, 1e-30)));
                worst = std::max(worst, err);
                n_bad += !(err < 2e-5);  // f32 arithmetic over <= ~250 cells: observed <= 1e-6
            }
        }
        return n_bad;
    };
    for (int t = 0; t < n_q; ++t) {  // row t of the job, and of the direct walk where it took the row
        const size_t oo = (size_t) t * c.n_head * DV, lo = (size_t) t * c.n_head;
        bad += compare(qj.data() + (size_t) t * c.n_head * D, maskj.data() + (size_t) t * c.n, oj.data() + oo,
                       lsej.data() + lo, t < n_direct ? o.data() + oo : nullptr,
                       t < n_direct ? lse.data() + lo : nullptr);
    }
    return bad;
}

int check(const std::vector<std::string> & isas) {
    int passed = 0, failed = 0;
    for (const std::string & isa : isas) {
        if (!A.rkv_cpu_decode_force_isa(isa.c_str())) {
            printf("isa %s: not available on this CPU\n", isa.c_str());
            continue;
        }
        std::mt19937 rng(42);
        double worst = 0;
        int cases = 0, bad_cases = 0;
        const ggml_type types[3] = {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0};
        for (ggml_type kt : types) for (ggml_type vt : types) for (int D : {64, 128, 256})
                for (int ratio : {1, 3, 4, 8}) {
            for (int mk = 0; mk < 3; ++mk) for (int alibi = 0; alibi < 2; ++alibi) {
                if ((D != 128 && (mk || alibi)) || (mk == 2 && alibi)) continue;
                const int nkv = ratio == 8 ? 1 : 2;
                const test_case c{nkv * ratio, nkv, D, kt, vt, (int64_t) (37 + 97 * ((kt + vt + ratio) % 3)), mk,
                                  (bool) alibi, (ratio == 4 && D == 128) ? 30.0f : 0.0f, 1 + (ratio + mk) % 5};
                const int b = run_case(c, rng, worst);
                cases++;
                if (b) {
                    bad_cases++;
                    printf("FAIL isa %s K %s V %s D %d G %d mask %d alibi %d softcap %.0f parts %d cells %lld: %d "
                           "rows\n", isa.c_str(), ggml_type_name(kt), ggml_type_name(vt), D, ratio, mk, alibi,
                           c.softcap, c.parts, (long long) c.n, b);
                }
            }
        }
        printf("isa %s: %d cases, %d failed, worst relative error %.3g\n", isa.c_str(), cases, bad_cases, worst);
        passed += cases - bad_cases;
        failed += bad_cases;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The pool's generations (rkv_cpu_pool_run): tasks of changing widths back to back, many more threads than this CPU
// has, so that workers are descheduled at every step. Each task must run once on every id below its width and on no
// other, and never after its run returned: a worker that took the width or the task of one generation and ran it in
// another (a lagging worker between a narrow task and a wide one) shows as a missing, doubled or late call.
int pool_stress(double seconds, int max_threads) {
    std::atomic<uint64_t> current{0}, late{0}, wrong{0};
    std::mt19937 rng(7);
    uint64_t runs = 0;
    const double t_end = now_s() + seconds;
    std::vector<std::atomic<int>> calls(max_threads);
    while (now_s() < t_end) {
        for (int rep = 0; rep < 64; ++rep) {
            // mostly the caller alone or a few threads, now and then all of them: narrow after wide leaves laggards
            const int nth = rng() % 3 == 0 ? max_threads : 1 + (int) (rng() % 2);
            const uint64_t gen = ++runs;
            current.store(gen);
            for (auto & c : calls) c.store(0);
            const std::function<void(int)> fn = [&, gen, nth](int ith) {
                if (current.load() != gen) late++;
                if (ith < 0 || ith >= nth) wrong++;
                else calls[ith]++;
            };
            A.rkv_cpu_pool_run(nth, fn);
            for (int i = 0; i < max_threads; ++i) {
                if (calls[i].load() != (i < nth ? 1 : 0)) wrong++;
            }
        }
    }
    current.store(0);
    printf("pool stress: %llu runs of up to %d threads, %llu wrong calls, %llu late calls\n", (unsigned long long) runs,
           max_threads, (unsigned long long) wrong.load(), (unsigned long long) late.load());
    return wrong.load() || late.load();
}

// The pool between tasks: n threads run a task a few times, then the process sleeps for 100 ms: how many workers are
// asleep then (all of them, unless ROLLINGKV_CPU_PART_SPIN_US is longer), and the CPU time the process spent meanwhile
// (their spinning before they slept; on a loaded machine less than the spin's wall time). One JSON line.
int pool_idle(int n) {
    const std::function<void(int)> noop = [](int) {};
    for (int i = 0; i < 3; ++i) A.rkv_cpu_pool_run(n, noop);
    timespec a, b;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    printf("{\"threads\": %d, \"asleep\": %d, \"idle_cpu_ms\": %.3f}\n", n, A.rkv_cpu_pool_sleepers(),
           ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9) * 1e3);
    return 0;
}

// a proc of the CPU backend by name (standalone: this binary's own)
void * cpu_proc(const char * name) {
#ifdef RKV_CPU_DECODE_STANDALONE
    return ggml_rkv_cpu_get_proc_address(name);
#else
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    return reg ? ggml_backend_reg_get_proc_address(reg, name) : nullptr;
#endif
}

int part_counts() {
    auto runs  = (ggml_rkv_cpu_part_runs_t) cpu_proc(GGML_RKV_CPU_PART_RUNS_PROC);
    auto calib = (ggml_rkv_cpu_part_runs_t) cpu_proc(GGML_RKV_CPU_PART_CALIB_RUNS_PROC);
    auto gbps  = (ggml_rkv_cpu_attn_measure_gbps_t) cpu_proc(GGML_RKV_CPU_ATTN_MEASURE_GBPS_PROC);
    if (!runs || !calib || !gbps) {
        fprintf(stderr, "the CPU backend does not offer the part counts or the calibration\n");
        return 1;
    }
    const uint64_t r0 = runs(), c0 = calib();
    gbps(2, GGML_TYPE_F16, 4u << 20, 1); // the planner's calibration, on a 4 MiB tail
    const uint64_t r1 = runs(), c1 = calib();
    // one op's part of 256 f16 cells, one head of 64, and the same flagged calib
    const int D = 64, n = 256;
    std::vector<ggml_fp16_t> kv((size_t) 2 * n * D, ggml_fp32_to_fp16(0.01f));
    std::vector<float> q(D, 0.01f), o(D), lse(1);
    rkv_cpu_part_job j{};
    j.n_head = 1; j.n_head_kv = 1; j.D = D; j.DV = D; j.k_type = GGML_TYPE_F16; j.v_type = GGML_TYPE_F16;
    j.n_q = 1; j.n_stream = 1; j.n_cells = n;
    j.q = (const uint8_t *) q.data(); j.q_nb1 = D * sizeof(float); j.q_nb3 = j.q_nb1;
    j.k = (const uint8_t *) kv.data();           j.k_nb1 = D * sizeof(ggml_fp16_t); j.k_nb2 = (size_t) n * j.k_nb1;
    j.k_nb3 = j.k_nb2;
    j.v = (const uint8_t *) (kv.data() + n * D); j.v_nb1 = j.k_nb1; j.v_nb2 = j.k_nb2; j.v_nb3 = j.k_nb3;
    j.n_mask_planes = 1; j.scale = 0.125f; j.o = o.data(); j.lse = lse.data(); j.n_threads = 2;
    A.rkv_cpu_part_run(j);
    const uint64_t r2 = runs(), c2 = calib();
    j.calib = 1;
    A.rkv_cpu_part_run(j);
    const uint64_t r3 = runs(), c3 = calib();
    // the calibration at several rows per cell (auto's slowdown per row count): a measure for 4 rows, calibration
    // parts again; 0 rows and more than GGML_RKV_CPU_PART_MAX_Q refused (< 0) without running a part
    const double g4 = gbps(2, GGML_TYPE_F16, 4u << 20, 4);
    const uint64_t r4 = runs(), c4 = calib();
    const double g0 = gbps(2, GGML_TYPE_F16, 4u << 20, 0), g9 = gbps(2, GGML_TYPE_F16, 4u << 20, GGML_RKV_CPU_PART_MAX_Q + 1);
    const uint64_t c5 = calib();
    printf("{\"calibration\": {\"runs\": %llu, \"calib_runs\": %llu}, \"op_part\": {\"runs\": %llu, \"calib_runs\": "
           "%llu}, \"calib_part\": {\"runs\": %llu, \"calib_runs\": %llu}, \"rows4\": {\"gbps\": %.3f, \"runs\": %llu, "
           "\"calib_runs\": %llu}, \"refused\": {\"gbps\": [%.1f, %.1f], \"calib_runs\": %llu}}\n",
           (unsigned long long) (r1 - r0), (unsigned long long) (c1 - c0), (unsigned long long) (r2 - r1),
           (unsigned long long) (c2 - c1), (unsigned long long) (r3 - r2), (unsigned long long) (c3 - c2), g4,
           (unsigned long long) (r4 - r3), (unsigned long long) (c4 - c3), g0, g9, (unsigned long long) (c5 - c4));
    return 0;
}

// The pool's threads against this process's CPUs: what ggml_rkv_get_cpu_threads gives, and the CPUs each of n pool
// threads may run on, the workers made from a thread confined to one CPU (the last the process may use), as a GPU
// runtime's callback thread may be. One JSON line.
int pool_affinity(int n) {
    cpu_set_t proc;
    CPU_ZERO(&proc);
    sched_getaffinity(0, sizeof(proc), &proc);
    int last = -1;
    for (int c = 0; c < CPU_SETSIZE; ++c) if (CPU_ISSET(c, &proc)) last = c;
    std::vector<std::string> sets(n);
    std::thread spawner([&] {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(last, &one);
        pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
        const std::function<void(int)> fn = [&](int ith) {
            cpu_set_t s;
            CPU_ZERO(&s);
            pthread_getaffinity_np(pthread_self(), sizeof(s), &s);
            std::string l;
            for (int c = 0; c < CPU_SETSIZE; ++c) if (CPU_ISSET(c, &s)) l += (l.empty() ? "" : ",") + std::to_string(c);
            sets[ith] = "[" + l + "]";
        };
        A.rkv_cpu_pool_run(n, fn);
    });
    spawner.join();
    std::string all;
    for (int i = 1; i < n; ++i) all += (i > 1 ? "," : "") + sets[i];
    printf("{\"process_cpus\": %d, \"part_threads\": %d, \"worker_cpus\": [%s]}\n", CPU_COUNT(&proc),
           A.get_cpu_threads(), all.c_str());
    return 0;
}

#ifndef RKV_CPU_DECODE_STANDALONE
// the first GPU device, if any (the pinned and registered allocations, the copies beside the attention)
ggml_backend_dev_t gpu_device() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            return d;
        }
    }
    return nullptr;
}

// host memory for the bench's K/V, allocated as named:
//   cpu       the CPU backend's buffer (what ggml gives the CPU: plain aligned memory)
//   cudahost  the GPU's pinned host buffer type as the runtime allocates it (cudaMallocHost)
//   thp       anonymous memory advised for transparent huge pages, not pinned
//   tail      what a rolling-KV tail lives in: the GPU backend's GGML_RKV_HOST_ALLOC_PROC (2 MiB pages, registered)
struct host_region {
    uint8_t * p = nullptr;
    size_t    n = 0;
    ggml_backend_buffer_t buf = nullptr;  // cpu, cudahost, tail
    bool mapped = false;                  // thp
};

bool region_alloc(const std::string & how, size_t n, host_region & r) {
    r = host_region();
    r.n = n;
    ggml_backend_dev_t gpu = gpu_device();
    if (how == "cpu" || how == "cudahost") {
        ggml_backend_buffer_type_t bt = how == "cpu" ? ggml_backend_cpu_buffer_type()
                                      : gpu ? ggml_backend_dev_host_buffer_type(gpu) : nullptr;
        if (!bt) {
            fprintf(stderr, "--alloc cudahost: no GPU with a pinned host buffer type\n");
            return false;
        }
        r.buf = ggml_backend_buft_alloc_buffer(bt, n);
    } else if (how == "tail") {
        auto fn = gpu ? (ggml_backend_rkv_host_buffer_alloc_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(gpu), GGML_RKV_HOST_ALLOC_PROC) : nullptr;
        r.buf = fn ? fn(gpu, n) : nullptr;
        if (!r.buf) {
            fprintf(stderr,
                    "--alloc tail: the GPU backend offers no tail memory (or ROLLINGKV_TAIL_HOST_MEMORY=cuda)\n");
            return false;
        }
    } else if (how == "thp") {
        const size_t huge = 2u << 20;
        r.n = (n + huge - 1) / huge * huge;
        void * p = mmap(nullptr, r.n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            return false;
        }
        madvise(p, r.n, MADV_HUGEPAGE);
        memset(p, 0, r.n);
        r.p = (uint8_t *) p;
        r.mapped = true;
        return true;
    } else {
        fprintf(stderr, "--alloc: cpu, cudahost, thp or tail, not %s\n", how.c_str());
        return false;
    }
    if (!r.buf) {
        return false;
    }
    r.p = (uint8_t *) ggml_backend_buffer_get_base(r.buf);
    r.n = ggml_backend_buffer_get_size(r.buf);
    return true;
}

void region_free(host_region & r) {
    if (r.mapped) {
        munmap(r.p, r.n);
    }
    if (r.buf) {
        ggml_backend_buffer_free(r.buf);
    }
    r = host_region();
}

// the share of 2 MiB pages behind [p, p + n) (AnonHugePages of the mapping in /proc/self/smaps), -1 if unknown
double huge_share(const void * p, size_t n) {
    FILE * f = fopen("/proc/self/smaps", "r");
    if (!f) {
        return -1;
    }
    char line[512];
    bool in = false;
    double kb_huge = -1, kb_size = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long a, b;
        if (sscanf(line, "%llx-%llx ", &a, &b) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = (uintptr_t) p >= a && (uintptr_t) p < b;
            if (in) kb_size = (double) (b - a) / 1024;
            continue;
        }
        double v;
        if (in && sscanf(line, "AnonHugePages: %lf kB", &v) == 1) {
            kb_huge = v;
        }
    }
    fclose(f);
    (void) n;
    return kb_huge < 0 || kb_size <= 0 ? -1 : kb_huge / kb_size;
}

// pinned host-to-device copies on a thread of their own while the caller's work runs (the link's traffic beside the
// CPU part): 32 MiB pieces from a pinned buffer into a device buffer until stopped; bytes counted
struct copy_beside {
    ggml_backend_buffer_t src = nullptr, dst = nullptr;
    ggml_context * ctx = nullptr;
    ggml_tensor * t = nullptr;
    std::thread th;
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> bytes{0};
    size_t n = 256u << 20;

    bool init() {
        ggml_backend_dev_t gpu = gpu_device();
        if (!gpu) {
            return false;
        }
        ggml_init_params ip = { ggml_tensor_overhead() * 2, nullptr, true };
        ctx = ggml_init(ip);
        t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) n);
        dst = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(gpu));
        src = ggml_backend_buft_alloc_buffer(ggml_backend_dev_host_buffer_type(gpu), n);
        if (!dst || !src) {
            return false;
        }
        memset(ggml_backend_buffer_get_base(src), 1, n);
        return true;
    }
    void start() {
        stop = false;
        bytes = 0;
        th = std::thread([this] {
            const size_t piece = 32u << 20;
            const uint8_t * s = (const uint8_t *) ggml_backend_buffer_get_base(src);
            for (size_t off = 0; !stop.load(std::memory_order_relaxed); off = (off + piece) % n) {
                ggml_backend_tensor_set(t, s + off, off, piece);
                bytes.fetch_add(piece, std::memory_order_relaxed);
            }
        });
    }
    void finish() {
        stop = true;
        th.join();
    }
    ~copy_beside() {
        if (src) ggml_backend_buffer_free(src);
        if (dst) ggml_backend_buffer_free(dst);
        if (ctx) ggml_free(ctx);
    }
};

int bench(int T, int layers, int64_t n, ggml_type type, int reps, const std::vector<std::string> & allocs, bool beside,
          int R) {
    const int n_kv = 8, G = 3, D = 128, n_head = n_kv * G;
    const size_t kh = row_bytes(type, D), nb1 = kh * n_kv, layer_bytes = 2 * nb1 * n;
    const double gb = (double) layer_bytes * layers / 1e9;

    // the CPU backend through the registry, so that builds with backends as modules run this too
    ggml_backend_t be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!be) {
        fprintf(stderr, "no CPU backend\n");
        return 1;
    }
    auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(ggml_backend_get_device(be)), "ggml_backend_set_n_threads");
    if (set_threads) {
        set_threads(be, T);
    }
    copy_beside cb;
    if (beside && !cb.init()) {
        fprintf(stderr, "--beside-copy: no GPU to copy to\n");
        return 1;
    }
    auto best = [&](const std::function<void()> & f) {
        f();
        double b = 1e30;
        for (int r = 0; r < reps; ++r) {
            const double t0 = now_s();
            f();
            b = std::min(b, now_s() - t0);
        }
        return b;
    };
    printf("cpu-decode bench: isa %s, %d threads, %d layers x %lld cells, %s K+V: %.3f GB per token\n",
           A.rkv_cpu_decode_isa(), T, layers, (long long) n, ggml_type_name(type), gb);
    if (beside) {
        cb.start();
        const double t0 = now_s();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        cb.finish();
        printf("  copies alone (pinned host -> device, 32 MiB pieces): %.1f GB/s\n",
               cb.bytes.load() / (now_s() - t0) / 1e9);
    }

    for (size_t ia = 0; ia < allocs.size(); ++ia) {
        const std::string & how = allocs[ia];
        host_region reg;
        const size_t total = layer_bytes * layers + 4096 * (2 * layers + 1) + sizeof(float) * D * n_head * R + 4096;
        if (!region_alloc(how, total, reg)) {
            fprintf(stderr, "cannot allocate %.3f GB as %s\n", total / 1e9, how.c_str());
            return 1;
        }
        // K and V of every layer in the region (cell-major rows of all KV heads, as llama.cpp's cache), Q beside
        ggml_init_params ip = { ggml_tensor_overhead() * (8 * layers + 16) +
                               ggml_graph_overhead_custom(4 * layers + 16, false), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        std::vector<ggml_tensor *> K(layers), V(layers);
        for (int l = 0; l < layers; ++l) {
            K[l] = ggml_new_tensor_2d(ctx, type, D * n_kv, n);
            V[l] = ggml_new_tensor_2d(ctx, type, D * n_kv, n);
        }
        // (the attention reads it as [row][head][D])
        ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, R, n_head);
        ggml_backend_buffer_t wrap = ggml_backend_cpu_buffer_from_ptr(reg.p, reg.n);
        ggml_tallocr ta = ggml_tallocr_new(wrap);
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
            ggml_tallocr_alloc(&ta, t);
        }
        {
            std::mt19937 rng(1);
            std::normal_distribution<float> N(0, 1);
            std::vector<float> row(D * n_kv);
            for (int l = 0; l < layers; ++l) {
                for (ggml_tensor * t : {K[l], V[l]}) {
                    for (int64_t i = 0; i < std::min<int64_t>(n, 4096); ++i) {
                        for (float & x : row) x = N(rng);
                        fill_row(type, row.data(), D * n_kv, (uint8_t *) t->data + i * nb1);
                    }
                    // the rest repeats the first rows (the timing is data-independent)
                    for (int64_t i = 4096; i < n; i += 4096) {
                        memcpy((uint8_t *) t->data + i * nb1, t->data, std::min<int64_t>(4096, n - i) * nb1);
                    }
                }
            }
            for (int i = 0; i < D * n_head * R; ++i) ((float *) q->data)[i] = N(rng) * 0.1f;
        }

        rkv_cpu_decode_params p{};
        p.q = (const float *) q->data; p.n_head = n_head; p.n_head_kv = n_kv; p.D = D; p.DV = D;
        p.k_type = type; p.v_type = type; p.k_nb1 = nb1; p.k_nb_head = kh; p.v_nb1 = nb1; p.v_nb_head = kh;
        p.n_cells = n;
        p.scale = 1.0f / sqrtf((float) D);
        p.n_rows = R; p.q_row = (size_t) D * n_head;
        const size_t pf = A.rkv_cpu_decode_part_floats(p);
        std::vector<float> parts(pf * T), o((size_t) R * n_head * D), lse((size_t) R * n_head);
        std::vector<uint8_t> sink(64 * T);

        auto attention = [&] {
            for (int l = 0; l < layers; ++l) {
                rkv_cpu_decode_params pl = p;
                pl.k = (const uint8_t *) K[l]->data;
                pl.v = (const uint8_t *) V[l]->data;
                A.rkv_cpu_pool_run(T, [&](int t) {
                    A.rkv_cpu_decode_range(pl, n * t / T, n * (t + 1) / T, parts.data() + t * pf);
                });
                A.rkv_cpu_decode_merge(pl, parts.data(), T, o.data(), lse.data());
            }
        };
        // the rows one by one (a walk of the cells per row, as the CPU part attended them before issue 26)
        auto attention_apart = [&] {
            for (int l = 0; l < layers; ++l) {
                for (int r = 0; r < R; ++r) {
                    rkv_cpu_decode_params pl = p;
                    pl.k = (const uint8_t *) K[l]->data;
                    pl.v = (const uint8_t *) V[l]->data;
                    pl.n_rows = 1;
                    pl.q = p.q + (size_t) r * p.q_row;
                    A.rkv_cpu_pool_run(T, [&](int t) {
                        A.rkv_cpu_decode_range(pl, n * t / T, n * (t + 1) / T, parts.data() + t * pf);
                    });
                    A.rkv_cpu_decode_merge(pl, parts.data(), T, o.data() + (size_t) r * n_head * D,
                                           lse.data() + (size_t) r * n_head);
                }
            }
        };
        std::vector<const uint8_t *> bufs;
        for (int l = 0; l < layers; ++l) {
            bufs.push_back((const uint8_t *) K[l]->data);
            bufs.push_back((const uint8_t *) V[l]->data);
        }
        auto read_scan = [&] {
            A.rkv_cpu_pool_run(T, [&](int t) {
                sink[64 * t] = (uint8_t) A.rkv_cpu_decode_read_scan(bufs.data(), (int) bufs.size(), nb1 * n, t, T);
            });
        };
        const double hs = huge_share(reg.p, reg.n);
        const double t_att = best(attention), t_scan = best(read_scan), t_apart = R > 1 ? best(attention_apart) : t_att;
        printf("  [%s] huge pages %s\n", how.c_str(),
               hs < 0 ? "unknown" : (std::to_string((int) std::lround(hs * 100)) + "%").c_str());
        printf("  [%s] attention            %8.2f ms  %6.1f GB/s\n", how.c_str(), t_att * 1e3, gb / t_att);
        if (R > 1) {
            printf("  [%s] %d rows one by one %6.2f ms  (in one walk %.2fx faster)\n", how.c_str(), R, t_apart * 1e3,
                   t_apart / t_att);
        }
        printf("  [%s] read scan            %8.2f ms  %6.1f GB/s  (attention at %.2fx of it)\n", how.c_str(),
               t_scan * 1e3, gb / t_scan, t_scan / t_att);
        double t_beside = 0, link_beside = 0;
        if (beside) {
            cb.start();
            const double t0 = now_s();
            t_beside = best(attention);
            const double dt = now_s() - t0;
            cb.finish();
            link_beside = cb.bytes.load() / dt / 1e9;
            printf("  [%s] attention beside copies %5.2f ms  %6.1f GB/s  (copies %.1f GB/s meanwhile: %.1f GB/s "
                   "together)\n", how.c_str(), t_beside * 1e3, gb / t_beside, link_beside, gb / t_beside + link_beside);
        }
        double t_copy = 0, t_vanilla = 0;
        if (ia == 0) {
            std::vector<uint8_t> dst(layer_bytes / 2 / T * T + 4096);
            auto copy = [&] {
                A.rkv_cpu_pool_run(T, [&](int t) {
                    const size_t chunk = nb1 * n / T, off = chunk * t;
                    for (int l = 0; l < layers; ++l) {
                        memcpy(dst.data() + chunk * t, (const uint8_t *) K[l]->data + off, chunk);
                        memcpy(dst.data() + chunk * t, (const uint8_t *) V[l]->data + off, chunk);
                    }
                });
            };
            // vanilla: ggml_flash_attn_ext per layer in one graph (decode: one query row, no mask), f32 precision
            ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4 * layers + 16, false);
            for (int l = 0; l < layers; ++l) {
                ggml_tensor * k = ggml_view_3d(ctx, K[l], D, n, n_kv, nb1, kh, 0);
                ggml_tensor * v = ggml_view_3d(ctx, V[l], D, n, n_kv, nb1, kh, 0);
                ggml_tensor * fa = ggml_flash_attn_ext(ctx, q, k, v, nullptr, 1.0f / sqrtf((float) D), 0.0f, 0.0f);
                ggml_prec_set_acc(fa, GGML_PREC_F32);
                ggml_build_forward_expand(gf, fa);
            }
            ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
            ggml_gallocr_alloc_graph(ga, gf);
            t_copy = best(copy);
            t_vanilla = best([&] { ggml_backend_graph_compute(be, gf); });
            printf("  [%s] copy                 %8.2f ms  %6.1f GB/s read\n", how.c_str(), t_copy * 1e3, gb / t_copy);
            printf("  [%s] ggml_flash_attn_ext  %8.2f ms  %6.1f GB/s  (attention %.2fx faster)\n", how.c_str(),
                   t_vanilla * 1e3, gb / t_vanilla, t_vanilla / t_att);
            ggml_gallocr_free(ga);
        }
        printf("{\"isa\": \"%s\", \"threads\": %d, \"layers\": %d, \"cells\": %lld, \"type\": \"%s\", \"alloc\": "
               "\"%s\", \"huge_share\": %.3f, "
               "\"gb\": %.6f, \"attention_ms\": %.4f, \"scan_ms\": %.4f, \"copy_ms\": %.4f, \"ggml_fa_ms\": %.4f, "
               "\"attention_beside_copies_ms\": %.4f, \"copies_beside_gbps\": %.2f, \"rows\": %d, \"rows_apart_ms\": "
               "%.4f}\n", A.rkv_cpu_decode_isa(), T, layers, (long long) n, ggml_type_name(type), how.c_str(), hs, gb,
               t_att * 1e3, t_scan * 1e3, t_copy * 1e3, t_vanilla * 1e3, t_beside * 1e3, link_beside, R, t_apart * 1e3);
        fflush(stdout);
        ggml_backend_buffer_free(wrap);
        ggml_free(ctx);
        region_free(reg);
    }
    ggml_backend_free(be);
    return 0;
}
#endif // RKV_CPU_DECODE_STANDALONE

} // namespace

int main(int argc, char ** argv) {
    bool do_bench = false;
    int T = (int) std::max(1u, std::thread::hardware_concurrency()), layers = 28, reps = 5;
    int64_t cells = 16384;
    ggml_type type = GGML_TYPE_F16;
    std::vector<std::string> isas, allocs;
    bool beside = false;
    double stress_s = 0;
    int affinity_n = 0, idle_n = 0, rows = 1;
    bool part_counts_mode = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) { fprintf(stderr, "%s needs a value\n", a.c_str()); exit(2); }
            return argv[++i];
        };
        if (a == "--bench") do_bench = true;
        else if (a == "-t") T = atoi(next());
        else if (a == "--layers") layers = atoi(next());
        else if (a == "--cells") cells = atoll(next());
        else if (a == "--reps") reps = atoi(next());
        else if (a == "--rows") rows = atoi(next());
        else if (a == "--alloc") {
            std::string v = next();
            for (size_t pos = 0; pos <= v.size();) {
                const size_t e = std::min(v.find(',', pos), v.size());
                allocs.push_back(v.substr(pos, e - pos));
                pos = e + 1;
            }
        }
        else if (a == "--beside-copy") beside = true;
        else if (a == "--pool-stress") stress_s = atof(next());
        else if (a == "--pool-affinity") affinity_n = atoi(next());
        else if (a == "--pool-idle") idle_n = atoi(next());
        else if (a == "--part-counts") part_counts_mode = true;
        else if (a == "--isa") isas.push_back(next());
        else if (a == "--perturb-ref") g_perturb_ref = atof(next());
        else if (a == "--type") {
            const std::string t = next();
            type = t == "f16" ? GGML_TYPE_F16 : t == "q8_0" ? GGML_TYPE_Q8_0 : t == "q4_0" ? GGML_TYPE_Q4_0
                   : GGML_TYPE_COUNT;
            if (type == GGML_TYPE_COUNT) { fprintf(stderr, "--type: f16, q8_0 or q4_0\n"); return 2; }
        } else {
            fprintf(stderr,
                    "usage: %s [--isa NAME] [--perturb-ref X] | --bench [-t N] [--layers L] [--cells N] [--type T] "
                    "[--reps R] [--rows R] [--alloc A,...] [--beside-copy] | --pool-stress SECONDS | --pool-affinity N "
                    "| --pool-idle N | --part-counts\n", argv[0]);
            return 2;
        }
    }
    if (T < 1 || layers < 1 || cells < 16 || reps < 1 || rows < 1) {
        fprintf(stderr, "-t, --layers, --reps, --rows must be >= 1 and --cells >= 16\n");
        return 2;
    }
    if (!api_init()) {
        return 1;
    }
    const std::string default_isa = A.rkv_cpu_decode_isa();  // the path this CPU takes, before any --isa
    for (const std::string & isa : isas) {
        if (isa != "avx512vnni" && isa != "avx512" && isa != "avx2" && isa != "neon-dotprod" && isa != "neon" &&
            isa != "scalar") {
            fprintf(stderr, "--isa: avx512vnni, avx512, avx2, neon-dotprod, neon or scalar, not %s\n", isa.c_str());
            return 2;
        }
        if (!A.rkv_cpu_decode_force_isa(isa.c_str())) {
            fprintf(stderr, "isa %s is not available on this CPU\n", isa.c_str());
            return 2;
        }
    }
    if (stress_s > 0) {
        return pool_stress(stress_s, 8);
    }
    if (affinity_n > 0) {
        return pool_affinity(affinity_n);
    }
    if (idle_n > 0) {
        return pool_idle(idle_n);
    }
    if (part_counts_mode) {
        return part_counts();
    }
    if (do_bench) {
#ifdef RKV_CPU_DECODE_STANDALONE
        fprintf(stderr, "--bench: not in a standalone build (no backends)\n");
        return 2;
#else
        if (!isas.empty()) A.rkv_cpu_decode_force_isa(isas[0].c_str());
        if (allocs.empty()) allocs = {"cpu"};
        for (const std::string & a : allocs) {
            if (a != "cpu" && a != "cudahost" && a != "thp" && a != "tail") {
                fprintf(stderr, "--alloc: cpu, cudahost, thp or tail, not '%s'\n", a.c_str());
                return 2;
            }
        }
        return bench(T, layers, cells, type, reps, allocs, beside, rows);
#endif
    }
    printf("default isa: %s\n", default_isa.c_str());
    if (isas.empty()) {
#if defined(__x86_64__) || defined(__i386__)
        isas = {"avx512vnni", "avx512", "avx2", "scalar"};  // each this CPU has; the others are reported
#else
        isas = {default_isa, "scalar"};  // the compiled path (NEON on AArch64), and the scalar one
        if (isas[0] == "scalar") isas.pop_back();
#endif
    }
    return check(isas);
}
