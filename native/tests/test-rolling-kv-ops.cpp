// rolling-KV op test: GGML_OP_STREAMING_FLASH_ATTN vs ggml_flash_attn_ext
//
// For every case a full K/V of n_kv cells is built from random floats and split at
// `split` into a window [0, split) and a tail [split, n_kv). Both ops run in one graph
// on the same backend (default CPU, -b NAME to choose another), so with the same thread
// count; the NMSE of the outputs is checked.
//
//  - same window/tail types: window and tail are views of one K/V tensor and the
//    reference is ggml_flash_attn_ext over the whole tensor (same types, F16 V
//    included). On the CPU backend the output must be BIT-IDENTICAL to the reference
//    (the CPU kernel runs ops.cpp's own path - split-KV decode, tiled or one-chunk -
//    over the virtual concatenation; printed as "bitexact" / "DIFF n"). On other
//    backends the NMSE is checked against the same 5e-7 (the CUDA parts run the stock
//    kernels; on the H200 same-type cases measured <= 4.6e-7); where it is exceeded (prefill
//    shapes reach ~6e-7: the kernels take Q and P in f16), the op passes if it is no farther
//    from attention in double precision than ggml_flash_attn_ext over the concatenation is
//    (NMSE within 2x; printed as "exact: op .., stock ..").
//  - mixed window/tail types: window and tail are separate tensors of their own types
//    holding the same floats; the reference is ggml_flash_attn_ext over an F32
//    concatenation of the dequantized window and tail. Q is then not quantized to
//    K's vec_dot type (q8_0/q8_1/f16/bf16) in the reference, which alone gives NMSE
//    ~1e-6, so the threshold is looser: 5e-5 (observed max ~2e-6; ~1.3e-5 when both V
//    parts are F16, which the op then accumulates in f16 like ggml's CPU one-chunk path;
//    test-backend-ops uses 5e-4 for flash attention across backends).
//
// Failure self-check (--expect-perturbed): with ROLLINGKV_DEBUG_PERTURB_TAIL=x set, this program sets the op's test
// hook on every op it builds (ggml_streaming_flash_attn_set_tail_perturb: every tail key's score times 1 + x, in the
// CPU and the CUDA forward alike), and every case whose tail holds a key some query row does not mask must FAIL and
// every other case must pass; a case that does as expected counts as passed. x = 1e-6 already breaks the CPU's
// bit-identity; the NMSE checks of mixed types and of other backends need a real perturbation, e.g. x = 1.
//
// Head size 72 runs on the stock TILE FlashAttention kernel on every CUDA/HIP device, which writes no per-row LSE:
// a backend other than the CPU must report the op unsupported for those cases (the scheduler then runs it on the
// CPU), and the CPU must run them exactly.
//  - fully masked q rows (no sinks): the op writes 0, as ggml's CPU flash attention does;
//    ggml's CUDA flash attention writes NaN (0/0) there, and such reference values are taken
//    as 0 (counted on the case line as ref-masked-nan-as-0).
//
// --exact: compute the double-precision reference for every case and fail a case where ggml_flash_attn_ext
// itself is farther than 1e-4 NMSE from it (a self-check of that reference: scale, softcap, ALiBi, sinks, masks).
//
// --heads: the head split's case set instead (llama_rkv_build_attn_heads, src/llama-rolling-kv-graph.cpp, built here
// from the same ops): a layer's KV heads [0, h) attended by ggml_flash_attn_ext on a view of their query heads, the
// others by the streaming op with an EMPTY window (their whole cache is "tail"), the two outputs concatenated by head,
// against ggml_flash_attn_ext over all heads. Same types: on the CPU bit-identical; two types (device heads at one,
// host heads at another): each head bit-identical to ggml_flash_attn_ext over all heads at that head's type. Other
// backends: NMSE within 5e-7 (5e-5 for two types). With --expect-perturbed every case with a host head whose keys are
// not all masked must fail.
//
// --map: a block map (ggml_streaming_flash_attn_set_block_map) on every case of two or more whole 256-cell blocks (n_kv
// a multiple of 256): the case's K/V and mask are the logical ones, the reference's. round(split/256) of its blocks,
// picked at random, are resident in a window of slots out of logical order, with one or two unused slots of garbage
// rows; the tail holds every logical cell, garbage where the block is resident (no tail when every block is). The op
// gets the physical mask (a key's logical column where it is mapped, -inf elsewhere) and, in every other mapped case,
// tail runs over the non-resident blocks some row sees. With an odd split and a mask, logical block 1 is masked for
// every row. Same bounds as without (on the CPU bit-identical for one type).
// --map-wrong: the op's map has logical blocks 0 and 1 swapped (K/V and mask as the true map has them). That is a
// permutation of the keys (each keeps its mask column), which only the CPU's bit-identity sees: exactly the same-type
// cases where a query row sees keys of both blocks must fail on the CPU, no case elsewhere.
//
// usage: test-rolling-kv-ops [-b BACKEND] [-t N_THREADS] [--quick] [--only N] [--tail-host] [--tail-cpu-frac F]
//                            [--exact] [--expect-perturbed] [--heads] [--runs|--runs-wrong] [--map|--map-wrong]
// --tail-cpu-frac F: every op leaves that share of its tail to the CPU (the hybrid tail; a GPU backend with --tail-host
// attends it on the host for decode-sized cases, everything else ignores it): same reference, same bounds.
// prints one line per case and a final "N passed, M failed" line; exit code 1 on failure.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rolling-kv.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

enum mask_mode {
    MASK_NONE,    // no mask
    MASK_CAUSAL,  // causal, padded rows beyond n_q and -inf padding columns at the end
    MASK_HOLES,   // causal + -inf runs in the middle and around the split point
    MASK_ROWS,    // holes + fully masked rows, rows with a fully masked window, rows with a fully masked tail
};

static const char * mask_name(mask_mode m) {
    switch (m) {
        case MASK_NONE:   return "none";
        case MASK_CAUSAL: return "causal";
        case MASK_HOLES:  return "holes";
        case MASK_ROWS:   return "rows";
    }
    return "?";
}

struct test_case {
    int64_t   D;          // head dim (DK == DV)
    int64_t   n_head_kv;
    int64_t   gqa;        // n_head = n_head_kv*gqa
    int64_t   n_kv;
    int64_t   n_q;
    int64_t   split;      // window = [0, split), tail = [split, n_kv)
    ggml_type tkw, tvw;   // window K/V types
    ggml_type tkt, tvt;   // tail K/V types
    mask_mode mask;
    bool      sinks;
    float     max_bias;
    float     softcap;
    bool      cache_layout; // K/V as permuted views of a [D, n_head_kv, n_kv] cache (like llama-kv-cache)
    int64_t   ne3;          // batch of streams (q, k, v ne[3]); mask broadcast over it
    bool      q_perm = false; // Q as a permuted view of a [D, n_head, n_q] tensor (like llama's attention input)
    // a head size only the stock TILE kernel runs (no LSE): refused by backends other than the CPU
    bool      tile_only = false;

    bool mixed() const { return tkw != tkt || tvw != tvt; }
};

static std::string case_str(const test_case & c) {
    char buf[512];
    snprintf(buf, sizeof(buf),
        "D=%3lld hkv=%lld gqa=%lld n_kv=%4lld n_q=%3lld split=%4lld K=%s/%s V=%s/%s mask=%s%s%s%s%s%s%s",
        (long long) c.D, (long long) c.n_head_kv, (long long) c.gqa, (long long) c.n_kv, (long long) c.n_q,
        (long long) c.split, ggml_type_name(c.tkw), ggml_type_name(c.tkt), ggml_type_name(c.tvw), ggml_type_name(c.tvt),
        mask_name(c.mask),
        c.sinks ? " sinks" : "",
        c.max_bias > 0.0f ? " alibi" : "",
        c.softcap != 0.0f ? " softcap" : "",
        c.cache_layout ? " cache" : "",
        c.ne3 > 1 ? " ne3=2" : "", c.q_perm ? " q-perm" : "");
    return buf;
}

// quantize/convert float rows into a buffer of type t (rows of n_per_row elements)
static std::vector<uint8_t> to_type(ggml_type t, const float * src, int64_t nrows, int64_t n_per_row) {
    std::vector<uint8_t> out(ggml_row_size(t, n_per_row)*nrows);
    ggml_quantize_chunk(t, src, out.data(), 0, nrows, n_per_row, nullptr);
    return out;
}

static std::vector<float> from_type(ggml_type t, const uint8_t * src, int64_t nrows, int64_t n_per_row) {
    std::vector<float> out(nrows*n_per_row);
    if (t == GGML_TYPE_F32) {
        memcpy(out.data(), src, out.size()*sizeof(float));
    } else {
        const auto * tr = ggml_get_type_traits(t);
        for (int64_t r = 0; r < nrows; ++r) {
            tr->to_float(src + r*ggml_row_size(t, n_per_row), out.data() + r*n_per_row, n_per_row);
        }
    }
    return out;
}

// data layout of host float arrays for K/V: [n_kv][n_head_kv][ne3][D] indexed by helper below
struct kv_host {
    int64_t D, n_kv, nh, ne3;
    std::vector<float> x; // logical [i3][h][cell][d]
    float & at(int64_t i3, int64_t h, int64_t cell, int64_t d) { return x[((i3*nh + h)*n_kv + cell)*D + d]; }
};

// a KV tensor of `type` holding cells [c0, c1) of the host data, either as a plain
// [D, n, nh, ne3] tensor or as a permuted view of a [D, nh, n, ne3] cache
struct kv_dev {
    ggml_tensor * storage = nullptr; // allocated tensor
    ggml_tensor * view    = nullptr; // [D, n, nh, ne3] as consumed by the ops
    std::vector<uint8_t> bytes;      // storage contents
};

static kv_dev make_kv(ggml_context * ctx, ggml_type type, kv_host & h, int64_t c0, int64_t c1, bool cache_layout,
                      int64_t pad_cells) {
    kv_dev r;
    const int64_t n = c1 - c0;
    const int64_t D = h.D;
    const int64_t ncap = n + pad_cells; // storage larger than the view (like a KV cache)
    std::vector<float> tmp;
    if (cache_layout) {
        // storage [D, nh, ncap, ne3]
        tmp.assign(D*h.nh*ncap*h.ne3, 0.0f);
        for (int64_t i3 = 0; i3 < h.ne3; ++i3)
        for (int64_t c = 0; c < n; ++c)
        for (int64_t hh = 0; hh < h.nh; ++hh)
        for (int64_t d = 0; d < D; ++d) {
            tmp[((i3*ncap + c)*h.nh + hh)*D + d] = h.at(i3, hh, c0 + c, d);
        }
        r.storage = ggml_new_tensor_4d(ctx, type, D, h.nh, ncap, h.ne3);
        ggml_tensor * v = ggml_view_4d(ctx, r.storage, D, h.nh, n, h.ne3, r.storage->nb[1], r.storage->nb[2],
                                       r.storage->nb[3], 0);
        r.view = ggml_permute(ctx, v, 0, 2, 1, 3); // -> [D, n, nh, ne3]
    } else {
        // storage [D, ncap, nh, ne3]
        tmp.assign(D*ncap*h.nh*h.ne3, 0.0f);
        for (int64_t i3 = 0; i3 < h.ne3; ++i3)
        for (int64_t hh = 0; hh < h.nh; ++hh)
        for (int64_t c = 0; c < n; ++c)
        for (int64_t d = 0; d < D; ++d) {
            tmp[((i3*h.nh + hh)*ncap + c)*D + d] = h.at(i3, hh, c0 + c, d);
        }
        r.storage = ggml_new_tensor_4d(ctx, type, D, ncap, h.nh, h.ne3);
        r.view = ggml_view_4d(ctx, r.storage, D, n, h.nh, h.ne3, r.storage->nb[1], r.storage->nb[2], r.storage->nb[3],
                              0);
    }
    r.bytes = to_type(type, tmp.data(), (int64_t) tmp.size()/D, D);
    return r;
}

// sub-view of cells [c0, c1) of a [D, n, nh, ne3] (possibly permuted) view
static ggml_tensor * sub_cells(ggml_context * ctx, ggml_tensor * t, int64_t c0, int64_t c1) {
    return ggml_view_4d(ctx, t, t->ne[0], c1 - c0, t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], c0*t->nb[1]);
}

static double nmse(const float * a, const float * b, size_t n) {
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < n; ++i) {
        const double d = (double) a[i] - (double) b[i];
        err += d*d;
        ref += (double) b[i]*(double) b[i];
    }
    if (ref == 0.0) {
        return err == 0.0 ? 0.0 : INFINITY;
    }
    return err/ref;
}

