// rollingkv: the KV residency planner's models (see llama-kv-residency.h): the budget, the link model, the head split,
// the hybrid tail's time model and auto tail types. No device access: the planner's test harness
// (rollingkv/plan-simulate.cpp) runs them on given figures.
#include "llama-kv-residency.h"

#include "ggml-rolling-kv.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

//
// budget and link model (no device access: simulate runs them on given figures)
//

uint32_t llama_rkv_plan_budget(llama_rkv_state & st) {
    const int64_t  target       = st.req.vram_target_mib;
    const size_t   target_bytes = target > 0 ? (size_t) target*LLAMA_RKV_MIB : 0;
    const uint64_t kv_size      = st.kv_size;
    const uint64_t n_stream     = std::max<uint32_t>(1, st.n_stream);

    st.error.clear();
    st.min_target_mib = 0;

    bool     fits   = true;
    uint64_t wc_fit = UINT32_MAX;
    const llama_rkv_dev_budget * binding = nullptr;

    for (auto & d : st.devs) {
        d.cell_bytes  = (d.row_bytes_window + d.conv_cell_bytes)*n_stream;
        d.kv_resident = kv_size*d.cell_bytes;

        if (target > 0) {
            // the weights are allocated already: they count against the target, and free excludes them
            d.avail = target_bytes > d.weights ? std::min(target_bytes - d.weights, d.free) : 0;
        } else {
            d.avail = d.free > st.reserve ? d.free - st.reserve : 0;
        }

        const size_t fixed       = d.compute + d.other_kv + (target > 0 ? d.runtime : 0);
        const size_t fixed_split = fixed + d.ring; // a resident cache streams nothing: no ring

        if (fixed + d.kv_resident > d.avail) {
            fits = false;
        }

        d.kv_budget = d.avail > fixed_split ? d.avail - fixed_split : 0;

        // the window tensors hold one more (trash) row per stream
        const uint64_t rows = d.cell_bytes > 0 ? d.kv_budget/d.cell_bytes : (uint64_t) UINT32_MAX + 1;
        d.fit_cells = (uint32_t) std::min<uint64_t>(rows > 0 ? rows - 1 : 0, UINT32_MAX);

        if (!binding || d.fit_cells < wc_fit) {
            binding = &d;
            wc_fit  = d.fit_cells;
        }

        // the smallest target with a plan: the whole KV, or the smallest window
        // (as a target: the runtime counts)
        const size_t fixed_target  = d.compute + d.other_kv + d.runtime;
        const size_t need_resident = d.weights + fixed_target + d.kv_resident;
        const size_t need_split    = d.weights + fixed_target + d.ring + (LLAMA_RKV_WINDOW_ALIGN + 1)*d.cell_bytes;
        const size_t need          = kv_size > LLAMA_RKV_WINDOW_ALIGN ? std::min(need_resident, need_split)
                : need_resident;

        d.min_target_mib  = (int64_t) ((need + LLAMA_RKV_MIB - 1)/LLAMA_RKV_MIB);
        st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib);
    }

    if (fits || !binding) {
        return 0;
    }

    const uint64_t wc = wc_fit/LLAMA_RKV_WINDOW_ALIGN*LLAMA_RKV_WINDOW_ALIGN;
    if (wc >= LLAMA_RKV_WINDOW_ALIGN && wc < kv_size) {
        return (uint32_t) wc;
    }

    const auto & d = *binding;
    const size_t min_window = (LLAMA_RKV_WINDOW_ALIGN + 1)*d.cell_bytes;

    char buf[768];
    if (target > 0 && target < d.min_target_mib) {
        snprintf(buf, sizeof(buf),
                "vram_target %" PRId64 " MiB is below the minimum of %" PRId64 " MiB on %s: weights %.0f MiB + compute "
                "buffers ~%.0f MiB (estimate) + GPU runtime ~%.0f MiB + other KV caches %.0f MiB + streaming ring %.0f "
                "MiB + a %u-cell KV window %.0f MiB", target, d.min_target_mib, d.name.c_str(),
                llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.runtime), llama_rkv_mib(d.other_kv),
                llama_rkv_mib(d.ring), LLAMA_RKV_WINDOW_ALIGN, llama_rkv_mib(min_window));
    } else {
        const std::string reserve = target > 0 ? "" : " minus a " + std::to_string(st.reserve/LLAMA_RKV_MIB) +
                                    " MiB reserve";
        snprintf(buf, sizeof(buf),
                "not enough free memory on %s for the KV cache: %.0f MiB free%s leave %.0f MiB, and compute buffers "
                "~%.0f MiB (estimate) + other KV caches %.0f MiB + streaming ring %.0f MiB + a %u-cell KV window %.0f "
                "MiB need %.0f MiB", d.name.c_str(), llama_rkv_mib(d.free), reserve.c_str(), llama_rkv_mib(d.avail),
                llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv), llama_rkv_mib(d.ring), LLAMA_RKV_WINDOW_ALIGN,
                llama_rkv_mib(min_window), llama_rkv_mib(d.compute + d.other_kv + d.ring + min_window));
    }
    st.error = buf;

    return 0;
}

