// rollingkv: the KV residency planner on figures given as JSON, for the tests (no model, no device).
//
// Not part of libllama: a small library of its own (librollingkv-plan-sim, built with the op tests), which the Python
// tests load through ctypes next to libllama (rollingkv_cli/llama_ext.py, Extension.simulate_plan). It runs the
// library's own decision (llama_rkv_decide, llama-kv-residency.h) on a llama_rkv_state filled from the figures and
// writes the plan as llama_rolling_kv_plan_json does. A device that is not host memory is modelled as a CUDA device:
// its ring and runtime memory default to what the CUDA backend reports (ggml-cuda/rolling-kv-budget.h, from the
// ROLLINGKV_SLOTS / ROLLINGKV_SLOT_MIB / ROLLINGKV_RUNTIME_MIB knobs of the process, read once).
//
//   int32_t rollingkv_plan_simulate(const char * json_in, char * buf, size_t buf_size);
//
// Input: a JSON object with mode ("auto"), vram_target_mib (0), window_cells (0), pcie_bw_gbps (0), type_k_tail,
// type_v_tail, kv_size*, n_stream (1), n_ubatch (512: a GPU's compute_mib gains the per-stream mask copy of
// llama_rkv_stream_mask_bytes for it), n_layer*, n_embd_k_gqa*, n_embd_v_gqa*, type_k ("f16"), type_v ("f16"), device
// ("GPU0"), host_memory (false), free_mib, weights_mib, compute_mib, other_kv_mib, recurrent_mib (a hybrid model's
// recurrent state, counted with the other caches and reported on its own), ring_mib (default: the CUDA ring; 0 for host
// memory), runtime_mib (default: the CUDA runtime's; 0 for host memory), reserve_mib (the default reserve), mem_bw_gbps
// (the device memory bandwidth a measurement would give; <= 0: none), tail_cpu_frac (the request default, -1 = auto; 0:
// off), cpu_attn_gbps (the request's CPU attention bandwidth, 0), cpu_attn_measured_gbps and link_measured_gbps (what
// the hybrid tail's calibrations would give; <= 0: none), cpu_attn_measured_gbps_2, _4 and _8 (the CPU calibration at 2,
// 4 and 8 query rows per cell; <= 0: none), layer_decode_measured_ms and cpu_part_latency_measured_ms
// (what the device's per-layer probes would give; < 0: none, the planner's constants), head_k and head_v (128),
// n_threads (0), refuse (a reason the cache is not eligible), devices (optional list of objects with name, n_layer,
// free_mib, weights_mib, compute_mib, other_kv_mib, recurrent_mib, ring_mib, runtime_mib, host_memory: one per device,
// layers split in order), device_heads (the request's, 0), n_head_kv (a number, or a list with one per layer whose K/V
// rows are then n_head_kv x head_k/head_v elements; default n_embd_k_gqa/head_k), refuse_head (a reason the cache
// cannot split by head, e.g. ALiBi; a layer with one KV head or a head size no cache type's block divides refuses by
// itself). type_k_tail/type_v_tail may be "auto" (the planner chooses the split's tail type); op_unsupported_tails (a
// list of type names) models a device whose streaming op refuses tails of those types. (*: required.) Output: the plan
// as llama_rolling_kv_plan_json writes it, plus "simulated": true; a refused request has mode_chosen "refused" and the
// message in "error"; invalid input gives {"error": ..., "invalid_input": true}. Returns the full length (excluding
// NUL; at most buf_size bytes are written, NUL included), or -1 if json_in is NULL.

#include "llama-kv-residency.h"
#include "llama-rolling-kv-internal.h"

#include "ggml-cuda/rolling-kv-budget.h"
#include "ggml-rolling-kv.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(_WIN32)
#define RKV_SIM_API extern "C" __declspec(dllexport)
#else
#define RKV_SIM_API extern "C" __attribute__((visibility("default")))
#endif