// the query rows (of n_q; mask [n_kv, n_q_pad] as fp16) whose mask is -inf at every key, when check is set (a mask and
// no sinks: only then has such a row no defined softmax); all false otherwise
static std::vector<bool> fully_masked_rows(const std::vector<ggml_fp16_t> & hm, int64_t n_q, int64_t n_kv, bool check) {
    std::vector<bool> dead(n_q, false);
    for (int64_t i = 0; check && i < n_q; ++i) {
        bool d = true;
        for (int64_t j = 0; j < n_kv && d; ++j) {
            d = ggml_fp16_to_fp32(hm[i*n_kv + j]) == -INFINITY;
        }
        dead[i] = d;
    }
    return dead;
}

// Attention in double precision over the values the op's K/V hold (after their types' rounding), the reference
// for backends whose kernels round (the CUDA kernels take Q and P in f16): dst layout [DV, n_head, n_q, ne3],
// 0 for fully masked rows without sinks (as the op). Scale, softcap, ALiBi slopes and sinks as ggml's CPU path.
static std::vector<float> exact_attention(const test_case & c, const std::vector<float> & hq, kv_host & k, kv_host & v,
        const std::vector<ggml_fp16_t> & hm, int64_t n_q_pad, const std::vector<float> & hs, float scale) {
    const int64_t D = c.D, n_kv = c.n_kv, n_head = c.n_head_kv*c.gqa, n_q = c.n_q, ne3 = c.ne3;
    GGML_UNUSED(n_q_pad);
    std::vector<float> out(D*n_head*n_q*ne3, 0.0f);
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2((double) n_head));
    const double m0 = pow(2.0, -(double) c.max_bias/n_head_log2);
    const double m1 = pow(2.0, -((double) c.max_bias/2.0)/n_head_log2);
    const double sc = c.softcap != 0.0f ? (double) scale/c.softcap : (double) scale;

    auto worker = [&](int64_t h0, int64_t h1) {
        std::vector<double> sv(n_kv), acc(D);
        for (int64_t h = h0; h < h1; ++h) {
            const int64_t hk = h/c.gqa;
            const double slope = c.max_bias > 0.0f
                                 ? (h < (int64_t) n_head_log2 ? pow(m0, h + 1) : pow(m1, 2*(h - n_head_log2) + 1))
                                 : 1.0;
            for (int64_t i3 = 0; i3 < ne3; ++i3) {
                for (int64_t iq = 0; iq < n_q; ++iq) {
                    const float * qr = c.q_perm ? &hq[((i3*n_q + iq)*n_head + h)*D] : &hq[((i3*n_head + h)*n_q + iq)*D];
                    double mx = -INFINITY;
                    for (int64_t j = 0; j < n_kv; ++j) {
                        const double mv = hm.empty() ? 0.0 : (double) ggml_fp16_to_fp32(hm[iq*n_kv + j]);
                        if (mv == -INFINITY) { sv[j] = -INFINITY; continue; }
                        double dot = 0.0;
                        const float * kr = &k.at(i3, hk, j, 0);
                        for (int64_t d = 0; d < D; ++d) dot += (double) qr[d]*kr[d];
                        double x = dot*sc;
                        if (c.softcap != 0.0f) x = c.softcap*tanh(x);
                        sv[j] = x + slope*mv;
                        mx = std::max(mx, sv[j]);
                    }
                    if (c.sinks) mx = std::max(mx, (double) hs[h]);
                    if (mx == -INFINITY) continue; // fully masked, no sinks: 0
                    double sum = c.sinks ? exp((double) hs[h] - mx) : 0.0;
                    std::fill(acc.begin(), acc.end(), 0.0);
                    for (int64_t j = 0; j < n_kv; ++j) {
                        if (sv[j] == -INFINITY) continue;
                        const double p = exp(sv[j] - mx);
                        sum += p;
                        const float * vr = &v.at(i3, hk, j, 0);
                        for (int64_t d = 0; d < D; ++d) acc[d] += p*vr[d];
                    }
                    float * o = &out[((i3*n_q + iq)*n_head + h)*D];
                    for (int64_t d = 0; d < D; ++d) o[d] = (float) (acc[d]/sum);
                }
            }
        }
    };
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(n_head, (int64_t) std::thread::hardware_concurrency()));
    std::vector<std::thread> th;
    for (int64_t t = 0; t < nt; ++t) {
        th.emplace_back(worker, t*n_head/nt, (t + 1)*n_head/nt);
    }
    for (auto & t : th) t.join();
    return out;
}

// K or V host values as a tensor of `type` holds them: every row rounded through the type
static void round_through(kv_host & x, ggml_type type) {
    if (type == GGML_TYPE_F32) return;
    for (int64_t i3 = 0; i3 < x.ne3; ++i3)
    for (int64_t h = 0; h < x.nh; ++h)
    for (int64_t cc = 0; cc < x.n_kv; ++cc) {
        float * row = &x.at(i3, h, cc, 0);
        auto qb = to_type(type, row, 1, x.D);
        auto back = from_type(type, qb.data(), 1, x.D);
        memcpy(row, back.data(), x.D*sizeof(float));
    }
}

enum result { RES_PASS, RES_FAIL, RES_SKIP };

static std::string g_extra; // extra per-case info printed on the case line

// --tail-host: the tail K/V live in the device's pinned host buffer type, flagged streamed, and the graph runs
// through a ggml_backend_sched of {device, CPU}: the op must stream the tail itself (the scheduler may neither
// move the op to the CPU nor copy the tail: one split, no device compute buffer), and three evaluations of the
// same graph (eager, then CUDA-graph capture and replay where available) must give identical outputs.
static bool           g_tail_host   = false;
static float          g_tail_cpu_frac = 0.0f;     // --tail-cpu-frac
static bool           g_exact_check = false;
static bool           g_expect_perturbed = false; // --expect-perturbed (ROLLINGKV_DEBUG_PERTURB_TAIL set)
static float          g_perturb_tail     = 0.0f;  // ROLLINGKV_DEBUG_PERTURB_TAIL: every op's tail_perturb (0: off)
static bool           g_tail_live = false;        // the case's tail holds a key some query row does not mask
static ggml_backend_t g_cpu_backend = nullptr;
// --runs: tail runs (ggml_streaming_flash_attn_set_tail_runs) on cases whose tail has at least two 256-cell blocks: the
// mask hides blocks 0, 2 and 3 of the tail from every row and the runs name the others, so the op must equal the
// reference over the whole K/V. --runs-wrong also leaves the first run's block out of the runs while its keys stay
// visible: exactly the cases where a query row sees one of them must fail.
static int            g_runs = 0; // 0 off, 1 --runs, 2 --runs-wrong
static bool           g_runs_on_case = false; // this case attends with runs
// --map, --map-wrong (see the top of the file)
static int            g_map = 0; // 0 off, 1 --map, 2 --map-wrong
static bool           g_map_on_case = false; // this case attends through a block map
static int            g_map_cases = 0;       // mapped cases so far: every other one has tail runs
static std::mt19937   g_map_rng(4321);       // the layouts and their garbage rows, apart from the cases' data

// the physical layout of a mapped case
struct map_layout {
    int64_t n_blocks = 0, n_res = 0, n_slots = 0;
    std::vector<int64_t> slot_block; // the logical block in each window slot, -1: unused (garbage rows)
    std::vector<bool>    resident;   // per logical block: in the window
    std::vector<int32_t> map;        // per logical block: its physical block of [window ; tail]

    int64_t n_win()  const { return 256*n_slots; }
    int64_t n_tail() const { return n_res < n_blocks ? 256*n_blocks : 0; } // the tail mirrors the logical cells
    int64_t phys(int64_t j) const { return 256*(int64_t) map[j/256] + j%256; }
};

// n_res of n_blocks blocks resident, picked at random, in shuffled slots (one or two unused), not in logical order
static map_layout make_map_layout(int64_t n_blocks, int64_t n_res, std::mt19937 & rng) {
    map_layout L;
    L.n_blocks = n_blocks;
    L.n_res    = n_res;
    L.n_slots  = n_res + 1 + (int64_t) (rng() % 2);
    auto shuffled = [&](int64_t n) {
        std::vector<int64_t> v(n);
        for (int64_t i = 0; i < n; ++i) v[i] = i;
        for (int64_t i = n; i > 1; --i) std::swap(v[i - 1], v[rng() % i]);
        return v;
    };
    const std::vector<int64_t> blocks = shuffled(n_blocks), slots = shuffled(L.n_slots);
    L.slot_block.assign(L.n_slots, -1);
    L.resident.assign(n_blocks, false);
    for (int64_t k = 0; k < n_res; ++k) {
        L.slot_block[slots[k]] = blocks[k];
        L.resident[blocks[k]]  = true;
    }
    // the resident blocks' slots must not rise with the block: else swap the slots of the first two
    std::vector<int64_t> slot_of(n_blocks, -1);
    for (int64_t sl = 0; sl < L.n_slots; ++sl) {
        if (L.slot_block[sl] >= 0) slot_of[L.slot_block[sl]] = sl;
    }
    std::vector<int64_t> res_slots;
    for (int64_t b = 0; b < n_blocks; ++b) {
        if (L.resident[b]) res_slots.push_back(slot_of[b]);
    }
    if (res_slots.size() >= 2 && std::is_sorted(res_slots.begin(), res_slots.end())) {
        std::swap(L.slot_block[res_slots[0]], L.slot_block[res_slots[1]]);
    }
    L.map.assign(n_blocks, -1);
    for (int64_t sl = 0; sl < L.n_slots; ++sl) {
        if (L.slot_block[sl] >= 0) L.map[L.slot_block[sl]] = (int32_t) sl;
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
        if (!L.resident[b]) L.map[b] = (int32_t) (L.n_slots + b);
    }
    return L;
}

static uint64_t cpu_part_runs(); // CPU parts of ops run so far (below)

// bytes the GPU backends' copy plans streamed so far (GGML_RKV_STREAMED_BYTES_PROC), 0 where none counts them
static uint64_t plan_streamed_bytes() {
    uint64_t sum = 0;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        auto fn = (ggml_backend_rkv_streamed_bytes_t) ggml_backend_reg_get_proc_address(ggml_backend_reg_get(i),
                GGML_RKV_STREAMED_BYTES_PROC);
        if (fn) {
            uint64_t total = 0, last = 0, plans = 0;
            fn(&total, &last, &plans);
            sum += total;
        }
    }
    return sum;
}

// the tail runs of a case with --runs: blocks of 256 cells of the n_tail-cell tail, blocks 0, 2 and 3 left out (and,
// wrong, the first run too); returns the cells [c0, c1) of the dropped run (none: c0 == c1)
static std::pair<int64_t, int64_t> case_runs(int64_t n_tail, bool wrong, std::vector<int32_t> & first,
        std::vector<int32_t> & n, std::vector<std::pair<int64_t, int64_t>> & hidden) {
    first.clear(); n.clear(); hidden.clear();
    const int64_t nb = (n_tail + 255)/256;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = 256*b, c1 = std::min(n_tail, c0 + 256);
        if (b == 0 || b == 2 || b == 3) {
            hidden.push_back({ c0, c1 });
        } else if (!first.empty() && first.back() + n.back() == c0) {
            n.back() += (int32_t) (c1 - c0);
        } else {
            first.push_back((int32_t) c0);
            n.push_back((int32_t) (c1 - c0));
        }
    }
    std::pair<int64_t, int64_t> dropped = { 0, 0 };
    if (wrong && !first.empty()) {
        dropped = { first[0], first[0] + n[0] };
        first.erase(first.begin());
        n.erase(n.begin());
    }
    return dropped;
}

// the op's parameters that the command line sets: --tail-cpu-frac as the cells of op's tail the CPU attends, rounded
// once as llama's planner rounds a share, and the test hook's tail perturbation (ROLLINGKV_DEBUG_PERTURB_TAIL)
static void set_op_params(ggml_tensor * op) {
    const ggml_tensor * kt = op->src[GGML_STREAMING_FA_SRC_K_TAIL];
    ggml_streaming_flash_attn_set_tail_cpu_cells(op, ggml_rkv_tail_cpu_cells(kt ? kt->ne[1] : 0, g_tail_cpu_frac));
    ggml_streaming_flash_attn_set_tail_perturb(op, g_perturb_tail);
}