// bytes read from device memory and streamed over the link per token at n_kv cells of every stream, for a window of wc
// cells (window) or the head split of st.head_layers (head), over the budgeted devices; mean: averaged over a sequence
// that grows from 0 to n_kv cells instead (the window: mean min(n, wc) and max(0, n - wc); the head split: n_kv/2)
void llama_rkv_token_bytes(const llama_rkv_state & st, bool head, uint32_t wc, double n_kv, double & device,
        double & tail, bool mean) {
    const double n_stream = std::max<uint32_t>(1, st.n_stream);
    const double w = std::min<double>(wc, n_kv);
    // cells of the window and of the tail read per token: at n_kv, or their means over n in [0, n_kv]
    const double c_win  = mean ? w - w*w/(2.0*n_kv) : w;
    const double c_tail = mean ? (n_kv - w)*(n_kv - w)/(2.0*n_kv) : n_kv - w;
    const double c_all  = mean ? n_kv/2.0 : n_kv;
    device = 0.0;
    tail   = 0.0;
    for (size_t i = 0; i < st.devs.size(); ++i) {
        const auto & d = st.devs[i];
        device += (double) d.weights + (double) d.other_kv;
        if (!head) {
            device += c_win*d.row_bytes_window*n_stream;
            tail   += c_tail*d.row_bytes_tail*n_stream;
            continue;
        }
        for (const auto & hl : st.head_layers) {
            if (hl.dev == (int32_t) i) {
                device += c_all*hl.device_heads*hl.head_bytes_window*n_stream;
                tail   += c_all*(hl.n_head_kv - hl.device_heads)*hl.head_bytes_tail*n_stream;
            }
        }
    }
}

// ms per token for the bytes of llama_rkv_token_bytes (< 0: a bandwidth is unknown)
double llama_rkv_token_ms(double device, double tail, double mem_bw, double link_bw) {
    if (mem_bw <= 0.0 || link_bw <= 0.0) {
        return -1.0;
    }
    return device/(mem_bw*1e9)*1e3 + tail/(link_bw*1e9)*1e3;
}

void llama_rkv_link_source(llama_rkv_state & st) {
    bool all_host = !st.devs.empty();
    for (const auto & d : st.devs) {
        all_host = all_host && d.host_memory;
    }

    if (st.req.pcie_bw_gbps > 0.0f) {
        st.link_bw_gbps   = st.req.pcie_bw_gbps;
        st.link_bw_source = "pcie_bw_gbps of the request";
    } else if (all_host && st.mem_bw_gbps > 0.0) {
        st.link_bw_gbps   = st.mem_bw_gbps;
        st.link_bw_source = "host memory bandwidth (the tail is in the same memory)";
    } else {
        st.link_bw_source = "unknown: no pcie_bw_gbps in the request (rollingkv probe pcie measures it)";
    }
}

void llama_rkv_plan_estimate(llama_rkv_state & st) {
    st.link_bw_gbps     = -1.0;
    st.est_device_bytes = 0;
    st.est_tail_bytes   = 0;
    st.t_resident_ms    = -1.0;
    st.t_tail_ms        = -1.0;
    st.t_token_ms       = -1.0;

    llama_rkv_link_source(st);

    if (!llama_rkv_is_split(st) || st.devs.empty()) {
        return;
    }

    // every token of a decode step reads the weights, the device's KV and the other caches from device memory and
    // streams the tail over the link, at full context on every stream
    llama_rkv_token_bytes(st, st.chosen == LLAMA_KV_RESIDENCY_HEAD, st.window_cells, st.kv_size, st.est_device_bytes,
                          st.est_tail_bytes);

    if (st.mem_bw_gbps > 0.0) {
        st.t_resident_ms = st.est_device_bytes/(st.mem_bw_gbps*1e9)*1e3;
    }
    if (st.link_bw_gbps > 0.0) {
        st.t_tail_ms = st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3;
    }
    if (st.t_resident_ms >= 0.0 && st.t_tail_ms >= 0.0) {
        st.t_token_ms = st.t_resident_ms + st.t_tail_ms;
    }
}

