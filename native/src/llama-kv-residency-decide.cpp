// rollingkv: the KV residency planner's decision (see llama-kv-residency.h): resident, a window or a head split, from
// the request and the budget's inputs (llama_rkv_decide). No device access: the cache constructor
// (llama_rkv_plan_cache, llama-kv-residency.cpp) hands it the devices' figures and measurers, the planner's test
// harness (rollingkv/plan-simulate.cpp) given ones.
#include "llama-kv-residency.h"

#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>

//
// decision
//

static uint32_t llama_rkv_resident(llama_rkv_state & st, std::string reason, bool eligible = true) {
    st.chosen       = LLAMA_KV_RESIDENCY_OFF;
    st.reason       = std::move(reason);
    st.eligible     = eligible;
    st.window_cells = 0;
    st.tail_cells   = 0;
    st.type_k_tail  = st.type_k;
    st.type_v_tail  = st.type_v;
    st.tail_auto_t_res_ms  = -1.0;
    st.tail_auto_t_link_ms = -1.0;
    st.tail_types_reason = !st.error.empty() ? "refused (see error)" :
        st.tail_auto_k || st.tail_auto_v ? "auto: nothing spills (resident): the window's types" : "no tail (resident)";
    llama_rkv_heads_whole(st);
    return 0;
}

// the whole KV fits the budget (the vram_target's, or the free VRAM's when target <= 0): resident, saying so
static uint32_t llama_rkv_resident_fits(llama_rkv_state & st, int64_t target) {
    size_t kv = 0;
    for (const auto & d : st.devs) {
        kv += d.kv_resident;
    }
    char buf[160];
    snprintf(buf, sizeof(buf), "the whole KV (%.0f MiB) fits the %s budget: resident", llama_rkv_mib(kv),
            target > 0 ? "vram_target" : "free VRAM");
    return llama_rkv_resident(st, buf);
}

static void llama_rkv_log_budget(const llama_rkv_state & st) {
    for (const auto & d : st.devs) {
        char target[64];
        if (st.req.vram_target_mib > 0) {
            snprintf(target, sizeof(target), "target %" PRId64 " MiB", st.req.vram_target_mib);
        } else {
            snprintf(target, sizeof(target), "free %.0f MiB - reserve %.0f MiB", llama_rkv_mib(d.free),
                     llama_rkv_mib(st.reserve));
        }
        char recr[64] = "";
        if (d.recurrent) {
            snprintf(recr, sizeof(recr), " (recurrent state %.1f MiB)", llama_rkv_mib(d.recurrent));
        }
        LLAMA_LOG_INFO("%s: rolling KV: budget on %s: %s, weights %.0f MiB, compute ~%.0f MiB (estimate), other KV "
                "%.0f MiB%s, streaming ring %.0f MiB (%d x %.0f MiB), free %.0f MiB -> %.0f MiB for the KV window "
                "(%.3f MiB/cell); whole KV %.0f MiB; minimum vram_target %" PRId64 " MiB\n", __func__,
                d.name.c_str(), target, llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv),
                recr, llama_rkv_mib(d.ring), d.ring ? st.ring_slots : 0,
                d.ring ? llama_rkv_mib(st.ring_slot_size) : 0.0, llama_rkv_mib(d.free), llama_rkv_mib(d.kv_budget),
                llama_rkv_mib(d.cell_bytes), llama_rkv_mib(d.kv_resident), d.min_target_mib);
    }
    if (!st.devs.empty() && !st.compute_note.empty()) {
        LLAMA_LOG_INFO("%s: rolling KV: compute buffer estimate: %s\n", __func__, st.compute_note.c_str());
    }
}