static result run_case(ggml_backend_t backend, bool is_cpu, const test_case & c, std::mt19937 & rng, bool verbose,
                       double * out_nmse, double * out_thr) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);

    const int64_t D = c.D, n_kv = c.n_kv, nhkv = c.n_head_kv, n_head = nhkv*c.gqa, ne3 = c.ne3;
    const int64_t n_q = c.n_q;
    const int64_t n_q_pad = c.mask == MASK_NONE ? n_q : n_q + 3; // mask rows beyond n_q
    const int64_t s = c.split;

    // host data
    kv_host hk{D, n_kv, nhkv, ne3, {}}, hv{D, n_kv, nhkv, ne3, {}};
    hk.x.resize(D*n_kv*nhkv*ne3);
    hv.x.resize(D*n_kv*nhkv*ne3);
    for (auto & x : hk.x) x = u(rng);
    for (auto & x : hv.x) x = u(rng);

    std::vector<float> hq(D*n_q*n_head*ne3);
    for (auto & x : hq) x = u(rng);

    std::vector<float> hs(n_head);
    for (auto & x : hs) x = 10.0f*u(rng); // large sinks, as test-backend-ops

    // mask [n_kv, n_q_pad, 1, 1] (broadcast over heads and ne3)
    std::vector<ggml_fp16_t> hm;
    if (c.mask != MASK_NONE) {
        hm.resize(n_kv*n_q_pad);
        const int64_t pad_cols = std::min<int64_t>(5, n_kv/4);
        const int64_t n_valid  = n_kv - pad_cols;
        for (int64_t i = 0; i < n_q_pad; ++i) {
            for (int64_t j = 0; j < n_kv; ++j) {
                float v = c.max_bias > 0.0f ? -0.01f*(float) std::abs((n_valid - n_q + i) - j) : 0.0f;
                if (c.max_bias == 0.0f && (j % 7) == 3) {
                    v = 0.5f*(u(rng) - 1.0f); // some non-zero finite mask values
                }
                bool masked = false;
                if (i >= n_q)                   masked = true; // padded rows
                if (j >= n_valid)               masked = true; // padded columns
                if (j > n_valid - n_q + i)      masked = true; // causal
                if (c.mask >= MASK_HOLES) {
                    if (j >= n_kv/3 && j < n_kv/3 + 40) masked = true;
                    if (j >= s - 3 && j < s + 3)          masked = true;
                }
                if (c.mask == MASK_ROWS) {
                    if (i % 4 == 1) masked = true;             // fully masked row
                    if (i % 4 == 2 && j <  s) masked = true;   // window fully masked
                    if (i % 4 == 3 && j >= s) masked = true;   // tail fully masked
                }
                hm[i*n_kv + j] = ggml_fp32_to_fp16(masked ? -INFINITY : v);
            }
        }
    }

    std::vector<int32_t> run_first, run_n;
    std::pair<int64_t, int64_t> run_dropped = { 0, 0 };
    g_runs_on_case = g_runs > 0 && !hm.empty() && n_kv - s >= 512;
    if (g_runs_on_case) {
        std::vector<std::pair<int64_t, int64_t>> hidden;
        run_dropped = case_runs(n_kv - s, g_runs == 2, run_first, run_n, hidden);
        for (const auto & h : hidden) {
            for (int64_t i = 0; i < n_q_pad; ++i) {
                for (int64_t j = s + h.first; j < s + h.second; ++j) {
                    hm[i*n_kv + j] = ggml_fp32_to_fp16(-INFINITY);
                }
            }
        }
        // an empty run list means the whole tail: the wrong case with nothing left would not leave anything out
        g_runs_on_case = !run_first.empty();
        char b[96];
        snprintf(b, sizeof(b), " runs=%zu", run_first.size());
        g_extra += b;
    }

    // --map: the physical layout, the op's (physical) mask and, every other case, tail runs over the non-resident
    // blocks some query row sees (at most GGML_RKV_MAX_TAIL_RUNS: the closest merged, what lies between is masked)
    g_map_on_case = g_map > 0 && n_kv % 256 == 0 && n_kv >= 512;
    map_layout ml;
    std::vector<ggml_fp16_t> hmp;
    int64_t n_phys = n_kv; // the op's keys
    auto sees = [&](int64_t i, int64_t j0, int64_t j1) { // query row i sees one of the logical keys [j0, j1)
        for (int64_t j = j0; j < j1; ++j) {
            if (hm.empty() || ggml_fp16_to_fp32(hm[i*n_kv + j]) != -INFINITY) return true;
        }
        return false;
    };
    if (g_map_on_case) {
        const int64_t n_blocks = n_kv/256;
        if (s % 2 == 1 && !hm.empty()) {
            // an odd split: logical block 1 masked for every row (a unified cache's block of another sequence)
            for (int64_t i = 0; i < n_q_pad; ++i) {
                for (int64_t j = 256; j < 512; ++j) {
                    hm[i*n_kv + j] = ggml_fp32_to_fp16(-INFINITY);
                }
            }
        }
        ml = make_map_layout(n_blocks, std::min(n_blocks, (s + 128)/256), g_map_rng);
        n_phys = ml.n_win() + ml.n_tail();
        hmp.assign(n_phys*n_q_pad, ggml_fp32_to_fp16(-INFINITY));
        for (int64_t i = 0; i < n_q_pad; ++i) {
            for (int64_t j = 0; j < n_kv; ++j) {
                hmp[i*n_phys + ml.phys(j)] = hm.empty() ? ggml_fp32_to_fp16(0.0f) : hm[i*n_kv + j];
            }
        }
        std::vector<std::pair<int64_t, int64_t>> groups; // [b0, b1): non-resident blocks that rows see
        for (int64_t b = 0; b < n_blocks && ml.n_tail() > 0; ++b) {
            bool seen = false;
            for (int64_t i = 0; i < n_q && !seen && !ml.resident[b]; ++i) {
                seen = sees(i, 256*b, 256*(b + 1));
            }
            if (!seen) continue;
            if (!groups.empty() && groups.back().second == b) {
                groups.back().second = b + 1;
            } else {
                groups.push_back({ b, b + 1 });
            }
        }
        while (groups.size() > GGML_RKV_MAX_TAIL_RUNS) {
            size_t k = 0;
            for (size_t g = 1; g + 1 < groups.size(); ++g) {
                if (groups[g + 1].first - groups[g].second < groups[k + 1].first - groups[k].second) k = g;
            }
            groups[k].second = groups[k + 1].second;
            groups.erase(groups.begin() + k + 1);
        }
        if (g_map_cases++ % 2 == 1 && !groups.empty()) {
            for (const auto & g : groups) {
                run_first.push_back((int32_t) (256*g.first));
                run_n.push_back((int32_t) (256*(g.second - g.first)));
            }
            g_runs_on_case = true;
        }
        char b[128];
        snprintf(b, sizeof(b), " map=%lld/%lld slots=%lld%s", (long long) ml.n_res, (long long) n_blocks,
                (long long) ml.n_slots, g_runs_on_case ? "" : " runs=0");
        g_extra += b;
        if (g_runs_on_case) {
            snprintf(b, sizeof(b), " runs=%zu", run_first.size());
            g_extra += b;
        }
    }

    // A q row whose mask is -inf everywhere has no defined softmax. The op (and ggml's CPU flash
    // attention) writes 0 there, but ggml's CUDA flash attention writes 0/0 = NaN when there are no
    // sinks. Such reference values are taken as 0; any other non-finite reference value still fails.
    g_tail_live = false;
    for (int64_t i = 0; i < n_q && !g_tail_live; ++i) {
        for (int64_t j = s; j < n_kv && !g_tail_live; ++j) {
            g_tail_live = hm.empty() || ggml_fp16_to_fp32(hm[i*n_kv + j]) != -INFINITY;
        }
    }
    if (g_map_on_case) {
        // the physical tail
        g_tail_live = false;
        for (int64_t i = 0; i < n_q && !g_tail_live; ++i) {
            for (int64_t j = ml.n_win(); j < n_phys && !g_tail_live; ++j) {
                g_tail_live = ggml_fp16_to_fp32(hmp[i*n_phys + j]) != -INFINITY;
            }
        }
    }
    if (g_map == 2) {
        // the swap of blocks 0 and 1 reorders the keys of a row that sees both: the CPU's bit-identity sees that
        g_tail_live = false;
        for (int64_t i = 0; g_map_on_case && is_cpu && !c.mixed() && i < n_q && !g_tail_live; ++i) {
            g_tail_live = sees(i, 0, 256) && sees(i, 256, 512);
        }
    }

    if (g_runs == 2) {
        // the verdict turns on the dropped run alone: a visible key there must make the case fail
        g_tail_live = false;
        for (int64_t i = 0; g_runs_on_case && i < n_q && !g_tail_live; ++i) {
            for (int64_t j = s + run_dropped.first; j < s + run_dropped.second && !g_tail_live; ++j) {
                g_tail_live = ggml_fp16_to_fp32(hm[i*n_kv + j]) != -INFINITY;
            }
        }
    }

    const std::vector<bool> row_masked = fully_masked_rows(hm, n_q, n_kv, c.mask != MASK_NONE && !c.sinks);
    auto zero_masked_nan = [&](std::vector<float> & r) {
        size_t n = 0;
        for (size_t e = 0; e < r.size(); ++e) {
            if (row_masked[(int64_t) (e/(size_t) (D*n_head)) % n_q] && !std::isfinite(r[e])) {
                r[e] = 0.0f;
                n++;
            }
        }
        return n;
    };

    const size_t ctx_size = 128*ggml_tensor_overhead() + ggml_graph_overhead();
    ggml_init_params ip = { ctx_size, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_context * ctx_host = g_tail_host ? ggml_init(ip) : nullptr; // tail storages (pinned host)
    std::vector<kv_dev> kvs_host;

    ggml_tensor * q_storage = c.q_perm ? ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, n_head, n_q, ne3)
                                       : ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, n_q, n_head, ne3);
    ggml_tensor * q = c.q_perm ? ggml_permute(ctx, q_storage, 0, 2, 1, 3) : q_storage;
    ggml_tensor * m = c.mask != MASK_NONE ? ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, n_q_pad, 1, 1) : nullptr;
    ggml_tensor * sk = c.sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_head) : nullptr;

    std::vector<kv_dev> kvs;
    kv_host exact_k, exact_v; // the values the op's K/V hold (for the exact reference on non-CPU backends)
    ggml_tensor *kw = nullptr, *vw = nullptr, *kt = nullptr, *vt = nullptr, *kref = nullptr, *vref = nullptr;
    std::vector<uint8_t> kref_bytes, vref_bytes;

    if (g_map_on_case) {
        // the physical window and tail, garbage in unused slots and in the tail cells of resident blocks
        const int64_t n_win = ml.n_win(), n_tail = ml.n_tail();
        kv_host wk{D, n_win, nhkv, ne3, {}}, wv{D, n_win, nhkv, ne3, {}};
        kv_host tk{D, n_tail, nhkv, ne3, {}}, tv{D, n_tail, nhkv, ne3, {}};
        for (kv_host * x : { &wk, &wv, &tk, &tv }) {
            x->x.resize(D*x->n_kv*nhkv*ne3);
        }
        for (int64_t i3 = 0; i3 < ne3; ++i3)
        for (int64_t h = 0; h < nhkv; ++h) {
            for (int64_t cc = 0; cc < n_win; ++cc) {
                const int64_t b = ml.slot_block[cc/256], j = 256*b + cc%256;
                for (int64_t d = 0; d < D; ++d) {
                    wk.at(i3, h, cc, d) = b >= 0 ? hk.at(i3, h, j, d) : 8.0f*u(g_map_rng);
                    wv.at(i3, h, cc, d) = b >= 0 ? hv.at(i3, h, j, d) : 8.0f*u(g_map_rng);
                }
            }
            for (int64_t cc = 0; cc < n_tail; ++cc) {
                const bool res = ml.resident[cc/256];
                for (int64_t d = 0; d < D; ++d) {
                    tk.at(i3, h, cc, d) = res ? 8.0f*u(g_map_rng) : hk.at(i3, h, cc, d);
                    tv.at(i3, h, cc, d) = res ? 8.0f*u(g_map_rng) : hv.at(i3, h, cc, d);
                }
            }
        }
        kvs.push_back(make_kv(ctx, c.tkw, wk, 0, n_win, c.cache_layout, 3)); kw = kvs.back().view;
        kvs.push_back(make_kv(ctx, c.tvw, wv, 0, n_win, c.cache_layout, 3)); vw = kvs.back().view;
        if (n_tail > 0) {
            auto & dst = g_tail_host ? kvs_host : kvs;
            ggml_context * ctx_t = g_tail_host ? ctx_host : ctx;
            dst.push_back(make_kv(ctx_t, c.tkt, tk, 0, n_tail, c.cache_layout, 3)); kt = dst.back().view;
            dst.push_back(make_kv(ctx_t, c.tvt, tv, 0, n_tail, c.cache_layout, 3)); vt = dst.back().view;
        }
        // the reference: the logical K/V (the same bytes per row: rows are quantized independently); mixed types: an
        // F32 copy of what the window and the tail hold, each block at its part's types
        kv_host rk = hk, rv = hv;
        if (c.mixed()) {
            for (int64_t i3 = 0; i3 < ne3; ++i3)
            for (int64_t h = 0; h < nhkv; ++h)
            for (int64_t j = 0; j < n_kv; ++j) {
                const bool res = ml.resident[j/256];
                for (auto * pr : { &rk, &rv }) {
                    const ggml_type t = pr == &rk ? (res ? c.tkw : c.tkt) : (res ? c.tvw : c.tvt);
                    float * row = &pr->at(i3, h, j, 0);
                    auto qb = to_type(t, row, 1, D);
                    auto back = from_type(t, qb.data(), 1, D);
                    memcpy(row, back.data(), D*sizeof(float));
                }
            }
            if (!is_cpu || g_exact_check) { exact_k = rk; exact_v = rv; }
        }
        const ggml_type trk = c.mixed() ? GGML_TYPE_F32 : c.tkw, trv = c.mixed() ? GGML_TYPE_F32 : c.tvw;
        kvs.push_back(make_kv(ctx, trk, rk, 0, n_kv, c.cache_layout, 3)); kref = kvs.back().view;
        kvs.push_back(make_kv(ctx, trv, rv, 0, n_kv, c.cache_layout, 3)); vref = kvs.back().view;
    } else if (!c.mixed()) {
        kvs.push_back(make_kv(ctx, c.tkw, hk, 0, n_kv, c.cache_layout, 3));
        kvs.push_back(make_kv(ctx, c.tvw, hv, 0, n_kv, c.cache_layout, 3));
        kref = kvs[0].view;
        vref = kvs[1].view;
        if (s > 0)    { kw = sub_cells(ctx, kref, 0, s);    vw = sub_cells(ctx, vref, 0, s); }
        if (s < n_kv && !g_tail_host) { kt = sub_cells(ctx, kref, s, n_kv); vt = sub_cells(ctx, vref, s, n_kv); }
        if (s < n_kv && g_tail_host) {
            // same bytes as the reference's cells [s, n_kv) (rows are quantized independently), in host memory
            kvs_host.push_back(make_kv(ctx_host, c.tkt, hk, s, n_kv, c.cache_layout, 3)); kt = kvs_host.back().view;
            kvs_host.push_back(make_kv(ctx_host, c.tvt, hv, s, n_kv, c.cache_layout, 3)); vt = kvs_host.back().view;
        }
    } else {
        if (s > 0) {
            kvs.push_back(make_kv(ctx, c.tkw, hk, 0, s, c.cache_layout, 3)); kw = kvs.back().view;
            kvs.push_back(make_kv(ctx, c.tvw, hv, 0, s, c.cache_layout, 3)); vw = kvs.back().view;
        }
        if (s < n_kv) {
            auto & dst = g_tail_host ? kvs_host : kvs;
            dst.push_back(make_kv(g_tail_host ? ctx_host : ctx, c.tkt, hk, s, n_kv, c.cache_layout, 3));
                    kt = dst.back().view;
            dst.push_back(make_kv(g_tail_host ? ctx_host : ctx, c.tvt, hv, s, n_kv, c.cache_layout, 3));
                    vt = dst.back().view;
        }
        // reference: F32 concatenation of what the window/tail hold after quantization
        kv_host rk = hk, rv = hv;
        for (auto * pr : { &rk, &rv }) {
            const bool isk = pr == &rk;
            for (int part = 0; part < 2; ++part) {
                const int64_t c0 = part == 0 ? 0 : s, c1 = part == 0 ? s : n_kv;
                if (c1 <= c0) continue;
                const ggml_type t = isk ? (part == 0 ? c.tkw : c.tkt) : (part == 0 ? c.tvw : c.tvt);
                for (int64_t i3 = 0; i3 < ne3; ++i3)
                for (int64_t h = 0; h < nhkv; ++h)
                for (int64_t cc = c0; cc < c1; ++cc) {
                    float * row = &pr->at(i3, h, cc, 0);
                    auto qb = to_type(t, row, 1, D);
                    auto back = from_type(t, qb.data(), 1, D);
                    memcpy(row, back.data(), D*sizeof(float));
                }
            }
        }
        kvs.push_back(make_kv(ctx, GGML_TYPE_F32, rk, 0, n_kv, c.cache_layout, 3)); kref = kvs.back().view;
        kvs.push_back(make_kv(ctx, GGML_TYPE_F32, rv, 0, n_kv, c.cache_layout, 3)); vref = kvs.back().view;
        if (!is_cpu || g_exact_check) { exact_k = rk; exact_v = rv; }
    }
    if ((!is_cpu || g_exact_check) && !c.mixed()) {
        exact_k = hk; round_through(exact_k, c.tkw);
        exact_v = hv; round_through(exact_v, c.tvw);
    }

    const float scale = 1.0f/sqrtf((float) D);

    // --map: the op's mask is the physical one (always there: the unused slots are masked), its map a graph input
    ggml_tensor * m_op  = g_map_on_case ? ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_phys, n_q_pad, 1, 1) : m;
    ggml_tensor * map_t = g_map_on_case ? ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ml.n_blocks) : nullptr;

    ggml_tensor * out = ggml_streaming_flash_attn(ctx, q, kw, vw, kt, vt, m_op, scale, c.max_bias, c.softcap);
    ggml_streaming_flash_attn_add_sinks(out, sk);
    ggml_streaming_flash_attn_set_prec(out, GGML_PREC_F32);
    set_op_params(out);
    if (g_runs_on_case) {
        ggml_streaming_flash_attn_set_tail_runs(out, (int) run_first.size(), run_first.data(), run_n.data());
    }
    if (map_t) {
        ggml_streaming_flash_attn_set_block_map(out, map_t);
    }

    ggml_tensor * ref = ggml_flash_attn_ext(ctx, q, kref, vref, m, scale, c.max_bias, c.softcap);
    ggml_flash_attn_ext_add_sinks(ref, sk);
    ggml_prec_set_acc(ref, GGML_PREC_F32);

    // mixed types in a prefill-sized batch over an F16/F32 window: queries in Q tiles that never read the tail
    // must be bit-identical to the resident cache of the window's type (checked on CPU, see rkv_fa_mixed_tiles)
    ggml_tensor * ref_w = nullptr;
    if (c.mixed() && m && !g_map_on_case && n_q >= 64 && s > 0 && s < n_kv && c.tkw == c.tvw &&
            (c.tkw == GGML_TYPE_F16 || c.tkw == GGML_TYPE_F32) && !g_tail_host) {
        kvs.push_back(make_kv(ctx, c.tkw, hk, 0, n_kv, c.cache_layout, 3)); ggml_tensor * kw_full = kvs.back().view;
        kvs.push_back(make_kv(ctx, c.tvw, hv, 0, n_kv, c.cache_layout, 3)); ggml_tensor * vw_full = kvs.back().view;
        ref_w = ggml_flash_attn_ext(ctx, q, kw_full, vw_full, m, scale, c.max_bias, c.softcap);
        ggml_flash_attn_ext_add_sinks(ref_w, sk);
        ggml_prec_set_acc(ref_w, GGML_PREC_F32);
    }

    // --tail-host, same types, cache layout: a second op (out_b) after set_rows that overwrite tail rows in host
    // memory (and the same rows of the reference), with new values on every evaluation. Its tail copies run ahead
    // of those writes (issued during the first op), so it is exact only if the op takes written rows again.
    ggml_tensor * out_b = nullptr, * ref_b = nullptr, * w_k = nullptr, * w_v = nullptr;
    ggml_tensor * ix_tail = nullptr, * ix_ref = nullptr;
    std::vector<ggml_tensor *> writes; // the set_rows nodes between the two ops
    std::vector<int64_t> h_ix_tail, h_ix_ref;
    if (g_tail_host && !c.mixed() && !g_map_on_case && c.cache_layout && s < n_kv) {
        const int64_t n_tail = n_kv - s;
        for (int64_t cell : { (int64_t) 0, n_tail/2, n_tail - 1 }) {
            if (!h_ix_tail.empty() && cell == h_ix_tail.back()) continue;
            h_ix_tail.push_back(cell);          // stream 0 of the tail storage
            h_ix_ref.push_back(s + cell);       // the same cell of the reference
        }
        const int64_t n_w = (int64_t) h_ix_tail.size();
        w_k = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*nhkv, n_w);
        w_v = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*nhkv, n_w);
        ix_tail = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_w);
        ix_ref  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_w);
        auto rows2d = [&](ggml_tensor * st) {
            return ggml_reshape_2d(ctx, st, st->ne[0]*st->ne[1], st->ne[2]*st->ne[3]);
        };
        out_b = ggml_streaming_flash_attn(ctx, q, kw, vw, kt, vt, m, scale, c.max_bias, c.softcap);
        ggml_streaming_flash_attn_add_sinks(out_b, sk);
        ggml_streaming_flash_attn_set_prec(out_b, GGML_PREC_F32);
        set_op_params(out_b);
        if (g_runs_on_case) {
            ggml_streaming_flash_attn_set_tail_runs(out_b, (int) run_first.size(), run_first.data(), run_n.data());
        }
        ref_b = ggml_flash_attn_ext(ctx, q, kref, vref, m, scale, c.max_bias, c.softcap);
        ggml_flash_attn_ext_add_sinks(ref_b, sk);
        ggml_prec_set_acc(ref_b, GGML_PREC_F32);
        // the writes are graph nodes of their own (set_rows returns a view of the written tensor)
        writes.push_back(ggml_set_rows(ctx, rows2d(kvs_host[0].storage), w_k, ix_tail));
        writes.push_back(ggml_set_rows(ctx, rows2d(kvs_host[1].storage), w_v, ix_tail));
        writes.push_back(ggml_set_rows(ctx, rows2d(kvs[0].storage), w_k, ix_ref));
        writes.push_back(ggml_set_rows(ctx, rows2d(kvs[1].storage), w_v, ix_ref));
    }


    ggml_backend_buffer_t buf_host = nullptr;
    if (g_tail_host && !kvs_host.empty()) {
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(backend));
        GGML_ASSERT(host_buft && "--tail-host needs a device with a pinned host buffer type");
        buf_host = ggml_backend_alloc_ctx_tensors_from_buft(ctx_host, host_buft);
        GGML_ASSERT(buf_host);
        for (auto & kv : kvs_host) {
            ggml_set_streamed(kv.storage);
        }
    }

    if (c.tile_only && !is_cpu) {
        // the stock dispatch picks TILE for this head size, which writes no LSE: the op must be refused
        const bool refused = !ggml_backend_supports_op(backend, out);
        g_extra += refused ? " refused (TILE kernel: no LSE)" : " SUPPORTED although the TILE kernel writes no LSE";
        g_tail_live = false; // nothing runs: the verdict does not depend on the tail
        if (buf_host) ggml_backend_buffer_free(buf_host);
        if (ctx_host) ggml_free(ctx_host);
        ggml_free(ctx);
        return refused ? RES_PASS : RES_FAIL;
    }
    if (!ggml_backend_supports_op(backend, out) || !ggml_backend_supports_op(backend, ref)) {
        if (buf_host) ggml_backend_buffer_free(buf_host);
        if (ctx_host) ggml_free(ctx_host);
        ggml_free(ctx);
        return RES_SKIP;
    }

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, ref);
    if (ref_w) {
        ggml_build_forward_expand(gf, ref_w);
    }
    if (out_b) {
        for (ggml_tensor * w : writes) {
            ggml_build_forward_expand(gf, w);
        }
        ggml_build_forward_expand(gf, out_b);
        ggml_build_forward_expand(gf, ref_b);
    }

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    GGML_ASSERT(buf);

    ggml_backend_tensor_set(q_storage, hq.data(), 0, ggml_nbytes(q_storage));
    if (m)  ggml_backend_tensor_set(m, hm.data(), 0, ggml_nbytes(m));
    if (sk) ggml_backend_tensor_set(sk, hs.data(), 0, ggml_nbytes(sk));
    if (map_t) {
        ggml_backend_tensor_set(m_op, hmp.data(), 0, ggml_nbytes(m_op));
        std::vector<int32_t> map_op = ml.map;
        if (g_map == 2) {
            std::swap(map_op[0], map_op[1]); // --map-wrong
        }
        ggml_backend_tensor_set(map_t, map_op.data(), 0, ggml_nbytes(map_t));
    }
    for (auto * set : { &kvs, &kvs_host }) {
        for (auto & kv : *set) {
            GGML_ASSERT(kv.bytes.size() == ggml_nbytes(kv.storage));
            ggml_backend_tensor_set(kv.storage, kv.bytes.data(), 0, kv.bytes.size());
        }
    }

    std::vector<float> ho(ggml_nelements(out)), hr(ggml_nelements(ref));
    GGML_ASSERT(ho.size() == hr.size());
    bool sched_ok = true;
    if (g_tail_host) {
        ggml_backend_t backends[2] = { backend, g_cpu_backend };
        ggml_backend_sched_t sched = ggml_backend_sched_new(backends, nullptr, 2, GGML_DEFAULT_GRAPH_SIZE, false, true);
        std::vector<float> first;
        std::vector<float> hob, hrb;
        std::mt19937 wrng(77);
        if (out_b) {
            ggml_backend_tensor_set(ix_tail, h_ix_tail.data(), 0, ggml_nbytes(ix_tail));
            ggml_backend_tensor_set(ix_ref, h_ix_ref.data(), 0, ggml_nbytes(ix_ref));
            hob.resize(ggml_nelements(out_b));
            hrb.resize(ggml_nelements(ref_b));
        }
        for (int run = 0; run < 3; ++run) {
            if (out_b) {
                // new rows on every evaluation (a replayed CUDA graph must re-read them too)
                std::vector<float> wk(ggml_nelements(w_k)), wv(ggml_nelements(w_v));
                for (auto & x : wk) x = 2.0f*u(wrng);
                for (auto & x : wv) x = 2.0f*u(wrng);
                ggml_backend_tensor_set(w_k, wk.data(), 0, ggml_nbytes(w_k));
                ggml_backend_tensor_set(w_v, wv.data(), 0, ggml_nbytes(w_v));
            }
            const uint64_t streamed0 = plan_streamed_bytes();
            const uint64_t parts0    = cpu_part_runs();
            const ggml_status st = ggml_backend_sched_graph_compute(sched, gf);
            GGML_ASSERT(st == GGML_STATUS_SUCCESS);
            if (kvs_host.size() >= 2) {
                // the copy plan's own count against what the ops read: each op's read tail cells less its CPU part
                // (the runs' cells when set), K and V rows of every stream. The CPU part is a hint the backend may
                // decline (a type or shape the part does not read): then the whole read tail streams
                const bool cpu_ran = cpu_part_runs() > parts0;
                const uint64_t got = plan_streamed_bytes() - streamed0;
                uint64_t want = 0;
                for (const ggml_tensor * op : { out, out_b }) {
                    if (!op) continue;
                    const int64_t n_cpu = cpu_ran ? ggml_streaming_flash_attn_get_tail_cpu_cells(op) : 0;
                    const int64_t n_tail = kt->ne[1];
                    int64_t cells = 0;
                    int32_t rf[GGML_RKV_MAX_TAIL_RUNS], rn[GGML_RKV_MAX_TAIL_RUNS];
                    const int nr = ggml_streaming_flash_attn_get_tail_runs(op, rf, rn);
                    if (nr == 0) {
                        cells = n_tail - n_cpu;
                    }
                    for (int r = 0; r < nr; ++r) {
                        cells += std::max<int64_t>(0, std::min<int64_t>(rf[r] + rn[r], n_tail - n_cpu) - rf[r]);
                    }
                    want += (uint64_t) cells*(kt->nb[1] + vt->nb[1])*(uint64_t) kt->ne[3];
                }
                // the proc is the CUDA backend's: absent (0 counted) only where no GPU backend streams
                if (got != want && !(got == 0 && plan_streamed_bytes() == 0)) {
                    g_extra += " STREAMED " + std::to_string(got) + " bytes, the ops read " + std::to_string(want);
                    sched_ok = false;
                }
            }
            const int    n_splits = ggml_backend_sched_get_n_splits(sched);
            const size_t dev_buf  = ggml_backend_sched_get_buffer_size(sched, backend);
            if (n_splits != 1 || dev_buf != 0) {
                // a tail copied by the scheduler would show up as a device compute buffer (everything else is
                // pre-allocated)
                g_extra += " SCHED splits=" + std::to_string(n_splits) + " device-buffer=" + std::to_string(dev_buf);
                sched_ok = false;
            }
            ggml_backend_tensor_get(out, ho.data(), 0, ggml_nbytes(out));
            if (out_b) {
                // the first op reads the rows the previous evaluation wrote: compare each run to its own reference
                ggml_backend_tensor_get(ref, hr.data(), 0, ggml_nbytes(ref));
                ggml_backend_tensor_get(out_b, hob.data(), 0, ggml_nbytes(out_b));
                ggml_backend_tensor_get(ref_b, hrb.data(), 0, ggml_nbytes(ref_b));
                zero_masked_nan(hr);
                zero_masked_nan(hrb);
                const double ea = nmse(ho.data(), hr.data(), ho.size());
                const double eb = nmse(hob.data(), hrb.data(), hob.size());
                // a stale row (copied before its write) errs by ~1e-2 NMSE; the kernels' own rounding is ~6e-7
                if (!(ea <= 5e-5) || !(eb <= 5e-5)) {
                    char b[160];
                    snprintf(b, sizeof(b), " WRITTEN-ROWS run %d: NMSE first op %.2e, op after the writes %.2e", run,
                             ea, eb);
                    g_extra += b;
                    sched_ok = false;
                }
            } else if (run == 0) {
                first = ho;
            } else if (memcmp(first.data(), ho.data(), ho.size()*sizeof(float)) != 0) {
                g_extra += " REPLAY-DIFF run " + std::to_string(run);
                sched_ok = false;
            }
            ggml_backend_sched_reset(sched);
        }
        ggml_backend_sched_free(sched);
    } else {
        const ggml_status st = ggml_backend_graph_compute(backend, gf);
        GGML_ASSERT(st == GGML_STATUS_SUCCESS);
        ggml_backend_tensor_get(out, ho.data(), 0, ggml_nbytes(out));
    }
    ggml_backend_tensor_get(ref, hr.data(), 0, ggml_nbytes(ref));
    std::vector<float> hrw;
    if (ref_w) {
        hrw.resize(ggml_nelements(ref_w));
        ggml_backend_tensor_get(ref_w, hrw.data(), 0, ggml_nbytes(ref_w));
    }

    ggml_backend_buffer_free(buf);
    if (buf_host) ggml_backend_buffer_free(buf_host);
    if (ctx_host) ggml_free(ctx_host);
    ggml_free(ctx);

    // A q row whose mask is -inf everywhere has no defined softmax. The op (and ggml's CPU flash
    // attention) writes 0 there, but ggml's CUDA flash attention writes 0/0 = NaN when there are no
    // sinks. Such reference values are taken as 0; any other non-finite reference value still fails.
    const size_t n_ref_zeroed = zero_masked_nan(hr);

    size_t n_nonfinite = 0;
    int64_t first_nonfinite = -1;
    for (size_t e = 0; e < ho.size(); ++e) {
        if (!std::isfinite(ho[e])) {
            if (n_nonfinite++ == 0) first_nonfinite = (int64_t) e;
        }
    }

    const double err = nmse(ho.data(), hr.data(), ho.size());
    // written rows (--tail-host): every run compared with its own reference above; stale rows err by ~1e-2
    const double thr = c.mixed() || out_b ? 5e-5 : 5e-7;
    *out_nmse = err;
    *out_thr  = thr;

    // NMSE of the op and of the stock kernels against attention in double precision, computed once, when needed
    double e_op = -1.0, e_ref = -1.0;
    auto exact_errors = [&](const char * tag) {
        if (e_op < 0.0) {
            const std::vector<float> ex = exact_attention(c, hq, exact_k, exact_v, hm, n_q_pad, hs, scale);
            e_op  = nmse(ho.data(), ex.data(), ex.size());
            e_ref = nmse(hr.data(), ex.data(), ex.size());
        }
        char b[128];
        snprintf(b, sizeof(b), " %s: op %.2e, stock %.2e", tag, e_op, e_ref);
        g_extra += b;
    };

    bool ok = n_nonfinite == 0 && err <= thr && sched_ok;
    if (!is_cpu && n_nonfinite == 0 && sched_ok && !ok && !out_b) {
        // the stock kernels round too (Q and P in f16): the op passes when it is no farther from the exact
        // result than ggml_flash_attn_ext over the concatenation is (within 2x its NMSE)
        exact_errors("exact");
        ok = e_op <= 2.0*e_ref;
    }
    if (g_exact_check) {
        exact_errors("exact-check");
        ok = ok && e_ref <= 1e-4 && e_op <= 1e-4;
    }
    if (!c.mixed() && is_cpu) {
        // same types on CPU: bit-identical to ggml_flash_attn_ext over the concatenation
        size_t n_diff = 0;
        for (size_t i = 0; i < ho.size(); ++i) {
            if (memcmp(&ho[i], &hr[i], sizeof(float)) != 0) n_diff++;
        }
        g_extra += n_diff == 0 ? " bitexact" : " DIFF " + std::to_string(n_diff) + "/" + std::to_string(ho.size());
        ok = ok && n_diff == 0;
    }
    if (ref_w && is_cpu) {
        // the first query row that reads the tail; rows of earlier Q tiles (64 rows, tiles may start anywhere
        // before it) never do
        int64_t r_star = n_q;
        for (int64_t i = 0; i < n_q && r_star == n_q; ++i) {
            for (int64_t j = s; j < n_kv; ++j) {
                if (ggml_fp16_to_fp32(hm[i*n_kv + j]) != -INFINITY) {
                    r_star = i;
                    break;
                }
            }
        }
        const int64_t n_rows = std::max<int64_t>(0, r_star - 64);
        size_t n_diff = 0, n_cmp = 0;
        for (int64_t i3 = 0; i3 < ne3; ++i3) {
            for (int64_t i = 0; i < n_rows; ++i) {
                for (int64_t h = 0; h < n_head; ++h) {
                    const size_t e0 = (size_t) (((i3*n_q + i)*n_head + h)*D);
                    n_cmp += D;
                    n_diff += memcmp(&ho[e0], &hrw[e0], D*sizeof(float)) != 0;
                }
            }
        }
        g_extra += n_cmp == 0 ? " (no tail-free rows)" : n_diff == 0 ? " tail-free-rows-bitexact"
                   : " TAIL-FREE-ROWS-DIFF " + std::to_string(n_diff);
        ok = ok && n_diff == 0;
    }
    if (!ok && n_nonfinite) {
        // dst is [DV, n_head, n_q, ne3]: name the first non-finite query row and head
        const int64_t row = first_nonfinite/D;
        g_extra += " non-finite=" + std::to_string(n_nonfinite) + " (first at q " + std::to_string((row/n_head) % n_q) +
            ", head " + std::to_string(row % n_head) + ")";
    }
    if (n_ref_zeroed) {
        g_extra += " ref-masked-nan-as-0=" + std::to_string(n_ref_zeroed);
    }
    GGML_UNUSED(verbose);
    return ok ? RES_PASS : RES_FAIL;
}