//
// the head split
//

uint32_t llama_rkv_device_heads(const llama_rkv_state & st, int32_t il) {
    if (st.chosen != LLAMA_KV_RESIDENCY_HEAD) {
        return 0;
    }
    for (const auto & hl : st.head_layers) {
        if (hl.il == il) {
            return hl.device_heads;
        }
    }
    return 0;
}

std::string llama_rkv_heads_summary(const llama_rkv_state & st) {
    if (st.chosen != LLAMA_KV_RESIDENCY_HEAD || st.head_layers.empty()) {
        return "";
    }
    uint32_t h_min = UINT32_MAX, h_max = 0, n_min = UINT32_MAX, n_max = 0, n_split = 0;
    for (const auto & hl : st.head_layers) {
        h_min = std::min(h_min, hl.device_heads);
        h_max = std::max(h_max, hl.device_heads);
        n_min = std::min(n_min, hl.n_head_kv);
        n_max = std::max(n_max, hl.n_head_kv);
        n_split += hl.device_heads < hl.n_head_kv;
    }
    char buf[256];
    const std::string h = h_min == h_max ? std::to_string(h_min) : std::to_string(h_min) + "-" + std::to_string(h_max);
    const std::string n = n_min == n_max ? std::to_string(n_min) : std::to_string(n_min) + "-" + std::to_string(n_max);
    snprintf(buf, sizeof(buf), "%s of %s KV heads on the device, %u of %zu layers split", h.c_str(), n.c_str(), n_split,
            st.head_layers.size());
    return buf;
}

void llama_rkv_heads_whole(llama_rkv_state & st) {
    for (auto & hl : st.head_layers) {
        hl.device_heads = hl.n_head_kv;
    }
}

// device bytes of the head split's KV on device di (+ the f16 copy flash attention makes of one layer's device heads)
size_t llama_rkv_head_dev_bytes(const llama_rkv_state & st, int32_t di) {
    const size_t n = (size_t) st.kv_size*std::max<uint32_t>(1, st.n_stream);
    size_t kv = 0, conv = 0;
    for (const auto & hl : st.head_layers) {
        if (hl.dev == di) {
            kv  += hl.device_heads*hl.head_bytes_window;
            conv = std::max(conv, hl.device_heads*hl.conv_head_bytes);
        }
    }
    return (kv + conv)*n;
}

bool llama_rkv_plan_heads(llama_rkv_state & st) {
    const int64_t target = st.req.vram_target_mib;

    llama_rkv_heads_whole(st); // layers no budget holds stay whole

    bool ok = true;
    for (size_t di = 0; di < st.devs.size(); ++di) {
        auto & d = st.devs[di];

        std::vector<llama_rkv_head_layer *> ls;
        for (auto & hl : st.head_layers) {
            if (hl.dev == (int32_t) di) {
                ls.push_back(&hl);
            }
        }

        // one KV head of every layer first
        for (auto * l : ls) {
            l->device_heads = 1;
        }
        const size_t base = llama_rkv_head_dev_bytes(st, (int32_t) di);

        const size_t fixed_target  = d.compute + d.other_kv + d.runtime;
        const size_t need_resident = d.weights + fixed_target + d.kv_resident;
        const size_t need_head     = d.weights + fixed_target + d.ring + base;
        d.min_target_mib_head = (int64_t) ((std::min(need_resident, need_head) + LLAMA_RKV_MIB - 1)/LLAMA_RKV_MIB);

        if (base > d.kv_budget) {
            d.head_kv_bytes = base;
            if (ok) {
                char buf[768];
                if (target > 0 && target < d.min_target_mib_head) {
                    snprintf(buf, sizeof(buf),
                            "vram_target %" PRId64 " MiB is below the head split's minimum of %" PRId64 " MiB on %s: "
                            "weights %.0f MiB + compute buffers ~%.0f MiB (estimate) + GPU runtime ~%.0f MiB + other "
                            "KV caches %.0f MiB + streaming ring %.0f MiB + one KV head of each of %zu layers %.0f MiB",
                            target, d.min_target_mib_head, d.name.c_str(), llama_rkv_mib(d.weights),
                            llama_rkv_mib(d.compute), llama_rkv_mib(d.runtime), llama_rkv_mib(d.other_kv),
                            llama_rkv_mib(d.ring), ls.size(), llama_rkv_mib(base));
                } else {
                    snprintf(buf, sizeof(buf),
                            "not enough free memory on %s for a head split: %.0f MiB left for the KV after compute "
                            "buffers, other KV caches and the streaming ring, and one KV head of each of %zu layers "
                            "needs %.0f MiB", d.name.c_str(), llama_rkv_mib(d.kv_budget), ls.size(),
                            llama_rkv_mib(base));
                }
                st.error = buf;
            }
            ok = false;
            continue;
        }

        // then one head at a time to the layer with the fewest (the first of them), while it fits
        std::vector<bool> full(ls.size(), false);
        while (true) {
            int best = -1;
            for (size_t i = 0; i < ls.size(); ++i) {
                if (!full[i] && ls[i]->device_heads < ls[i]->n_head_kv &&
                    (best < 0 || ls[i]->device_heads < ls[best]->device_heads)) {
                    best = (int) i;
                }
            }
            if (best < 0) {
                break;
            }
            ls[best]->device_heads++;
            if (llama_rkv_head_dev_bytes(st, (int32_t) di) > d.kv_budget) {
                ls[best]->device_heads--;
                full[best] = true;
            }
        }
        d.head_kv_bytes = llama_rkv_head_dev_bytes(st, (int32_t) di);
    }

    if (!ok) {
        llama_rkv_heads_whole(st);
    }
    return ok;
}