namespace {

using rkv_json = nlohmann::ordered_json; // ordered: "unknown key" names the first one in the input

// parses the input (no exceptions: "" or why it is not valid); refuses duplicate keys, numbers out of the double range
// and more than 16 levels of nesting, as the planner's input is a flat object with a list or two
std::string rkv_parse(const char * json_in, rkv_json & out) {
    std::string err;
    std::vector<std::vector<std::string>> keys; // the keys of each object being parsed
    const rkv_json::parser_callback_t cb = [&](int depth, rkv_json::parse_event_t event, rkv_json & parsed) {
        if (!err.empty()) {
            return true;
        }
        switch (event) {
            case rkv_json::parse_event_t::object_start:
            case rkv_json::parse_event_t::array_start:
                if (depth > 16) {
                    err = "nested too deep";
                }
                if (event == rkv_json::parse_event_t::object_start) {
                    keys.emplace_back();
                }
                break;
            case rkv_json::parse_event_t::object_end:
                keys.pop_back();
                break;
            case rkv_json::parse_event_t::key: {
                const std::string key = parsed.get<std::string>();
                auto & seen = keys.back();
                if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
                    err = "duplicate key " + key;
                }
                seen.push_back(key);
            } break;
            case rkv_json::parse_event_t::value:
                if (parsed.is_number_float() && !std::isfinite(parsed.get<double>())) {
                    err = "bad number";
                }
                break;
            default:
                break;
        }
        return true;
    };
    out = rkv_json::parse(json_in, cb, /* allow_exceptions */ false);
    if (!err.empty()) {
        return err;
    }
    if (out.is_discarded()) {
        return "not valid JSON";
    }
    return "";
}

// typed reads of the input object that refuse wrong types and remember every key read
struct rkv_jreader {
    using is_t = bool (rkv_json::*)() const noexcept;

    const rkv_json & o;
    std::string      err;
    std::vector<std::string> known;

    // the value of key, nullptr when absent or null
    const rkv_json * get(const char * key) const {
        const auto it = o.find(key);
        return it == o.end() || it->is_null() ? nullptr : &*it;
    }

    const rkv_json * at(const char * key, is_t is, const char * what) {
        known.push_back(key);
        const rkv_json * v = get(key);
        if (!v) {
            return nullptr;
        }
        if (!(v->*is)() && err.empty()) {
            err = std::string(key) + " must be " + what;
            return nullptr;
        }
        return (v->*is)() ? v : nullptr;
    }

    double num(const char * key, double def, bool required = false) {
        const rkv_json * v = at(key, &rkv_json::is_number, "a number");
        if (!v) {
            if (required && err.empty()) {
                err = std::string(key) + " is required";
            }
            return def;
        }
        return v->get<double>();
    }

    // a count: a non-negative integer
    uint64_t count(const char * key, uint64_t def, bool required = false) {
        const double v = num(key, (double) def, required);
        if (v < 0 || v != std::floor(v) || v > 9.0e15) {
            if (err.empty()) {
                err = std::string(key) + " must be a non-negative integer";
            }
            return def;
        }
        return (uint64_t) v;
    }

    size_t mib(const char * key, size_t def_bytes) {
        const double v = num(key, -1.0);
        if (!get(key)) {
            return def_bytes;
        }
        if (v < 0) {
            if (err.empty()) {
                err = std::string(key) + " must be >= 0";
            }
            return def_bytes;
        }
        return (size_t) std::llround(v*LLAMA_RKV_MIB);
    }

    std::string str(const char * key, const std::string & def) {
        const rkv_json * v = at(key, &rkv_json::is_string, "a string");
        return v ? v->get<std::string>() : def;
    }

    bool flag(const char * key, bool def) {
        const rkv_json * v = at(key, &rkv_json::is_boolean, "true or false");
        return v ? v->get<bool>() : def;
    }

    std::string unknown_key() const {
        for (const auto & kv : o.items()) {
            if (std::find(known.begin(), known.end(), kv.key()) == known.end()) {
                return kv.key();
            }
        }
        return "";
    }
};

ggml_type rkv_type_from_name(const std::string & s) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * name = ggml_type_name((ggml_type) t);
        if (name && s == name) {
            return (ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}

std::string rkv_invalid(const std::string & why) {
    return "{\"error\":" + llama_rkv_json_str("invalid input: " + why) + ",\"invalid_input\":true}";
}

} // namespace