static test_case mk(int64_t D, int64_t hkv, int64_t gqa, int64_t n_kv, int64_t n_q, int64_t split, ggml_type tk,
                    ggml_type tv, mask_mode mm = MASK_CAUSAL, bool sinks = false, float max_bias = 0.0f,
                    float softcap = 0.0f, bool cache = false, ggml_type tkt = GGML_TYPE_COUNT,
                    ggml_type tvt = GGML_TYPE_COUNT, int64_t ne3 = 1) {
    test_case c;
    c.D = D; c.n_head_kv = hkv; c.gqa = gqa; c.n_kv = n_kv; c.n_q = n_q; c.split = split;
    c.tkw = tk; c.tvw = tv;
    c.tkt = tkt == GGML_TYPE_COUNT ? tk : tkt;
    c.tvt = tvt == GGML_TYPE_COUNT ? tv : tvt;
    c.mask = mm; c.sinks = sinks; c.max_bias = max_bias; c.softcap = softcap; c.cache_layout = cache; c.ne3 = ne3;
    return c;
}

static std::vector<test_case> make_cases(bool quick) {
    std::vector<test_case> cases;
    const ggml_type F16 = GGML_TYPE_F16, Q8 = GGML_TYPE_Q8_0, Q4 = GGML_TYPE_Q4_0, BF16 = GGML_TYPE_BF16;

    const int64_t n_kv = 512;
    const std::vector<int64_t> splits = { 0, 1, 255, 256, n_kv - 1, n_kv };

    // core matrix: head dims x GQA x n_q x split points x types
    for (int64_t D : { 64, 128, 256 }) {
        for (int64_t gqa : { 1, 2, 4, 8 }) {
            for (int64_t n_q : { 1, 7 }) {
                for (ggml_type t : { F16, Q8, Q4, BF16 }) {
                    for (int64_t s : splits) {
                        if (quick) {
                            // quick: every type, split and head dim, but thinned out
                            if ((D == 128) != (gqa == 2)) continue;
                            if (n_q == 7 && !(s == 1 || s == 256 || s == n_kv)) continue;
                            if (n_q == 1 && !(s == 0 || s == 255 || s == n_kv - 1)) continue;
                        }
                        cases.push_back(mk(D, 2, gqa, n_kv, n_q, s, t, t, MASK_CAUSAL, false, 0.0f, 0.0f,
                                           /*cache=*/(s % 2) == 1));
                    }
                }
            }
        }
    }
    if (quick) {
        // make sure every head dim / gqa appears at least once in quick mode
        for (int64_t D : { 64, 256 }) for (int64_t gqa : { 1, 4, 8 }) {
            cases.push_back(mk(D, 2, gqa, n_kv, 7, 255, F16, F16, MASK_HOLES, false, 0.0f, 0.0f, true));
        }
    }

    if (g_runs) {
        // tails of five and six blocks (the mask hides blocks 0, 2 and 3: two runs, the last ending with the tail, a
        // partial block once): decode, small and prefill-sized (tiled) batches, every mask, sinks, softcap, ALiBi,
        // quantized and mixed types, two streams
        const int64_t n_kv_r = 1536;
        for (ggml_type t : { F16, Q8, Q4 }) {
            for (int64_t s : { (int64_t) 0, (int64_t) 256, (int64_t) 300 }) {
                for (int64_t n_q : { 1, 7, 64 }) {
                    cases.push_back(mk(128, 2, 4, n_kv_r, n_q, s, t, t, MASK_CAUSAL, false, 0.0f, 0.0f, (s % 2) == 0));
                    cases.push_back(mk(64, 2, 2, n_kv_r, n_q, s, t, t, MASK_ROWS, true, 0.0f, 0.0f, false));
                    if (!quick) {
                        cases.push_back(mk(128, 2, 4, n_kv_r, n_q, s, t, t, MASK_HOLES, false, 0.0f, 30.0f, true));
                        cases.push_back(mk(64, 3, 4, n_kv_r, n_q, s, t, t, MASK_HOLES, false, 8.0f, 0.0f, false));
                    }
                }
                // mixed
                cases.push_back(mk(128, 2, 4, n_kv_r, 7, s, F16, F16, MASK_HOLES, false, 0.0f, 0.0f, true, t, t));
                cases.push_back(mk(64, 1, 2, n_kv_r, 7, s, t, t, MASK_ROWS, false, 0.0f, 0.0f, true, GGML_TYPE_COUNT,
                        GGML_TYPE_COUNT, 2)); // ne3 = 2
            }
        }
    }

    if (g_map) {
        // six blocks, none, half or all of them resident (round(split/256)): decode (split-KV for F16), small and
        // prefill-sized (tiled for F16) batches, every mask, sinks, softcap, ALiBi, quantized and mixed types, two
        // streams
        const int64_t n_kv_m = 1536;
        for (ggml_type t : { F16, Q8, Q4 }) {
            for (int64_t s : { (int64_t) 0, (int64_t) 768, n_kv_m }) {
                for (int64_t n_q : { 1, 7, 64 }) {
                    cases.push_back(mk(128, 2, 4, n_kv_m, n_q, s, t, t, MASK_CAUSAL, false, 0.0f, 0.0f, s % 512 == 0));
                    cases.push_back(mk(64, 2, 2, n_kv_m, n_q, s, t, t, MASK_ROWS, true, 0.0f, 0.0f, false));
                    if (!quick) {
                        cases.push_back(mk(128, 2, 4, n_kv_m, n_q, s, t, t, MASK_HOLES, false, 0.0f, 30.0f, true));
                        cases.push_back(mk(64, 3, 4, n_kv_m, n_q, s, t, t, MASK_HOLES, false, 8.0f, 0.0f, false));
                        cases.push_back(mk(64, 2, 2, n_kv_m, n_q, s, t, t, MASK_NONE, n_q == 7, 0.0f, 0.0f, true));
                    }
                }
                if (s < n_kv_m) { // mixed (with every block resident there is no tail)
                    cases.push_back(mk(128, 2, 4, n_kv_m, 7, s, F16, F16, MASK_HOLES, false, 0.0f, 0.0f, true, t, t));
                    cases.push_back(mk(64, 2, 2, n_kv_m, 64, s, F16, F16, MASK_CAUSAL, true, 0.0f, 0.0f, false, t, t));
                }
                cases.push_back(mk(64, 1, 2, n_kv_m, 7, s, t, t, MASK_ROWS, false, 0.0f, 0.0f, true, GGML_TYPE_COUNT,
                        GGML_TYPE_COUNT, 2)); // ne3 = 2
            }
        }
    }

    // masks, softcap, sinks, ALiBi (n_head power of 2 and not), mixed types, empty parts
    for (ggml_type t : { F16, Q8, Q4, BF16 }) {
        for (int64_t s : { (int64_t) 0, (int64_t) 1, (int64_t) 256, n_kv - 1, n_kv }) {
            if (quick && !(s == 1 || s == n_kv)) continue;
            cases.push_back(mk(128, 2, 4, n_kv, 7, s, t, t, MASK_HOLES, false, 0.0f, 0.0f, true));
            cases.push_back(mk(128, 2, 4, n_kv, 7, s, t, t, MASK_ROWS,  false, 0.0f, 0.0f, false));
            cases.push_back(mk(128, 2, 4, n_kv, 7, s, t, t, MASK_ROWS,  true,  0.0f, 0.0f, true));   // sinks
            cases.push_back(mk(128, 2, 4, n_kv, 7, s, t, t, MASK_HOLES, false, 0.0f, 30.0f, false)); // softcap
            cases.push_back(mk(128, 2, 4, n_kv, 7, s, t, t, MASK_CAUSAL, true, 0.0f, 30.0f, true));  // softcap + sinks
            cases.push_back(mk( 64, 3, 4, n_kv, 7, s, t, t, MASK_HOLES, false, 8.0f, 0.0f, false));  // ALiBi, 12 heads
            // ALiBi, 8 heads + sinks
            cases.push_back(mk( 64, 2, 4, n_kv, 7, s, t, t, MASK_ROWS,  true,  8.0f, 0.0f, true));
            if (!quick) {
                cases.push_back(mk( 64, 2, 2, n_kv, 1, s, t, t, MASK_NONE, false, 0.0f, 0.0f, false)); // no mask
                // no mask + sinks
                cases.push_back(mk( 64, 2, 2, n_kv, 7, s, t, t, MASK_NONE, true,  0.0f, 0.0f, true));
                // ne3 = 2
                cases.push_back(mk( 64, 1, 2, 256,  7, s/2, t, t, MASK_ROWS, false, 0.0f, 0.0f, true, GGML_TYPE_COUNT,
                                   GGML_TYPE_COUNT, 2));
            }
        }
    }

    // other K/V types accepted by the CPU flash attention, and K type != V type
    for (ggml_type t : { GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_F32 }) {
        for (int64_t s : { (int64_t) 1, (int64_t) 256, n_kv }) {
            if (quick && s != 256) continue;
            cases.push_back(mk(128, 2, 2, n_kv, 7, s, t, t, MASK_HOLES, true, 0.0f, 0.0f, true));
        }
    }
    cases.push_back(mk(128, 2, 2, n_kv, 7, 255, F16, Q8, MASK_ROWS, true, 0.0f, 0.0f, true));
    cases.push_back(mk(128, 2, 2, n_kv, 1, 255, Q8, F16, MASK_HOLES, false, 0.0f, 0.0f, false));

    // mixed window/tail types (looser threshold, see top of file)
    struct mix { ggml_type kw, vw, kt, vt; };
    for (mix x : { mix{ F16, F16, Q8, Q8 }, mix{ Q8, Q8, Q4, Q4 }, mix{ BF16, F16, Q8, Q4 },
                  mix{ Q8, F16, F16, F16 } }) {
        for (int64_t s : { (int64_t) 0, (int64_t) 1, (int64_t) 255, (int64_t) 256, n_kv - 1, n_kv }) {
            if (quick && !(s == 1 || s == 256)) continue;
            for (int64_t n_q : { 1, 7 }) {
                cases.push_back(mk(128, 2, 4, n_kv, n_q, s, x.kw, x.vw, n_q == 1 ? MASK_CAUSAL : MASK_ROWS, n_q == 7,
                                   0.0f, 0.0f, s % 2 == 1, x.kt, x.vt));
            }
        }
    }

    // decode below the split-KV threshold (one-chunk path, f16 V accumulation)
    cases.push_back(mk(128, 2, 4,  300,   1, 150, F16, F16, MASK_CAUSAL, true, 0.0f, 0.0f, true));
    // decode, split-KV path: chunk boundaries (ceil(n_kv/nth)) before, at and after the split
    for (int64_t s : { (int64_t) 100, (int64_t) 341, (int64_t) 342, (int64_t) 343, (int64_t) 600 }) {
        if (quick && s != 342) continue;
        cases.push_back(mk( 64, 2, 4, 1025, 1, s, F16, F16, MASK_HOLES, s % 2 == 0, 0.0f, 0.0f, s % 2 == 1));
        cases.push_back(mk( 64, 2, 4, 1025, 1, s, GGML_TYPE_F32, GGML_TYPE_F32, MASK_ROWS, true, 0.0f, 0.0f,
                           s % 2 == 0));
    }

    // prefill-sized batches (the tiled f32 path for F16/F32; KV tiles straddle splits not multiple of 64)
    cases.push_back(mk( 64, 2, 2,  512, 512, 255, F16, F16, MASK_HOLES, true, 0.0f, 0.0f, true));
    cases.push_back(mk( 64, 2, 2,  512, 512, 256, Q8,  Q8,  MASK_ROWS, false, 0.0f, 0.0f, false));
    cases.push_back(mk( 64, 2, 2,  300, 100, 170, GGML_TYPE_F32, GGML_TYPE_F32, MASK_ROWS, true, 0.0f, 30.0f, true));
    cases.push_back(mk( 64, 2, 2,  300,  64,  33, F16, F16, MASK_CAUSAL, false, 8.0f, 0.0f, false)); // ALiBi
    // mixed types in prefill: the queries before the window boundary must match the resident window type exactly
    cases.push_back(mk(128, 2, 4, 1024, 512, 768, F16, F16, MASK_CAUSAL, false, 0.0f, 0.0f, true, Q8, Q8));
    cases.push_back(mk( 64, 2, 2, 1024, 512, 768, F16, F16, MASK_HOLES, true, 0.0f, 0.0f, true, Q4, F16));

    // the shapes of the models the GPU gates run: permuted Q (as llama passes it), prefill ubatches of 512 over a
    // 512-cell window, decode over a long tail; SmolLM2-135M (D 64, 9 heads / 3 KV heads) and the 8-layer synthetic
    // model (D 128, 16 / 4)
    for (bool prefill : { true, false }) {
        for (int64_t hkv : { (int64_t) 3, (int64_t) 4 }) {
            const int64_t D = hkv == 3 ? 64 : 128, gqa = hkv == 3 ? 3 : 4;
            for (ggml_type t : { F16, Q8 }) {
                if (quick && t != F16) continue;
                test_case c = prefill ? mk(D, hkv, gqa, 1024, 512, 512, t, t, MASK_CAUSAL, false, 0.0f, 0.0f, true)
                                      : mk(D, hkv, gqa, 2048, 1, 512, t, t, MASK_CAUSAL, false, 0.0f, 0.0f, true);
                c.q_perm = true;
                cases.push_back(c);
            }
        }
    }
    if (!quick) {
        cases.push_back(mk(128, 2, 4, 1024, 512,   0, F16, F16, MASK_CAUSAL, false, 0.0f, 0.0f, true));
        cases.push_back(mk(128, 2, 4, 1024, 512, 256, F16, F16, MASK_HOLES, true, 0.0f, 30.0f, true));
        cases.push_back(mk(128, 2, 4, 1024, 512, 1023, Q4, Q4, MASK_ROWS, false, 8.0f, 0.0f, false));
        cases.push_back(mk(256, 1, 8, 1024, 512, 1024, BF16, BF16, MASK_CAUSAL, true, 0.0f, 0.0f, true));
        cases.push_back(mk(256, 1, 8, 1024,   1, 1,   F16, F16, MASK_CAUSAL, false, 0.0f, 0.0f, true));
        cases.push_back(mk(256, 2, 4, 1024,   7, 255, Q8,  Q8,  MASK_HOLES, true, 0.0f, 0.0f, true));
        cases.push_back(mk(128, 2, 4, 1024, 512, 256, F16, F16, MASK_ROWS, true, 0.0f, 0.0f, false, Q8, Q8));
    }

    // head size 72: only the stock TILE kernel runs it (on every CUDA/HIP device), which writes no LSE. The CPU runs
    // the op exactly; other backends must refuse it (appended last: the random data of the cases above is unchanged)
    for (int64_t n_q : { 1, 7 }) {
        for (int64_t s : { (int64_t) 0, (int64_t) 256, n_kv }) {
            if (quick && s != 256) continue;
            test_case c = mk(72, 2, 2, n_kv, n_q, s, F16, F16, MASK_CAUSAL, n_q == 7, 0.0f, 0.0f, true);
            c.tile_only = true;
            cases.push_back(c);
        }
    }

    return cases;
}