// the model of the header at share f
static double llama_rkv_tail_cpu_time(double t_res_ms, double t_link_ms, double t_cpu_ms, double latency_ms, double f) {
    return std::max(t_res_ms + f*t_cpu_ms + (f > 0.0 ? latency_ms : 0.0), (1.0 - f)*t_link_ms);
}

double llama_rkv_tail_cpu_best(double t_res_ms, double t_link_ms, double t_cpu_ms, double latency_ms) {
    auto model = [&](double f) { return llama_rkv_tail_cpu_time(t_res_ms, t_link_ms, t_cpu_ms, latency_ms, f); };
    double best_f = 0.0, best_t = model(0.0);
    for (int i = 1; i <= 64; ++i) {
        const double f = i/64.0;
        if (model(f) < best_t) {
            best_t = model(f);
            best_f = f;
        }
    }
    return best_t > 0.97*model(0.0) ? 0.0 : best_f;
}

float llama_rkv_tail_cpu_frac_at(const llama_rkv_tail_cpu & m, uint32_t tail_cells, double rows) {
    if (tail_cells == 0 || (m.frac <= 0.0f && !m.is_auto)) {
        return 0.0f;
    }
    if (!m.is_auto || m.tail_cells == 0) {
        return m.frac;
    }
    // the part's slowdown at this many rows per cell, between the measured counts linearly
    const double r  = std::min<double>(GGML_RKV_CPU_PART_MAX_Q, std::max(1.0, rows));
    const int    r0 = (int) r;
    const double slow = r0 >= GGML_RKV_CPU_PART_MAX_Q ? m.slow[GGML_RKV_CPU_PART_MAX_Q - 1] :
                        m.slow[r0 - 1] + (r - r0)*(m.slow[r0] - m.slow[r0 - 1]);
    const double s = (double) tail_cells/m.tail_cells;
    return (float) llama_rkv_tail_cpu_best(m.t_res_ms, s*m.t_link_ms, s*m.t_cpu_ms*slow, m.latency_ms);
}

uint32_t llama_rkv_tail_cpu_from_cells(const llama_rkv_tail_cpu & m) {
    for (uint32_t c = LLAMA_RKV_WINDOW_ALIGN; c < m.tail_cells + LLAMA_RKV_WINDOW_ALIGN; c += LLAMA_RKV_WINDOW_ALIGN) {
        const uint32_t cells = std::min(c, m.tail_cells);
        if (llama_rkv_tail_cpu_frac_at(m, cells) > 0.0f) {
            return cells;
        }
    }
    return 0;
}

// the hybrid tail's per-layer terms: measured on the device when auto chooses a share (measure; plan-simulate's
// measurers give what the probes would), else the constants measured once on the H200 (llama-kv-residency.h). The
// measurers keep their figures for the process, so a later plan asks them again at no cost
static void llama_rkv_plan_layer_terms(llama_rkv_state & st, const llama_rkv_decide_in & in, bool measure) {
    const auto term = [measure](double & v, std::string & source, const std::function<double(std::string *)> & fn,
            double fallback, const char * why_fallback) {
        std::string how;
        v = measure && fn ? fn(&how) : -1.0;
        if (v >= 0.0) {
            source = how;
        } else {
            v      = fallback;
            source = std::string(why_fallback) + (how.empty() ? "" : " (" + how + ")");
        }
    };
    term(st.layer_decode_ms, st.layer_decode_source, in.measure_layer_decode, LLAMA_RKV_LAYER_DECODE_MS,
            "assumed: the H200's figure (LLAMA_RKV_LAYER_DECODE_MS)");
    term(st.cpu_part_latency_ms, st.cpu_part_latency_source, in.measure_cpu_part_latency, LLAMA_RKV_CPU_PART_LATENCY_MS,
            "assumed: the H200's figure (LLAMA_RKV_CPU_PART_LATENCY_MS)");
}