// the vram_target terms of an explicit split (window cells or device heads): refused below what the device needs
// before any KV (st.error), a warning when the split's device bytes exceed the budget
static bool llama_rkv_check_explicit(llama_rkv_state & st, const llama_rkv_decide_in & in, const char * what,
        const std::function<size_t(const llama_rkv_dev_budget &, size_t)> & need_of) {
    const int64_t target = st.req.vram_target_mib;
    // the budget terms, for the plan; an explicit split needs no minimum
    llama_rkv_plan_budget(st);
    st.error.clear();
    for (size_t i = 0; i < st.devs.size(); ++i) {
        const auto & d = st.devs[i];
        const size_t fixed = d.weights + d.compute + d.other_kv + d.ring;
        if (target > 0 && (size_t) target*LLAMA_RKV_MIB < fixed) {
            char buf[512];
            snprintf(buf, sizeof(buf),
                    "vram_target %" PRId64 " MiB is below the minimum of %.0f MiB on %s before any KV: "
                    "weights %.0f MiB + compute buffers ~%.0f MiB (estimate) + other KV caches "
                    "%.0f MiB + streaming ring %.0f MiB", target, std::ceil(llama_rkv_mib(fixed)), d.name.c_str(),
                    llama_rkv_mib(d.weights), llama_rkv_mib(d.compute), llama_rkv_mib(d.other_kv),
                    llama_rkv_mib(d.ring));
            st.error = buf;
            if (!in.quiet) {
                llama_rkv_log_budget(st);
            }
            return false;
        }
        const size_t need = need_of(d, i);
        if (need > d.kv_budget && !in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: the explicit %s needs %.0f MiB on %s, %.0f MiB more than the budget\n",
                    __func__, what, llama_rkv_mib(need), d.name.c_str(), llama_rkv_mib(need - d.kv_budget));
        }
    }
    return true;
}

// a split was chosen (st.chosen, st.reason): the tail types, the link model, the hybrid tail's share and the logs;
// false (st.error set) when the tail types refuse the request
static bool llama_rkv_finish_split(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    st.eligible = true;

    // the link model: only a split needs the device's memory bandwidth (auto may have measured it already)
    if (!st.devs.empty() && in.measure && st.mem_bw_gbps <= 0.0) {
        st.mem_bw_gbps = in.measure(&st.mem_bw_source);
    }
    if (!llama_rkv_choose_tail_types(st, in)) {
        return false;
    }
    llama_rkv_plan_estimate(st);
    llama_rkv_plan_tail_cpu(st, in);

    if (!in.quiet && !st.devs.empty()) {
        LLAMA_LOG_INFO("%s: rolling KV: device memory bandwidth %.1f GB/s (%s); link %.2f GB/s (%s)\n", __func__,
                st.mem_bw_gbps, st.mem_bw_source.c_str(), st.link_bw_gbps, st.link_bw_source.c_str());
        if (st.t_token_ms >= 0.0) {
            LLAMA_LOG_INFO("%s: rolling KV: expected %.2f ms/token at full context = %.2f ms resident (%.0f MiB at "
                    "%.1f GB/s) + %.2f ms tail (%.0f MiB at %.2f GB/s)\n", __func__, st.t_token_ms,
                    st.t_resident_ms, st.est_device_bytes/LLAMA_RKV_MIB, st.mem_bw_gbps,
                    st.t_tail_ms, st.est_tail_bytes/LLAMA_RKV_MIB, st.link_bw_gbps);
        } else {
            LLAMA_LOG_INFO("%s: rolling KV: no ms/token estimate (%s)\n", __func__,
                    st.mem_bw_gbps <= 0.0 ? st.mem_bw_source.c_str() : st.link_bw_source.c_str());
        }
        LLAMA_LOG_INFO("%s: rolling KV: CPU part of the tail: %.3f (%s)%s\n", __func__, st.tail_cpu_frac,
                st.tail_cpu_reason.c_str(), st.t_token_hybrid_ms >= 0.0
                ? (", expected " + std::to_string(st.t_token_hybrid_ms) + " ms/token").c_str() : "");
        if (st.layer_decode_ms >= 0.0) {
            LLAMA_LOG_INFO("%s: rolling KV: per layer, decode beyond its bytes %.3f ms (%s); a CPU part %.3f ms (%s)\n",
                    __func__, st.layer_decode_ms, st.layer_decode_source.c_str(), st.cpu_part_latency_ms,
                    st.cpu_part_latency_source.c_str());
        }
        if (!st.auto_reason.empty()) {
            LLAMA_LOG_INFO("%s: rolling KV: %s\n", __func__, st.auto_reason.c_str());
        }
        if (st.tail_auto_k || st.tail_auto_v) {
            LLAMA_LOG_INFO("%s: rolling KV: tail types K %s, V %s (%s)\n", __func__, ggml_type_name(st.type_k_tail),
                    ggml_type_name(st.type_v_tail), st.tail_types_reason.c_str());
        }
    }
    return true;
}