//
// --heads: the head split
//

struct head_case {
    int64_t   D, n_head_kv, gqa, h_dev; // KV heads [0, h_dev) on the "device", the rest streamed
    int64_t   n_kv, n_q, ne3;
    ggml_type tkd, tvd;                 // device heads' K/V types
    ggml_type tkh, tvh;                 // host heads' K/V types
    mask_mode mask;
    bool      sinks;
    float     softcap;

    bool mixed() const { return tkd != tkh || tvd != tvh; }
};

static std::string head_case_str(const head_case & c) {
    char buf[512];
    snprintf(buf, sizeof(buf),
        "heads D=%3lld hkv=%lld gqa=%lld h_dev=%lld n_kv=%4lld n_q=%3lld K=%s/%s V=%s/%s mask=%s%s%s%s",
        (long long) c.D, (long long) c.n_head_kv, (long long) c.gqa, (long long) c.h_dev, (long long) c.n_kv,
        (long long) c.n_q, ggml_type_name(c.tkd), ggml_type_name(c.tkh), ggml_type_name(c.tvd), ggml_type_name(c.tvh),
        mask_name(c.mask), c.sinks ? " sinks" : "", c.softcap != 0.0f ? " softcap" : "", c.ne3 > 1 ? " ne3=2" : "");
    return buf;
}