static std::string rkv_plan_simulate(const char * json_in) {
    rkv_json in;
    {
        const std::string err = rkv_parse(json_in, in);
        if (!err.empty()) {
            return rkv_invalid(err);
        }
        if (!in.is_object()) {
            return rkv_invalid("expected an object");
        }
    }

    rkv_jreader r { in, "", {} };

    llama_rkv_state st;
    st.req = llama_rolling_kv_default_params();

    const std::string mode = r.str("mode", "auto");
    const int32_t mode_i = llama_kv_residency_mode_from_str(mode.c_str());
    if (mode_i < 0) {
        return rkv_invalid("unknown mode " + mode);
    }
    st.req.mode            = (llama_kv_residency_mode) mode_i;
    st.req.vram_target_mib = (int64_t) r.count("vram_target_mib", 0);
    st.req.window_cells    = (int64_t) r.count("window_cells", 0);
    st.req.pcie_bw_gbps    = (float) r.num("pcie_bw_gbps", 0.0);
    st.req.tail_cpu_frac   = (float) r.num("tail_cpu_frac", st.req.tail_cpu_frac); // the request default (auto); 0: off
    // the CPU part's attention bandwidth; <= 0: none given
    st.req.cpu_attn_gbps   = (float) r.num("cpu_attn_gbps", 0.0);
    st.req.device_heads    = (int32_t) r.count("device_heads", 0);
    st.head_k    = (int64_t) r.count("head_k", 128);
    st.head_v    = (int64_t) r.count("head_v", 128);
    st.n_threads = (int32_t) r.count("n_threads", 0);
    const double cpu_attn_measured = r.num("cpu_attn_measured_gbps", -1.0); // what a calibration would give
    const double cpu_attn_rows[3]  = { r.num("cpu_attn_measured_gbps_2", -1.0), r.num("cpu_attn_measured_gbps_4", -1.0),
                                       r.num("cpu_attn_measured_gbps_8", -1.0) }; // and at 2, 4 and 8 rows
    const double link_measured     = r.num("link_measured_gbps", -1.0);     // what a pinned-copy measurement would give
    // what the device's layer probe would give
    const double layer_measured    = r.num("layer_decode_measured_ms", -1.0);
    // what its backend's CPU-part probe would
    const double latency_measured  = r.num("cpu_part_latency_measured_ms", -1.0);

    st.kv_size  = (uint32_t) r.count("kv_size", 0, true);
    st.n_stream = (uint32_t) r.count("n_stream", 1);
    st.n_ubatch = (uint32_t) r.count("n_ubatch", 512);

    const uint32_t n_layer      = (uint32_t) r.count("n_layer", 0, true);
    const uint64_t n_embd_k_gqa = r.count("n_embd_k_gqa", 0, true);
    const uint64_t n_embd_v_gqa = r.count("n_embd_v_gqa", 0, true);

    st.type_k = rkv_type_from_name(r.str("type_k", "f16"));
    st.type_v = rkv_type_from_name(r.str("type_v", "f16"));
    const std::string tkt = r.str("type_k_tail", "");
    const std::string tvt = r.str("type_v_tail", "");
    st.req.type_k_tail = tkt.empty() ? GGML_TYPE_COUNT : tkt == "auto" ? LLAMA_ROLLING_KV_TAIL_TYPE_AUTO
                         : rkv_type_from_name(tkt);
    st.req.type_v_tail = tvt.empty() ? GGML_TYPE_COUNT : tvt == "auto" ? LLAMA_ROLLING_KV_TAIL_TYPE_AUTO
                         : rkv_type_from_name(tvt);
    // as llama_init_from_model_rolling_kv: the cache describes itself at the window's types, the planner chooses the
    // tail's
    llama_rkv_take_auto_tail(st);
    const bool k_auto_given = st.tail_auto_k;
    const bool v_auto_given = st.tail_auto_v;
    std::vector<ggml_type> op_unsupported;
    {
        const rkv_json * u = r.at("op_unsupported_tails", &rkv_json::is_array, "a list of type names");
        for (size_t i = 0; u && i < u->size(); ++i) {
            const ggml_type t = (*u)[i].is_string() ? rkv_type_from_name((*u)[i].get<std::string>()) : GGML_TYPE_COUNT;
            if (t == GGML_TYPE_COUNT) {
                return rkv_invalid("op_unsupported_tails must list type names");
            }
            op_unsupported.push_back(t);
        }
    }

    const std::string dev_name    = r.str("device", "GPU0");
    const bool        host_memory = r.flag("host_memory", false);
    const size_t      ring_unset  = (size_t) -1; // default: the ring the CUDA op would allocate (needs the row sizes)

    llama_rkv_dev_budget base;
    base.name        = dev_name;
    base.host_memory = host_memory;
    base.free        = r.mib("free_mib", 0);
    base.weights     = r.mib("weights_mib", 0);
    base.compute     = r.mib("compute_mib", 0);
    base.other_kv    = r.mib("other_kv_mib", 0);
    base.recurrent   = r.mib("recurrent_mib", 0);  // a hybrid model's recurrent state: counted with the other caches
    base.ring        = r.mib("ring_mib", ring_unset);
    const size_t runtime_unset = (size_t) -1; // default: the library's GPU runtime reserve on a GPU, 0 in host memory
    base.runtime     = r.mib("runtime_mib", runtime_unset);
    const size_t reserve = r.mib("reserve_mib", LLAMA_RKV_VRAM_RESERVE);

    const double mem_bw = r.num("mem_bw_gbps", -1.0);
    const std::string refuse = r.str("refuse", "");

    const rkv_json * devs = r.at("devices", &rkv_json::is_array, "a list of objects");
    const std::string refuse_head = r.str("refuse_head", "");
    // n_head_kv: a number or a list (one per layer)
    std::vector<uint64_t> heads_of;
    {
        r.known.push_back("n_head_kv");
        const rkv_json * h = r.get("n_head_kv");
        if (h && h->is_number()) {
            const double n = h->get<double>();
            heads_of.assign(1, (uint64_t) std::max(0.0, n));
            if (n < 1 || n != std::floor(n)) {
                return rkv_invalid("n_head_kv must be a positive integer or a list of them");
            }
        } else if (h && h->is_array()) {
            for (const auto & e : *h) {
                if (!e.is_number() || e.get<double>() < 1 || e.get<double>() != std::floor(e.get<double>())) {
                    return rkv_invalid("n_head_kv must be a positive integer or a list of them");
                }
                heads_of.push_back((uint64_t) e.get<double>());
            }
        } else if (h) {
            return rkv_invalid("n_head_kv must be a positive integer or a list of them");
        }
    }

    if (!r.err.empty()) {
        return rkv_invalid(r.err);
    }
    if (!r.unknown_key().empty()) {
        return rkv_invalid("unknown key " + r.unknown_key());
    }
    if (st.kv_size == 0 || n_layer == 0 || n_embd_k_gqa == 0 || n_embd_v_gqa == 0 || st.n_stream == 0) {
        return rkv_invalid("kv_size, n_stream, n_layer, n_embd_k_gqa and n_embd_v_gqa must be > 0");
    }
    for (ggml_type t : { st.type_k, st.type_v }) {
        if (t == GGML_TYPE_COUNT) {
            return rkv_invalid("unknown type_k or type_v");
        }
    }
    for (ggml_type t : { st.req.type_k_tail, st.req.type_v_tail }) {
        if (t != GGML_TYPE_COUNT && !ggml_rkv_tail_type_supported(t)) {
            return rkv_invalid("unsupported tail type");
        }
    }
    if ((!tkt.empty() && !k_auto_given && st.req.type_k_tail == GGML_TYPE_COUNT) ||
        (!tvt.empty() && !v_auto_given && st.req.type_v_tail == GGML_TYPE_COUNT)) {
        return rkv_invalid("unknown tail type");
    }

    const ggml_type type_k_tail = st.req.type_k_tail == GGML_TYPE_COUNT ? st.type_k : st.req.type_k_tail;
    const ggml_type type_v_tail = st.req.type_v_tail == GGML_TYPE_COUNT ? st.type_v : st.req.type_v_tail;

    for (const auto & [t, n] : { std::make_pair(st.type_k, n_embd_k_gqa), std::make_pair(st.type_v, n_embd_v_gqa),
                                 std::make_pair(type_k_tail, n_embd_k_gqa),
                                 std::make_pair(type_v_tail, n_embd_v_gqa) }) {
        if (n % ggml_blck_size(t) != 0) {
            return rkv_invalid(std::string("the K/V row size is not a multiple of the block size of ") +
                               ggml_type_name(t));
        }
    }

    // a GPU device is modelled as a CUDA device: the ring and the runtime memory the CUDA backend reports
    ggml_rkv_dev_budget cuda;
    ggml_cuda_rkv_dev_budget_of(ggml_row_size(type_k_tail, n_embd_k_gqa), ggml_row_size(type_v_tail, n_embd_v_gqa),
                                st.n_stream, &cuda);
    if (base.ring == ring_unset) {
        if (!host_memory) {
            st.ring_slots     = cuda.ring_slots;
            st.ring_slot_size = cuda.ring_slot_bytes;
        }
        base.ring = host_memory ? 0 : (size_t) cuda.ring_slots*cuda.ring_slot_bytes;
    }

    // the layers' KV heads: one count for all, a list (K/V rows of n_head_kv x head_k/head_v), or from the row size
    if (heads_of.size() > 1 && heads_of.size() != n_layer) {
        return rkv_invalid("n_head_kv must list one count per layer (n_layer)");
    }
    if (heads_of.empty()) {
        if (st.head_k <= 0 || st.head_v <= 0 || n_embd_k_gqa % st.head_k != 0 || n_embd_v_gqa % st.head_v != 0 ||
                n_embd_k_gqa/st.head_k != n_embd_v_gqa/st.head_v) {
            return rkv_invalid("n_embd_k_gqa/head_k and n_embd_v_gqa/head_v must be one whole number of KV heads (or "
                               "give n_head_kv)");
        }
        heads_of.assign(1, n_embd_k_gqa/st.head_k);
    }
    auto heads = [&](uint32_t il) { return (uint32_t) heads_of[heads_of.size() == 1 ? 0 : il]; };
    const bool per_layer_heads = heads_of.size() > 1;
    if (per_layer_heads) {
        for (ggml_type t : { st.type_k, type_k_tail }) {
            if (st.head_k % ggml_blck_size(t) != 0) {
                return rkv_invalid(std::string("head_k is not a multiple of the block size of ") + ggml_type_name(t));
            }
        }
        for (ggml_type t : { st.type_v, type_v_tail }) {
            if (st.head_v % ggml_blck_size(t) != 0) {
                return rkv_invalid(std::string("head_v is not a multiple of the block size of ") + ggml_type_name(t));
            }
        }
    }

    // one layer's K+V bytes per cell and stream, as the cache constructor counts them
    std::vector<size_t> row_w(n_layer), row_t(n_layer), conv(n_layer);
    for (uint32_t il = 0; il < n_layer; ++il) {
        const uint64_t nk = per_layer_heads ? heads(il)*st.head_k : n_embd_k_gqa;
        const uint64_t nv = per_layer_heads ? heads(il)*st.head_v : n_embd_v_gqa;
        row_w[il] = ggml_row_size(st.type_k, nk) + ggml_row_size(st.type_v, nv);
        row_t[il] = ggml_row_size(type_k_tail, nk) + ggml_row_size(type_v_tail, nv);
        conv[il]  = (st.type_k != GGML_TYPE_F16 ? nk*2 : 0) + (st.type_v != GGML_TYPE_F16 ? nv*2 : 0);
    }

    // the head split's layers, as the cache constructor describes them (llama_kv_cache::rkv_plan)
    st.head_refuse = refuse_head;
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (heads(il) < 2) {
            st.head_refuse = "a layer with one KV head (MQA) cannot be split by head";
        } else if (st.head_k % ggml_blck_size(st.type_k) != 0 || st.head_k % ggml_blck_size(type_k_tail) != 0 ||
                   st.head_v % ggml_blck_size(st.type_v) != 0 || st.head_v % ggml_blck_size(type_v_tail) != 0) {
            st.head_refuse = "the KV head size is not a multiple of a cache type's block size";
        }
        llama_rkv_head_layer hl;
        hl.il                = (int32_t) il;
        hl.n_head_kv         = heads(il);
        hl.head_bytes_window = ggml_row_size(st.type_k, st.head_k) + ggml_row_size(st.type_v, st.head_v);
        hl.head_bytes_tail   = ggml_row_size(type_k_tail, st.head_k) + ggml_row_size(type_v_tail, st.head_v);
        hl.head_k            = (uint32_t) st.head_k;
        hl.head_v            = (uint32_t) st.head_v;
        hl.conv_head_bytes   = (st.type_k != GGML_TYPE_F16 ? st.head_k*2 : 0) +
                (st.type_v != GGML_TYPE_F16 ? st.head_v*2 : 0);
        hl.device_heads      = hl.n_head_kv;
        st.head_layers.push_back(hl);
    }

    uint32_t il_next = 0;
    auto add_dev = [&](llama_rkv_dev_budget d, uint32_t n) {
        if (d.runtime == runtime_unset) {
            d.runtime = d.host_memory ? 0 : cuda.runtime_bytes;
        }
        d.n_layer          = n;
        d.row_bytes_window = 0;
        d.row_bytes_tail   = 0;
        d.conv_cell_bytes  = 0;
        for (uint32_t il = il_next; il < il_next + n; ++il) {
            d.row_bytes_window += row_w[il];
            d.row_bytes_tail   += row_t[il];
            d.conv_cell_bytes   = std::max(d.conv_cell_bytes, d.host_memory ? 0 : conv[il]);
            st.head_layers[il].dev = (int32_t) st.devs.size();
            if (d.host_memory) {
                st.head_layers[il].conv_head_bytes = 0;
            }
        }
        il_next += n;
        // as the cache constructor adds it to a GPU's compute estimate (llama_rkv_stream_mask_bytes)
        d.stream_masks     = d.host_memory ? 0 : llama_rkv_stream_mask_bytes(llama_rkv_estimate_tokens(st), st.kv_size,
                st.n_stream);
        d.compute         += d.stream_masks;
        d.other_kv        += d.recurrent; // as the cache constructor counts it (llama_kv_cache::rkv_plan)
        if (d.recurrent) {
            st.hybrid = true;
            st.recurrent_bytes.emplace_back(nullptr, d.recurrent);
        }
        st.devs.push_back(std::move(d));
    };

    if (!devs) {
        add_dev(base, n_layer);
    } else {
        uint32_t n_total = 0;
        for (size_t i = 0; i < devs->size(); ++i) {
            const rkv_json & o = (*devs)[i];
            if (!o.is_object()) {
                return rkv_invalid("devices must be a list of objects");
            }
            rkv_jreader dr { o, "", {} };
            llama_rkv_dev_budget d = base;
            d.name        = dr.str("name", "GPU" + std::to_string(i));
            d.host_memory = dr.flag("host_memory", base.host_memory);
            d.free        = dr.mib("free_mib", base.free);
            d.weights     = dr.mib("weights_mib", base.weights);
            d.compute     = dr.mib("compute_mib", base.compute);
            d.other_kv    = dr.mib("other_kv_mib", base.other_kv);
            d.recurrent   = dr.mib("recurrent_mib", base.recurrent);
            d.ring        = dr.mib("ring_mib", d.host_memory ? 0 : base.ring);
            d.runtime     = dr.mib("runtime_mib", base.runtime);
            const uint32_t n = (uint32_t) dr.count("n_layer", 0, true);
            if (!dr.err.empty()) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: " + dr.err);
            }
            if (!dr.unknown_key().empty()) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: unknown key " + dr.unknown_key());
            }
            if (n == 0) {
                return rkv_invalid("devices[" + std::to_string(i) + "]: n_layer must be > 0");
            }
            if (n_total + n > n_layer) {
                return rkv_invalid("the devices' n_layer must add up to n_layer");
            }
            add_dev(d, n);
            n_total += n;
        }
        if (n_total != n_layer) {
            return rkv_invalid("the devices' n_layer must add up to n_layer");
        }
    }

    st.resolved = true;

    llama_rkv_decide_in di;
    di.refuse      = refuse.empty() ? nullptr : refuse.c_str();
    di.host_memory = !st.devs.empty() && st.devs[0].host_memory;
    di.quiet       = true;
    di.reserve     = reserve;
    di.measure     = [mem_bw](std::string * how) {
        *how = mem_bw > 0.0 ? "given" : "not given";
        return mem_bw > 0.0 ? mem_bw : -1.0;
    };
    if (cpu_attn_measured > 0.0) {
        di.measure_cpu_attn = [cpu_attn_measured](std::string * how) {
            *how = "given (measured)";
            return cpu_attn_measured;
        };
    }
    if (cpu_attn_rows[0] > 0.0 || cpu_attn_rows[1] > 0.0 || cpu_attn_rows[2] > 0.0) {
        di.measure_cpu_attn_rows = [cpu_attn_rows](int n_rows, std::string * how) {
            *how = "given (measured)";
            return cpu_attn_rows[n_rows == 2 ? 0 : n_rows == 4 ? 1 : 2];
        };
    }
    if (link_measured > 0.0) {
        di.measure_link = [link_measured](std::string * how) { *how = "given (measured)"; return link_measured; };
    }
    if (layer_measured >= 0.0) {
        di.measure_layer_decode = [layer_measured](std::string * how) {
            *how = "given (measured)";
            return layer_measured;
        };
    }
    if (latency_measured >= 0.0) {
        di.measure_cpu_part_latency = [latency_measured](std::string * how) {
            *how = "given (measured)";
            return latency_measured;
        };
    }
    if (!op_unsupported.empty() && !host_memory) {
        di.tail_op_unsupported = [op_unsupported, dev_name](ggml_type tk, ggml_type tv, bool) -> std::string {
            for (ggml_type t : op_unsupported) {
                if (t == tk || t == tv) {
                    return "the " + dev_name + " backend cannot run the streaming op with a " + ggml_type_name(tk) +
                           "/" + ggml_type_name(tv) + " tail (given)";
                }
            }
            return "";
        };
    }

    const uint32_t wc = llama_rkv_decide(st, di);

    // the layers as the cache would allocate them: the window (+1 trash row) on the device, the tail
    // (+1 trash row) in host memory, per stream; a head split: the device's heads and the host's of every cell
    if (st.error.empty()) {
        const bool head = st.chosen == LLAMA_KV_RESIDENCY_HEAD;
        for (uint32_t il = 0; il < n_layer; ++il) {
            const auto & hl = st.head_layers[il];
            llama_rkv_layer_plan lp;
            lp.il           = (int32_t) il;
            lp.n_head_kv    = hl.n_head_kv;
            lp.device_heads = hl.device_heads;
            lp.split        = wc > 0 || (head && hl.device_heads < hl.n_head_kv);
            lp.window_cells = wc ? wc : st.kv_size;
            lp.tail_cells   = wc ? st.kv_size - wc : lp.split ? st.kv_size : 0;
            if (head) {
                lp.device_bytes = (size_t) st.kv_size*hl.device_heads*hl.head_bytes_window*st.n_stream;
                lp.host_bytes   = (size_t) st.kv_size*(hl.n_head_kv - hl.device_heads)*hl.head_bytes_tail*st.n_stream;
            } else {
                // the tail at the plan's types (auto tail types choose them after the split)
                const uint64_t nk = per_layer_heads ? heads(il)*st.head_k : n_embd_k_gqa;
                const uint64_t nv = per_layer_heads ? heads(il)*st.head_v : n_embd_v_gqa;
                const size_t row_plan = wc ? ggml_row_size(st.type_k_tail, nk) + ggml_row_size(st.type_v_tail, nv) : 0;
                lp.device_bytes = (size_t) (wc ? wc + 1 : st.kv_size)*row_w[il]*st.n_stream;
                lp.host_bytes   = wc ? (size_t) (st.kv_size - wc + 1)*row_plan*st.n_stream : 0;
            }
            st.layers.push_back(lp);
        }
    }

    std::string res = llama_rkv_plan_to_json(&st);
    res.pop_back();
    res += ",\"simulated\":true}";
    return res;
}

RKV_SIM_API int32_t rollingkv_plan_simulate(const char * json_in, char * buf, size_t buf_size) {
    if (!json_in) {
        return -1;
    }
#ifdef GGML_BACKEND_DL
    // the CPU part's functions (whether a tail type has one) are the CPU backend's: a build of modules loads it first
    static const bool loaded = [] { ggml_backend_load_all(); return true; }();
    (void) loaded;
#endif
    const std::string s = rkv_plan_simulate(json_in);
    if (buf && buf_size > 0) {
        const size_t n = std::min(s.size(), buf_size - 1);
        memcpy(buf, s.data(), n);
        buf[n] = '\0';
    }
    return (int32_t) s.size();
}