static uint32_t llama_rkv_choose_window(llama_rkv_state & st, uint32_t wc, std::string reason) {
    st.chosen       = LLAMA_KV_RESIDENCY_WINDOW;
    st.window_cells = wc;
    st.tail_cells   = st.kv_size - wc;
    st.reason       = std::move(reason);
    llama_rkv_heads_whole(st);
    return wc;
}

static void llama_rkv_choose_head(llama_rkv_state & st, std::string reason) {
    // every cell of the host heads is "tail"
    st.chosen       = LLAMA_KV_RESIDENCY_HEAD;
    st.window_cells = 0;
    st.tail_cells   = st.kv_size;
    st.reason       = std::move(reason) + " (" + llama_rkv_heads_summary(st) + ")";
}

// auto's margin: head must be this much cheaper than the window at full context (the window streams less at any shorter
// context, and nothing while a sequence fits it)
static const double LLAMA_RKV_HEAD_MARGIN = 0.97;

// a tactic's cost at full context (and its tail bytes at half context) from the current plan in st
static llama_rkv_tactic_cost llama_rkv_tactic(const llama_rkv_state & st, bool head, uint32_t wc) {
    llama_rkv_tactic_cost c;
    c.valid = true;
    llama_rkv_token_bytes(st, head, wc, st.kv_size, c.device_bytes, c.tail_bytes);
    llama_rkv_token_bytes(st, head, wc, st.kv_size, c.device_bytes_mean, c.tail_bytes_mean, true);
    c.t_token_ms      = llama_rkv_token_ms(c.device_bytes, c.tail_bytes, st.mem_bw_gbps, st.link_bw_gbps);
    c.t_token_mean_ms = llama_rkv_token_ms(c.device_bytes_mean, c.tail_bytes_mean, st.mem_bw_gbps, st.link_bw_gbps);
    return c;
}