// the heads [h0, h1) of host data
static kv_host heads_of(kv_host & x, int64_t h0, int64_t h1) {
    kv_host r{x.D, x.n_kv, h1 - h0, x.ne3, {}};
    r.x.resize(r.D*r.n_kv*r.nh*r.ne3);
    for (int64_t i3 = 0; i3 < x.ne3; ++i3)
    for (int64_t h = h0; h < h1; ++h)
    for (int64_t cc = 0; cc < x.n_kv; ++cc)
    for (int64_t d = 0; d < x.D; ++d) {
        r.at(i3, h - h0, cc, d) = x.at(i3, h, cc, d);
    }
    return r;
}

static result run_head_case(ggml_backend_t backend, bool is_cpu, const head_case & c, std::mt19937 & rng,
                            double * out_nmse, double * out_thr) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);

    const int64_t D = c.D, n_kv = c.n_kv, nhkv = c.n_head_kv, n_head = nhkv*c.gqa, ne3 = c.ne3, n_q = c.n_q;
    const int64_t n_q_pad = c.mask == MASK_NONE ? n_q : n_q + 3;
    const int64_t hq = c.h_dev*c.gqa; // query heads of the device's KV heads

    kv_host hk{D, n_kv, nhkv, ne3, {}}, hv{D, n_kv, nhkv, ne3, {}};
    hk.x.resize(D*n_kv*nhkv*ne3);
    hv.x.resize(D*n_kv*nhkv*ne3);
    for (auto & x : hk.x) x = u(rng);
    for (auto & x : hv.x) x = u(rng);
    std::vector<float> hq_data(D*n_head*n_q*ne3);
    for (auto & x : hq_data) x = u(rng);
    std::vector<float> hs(n_head);
    for (auto & x : hs) x = 10.0f*u(rng);

    // mask [n_kv, n_q_pad, 1, 1]: causal over the last n_q cells, holes, fully masked rows (MASK_ROWS)
    std::vector<ggml_fp16_t> hm;
    g_tail_live = false;
    if (c.mask != MASK_NONE) {
        hm.resize(n_kv*n_q_pad);
        for (int64_t i = 0; i < n_q_pad; ++i) {
            for (int64_t j = 0; j < n_kv; ++j) {
                float v = (j % 7) == 3 ? 0.5f*(u(rng) - 1.0f) : 0.0f;
                bool masked = i >= n_q || j > n_kv - n_q + i;
                if (c.mask >= MASK_HOLES && j >= n_kv/3 && j < n_kv/3 + 40) masked = true;
                if (c.mask == MASK_ROWS && i % 4 == 1) masked = true;
                hm[i*n_kv + j] = ggml_fp32_to_fp16(masked ? -INFINITY : v);
                g_tail_live = g_tail_live || (i < n_q && !masked);
            }
        }
    } else {
        g_tail_live = true;
    }
    g_tail_live = g_tail_live && c.h_dev < nhkv;

    const size_t ctx_size = 128*ggml_tensor_overhead() + ggml_graph_overhead();
    ggml_init_params ip = { ctx_size, nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    // Q as llama holds it: [D, n_head, n_q, ne3]
    ggml_tensor * q_storage = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, n_head, n_q, ne3);
    ggml_tensor * m  = c.mask != MASK_NONE ? ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, n_q_pad, 1, 1) : nullptr;
    ggml_tensor * sk = c.sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_head) : nullptr;

    auto q_heads = [&](int64_t h0, int64_t h1) {
        ggml_tensor * v = ggml_view_4d(ctx, q_storage, D, h1 - h0, n_q, ne3, q_storage->nb[1], q_storage->nb[2],
                q_storage->nb[3], h0*q_storage->nb[1]);
        return ggml_permute(ctx, v, 0, 2, 1, 3);
    };
    const float scale = 1.0f/sqrtf((float) D);

    std::vector<kv_dev> kvs;
    // the references: every head at the device types (and at the host types when they differ)
    kvs.push_back(make_kv(ctx, c.tkd, hk, 0, n_kv, true, 3));
    kvs.push_back(make_kv(ctx, c.tvd, hv, 0, n_kv, true, 3));
    ggml_tensor * ref_d = ggml_flash_attn_ext(ctx, q_heads(0, n_head), kvs[0].view, kvs[1].view, m, scale, 0.0f,
                                              c.softcap);
    ggml_flash_attn_ext_add_sinks(ref_d, sk);
    ggml_prec_set_acc(ref_d, GGML_PREC_F32);
    ggml_tensor * ref_h = ref_d;
    if (c.mixed()) {
        kvs.push_back(make_kv(ctx, c.tkh, hk, 0, n_kv, true, 3));
        kvs.push_back(make_kv(ctx, c.tvh, hv, 0, n_kv, true, 3));
        ref_h = ggml_flash_attn_ext(ctx, q_heads(0, n_head), kvs[2].view, kvs[3].view, m, scale, 0.0f, c.softcap);
        ggml_flash_attn_ext_add_sinks(ref_h, sk);
        ggml_prec_set_acc(ref_h, GGML_PREC_F32);
    }

    // the split: the device's heads in tensors of their own, the host's in others (each [D*heads, cells] rows, as the
    // cache)
    kv_host hk_d = heads_of(hk, 0, c.h_dev), hv_d = heads_of(hv, 0, c.h_dev);
    kv_host hk_h = heads_of(hk, c.h_dev, nhkv), hv_h = heads_of(hv, c.h_dev, nhkv);
    const size_t i_d = kvs.size();
    kvs.push_back(make_kv(ctx, c.tkd, hk_d, 0, n_kv, true, 0));
    kvs.push_back(make_kv(ctx, c.tvd, hv_d, 0, n_kv, true, 0));
    kvs.push_back(make_kv(ctx, c.tkh, hk_h, 0, n_kv, true, 0));
    kvs.push_back(make_kv(ctx, c.tvh, hv_h, 0, n_kv, true, 0));

    ggml_tensor * a = ggml_flash_attn_ext(ctx, q_heads(0, hq), kvs[i_d].view, kvs[i_d + 1].view, m, scale, 0.0f,
                                          c.softcap);
    ggml_flash_attn_ext_add_sinks(a, sk ? ggml_view_1d(ctx, sk, hq, 0) : nullptr);
    ggml_prec_set_acc(a, GGML_PREC_F32);
    ggml_tensor * b = ggml_streaming_flash_attn(ctx, q_heads(hq, n_head), nullptr, nullptr, kvs[i_d + 2].view,
            kvs[i_d + 3].view, m, scale, 0.0f, c.softcap);
    ggml_streaming_flash_attn_add_sinks(b, sk ? ggml_view_1d(ctx, sk, n_head - hq, hq*sk->nb[0]) : nullptr);
    ggml_streaming_flash_attn_set_prec(b, GGML_PREC_F32);
    set_op_params(b);

    // as llama_rkv_build_attn_heads: [DV*heads, n_q*ne3] each, concatenated by head
    ggml_tensor * out = ggml_concat(ctx, ggml_reshape_2d(ctx, a, D*hq, n_q*ne3),
                                    ggml_reshape_2d(ctx, b, D*(n_head - hq), n_q*ne3), 0);

    if (!ggml_backend_supports_op(backend, b) || !ggml_backend_supports_op(backend, a) ||
            !ggml_backend_supports_op(backend, ref_d) || !ggml_backend_supports_op(backend, ref_h)) {
        ggml_free(ctx);
        return RES_SKIP;
    }

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, ref_d);
    ggml_build_forward_expand(gf, ref_h);

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    GGML_ASSERT(buf);
    ggml_backend_tensor_set(q_storage, hq_data.data(), 0, ggml_nbytes(q_storage));
    if (m)  ggml_backend_tensor_set(m, hm.data(), 0, ggml_nbytes(m));
    if (sk) ggml_backend_tensor_set(sk, hs.data(), 0, ggml_nbytes(sk));
    for (auto & kv : kvs) {
        ggml_backend_tensor_set(kv.storage, kv.bytes.data(), 0, kv.bytes.size());
    }
    GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);

    std::vector<float> ho(ggml_nelements(out)), hd(ggml_nelements(ref_d)), hh(ggml_nelements(ref_h));
    ggml_backend_tensor_get(out, ho.data(), 0, ggml_nbytes(out));
    ggml_backend_tensor_get(ref_d, hd.data(), 0, ggml_nbytes(ref_d));
    ggml_backend_tensor_get(ref_h, hh.data(), 0, ggml_nbytes(ref_h));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);

    // the expected output: each head from the reference at its part's types ([D, n_head, n_q, ne3], as out's rows)
    std::vector<float> ex(ho.size());
    for (int64_t r = 0; r < n_q*ne3; ++r) {
        for (int64_t h = 0; h < n_head; ++h) {
            const size_t e0 = (size_t) ((r*n_head + h)*D);
            memcpy(&ex[e0], (h < hq ? hd.data() : hh.data()) + e0, D*sizeof(float));
        }
    }

    // A q row masked everywhere (no sinks) has no defined softmax: the streaming op writes 0 (as ggml's CPU flash
    // attention), ggml's CUDA flash attention 0/0 = NaN, in the unsplit layer and in the device heads alike. There a
    // non-finite value of the reference is taken as 0, and one of the output too where the reference's is non-finite
    // (the device heads run that kernel); any other non-finite value fails.
    size_t n_masked_nan = 0;
    const std::vector<bool> dead = fully_masked_rows(hm, n_q, n_kv, c.mask != MASK_NONE && !c.sinks);
    for (int64_t r = 0; r < n_q*ne3; ++r) {
        for (size_t e = (size_t) (r*n_head*D); dead[r % n_q] && e < (size_t) ((r + 1)*n_head*D); ++e) {
            if (!std::isfinite(ex[e])) {
                ex[e] = 0.0f;
                n_masked_nan++;
                if (!std::isfinite(ho[e])) {
                    ho[e] = 0.0f;
                }
            }
        }
    }
    if (n_masked_nan) {
        g_extra += " masked-nan-as-0=" + std::to_string(n_masked_nan);
    }

    size_t n_nonfinite = 0, n_diff = 0;
    for (size_t i = 0; i < ho.size(); ++i) {
        n_nonfinite += !std::isfinite(ho[i]);
        n_diff += memcmp(&ho[i], &ex[i], sizeof(float)) != 0;
    }
    const double err = nmse(ho.data(), ex.data(), ho.size());
    const double thr = c.mixed() ? 5e-5 : 5e-7;
    *out_nmse = err;
    *out_thr  = thr;

    bool ok = n_nonfinite == 0 && err <= thr;
    if (!is_cpu && n_nonfinite == 0 && !ok) {
        // the stock kernels round too (Q and P in f16): the split passes when it is no farther from attention in double
        // precision (over the values its K/V hold) than ggml_flash_attn_ext over every head is (within 2x its NMSE)
        auto held = [&](const kv_host & x, ggml_type td, ggml_type th) {
            kv_host r = x, d = heads_of(r, 0, c.h_dev), h = heads_of(r, c.h_dev, nhkv);
            round_through(d, td);
            round_through(h, th);
            for (int64_t i3 = 0; i3 < ne3; ++i3)
            for (int64_t hh = 0; hh < nhkv; ++hh)
            for (int64_t cc = 0; cc < n_kv; ++cc)
            for (int64_t dd = 0; dd < D; ++dd) {
                r.at(i3, hh, cc, dd) = hh < c.h_dev ? d.at(i3, hh, cc, dd) : h.at(i3, hh - c.h_dev, cc, dd);
            }
            return r;
        };
        kv_host xk = held(hk, c.tkd, c.tkh), xv = held(hv, c.tvd, c.tvh);
        test_case tc = {};
        tc.D = D; tc.n_head_kv = nhkv; tc.gqa = c.gqa; tc.n_kv = n_kv; tc.n_q = n_q; tc.split = 0;
        tc.tkw = c.tkd; tc.tvw = c.tvd; tc.tkt = c.tkh; tc.tvt = c.tvh;
        tc.mask = c.mask; tc.sinks = c.sinks; tc.max_bias = 0.0f; tc.softcap = c.softcap; tc.ne3 = ne3;
        tc.q_perm = true; // Q as [D, n_head, n_q, ne3]
        const std::vector<float> xa = exact_attention(tc, hq_data, xk, xv, hm, n_q_pad, hs, scale);
        const double e_op = nmse(ho.data(), xa.data(), xa.size()), e_ref = nmse(ex.data(), xa.data(), xa.size());
        char b[128];
        snprintf(b, sizeof(b), " exact: op %.2e, stock %.2e", e_op, e_ref);
        g_extra += b;
        ok = e_op <= 2.0*e_ref;
    }
    if (is_cpu) {
        g_extra += n_diff == 0 ? " bitexact" : " DIFF " + std::to_string(n_diff) + "/" + std::to_string(ho.size());
        ok = ok && n_diff == 0;
    }
    if (n_nonfinite) {
        g_extra += " non-finite=" + std::to_string(n_nonfinite);
    }
    return ok ? RES_PASS : RES_FAIL;
}

