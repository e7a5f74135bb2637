// rolling-KV: the CPU decode attention of a hybrid tail (ggml/src/rolling-kv-cpu-decode.h), checked and timed
//
//   test-rolling-kv-cpu-decode [--isa avx512|avx2|scalar]
//       every case (K/V types f16, q8_0, q4_0 in all pairs; head sizes 64, 128, 256; GQA ratios 1, 3, 4, 8;
//       masks with holes and a fully masked row; ALiBi; softcap; uneven and empty cell ranges merged) against
//       attention in double precision over the same (dequantised) rows; each ISA this CPU has, or the one named.
//       Prints one line per failing case and "N passed, M failed"; exit 1 on failure.
//       --perturb-ref X multiplies the reference's scores by (1 + X): the self-check that the comparison bites
//       (X = 1e-4 must fail every case with a visible cell).
//   test-rolling-kv-cpu-decode --bench [-t THREADS] [--layers L] [--cells N] [--type f16|q8_0|q4_0] [--reps R]
//       one decode token of the synthetic 28-layer shape (8 KV heads, 24 query heads, head size 128) over L layers of
//       N cells: this attention on T threads (split over cells, merged), against, in the same run and on the same
//       bytes, a memory-bound read (vector loads), a copy, and ggml_flash_attn_ext on the CPU backend with T threads
//       (what vanilla llama.cpp runs for -nkvo). Prints GB/s of K+V for each and the ratios.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
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
#include <vector>

namespace {

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
    std::vector<float> slope(c.n_head);
    for (int h = 0; h < c.n_head; ++h) slope[h] = powf(2.f, -8.f * (h + 1) / c.n_head);

    rkv_cpu_decode_params p{};
    p.q = q.data(); p.n_head = c.n_head; p.n_head_kv = c.n_head_kv; p.D = D; p.DV = DV; p.k_type = c.kt; p.v_type = c.vt;
    p.k = K.data(); p.k_nb1 = knb1; p.k_nb_head = kh; p.v = V.data(); p.v_nb1 = vnb1; p.v_nb_head = vh; p.n_cells = c.n;
    p.mask = c.mask_kind || c.alibi ? (const uint16_t *) mask.data() : nullptr;
    p.slope = c.alibi ? slope.data() : nullptr;
    p.scale = 1.0f / sqrtf((float) D); p.softcap = c.softcap;

    const size_t pf = rkv_cpu_decode_part_floats(p);
    std::vector<float> parts(pf * c.parts), o((size_t) c.n_head * DV), lse(c.n_head);
    std::vector<int64_t> b(c.parts + 1);
    for (int i = 0; i <= c.parts; ++i) b[i] = c.n * i / c.parts;
    if (c.parts >= 3) b[2] = b[1];  // range 1 empty, range 2 covers its cells
    for (int i = 0; i < c.parts; ++i) rkv_cpu_decode_range(p, b[i], b[i + 1], parts.data() + i * pf);
    rkv_cpu_decode_merge(p, parts.data(), c.parts, o.data(), lse.data());