void llama_rkv_plan_tail_cpu(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.tail_cpu_frac     = 0.0f;
    st.t_token_hybrid_ms = -1.0;
    st.tail_cpu          = llama_rkv_tail_cpu{};
    for (double & g : st.cpu_attn_rows_gbps) {
        g = -1.0;
    }
    st.layer_decode_ms     = -1.0; // the time model's terms: null where no share is modelled
    st.cpu_part_latency_ms = -1.0;
    const float req = st.req.tail_cpu_frac;

    bool host_memory = st.devs.empty();
    uint32_t n_layer = 0;
    for (const auto & d : st.devs) {
        host_memory = host_memory || d.host_memory;
        n_layer += d.n_layer;
    }
    if (!llama_rkv_is_split(st) || st.tail_cells == 0) {
        st.tail_cpu_reason = "no split: no tail";
        return;
    }
    if (host_memory) {
        st.tail_cpu_reason = "no GPU: the CPU attends the whole tail already";
        return;
    }
    if (req == 0.0f) {
        st.tail_cpu_reason = "off (tail_cpu_frac 0)";
        return;
    }
    if (!llama_rkv_cpu_part_available()) {
        st.tail_cpu_reason = "the CPU backend offers no CPU part";
        return;
    }
    if (!llama_rkv_cpu_part_supported(st.type_k_tail, st.type_v_tail, st.head_k, st.head_v)) {
        char buf[200];
        snprintf(buf, sizeof(buf),
                "the CPU part reads f16, q8_0 and q4_0 tails with head sizes that are multiples of 32, not K %s / V %s",
                ggml_type_name(st.type_k_tail), ggml_type_name(st.type_v_tail));
        st.tail_cpu_reason = buf;
        return;
    }

    // the model's inputs (a request's share needs none, but the plan reports what it is expected to give)
    if (st.req.cpu_attn_gbps > 0.0f) {
        st.cpu_attn_gbps   = st.req.cpu_attn_gbps;
        st.cpu_attn_source = "request";
    } else if (req < 0.0f && in.measure_cpu_attn) {
        st.cpu_attn_gbps = in.measure_cpu_attn(&st.cpu_attn_source);
    }
    if (st.link_bw_gbps <= 0.0 && req < 0.0f && in.measure_link) {
        st.link_bw_gbps = in.measure_link(&st.link_bw_source);
        if (st.link_bw_gbps > 0.0) {
            st.t_tail_ms = st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3;
            if (st.t_resident_ms >= 0.0) {
                st.t_token_ms = st.t_resident_ms + st.t_tail_ms;
            }
        }
    }

    const bool known = st.cpu_attn_gbps > 0.0 && st.link_bw_gbps > 0.0;
    llama_rkv_plan_layer_terms(st, in, req < 0.0f && known);
    const double t_res  = std::max(0.0, st.t_resident_ms) + n_layer*st.layer_decode_ms;
    const double t_link = known ? st.est_tail_bytes/(st.link_bw_gbps*1e9)*1e3 : 0.0;
    const double t_cpu  = known ? st.est_tail_bytes/(st.cpu_attn_gbps*1e9)*1e3 : 0.0;
    const double latency = n_layer*st.cpu_part_latency_ms;

    if (req > 0.0f) {
        st.tail_cpu_frac   = std::min(1.0f, req);
        st.tail_cpu_reason = "requested";
        st.tail_cpu.frac   = st.tail_cpu_frac;
    } else if (!known) {
        st.tail_cpu_reason = std::string("auto: off, ") +
            (st.cpu_attn_gbps <= 0.0 ? "the CPU attention bandwidth" : "the link bandwidth") + " is unknown";
        return;
    } else {
        const double best_f = llama_rkv_tail_cpu_best(t_res, t_link, t_cpu, latency);
        char buf[384];
        if (best_f == 0.0) {
            snprintf(buf, sizeof(buf),
                    "auto: off, a CPU part would gain < 3 %% (link %.1f GB/s, CPU attention %.1f GB/s)",
                    st.link_bw_gbps, st.cpu_attn_gbps);
            st.tail_cpu_reason = buf;
            return;
        }
        st.tail_cpu_frac = (float) best_f;
        st.tail_cpu = { st.tail_cpu_frac, true, t_res, t_link, t_cpu, latency, st.tail_cells };
        // several rows per cell (a step of sequences sharing a prefix): measured at 2, 4 and 8 rows, interpolated
        if (in.measure_cpu_attn_rows) {
            const int at[] = { 1, 2, 4, 8 };
            double slow_at[4] = { 1.0, 1.0, 1.0, 1.0 };
            for (int i = 1; i < 4; ++i) {
                std::string how;
                const double g = in.measure_cpu_attn_rows(at[i], &how);
                slow_at[i] = g > 0.0 ? std::max(slow_at[i - 1], st.cpu_attn_gbps/g) : slow_at[i - 1];
                st.cpu_attn_rows_gbps[i - 1] = g;
            }
            for (int r = 1; r <= GGML_RKV_CPU_PART_MAX_Q; ++r) {
                int i = 0;
                while (i < 2 && at[i + 1] < r) {
                    ++i;
                }
                const double t = std::min(1.0, (double) (r - at[i])/(at[i + 1] - at[i]));
                st.tail_cpu.slow[r - 1] = (float) (slow_at[i] + t*(slow_at[i + 1] - slow_at[i]));
            }
        }
        snprintf(buf, sizeof(buf),
                "auto: %.0f %% of each tail on the CPU at full context (link %.1f GB/s, CPU attention %.1f GB/s, %d "
                "threads, per layer %.3f ms of decode beyond its bytes and %.3f ms per CPU part), chosen again as the "
                "tail grows: none below %u cells", 100.0*best_f, st.link_bw_gbps, st.cpu_attn_gbps, st.n_threads,
                st.layer_decode_ms, st.cpu_part_latency_ms, llama_rkv_tail_cpu_from_cells(st.tail_cpu));
        st.tail_cpu_reason = buf;
    }
    if (known) {
        st.t_token_hybrid_ms = llama_rkv_tail_cpu_time(t_res, t_link, t_cpu, latency, st.tail_cpu_frac);
    }
}