static head_case mkh(int64_t D, int64_t hkv, int64_t gqa, int64_t h_dev, int64_t n_kv, int64_t n_q, ggml_type tk,
                     ggml_type tv, mask_mode mm = MASK_CAUSAL, bool sinks = false, float softcap = 0.0f,
                     ggml_type tkh = GGML_TYPE_COUNT, ggml_type tvh = GGML_TYPE_COUNT, int64_t ne3 = 1) {
    head_case c;
    c.D = D; c.n_head_kv = hkv; c.gqa = gqa; c.h_dev = h_dev; c.n_kv = n_kv; c.n_q = n_q; c.ne3 = ne3;
    c.tkd = tk; c.tvd = tv;
    c.tkh = tkh == GGML_TYPE_COUNT ? tk : tkh;
    c.tvh = tvh == GGML_TYPE_COUNT ? tv : tvh;
    c.mask = mm; c.sinks = sinks; c.softcap = softcap;
    return c;
}

static std::vector<head_case> make_head_cases(bool quick) {
    std::vector<head_case> cases;
    const ggml_type F16 = GGML_TYPE_F16, Q8 = GGML_TYPE_Q8_0, Q4 = GGML_TYPE_Q4_0, BF16 = GGML_TYPE_BF16,
                    F32 = GGML_TYPE_F32;

    // every cut of the KV heads, GQA 1..4: decode (one-chunk below 512 cells, split-KV above), small batches, prefill
    // batches on the tiled path (n_q >= 64, F16/F32)
    for (int64_t hkv : { 2, 3, 4 }) {
        for (int64_t h = 1; h < hkv; ++h) {
            for (int64_t gqa : { 1, 3 }) {
                if (quick && (gqa == 1) != (hkv == 2)) continue;
                cases.push_back(mkh( 64, hkv, gqa, h,  300,   1, F16, F16, MASK_CAUSAL));
                cases.push_back(mkh( 64, hkv, gqa, h, 1025,   1, F16, F16, MASK_HOLES, true));
                cases.push_back(mkh( 64, hkv, gqa, h,  512,   7, F16, F16, MASK_ROWS, gqa == 3, 0.0f));
                cases.push_back(mkh( 64, hkv, gqa, h,  512, 128, F16, F16, MASK_CAUSAL, gqa == 3));
                if (!quick) {
                    cases.push_back(mkh(128, hkv, gqa, h, 1024, 512, F16, F16, MASK_HOLES, false, 30.0f));
                }
            }
        }
    }
    // the demo model's shape (SmolLM2-135M: D 64, 3 KV heads, 9 query heads) in prefill and decode, and the types
    for (ggml_type t : { F16, Q8, Q4, BF16, F32 }) {
        if (quick && !(t == F16 || t == Q8)) continue;
        cases.push_back(mkh( 64, 3, 3, 2,  512, 512, t, t, MASK_CAUSAL, false));
        cases.push_back(mkh( 64, 3, 3, 1, 2048,   1, t, t, MASK_CAUSAL, true));
        cases.push_back(mkh(128, 4, 4, 3,  512,   7, t, t, MASK_HOLES, true, 30.0f));
        cases.push_back(mkh( 64, 3, 3, 1,  300,   5, t, t, MASK_ROWS, false, 0.0f, t, t, 2)); // two streams
    }
    // no mask
    cases.push_back(mkh(64, 2, 2, 1, 512, 3, F16, F16, MASK_NONE, true));
    // two types: device heads at one, host heads at another (the tail types)
    struct mix { ggml_type kd, vd, kh, vh; };
    for (mix x : { mix{ F16, F16, Q8, Q8 }, mix{ Q8, Q8, Q4, Q4 }, mix{ F16, F16, Q4, F16 } }) {
        for (int64_t n_q : { 1, 7, 128 }) {
            if (quick && n_q == 7) continue;
            cases.push_back(mkh(64, 3, 3, 1, 1025, n_q, x.kd, x.vd, n_q == 1 ? MASK_CAUSAL : MASK_ROWS, n_q != 1, 0.0f,
                                x.kh, x.vh));
        }
    }
    return cases;
}