    int bad = 0;
    const int G = c.n_head / c.n_head_kv;
    std::vector<double> kd(D), vd(DV), s(c.n), od(DV);
    for (int h = 0; h < c.n_head; ++h) {
        const int g = h / G;
        double m = -INFINITY;
        for (int64_t i = 0; i < c.n; ++i) {
            const double mv = p.mask ? ggml_fp16_to_fp32(mask[i]) : 0;
            if (mv == -INFINITY) { s[i] = -INFINITY; continue; }
            dequant_ref(c.kt, K.data() + i * knb1 + g * kh, D, kd.data());
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += (double) q[(size_t) h * D + d] * kd[d];
            dot *= p.scale * (1.0 + g_perturb_ref);
            if (c.softcap) dot = c.softcap * tanh(dot / c.softcap);
            s[i] = dot + (c.alibi ? slope[h] : 1.0) * mv;
            m = std::max(m, s[i]);
        }
        if (m == -INFINITY) {  // every cell masked: LSE -inf, output 0
            bad += lse[h] != -INFINITY;
            for (int d = 0; d < DV; ++d) if (o[(size_t) h * DV + d] != 0.0f) { bad++; break; }
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
        double err = fabs(lse[h] - lref) / std::max(1.0, fabs(lref));
        double num = 0, den = 0;
        for (int d = 0; d < DV; ++d) {
            const double r = od[d] / sum, e = o[(size_t) h * DV + d] - r;
            num += e * e;
            den += r * r;
        }
        err = std::max(err, sqrt(num / std::max(den, 1e-30)));
        worst = std::max(worst, err);
        bad += !(err < 2e-5);  // f32 arithmetic over <= ~250 cells: observed <= 1e-6
    }
    return bad;
}

int check(const std::vector<std::string> & isas) {
    int passed = 0, failed = 0;
    for (const std::string & isa : isas) {
        if (!rkv_cpu_decode_force_isa(isa.c_str())) {
            printf("isa %s: not available on this CPU\n", isa.c_str());
            continue;
        }
        std::mt19937 rng(42);
        double worst = 0;
        int cases = 0, bad_cases = 0;
        const ggml_type types[3] = {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0};
        for (ggml_type kt : types) for (ggml_type vt : types) for (int D : {64, 128, 256}) for (int ratio : {1, 3, 4, 8}) {
            for (int mk = 0; mk < 3; ++mk) for (int alibi = 0; alibi < 2; ++alibi) {
                if ((D != 128 && (mk || alibi)) || (mk == 2 && alibi)) continue;
                const int nkv = ratio == 8 ? 1 : 2;
                const test_case c{nkv * ratio, nkv, D, kt, vt, (int64_t) (37 + 97 * ((kt + vt + ratio) % 3)), mk, (bool) alibi,
                                  (ratio == 4 && D == 128) ? 30.0f : 0.0f, 1 + (ratio + mk) % 5};
                const int b = run_case(c, rng, worst);
                cases++;
                if (b) {
                    bad_cases++;
                    printf("FAIL isa %s K %s V %s D %d G %d mask %d alibi %d softcap %.0f parts %d cells %lld: %d rows\n", isa.c_str(),
                           ggml_type_name(kt), ggml_type_name(vt), D, ratio, mk, alibi, c.softcap, c.parts, (long long) c.n, b);
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

int bench(int T, int layers, int64_t n, ggml_type type, int reps) {
    const int n_kv = 8, G = 3, D = 128, n_head = n_kv * G;
    // one CPU-backend buffer holds every layer's K and V (cell-major rows of all KV heads, as llama.cpp's cache)
    ggml_init_params ip = { ggml_tensor_overhead() * (8 * layers + 16) + ggml_graph_overhead_custom(4 * layers + 16, false), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    std::vector<ggml_tensor *> K(layers), V(layers);
    for (int l = 0; l < layers; ++l) {
        K[l] = ggml_new_tensor_2d(ctx, type, D * n_kv, n);
        V[l] = ggml_new_tensor_2d(ctx, type, D * n_kv, n);
    }
    ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, 1, n_head);
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
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    if (!buf) {
        fprintf(stderr, "cannot allocate %d layers of %lld cells\n", layers, (long long) n);
        return 1;
    }
    const size_t kh = row_bytes(type, D), nb1 = kh * n_kv, layer_bytes = 2 * nb1 * n;
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
                for (int64_t i = 4096; i < n; i += 4096) {  // the rest repeats the first rows (the timing is data-independent)
                    memcpy((uint8_t *) t->data + i * nb1, t->data, std::min<int64_t>(4096, n - i) * nb1);
                }
            }
        }
        for (int i = 0; i < D * n_head; ++i) ((float *) q->data)[i] = N(rng) * 0.1f;
    }
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

    rkv_cpu_decode_params p{};
    p.q = (const float *) q->data; p.n_head = n_head; p.n_head_kv = n_kv; p.D = D; p.DV = D;
    p.k_type = type; p.v_type = type; p.k_nb1 = nb1; p.k_nb_head = kh; p.v_nb1 = nb1; p.v_nb_head = kh; p.n_cells = n;
    p.scale = 1.0f / sqrtf((float) D);
    const size_t pf = rkv_cpu_decode_part_floats(p);
    std::vector<float> parts(pf * T), o((size_t) n_head * D), lse(n_head);
    std::vector<uint8_t> sink(64 * T);

    auto attention = [&] {
        for (int l = 0; l < layers; ++l) {
            rkv_cpu_decode_params pl = p;
            pl.k = (const uint8_t *) K[l]->data;
            pl.v = (const uint8_t *) V[l]->data;
            rkv_cpu_pool_run(T, [&](int t) { rkv_cpu_decode_range(pl, n * t / T, n * (t + 1) / T, parts.data() + t * pf); });
            rkv_cpu_decode_merge(pl, parts.data(), T, o.data(), lse.data());
        }
    };
    std::vector<const uint8_t *> bufs;
    for (int l = 0; l < layers; ++l) {
        bufs.push_back((const uint8_t *) K[l]->data);
        bufs.push_back((const uint8_t *) V[l]->data);
    }
    auto read_scan = [&] {
        rkv_cpu_pool_run(T, [&](int t) { sink[64 * t] = (uint8_t) rkv_cpu_decode_read_scan(bufs.data(), (int) bufs.size(), nb1 * n, t, T); });
    };
    std::vector<uint8_t> dst(layer_bytes / 2 / T * T + 4096);
    auto copy = [&] {
        rkv_cpu_pool_run(T, [&](int t) {
            const size_t chunk = nb1 * n / T, off = chunk * t;
            for (int l = 0; l < layers; ++l) {
                memcpy(dst.data() + chunk * t, (const uint8_t *) K[l]->data + off, chunk);
                memcpy(dst.data() + chunk * t, (const uint8_t *) V[l]->data + off, chunk);
            }
        });
    };
    auto vanilla = [&] { ggml_backend_graph_compute(be, gf); };
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
    const double ta = best(attention), ts = best(read_scan), tc = best(copy), tv = best(vanilla);
    const double gb = (double) layer_bytes * layers / 1e9;
    printf("cpu-decode bench: isa %s, %d threads, %d layers x %lld cells, %s K+V: %.3f GB per token\n", rkv_cpu_decode_isa(), T,
           layers, (long long) n, ggml_type_name(type), gb);
    printf("  attention            %8.2f ms  %6.1f GB/s\n", ta * 1e3, gb / ta);
    printf("  read scan            %8.2f ms  %6.1f GB/s  (attention at %.2fx of it)\n", ts * 1e3, gb / ts, ts / ta);
    printf("  copy                 %8.2f ms  %6.1f GB/s read\n", tc * 1e3, gb / tc);
    printf("  ggml_flash_attn_ext  %8.2f ms  %6.1f GB/s  (attention %.2fx faster)\n", tv * 1e3, gb / tv, tv / ta);
    printf("{\"isa\": \"%s\", \"threads\": %d, \"layers\": %d, \"cells\": %lld, \"type\": \"%s\", \"gb\": %.6f, "
           "\"attention_ms\": %.4f, \"scan_ms\": %.4f, \"copy_ms\": %.4f, \"ggml_fa_ms\": %.4f}\n", rkv_cpu_decode_isa(), T, layers,
           (long long) n, ggml_type_name(type), gb, ta * 1e3, ts * 1e3, tc * 1e3, tv * 1e3);
    ggml_gallocr_free(ga);
    ggml_backend_buffer_free(buf);
    ggml_backend_free(be);
    ggml_free(ctx);
    return 0;
}

} // namespace

int main(int argc, char ** argv) {
    bool do_bench = false;
    int T = (int) std::max(1u, std::thread::hardware_concurrency()), layers = 28, reps = 5;
    int64_t cells = 16384;
    ggml_type type = GGML_TYPE_F16;
    std::vector<std::string> isas;
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
        else if (a == "--isa") isas.push_back(next());
        else if (a == "--perturb-ref") g_perturb_ref = atof(next());
        else if (a == "--type") {
            const std::string t = next();
            type = t == "f16" ? GGML_TYPE_F16 : t == "q8_0" ? GGML_TYPE_Q8_0 : t == "q4_0" ? GGML_TYPE_Q4_0 : GGML_TYPE_COUNT;
            if (type == GGML_TYPE_COUNT) { fprintf(stderr, "--type: f16, q8_0 or q4_0\n"); return 2; }
        } else {
            fprintf(stderr, "usage: %s [--isa NAME] [--perturb-ref X] | --bench [-t N] [--layers L] [--cells N] [--type T] [--reps R]\n", argv[0]);
            return 2;
        }
    }
    if (T < 1 || layers < 1 || cells < 16 || reps < 1) {
        fprintf(stderr, "-t, --layers, --reps must be >= 1 and --cells >= 16\n");
        return 2;
    }
    for (const std::string & isa : isas) {
        if (isa != "avx512" && isa != "avx2" && isa != "scalar") {
            fprintf(stderr, "--isa: avx512, avx2 or scalar, not %s\n", isa.c_str());
            return 2;
        }
        if (!rkv_cpu_decode_force_isa(isa.c_str())) {
            fprintf(stderr, "isa %s is not available on this CPU\n", isa.c_str());
            return 2;
        }
    }
    ggml_backend_load_all();  // a no-op unless the backends are modules
    if (do_bench) {
        if (!isas.empty()) rkv_cpu_decode_force_isa(isas[0].c_str());
        return bench(T, layers, cells, type, reps);
    }
    if (isas.empty()) isas = {"avx512", "avx2", "scalar"};  // each this CPU has; the others are reported
    return check(isas);
}