//
// auto tail types (see the header)
//

void llama_rkv_take_auto_tail(llama_rkv_state & st) {
    if (st.req.type_k_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO) {
        st.tail_auto_k     = true;
        st.req.type_k_tail = GGML_TYPE_COUNT;
    }
    if (st.req.type_v_tail == LLAMA_ROLLING_KV_TAIL_TYPE_AUTO) {
        st.tail_auto_v     = true;
        st.req.type_v_tail = GGML_TYPE_COUNT;
    }
}

// an auto axis' floor: q8_0 under a float window, else the window's own (already compact) type
static ggml_type llama_rkv_auto_tail_floor(ggml_type window) {
    return window == GGML_TYPE_F32 || window == GGML_TYPE_F16 || window == GGML_TYPE_BF16 ? GGML_TYPE_Q8_0 : window;
}

static double llama_rkv_bytes_per_elem(ggml_type t) {
    return (double) ggml_type_size(t)/(double) ggml_blck_size(t);
}

// whether every layer's tail can hold type t: a window split stores whole rows of its blocks, a head split whole heads
// (false when the layers' shapes are unknown, unless t is the window's type, which the cache holds already)
static bool llama_rkv_tail_type_fits(const llama_rkv_state & st, ggml_type t, bool is_v, bool head) {
    if (t == (is_v ? st.type_v : st.type_k)) {
        return true;
    }
    if (st.head_layers.empty()) {
        return false;
    }
    const uint64_t blck = (uint64_t) ggml_blck_size(t);
    for (const auto & hl : st.head_layers) {
        const uint64_t h = is_v ? hl.head_v : hl.head_k;
        if (h == 0 || (head ? h : h*hl.n_head_kv) % blck != 0) {
            return false;
        }
    }
    return true;
}