// CPU parts run so far (which cases a backend attended partly on the CPU): the CPU backend's count, through its
// registry
static uint64_t cpu_part_runs() {
    static const ggml_rkv_cpu_part_runs_t fn = [] {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        return reg ? (ggml_rkv_cpu_part_runs_t) ggml_backend_reg_get_proc_address(reg, GGML_RKV_CPU_PART_RUNS_PROC)
               : nullptr;
    }();
    return fn ? fn() : 0;
}

int main(int argc, char ** argv) {
    std::string backend_name = "CPU";
    bool quick   = false;
    bool verbose = false;
    bool heads   = false; // --heads: the head split's cases
    long only    = -1; // --only N: run case N alone (to isolate one case, e.g. under compute-sanitizer)
    int  n_threads = (int) std::max(1u, std::thread::hardware_concurrency());

    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-b" && i + 1 < argc) {
            backend_name = argv[++i];
        } else if (a == "-t" && i + 1 < argc) {
            n_threads = std::max(1, atoi(argv[++i]));
        } else if (a == "--quick") {
            quick = true;
        } else if (a == "-v") {
            verbose = true;
        } else if (a == "--only" && i + 1 < argc) {
            only = atol(argv[++i]);
        } else if (a == "--tail-host") {
            g_tail_host = true;
        } else if (a == "--tail-cpu-frac" && i + 1 < argc) {
            g_tail_cpu_frac = strtof(argv[++i], nullptr);
            if (!(g_tail_cpu_frac >= 0.0f && g_tail_cpu_frac <= 1.0f)) {
                fprintf(stderr, "--tail-cpu-frac must be in [0, 1]\n");
                return 2;
            }
        } else if (a == "--exact") {
            g_exact_check = true;
        } else if (a == "--expect-perturbed") {
            g_expect_perturbed = true;
        } else if (a == "--heads") {
            heads = true;
        } else if (a == "--runs") {
            g_runs = 1;
        } else if (a == "--runs-wrong") {
            g_runs = 2;
        } else if (a == "--map") {
            g_map = 1;
        } else if (a == "--map-wrong") {
            g_map = 2;
        } else {
            fprintf(stderr,
                    "usage: %s [-b BACKEND] [-t N_THREADS] [--quick] [--only N] [--tail-host] [--tail-cpu-frac F] "
                    "[--exact] [--expect-perturbed] [--heads] [--runs|--runs-wrong] [--map|--map-wrong]\n", argv[0]);
            return 2;
        }
    }

    ggml_backend_load_all();

    ggml_backend_dev_t dev = ggml_backend_dev_by_name(backend_name.c_str());
    if (!dev) {
        printf("backend %s not found, skipping\n", backend_name.c_str());
        printf("0 passed, 0 failed\n");
        return 0;
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    GGML_ASSERT(backend);
    // bit-identity is asserted on CPU only
    const bool is_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    if (g_tail_host) {
        if (is_cpu || !ggml_backend_dev_host_buffer_type(dev)) {
            printf("--tail-host: backend %s has no pinned host buffer type, skipping\n", backend_name.c_str());
            printf("0 passed, 0 failed\n");
            return 0;
        }
        g_cpu_backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        GGML_ASSERT(g_cpu_backend);
    }

    // use all cores on CPU-like backends
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg,
            "ggml_backend_set_n_threads");
    if (set_n_threads) {
        set_n_threads(backend, n_threads);
    }

    // the test hook: this program sets it on every op it builds (the op's tail_perturb parameter); the library reads no
    // such variable
    const char * perturb = getenv("ROLLINGKV_DEBUG_PERTURB_TAIL");
    if (perturb && *perturb) {
        char * end = nullptr;
        g_perturb_tail = strtof(perturb, &end);
        if (end == perturb || *end != '\0' || !(g_perturb_tail > -1.0f && g_perturb_tail <= FLT_MAX)) {
            fprintf(stderr, "ROLLINGKV_DEBUG_PERTURB_TAIL=%s is not a finite number above -1\n", perturb);
            return 2;
        }
    }
    if (g_expect_perturbed && g_perturb_tail == 0.0f) {
        fprintf(stderr, "--expect-perturbed needs ROLLINGKV_DEBUG_PERTURB_TAIL=x (x != 0, e.g. 1)\n");
        return 2;
    }

    char cpu_frac[64] = "";
    if (g_tail_cpu_frac > 0.0f) {
        snprintf(cpu_frac, sizeof(cpu_frac), ", tail CPU share %g", (double) g_tail_cpu_frac);
    }
    if (heads && (g_tail_host || g_exact_check)) {
        fprintf(stderr, "--heads runs the head split's cases on the backend alone: without --tail-host and --exact\n");
        return 2;
    }
    if (g_map && (heads || g_runs || (g_map == 2 && g_expect_perturbed))) {
        fprintf(stderr, "--map and --map-wrong go without --heads and --runs (they set runs of their own), --map-wrong "
                "without --expect-perturbed\n");
        return 2;
    }

    printf("test-rolling-kv-ops: %sbackend %s, %d threads, %s%s%s%s%s\n", heads ? "head split, " : "",
        ggml_backend_name(backend), n_threads, quick ? "quick" : "full",
        is_cpu ? ", same-type cases must be bit-identical" : "",
        g_tail_host ? ", tail in pinned host memory (streamed)" : "", cpu_frac,
        g_expect_perturbed ? ", tail perturbed: cases with a live tail must fail" : "");

    std::mt19937 rng(1234);
    const auto cases = heads ? std::vector<test_case>() : make_cases(quick);
    const auto hcases = heads ? make_head_cases(quick) : std::vector<head_case>();
    const size_t n_cases = heads ? hcases.size() : cases.size();

    int n_pass = 0, n_fail = 0, n_skip = 0;
    const auto t_start = std::chrono::steady_clock::now();

    for (size_t i = 0; i < n_cases; ++i) {
        if (only >= 0 && (long) i != only) {
            continue;
        }
        const std::string name = heads ? head_case_str(hcases[i]) : case_str(cases[i]);
        double err = 0.0, thr = 0.0;
        const auto t0 = std::chrono::steady_clock::now();
        g_extra.clear();
        const uint64_t cpu_runs = cpu_part_runs();
        const result r = heads ? run_head_case(backend, is_cpu, hcases[i], rng, &err, &thr)
                               : run_case(backend, is_cpu, cases[i], rng, verbose, &err, &thr);
        if (cpu_part_runs() != cpu_runs) {
            g_extra += " cpu-part=" + std::to_string(cpu_part_runs() - cpu_runs); // op evaluations with a CPU part
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (r == RES_SKIP) {
            n_skip++;
            printf("[%4zu] %s: not supported, skipped\n", i, name.c_str());
            continue;
        }
        const char * verdict = r == RES_PASS ? "OK" : "FAIL";
        bool as_expected = r == RES_PASS;
        if (g_expect_perturbed || g_runs == 2 || g_map == 2) {
            // the self-check: a live tail (--runs-wrong: a visible key left out of the runs; --map-wrong: a row that
            // sees keys of both swapped blocks) must make the case fail, and nothing else may
            as_expected = (r == RES_FAIL) == g_tail_live;
            verdict = as_expected ? (g_tail_live ? "OK (fails: perturbed tail)" : "OK (no live tail)")
                                  : (g_tail_live ? "FAIL (perturbed tail not detected)"
                                     : "FAIL (no live tail, yet failed)");
        }
        (as_expected ? n_pass : n_fail)++;
        printf("[%4zu] %s: NMSE=%.3e (thr %.0e)%s %7.1f ms %s\n", i, name.c_str(), err, thr, g_extra.c_str(), ms,
               verdict);
        fflush(stdout);
    }

    const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    printf("%d skipped, %.1f s\n", n_skip, total_s);
    printf("%d passed, %d failed\n", n_pass, n_fail);

    if (g_cpu_backend) {
        ggml_backend_free(g_cpu_backend);
    }
    ggml_backend_free(backend);
    return n_fail == 0 ? 0 : 1;
}