// the head split of a request that asks for it (mode head, or auto with device_heads)
static uint32_t llama_rkv_decide_head(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;
    const int64_t target = req.vram_target_mib;

    st.reserve = target > 0 ? 0 : in.reserve;

    if (req.device_heads > 0) {
        const uint32_t n = (uint32_t) req.device_heads;
        uint32_t n_max = 0;
        bool any = false;
        for (auto & hl : st.head_layers) {
            hl.device_heads = std::min(n, hl.n_head_kv);
            any   = any || hl.device_heads < hl.n_head_kv;
            n_max = std::max(n_max, hl.n_head_kv);
        }
        if (!any) {
            st.devs.clear();
            if (st.tail_auto_k || st.tail_auto_v) {
                st.error = "device_heads " + std::to_string(n) + " keeps every KV head on the device (" +
                    std::to_string(n_max) +
                    " per layer): nothing spills, so auto has no tail to choose a type for; give fewer device heads, "
                    "or a tail type";
                return llama_rkv_resident(st, st.error);
            }
            return llama_rkv_resident(st, "device_heads " + std::to_string(n) + " >= the KV heads of every layer (" +
                    std::to_string(n_max) + "): the whole cache on the device (resident)");
        }
        if (!in.head_op_unsupported.empty() && !in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: %s: the op runs on the CPU, the device heads' results are copied every "
                    "step\n", __func__, in.head_op_unsupported.c_str());
        }
        st.heads_explicit = true;
        if (!st.devs.empty()) {
            const auto heads = st.head_layers; // the budget does not change them
            if (!llama_rkv_check_explicit(st, in, "head split", [&](const llama_rkv_dev_budget &, size_t i) {
                        return llama_rkv_head_dev_bytes(st, (int32_t) i); })) {
                return llama_rkv_resident(st, st.error);
            }
            st.head_layers = heads;
            for (size_t i = 0; i < st.devs.size(); ++i) {
                st.devs[i].head_kv_bytes = llama_rkv_head_dev_bytes(st, (int32_t) i);
            }
        }
        llama_rkv_choose_head(st, std::string(llama_rkv_mode_name(req.mode)) + ": explicit " + std::to_string(n) +
                " device KV heads per layer");
        if (!llama_rkv_finish_split(st, in)) {
            return llama_rkv_resident(st, st.error);
        }
        return 0;
    }

    if (st.devs.empty()) {
        return llama_rkv_resident(st, in.no_device.empty() ? "no device to budget: resident" : in.no_device);
    }
    if (in.host_memory && target <= 0) {
        st.devs.clear();
        return llama_rkv_resident(st,
                                  "no GPU and no vram_target: resident (a vram_target sizes a head split in host "
                                  "memory)");
    }
    if (!in.head_op_unsupported.empty()) {
        st.devs.clear();
        return llama_rkv_resident(st, in.head_op_unsupported + ": resident", false);
    }

    st.budgeted = true;
    const uint32_t wc = llama_rkv_plan_budget(st);
    const bool fits = wc == 0 && st.error.empty();
    st.error.clear();
    if (!fits) {
        llama_rkv_plan_heads(st);
    }
    st.min_target_mib = 0;
    for (const auto & d : st.devs) {
        st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib_head);
    }
    if (!in.quiet) {
        llama_rkv_log_budget(st);
    }
    if (fits) {
        return llama_rkv_resident_fits(st, target);
    }
    if (!st.error.empty()) {
        return llama_rkv_resident(st, st.error);
    }
    llama_rkv_choose_head(st, std::string("head: the most KV heads per layer that fit the ") +
            (target > 0 ? "vram_target" : "free VRAM") + " budget");
    if (!llama_rkv_finish_split(st, in)) {
        return llama_rkv_resident(st, st.error);
    }
    return 0;
}

// the window of a request that gives its cells (st.reserve set): checked against the vram_target's terms, not sized by
// them
static uint32_t llama_rkv_decide_window_explicit(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;
    const uint32_t wc = (uint32_t) req.window_cells;
    if (!st.devs.empty() && !llama_rkv_check_explicit(st, in, "window", [wc](const llama_rkv_dev_budget & d, size_t) {
                return (size_t) (wc + 1)*d.cell_bytes; })) {
        return llama_rkv_resident(st, st.error);
    }
    char buf[256];
    snprintf(buf, sizeof(buf), "%s: explicit window of %u cells", llama_rkv_mode_name(req.mode), wc);
    llama_rkv_choose_window(st, wc, buf);
    if (!llama_rkv_finish_split(st, in)) {
        return llama_rkv_resident(st, st.error);
    }
    return wc;
}