// the plan's tail-dependent figures at these types: the devices' K+V row bytes of the tail, the head layers' bytes of
// one host head (0 where the type does not divide a head: no head split at it)
void llama_rkv_retype_tail(llama_rkv_state & st, ggml_type tk, ggml_type tv) {
    st.type_k_tail = tk;
    st.type_v_tail = tv;
    bool known = !st.head_layers.empty();
    for (const auto & hl : st.head_layers) {
        known = known && hl.head_k > 0 && hl.head_v > 0;
    }
    if (!known) {
        return; // the figures stay as the cache described them (at the window's types)
    }
    for (auto & d : st.devs) {
        d.row_bytes_tail = 0;
    }
    const int64_t bk = ggml_blck_size(tk);
    const int64_t bv = ggml_blck_size(tv);
    for (auto & hl : st.head_layers) {
        hl.head_bytes_tail = hl.head_k % bk == 0 && hl.head_v % bv == 0 ?
            ggml_row_size(tk, hl.head_k) + ggml_row_size(tv, hl.head_v) : 0;
        const int64_t nk = (int64_t) hl.head_k*hl.n_head_kv;
        const int64_t nv = (int64_t) hl.head_v*hl.n_head_kv;
        if (hl.dev >= 0 && (size_t) hl.dev < st.devs.size() && nk % bk == 0 && nv % bv == 0) {
            st.devs[hl.dev].row_bytes_tail += ggml_row_size(tk, nk) + ggml_row_size(tv, nv);
        }
    }
}

// auto tail types: the floor of each auto axis (fk, fv), where every layer takes it; an explicit axis keeps its type
// (req_k, req_v). An axis whose floor does not divide the rows (or heads) or that the op refuses keeps the window's
// type, said in notes; false (st.error) where a requested head split cannot take it
static bool llama_rkv_auto_tail_floors(llama_rkv_state & st, const llama_rkv_decide_in & in, bool head, ggml_type req_k,
        ggml_type req_v, ggml_type & fk, ggml_type & fv, std::string & notes) {
    const bool head_requested = st.req.mode == LLAMA_KV_RESIDENCY_HEAD || st.req.device_heads > 0;
    fk = st.tail_auto_k ? llama_rkv_auto_tail_floor(st.type_k) : req_k;
    fv = st.tail_auto_v ? llama_rkv_auto_tail_floor(st.type_v) : req_v;
    for (const bool is_v : { false, true }) {
        ggml_type & f = is_v ? fv : fk;
        const ggml_type window = is_v ? st.type_v : st.type_k;
        if (!(is_v ? st.tail_auto_v : st.tail_auto_k) || llama_rkv_tail_type_fits(st, f, is_v, head)) {
            continue;
        }
        if (head && head_requested) {
            char buf[320];
            snprintf(buf, sizeof(buf),
                    "the head split's host heads (%s size %u) cannot take the %s tail that auto chooses (blocks of %d "
                    "elements): give -ct%st a type that divides them, or split by window", is_v ? "V head" : "K head",
                    st.head_layers.empty() ? 0u : (is_v ? st.head_layers[0].head_v : st.head_layers[0].head_k),
                    ggml_type_name(f), (int) ggml_blck_size(f), is_v ? "v" : "k");
            st.error = buf;
            return false;
        }
        notes += std::string("; ") + (is_v ? "V" : "K") + ": " + ggml_type_name(f) + " blocks do not divide the " +
                 (head ? "KV heads" : "rows") + ", the window's " + ggml_type_name(window);
        f = window;
    }
    if (in.tail_op_unsupported && (fk != req_k || fv != req_v)) {
        const std::string why = in.tail_op_unsupported(fk, fv, head);
        if (!why.empty()) {
            notes += "; " + why + ", the window's types";
            fk = st.tail_auto_k ? st.type_k : req_k;
            fv = st.tail_auto_v ? st.type_v : req_v;
        }
    }
    return true;
}

// auto tail types: the link-only time of the split's tail at the types fk/fv (st.tail_auto_t_link_ms) against the time
// of what the device reads (st.tail_auto_t_res_ms), both per token at full context; false when the bandwidths are not
// known (link_how: where the link's came from, or why it is unknown)
static bool llama_rkv_auto_tail_times(llama_rkv_state & st, const llama_rkv_decide_in & in, bool head, ggml_type fk,
        ggml_type fv, std::string & link_how) {
    llama_rkv_retype_tail(st, fk, fv);
    double dev_bytes = 0.0, tail_bytes = 0.0;
    llama_rkv_token_bytes(st, head, st.window_cells, st.kv_size, dev_bytes, tail_bytes);

    llama_rkv_link_source(st);
    double link_bw = st.link_bw_gbps;
    link_how = st.link_bw_source;
    if (link_bw <= 0.0 && in.measure_link) {
        link_bw = in.measure_link(&link_how);
    }
    const bool known = !st.devs.empty() && st.mem_bw_gbps > 0.0 && link_bw > 0.0;
    if (known) {
        st.tail_auto_t_res_ms  = dev_bytes/(st.mem_bw_gbps*1e9)*1e3;
        st.tail_auto_t_link_ms = tail_bytes/(link_bw*1e9)*1e3;
    }
    return known;
}

bool llama_rkv_choose_tail_types(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.tail_auto_t_res_ms  = -1.0;
    st.tail_auto_t_link_ms = -1.0;

    const ggml_type req_k = st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail;
    const ggml_type req_v = st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail;

    if (!st.tail_auto_k && !st.tail_auto_v) {
        st.type_k_tail = req_k;
        st.type_v_tail = req_v;
        st.tail_types_reason = st.req.type_k_tail == GGML_TYPE_COUNT && st.req.type_v_tail == GGML_TYPE_COUNT ?
            "the window's types (none requested)" : "requested";
        return true;
    }

    const bool head = st.chosen == LLAMA_KV_RESIDENCY_HEAD;
    std::string notes;

    ggml_type fk, fv;
    if (!llama_rkv_auto_tail_floors(st, in, head, req_k, req_v, fk, fv, notes)) {
        return false;
    }

    std::string link_how;
    const bool known = llama_rkv_auto_tail_times(st, in, head, fk, fv, link_how);

    ggml_type ck = fk, cv = fv;
    char buf[512];
    if (known && st.tail_auto_t_link_ms > LLAMA_RKV_AUTO_TAIL_Q4_RATIO*st.tail_auto_t_res_ms) {
        for (const bool is_v : { false, true }) {
            ggml_type & c = is_v ? cv : ck;
            const ggml_type window = is_v ? st.type_v : st.type_k;
            if ((is_v ? st.tail_auto_v : st.tail_auto_k) &&
                llama_rkv_bytes_per_elem(window) > llama_rkv_bytes_per_elem(GGML_TYPE_Q4_0)) {
                if (llama_rkv_tail_type_fits(st, GGML_TYPE_Q4_0, is_v, head)) {
                    c = GGML_TYPE_Q4_0;
                } else {
                    notes += std::string("; ") + (is_v ? "V" : "K") + ": q4_0 blocks do not divide the " +
                             (head ? "KV heads" : "rows");
                }
            }
        }
        if (in.tail_op_unsupported && (ck != fk || cv != fv)) {
            const std::string why = in.tail_op_unsupported(ck, cv, head);
            if (!why.empty()) {
                notes += "; " + why;
                ck = fk;
                cv = fv;
            }
        }
        snprintf(buf, sizeof(buf),
                "auto: K %s, V %s: the tail's link-only time at %s/%s (%.3g ms/token at full context) exceeds %g x the "
                "resident time (%.3g ms)", ggml_type_name(ck), ggml_type_name(cv), ggml_type_name(fk),
                ggml_type_name(fv), st.tail_auto_t_link_ms, LLAMA_RKV_AUTO_TAIL_Q4_RATIO, st.tail_auto_t_res_ms);
    } else if (known) {
        snprintf(buf, sizeof(buf),
                "auto: K %s, V %s (the floor): the tail's link-only time (%.3g ms/token at full context) is within %g "
                "x the resident time (%.3g ms)", ggml_type_name(ck), ggml_type_name(cv), st.tail_auto_t_link_ms,
                LLAMA_RKV_AUTO_TAIL_Q4_RATIO, st.tail_auto_t_res_ms);
    } else {
        snprintf(buf, sizeof(buf),
                "auto: K %s, V %s (the floor): the link-only time cannot be weighed against the resident time (%s)",
                ggml_type_name(ck), ggml_type_name(cv),
                st.devs.empty() ? "no device was budgeted" : st.mem_bw_gbps <= 0.0 ? st.mem_bw_source.c_str()
                : link_how.c_str());
    }
    st.tail_types_reason = buf + notes;
    llama_rkv_retype_tail(st, ck, cv);
    return true;
}

uint32_t llama_rkv_estimate_tokens(const llama_rkv_state & st) {
    // unknown (a context made without llama_init_from_model_rolling_kv): llama_context_default_params' 512
    uint32_t n_tokens = st.n_ubatch > 0 ? st.n_ubatch : 512;
    if (st.n_ctx > 0) {
        n_tokens = std::min(n_tokens, st.n_ctx);
    }
    return n_tokens;
}

size_t llama_rkv_stream_mask_bytes(uint32_t n_tokens, uint32_t n_kv, uint32_t n_stream) {
    if (n_stream < 2) {
        return 0;
    }
    return (size_t) n_tokens*n_kv*sizeof(ggml_fp16_t);
}