// auto with a budget that does not hold the whole KV (wc: the budget's window, st.error: why none fits): the window
// against the head split (st.cost_window, st.cost_head, st.auto_reason); true: take the head split, whose layers'
// device heads and minimum targets are then in st
static bool llama_rkv_auto_compare(llama_rkv_state & st, const llama_rkv_decide_in & in, uint32_t wc) {
    bool head = false;
    const std::string err_window = st.error;
    st.error.clear();
    st.auto_compared = true;

    if (err_window.empty()) {
        st.cost_window = llama_rkv_tactic(st, false, wc);
    } else {
        st.cost_window.why_not = err_window;
    }
    if (!st.head_refuse.empty()) {
        st.cost_head.why_not = st.head_refuse;
    } else if (!in.head_op_unsupported.empty()) {
        st.cost_head.why_not = in.head_op_unsupported;
    } else if (!llama_rkv_plan_heads(st)) {
        st.cost_head.why_not = st.error;
        st.error.clear();
    } else {
        st.cost_head = llama_rkv_tactic(st, true, 0);
    }

    if (st.cost_window.valid && st.cost_head.valid) {
        // both fit: compare them where they cost most, at full context (the time model when both bandwidths are known)
        if (in.measure && st.mem_bw_gbps <= 0.0) {
            st.mem_bw_gbps = in.measure(&st.mem_bw_source);
        }
        llama_rkv_link_source(st);
        st.cost_window = llama_rkv_tactic(st, false, wc);
        st.cost_head   = llama_rkv_tactic(st, true, 0);
        const bool by_time = st.cost_window.t_token_ms > 0.0 && st.cost_head.t_token_ms > 0.0;
        const double w      = by_time ? st.cost_window.t_token_ms      : st.cost_window.tail_bytes;
        const double h      = by_time ? st.cost_head.t_token_ms        : st.cost_head.tail_bytes;
        const double w_mean = by_time ? st.cost_window.t_token_mean_ms : st.cost_window.tail_bytes_mean;
        const double h_mean = by_time ? st.cost_head.t_token_mean_ms   : st.cost_head.tail_bytes_mean;
        head = h < LLAMA_RKV_HEAD_MARGIN*w && h_mean < LLAMA_RKV_HEAD_MARGIN*w_mean;
        const double unit = by_time ? 1.0 : (double) LLAMA_RKV_MIB;
        const char * what = by_time ? "ms/token" : "MiB streamed/token";
        char buf[640];
        snprintf(buf, sizeof(buf),
                "auto: %s: the head split %.3g %s at full context and %.3g on average over a sequence growing to it, "
                "the window %.3g and %.3g (head is taken only where it is more than 3 %% cheaper on both: the window "
                "streams nothing while a sequence fits it)", head ? "head" : "window", h/unit, what, h_mean/unit,
                w/unit, w_mean/unit);
        st.auto_reason = buf;
    } else if (st.cost_head.valid) {
        head = true;
        st.auto_reason = "auto: head, the window does not fit (" + err_window + ")";
    } else {
        st.auto_reason = "auto: window, no head split (" + st.cost_head.why_not + ")";
        st.error = err_window;
    }
    if (head) {
        st.min_target_mib = 0;
        for (auto & d : st.devs) {
            d.min_target_mib  = std::min(d.min_target_mib, d.min_target_mib_head);
            st.min_target_mib = std::max(st.min_target_mib, d.min_target_mib);
        }
    } else {
        llama_rkv_heads_whole(st);
    }
    return head;
}

// a window or head split sized by the budget (auto or window mode, no explicit window): resident when the whole cache
// fits, else the window (or, in auto, the head split where it is cheaper) that fits the budget of target MiB (0: the
// free VRAM)
static uint32_t llama_rkv_decide_budgeted(llama_rkv_state & st, const llama_rkv_decide_in & in, int64_t target) {
    const auto & req = st.req;

    st.budgeted = true;
    const uint32_t wc = llama_rkv_plan_budget(st);
    const bool fits = wc == 0 && st.error.empty();

    // auto: the head split is the other candidate where this cache can split by head
    const bool head = !fits && req.mode == LLAMA_KV_RESIDENCY_AUTO && llama_rkv_auto_compare(st, in, wc);

    if (!in.quiet) {
        llama_rkv_log_budget(st);
    }
    if (!st.error.empty()) {
        return llama_rkv_resident(st, st.error);
    }
    if (fits) {
        return llama_rkv_resident_fits(st, target);
    }

    if (head) {
        llama_rkv_choose_head(st, std::string("auto: the most KV heads per layer that fit the ") +
                (target > 0 ? "vram_target" : "free VRAM") + " budget");
        if (!llama_rkv_finish_split(st, in)) {
            return llama_rkv_resident(st, st.error);
        }
        return 0;
    }

    char buf[256];
    snprintf(buf, sizeof(buf), "%s: window of %u cells, the largest multiple of %u that fits the %s budget",
            llama_rkv_mode_name(req.mode), wc, LLAMA_RKV_WINDOW_ALIGN, target > 0 ? "vram_target" : "free VRAM");
    llama_rkv_choose_window(st, wc, buf);
    if (!llama_rkv_finish_split(st, in)) {
        return llama_rkv_resident(st, st.error);
    }
    return wc;
}

static uint32_t llama_rkv_decide_impl(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const auto & req = st.req;

    st.error.clear();
    st.budgeted       = false;
    st.heads_explicit = false;
    st.auto_compared  = false;
    st.auto_reason.clear();
    st.cost_window = {};
    st.cost_head   = {};

    const bool tail_auto = st.tail_auto_k || st.tail_auto_v;
    if (tail_auto) {
        // plan at the window's types (a plan made before on this state may have left the chosen ones)
        llama_rkv_retype_tail(st, st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail,
                st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail);
    }

    // the answers that need no budget report none
    if (req.mode == LLAMA_KV_RESIDENCY_OFF) {
        st.devs.clear();
        if (tail_auto) {
            st.error = "auto tail types choose the type of a split's tail, and mode off never splits: use mode auto or "
                       "window, or give the tail a type";
            return llama_rkv_resident(st, st.error);
        }
        return llama_rkv_resident(st, "mode off: the upstream resident cache");
    }
    if (in.refuse) {
        st.devs.clear();
        return llama_rkv_resident(st, in.refuse, false);
    }

    // head mode, or auto with explicit device heads
    if (req.mode == LLAMA_KV_RESIDENCY_HEAD || (req.mode == LLAMA_KV_RESIDENCY_AUTO && req.device_heads > 0)) {
        if (!st.head_refuse.empty()) {
            st.devs.clear();
            st.error = "the head split is not possible for this model: " + st.head_refuse;
            return llama_rkv_resident(st, st.error, false);
        }
        return llama_rkv_decide_head(st, in);
    }

    const bool explicit_wc = req.window_cells > 0;

    if (explicit_wc && (uint64_t) req.window_cells >= st.kv_size) {
        st.devs.clear();
        if (tail_auto) {
            st.error = "window_cells " + std::to_string(req.window_cells) + " holds the whole cache (" +
                std::to_string(st.kv_size) +
                " cells per stream): nothing spills, so auto has no tail to choose a type for; give a smaller window, "
                "or a tail type";
            return llama_rkv_resident(st, st.error);
        }
        return llama_rkv_resident(st, "window_cells >= kv_size: the whole cache is the window (resident)");
    }

    if (!in.op_unsupported.empty()) {
        if (!explicit_wc) {
            st.devs.clear();
            return llama_rkv_resident(st, in.op_unsupported + ": resident", false);
        }
        if (!in.quiet) {
            LLAMA_LOG_WARN("%s: rolling KV: %s: the op runs on the CPU, the window is copied to the host every step\n",
                    __func__, in.op_unsupported.c_str());
        }
    }

    const int64_t target = req.vram_target_mib;
    st.reserve = target > 0 ? 0 : in.reserve;

    if (explicit_wc) {
        return llama_rkv_decide_window_explicit(st, in);
    }

    if (st.devs.empty()) {
        return llama_rkv_resident(st, in.no_device.empty() ? "no device to budget: resident" : in.no_device);
    }
    if (in.host_memory && target <= 0) {
        st.devs.clear();
        return llama_rkv_resident(st,
                                  "no GPU and no vram_target: resident (a vram_target sizes a window in host memory)");
    }

    return llama_rkv_decide_budgeted(st, in, target);
}

uint32_t llama_rkv_decide(llama_rkv_state & st, const llama_rkv_decide_in & in) {
    const uint32_t wc = llama_rkv_decide_impl(st, in);
    if (!llama_rkv_is_split(st)) {
        // a resident plan still reports the link it would have planned with
        llama_rkv_plan_estimate(st);
    }
    return wc;
}
