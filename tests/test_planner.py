"""The VRAM-budget planner of the library (llama-kv-residency*.cpp).

Most tests run the planner on FAKE memory figures through rollingkv_plan_simulate (no model, no GPU; the
planner test library librollingkv-plan-sim next to libllama, which models a GPU as the CUDA backend reports it)
and check its plan against the budget arithmetic written out independently below:

    avail     = min(vram_target - weights, free)        (no target: free - reserve)
    compute   = the given estimate + on a GPU with several streams the per-stream mask copy:
                n_ubatch x kv_size x 2 bytes (one f16 KQ mask more: a head split's device heads read the mask whole
                beside the host heads' per-stream views)
    resident  iff compute + other KV + whole KV <= avail
    window    = the largest multiple of 256 cells with (window + 1 trash row) x cell bytes
                <= avail - compute - other KV - streaming ring
    t_token   = (weights + other KV + window KV) / mem_bw + tail KV / link_bw

The last tests run the real planner on the CPU build with the demo model (host memory as the "device").
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from conftest import LIB_PRELUDE, run_python

pytestmark = pytest.mark.build

MiB = 2**20
ALIGN = 256

# ggml row sizes (bytes per n elements) of the cache types
_BLOCK = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
          "q5_0": (32, 22), "q5_1": (32, 24)}


def row(t: str, n: int) -> int:
    blk, size = _BLOCK[t]
    assert n % blk == 0
    return n // blk * size


# an 8B-like model on one GPU: 32 layers of 8 KV heads x 128, f16 cache -> 4 KiB per layer and cell, 128 KiB per cell
GPU = dict(kv_size=131072, n_layer=32, n_embd_k_gqa=1024, n_embd_v_gqa=1024, weights_mib=4500, compute_mib=300,
           ring_mib=96, free_mib=140000, pcie_bw_gbps=53.5, mem_bw_gbps=4000)


RUNTIME_MIB = 640  # the CUDA backend's default runtime reserve (ROLLINGKV_RUNTIME_MIB)


def fig(**kw) -> dict:
    return {**GPU, **kw}


def stream_masks(f: dict) -> int:
    """What one op per stream adds to a GPU's compute buffer (llama_rkv_stream_mask_bytes): the scheduler keeps the f16
    KQ mask, a graph input, on the CPU and copies each distinct view of it to the GPU. The ops read one view per stream,
    shared by every layer: together one mask, in place of the mask a window split no longer reads whole; a head split's
    device heads read it whole as well, so a GPU with several streams counts one mask more (the budget precedes the
    choice of tactic)."""
    if f.get("host_memory") or f.get("n_stream", 1) < 2:
        return 0
    return f.get("n_ubatch", 512) * f["kv_size"] * 2


class Expect:
    """The plan the documented arithmetic gives for figures f (single device, defaults as the library's)."""

    def __init__(self, f: dict):
        n_stream = f.get("n_stream", 1)
        tk, tv = f.get("type_k", "f16"), f.get("type_v", "f16")
        tkt, tvt = f.get("type_k_tail", tk), f.get("type_v_tail", tv)
        nk, nv, n_layer = f["n_embd_k_gqa"], f["n_embd_v_gqa"], f["n_layer"]
        self.row_w = row(tk, nk) + row(tv, nv)  # one layer, one cell, one stream
        self.row_t = row(tkt, nk) + row(tvt, nv)
        conv = (0 if tk == "f16" else 2 * nk) + (0 if tv == "f16" else 2 * nv)  # f16 copy flash attention makes
        self.cell = (n_layer * self.row_w + conv) * n_stream
        weights, compute = round(f["weights_mib"] * MiB), round(f["compute_mib"] * MiB)
        self.stream_masks = stream_masks(f)
        compute += self.stream_masks
        other, ring = round(f.get("other_kv_mib", 0) * MiB), round(f["ring_mib"] * MiB)
        free, target = round(f["free_mib"] * MiB), f.get("vram_target_mib", 0)
        reserve = round(f.get("reserve_mib", 1024) * MiB)
        # the GPU runtime's own memory (CUDA context, cuBLAS, pools) counts against a target only
        runtime = round(f.get("runtime_mib", 0 if f.get("host_memory") else RUNTIME_MIB) * MiB)
        self.avail = max(0, min(target * MiB - weights, free)) if target else max(0, free - reserve)
        self.kv_resident = f["kv_size"] * self.cell
        fixed = compute + other + (runtime if target else 0)
        self.fits = fixed + self.kv_resident <= self.avail
        self.kv_budget = max(0, self.avail - fixed - ring)
        self.window = max(0, self.kv_budget // self.cell - 1) // ALIGN * ALIGN
        need_split = weights + compute + other + runtime + ring + (ALIGN + 1) * self.cell
        need_resident = weights + compute + other + runtime + self.kv_resident
        self.min_target_mib = math.ceil(min(need_split, need_resident) / MiB)
        self.weights, self.other, self.n_layer, self.n_stream = weights, other, n_layer, n_stream


_SIMULATE = """
import json, os, sys
from pathlib import Path
from rollingkv_cli.lib import llama_ext
llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
out = {}
for name, case in json.loads(os.environ["RKV_CASES"]).items():
    case.pop("_env", None)  # set on the process: the knobs are read once
    out[name] = ext.simulate_plan(case)
print(json.dumps(out))
"""

# the target at which the whole KV of GPU just fits, in MiB (the figures are whole MiB)
FIT_MIB = GPU["weights_mib"] + GPU["compute_mib"] + RUNTIME_MIB + GPU["kv_size"] * 32 * 4096 // MiB
SWEEP = [6000, 6001, 9000, 12345, 15000, 18000, 20000, FIT_MIB - 200, FIT_MIB - 2]
# what a GPU of GPU needs before any KV with a target: weights + compute + runtime + ring
WEIGHTS_ETC_MIB = GPU["weights_mib"] + GPU["compute_mib"] + RUNTIME_MIB + GPU["ring_mib"]
NO_RING_MIB = WEIGHTS_ETC_MIB - GPU["ring_mib"]
HEAD_BYTES = 2 * 128 * 2  # K + V of one KV head of 128, f16, per cell
# the head split's minimum: one KV head of each of the 32 layers for every cell
HEAD_MIN_MIB = WEIGHTS_ETC_MIB + GPU["kv_size"] * 32 * HEAD_BYTES // MiB
TAIL_TYPES = ["f16", "q8_0", "q4_0"]


def _cases() -> dict:
    c = {
        "fits": fig(vram_target_mib=FIT_MIB),
        "barely": fig(vram_target_mib=FIT_MIB - 1),
        "far": fig(kv_size=1048576, vram_target_mib=8000, pcie_bw_gbps=25.0, mem_bw_gbps=3000.0),
        "below_weights": fig(vram_target_mib=4000),
        "no_target": fig(free_mib=9000),
        "no_target_reserve": fig(free_mib=9000, reserve_mib=100),
        "free_caps_target": fig(vram_target_mib=100000, free_mib=9000),
        "q8_window": fig(vram_target_mib=12000, type_k="q8_0", type_v="q8_0"),
        "streams": fig(kv_size=32768, n_stream=4, vram_target_mib=12000),
        "other_kv": fig(vram_target_mib=12000, other_kv_mib=2048),
        "recurrent": fig(vram_target_mib=12000, recurrent_mib=2048),  # a hybrid model's recurrent state
        "recurrent_fits": fig(vram_target_mib=FIT_MIB, recurrent_mib=1),
        "recurrent_two_gpus": fig(vram_target_mib=10000, devices=[{"name": "CUDA0", "n_layer": 16, "weights_mib": 2000, "recurrent_mib": 1500},
                                                                 {"name": "CUDA1", "n_layer": 16, "weights_mib": 2000}]),
        "refuse": fig(vram_target_mib=6000, refuse="flash attention is off"),
        "off": fig(mode="off", vram_target_mib=6000),
        "explicit": fig(mode="window", window_cells=1000),
        "explicit_whole": fig(mode="window", window_cells=200000),
        "explicit_below": fig(mode="window", window_cells=1000, vram_target_mib=4000),
        "no_link": fig(vram_target_mib=12000, pcie_bw_gbps=0),
        "no_mem_bw": fig(vram_target_mib=12000, mem_bw_gbps=0),
        "ring_env": {**{k: v for k, v in fig(vram_target_mib=12000).items() if k != "ring_mib"},
                     "_env": {"ROLLINGKV_SLOTS": "5", "ROLLINGKV_SLOT_MIB": "16"}},
        "ring_env_low": {**{k: v for k, v in fig(vram_target_mib=12000).items() if k != "ring_mib"},
                         "_env": {"ROLLINGKV_SLOTS": "three", "ROLLINGKV_SLOT_MIB": "0"}},
        "ring_env_high": {**{k: v for k, v in fig(vram_target_mib=12000).items() if k != "ring_mib"},
                          "_env": {"ROLLINGKV_SLOTS": "99", "ROLLINGKV_SLOT_MIB": "64"}},
        "ring_default": {**{k: v for k, v in fig(vram_target_mib=12000).items() if k != "ring_mib"},
                         "_env": {"ROLLINGKV_SLOTS": "", "ROLLINGKV_SLOT_MIB": ""}},
        # 8 streams of f32 K/V of 8192 wide: one 256-cell chunk of a layer is 128 MiB, more than a 32 MiB slot
        "ring_big_rows": {**{k: v for k, v in fig(vram_target_mib=60000, kv_size=16384, n_stream=8, n_embd_k_gqa=8192,
                                                n_embd_v_gqa=8192, n_layer=4, type_k="f32", type_v="f32").items() if k != "ring_mib"},
                          "_env": {"ROLLINGKV_SLOTS": "", "ROLLINGKV_SLOT_MIB": ""}},
        "two_gpus": fig(vram_target_mib=10000, devices=[{"name": "CUDA0", "n_layer": 16, "weights_mib": 2000},
                                                       {"name": "CUDA1", "n_layer": 16, "weights_mib": 5000}]),
        "runtime_given": fig(vram_target_mib=12000, runtime_mib=100),
        "runtime_env": {**fig(vram_target_mib=12000), "_env": {"ROLLINGKV_RUNTIME_MIB": "1000"}},
        "runtime_no_target": fig(free_mib=9000, runtime_mib=5000),
        "bad_key": fig(vram_target_mib=1, windw_cells=5),
        "bad_tail": fig(type_k_tail="q2_K"),
        "missing": {k: v for k, v in GPU.items() if k != "kv_size"},
        "bad_devices": fig(devices=[{"name": "CUDA0", "n_layer": 5}]),
    }
    # the hybrid tail's share (llama_rkv_plan_tail_cpu): a 50 GiB tail of the 8B-like model, 40 GB/s of CPU attention
    hyb = dict(kv_size=262144, vram_target_mib=12000, cpu_attn_gbps=40.0)
    for link in (6.5, 25.0, 53.5):
        c[f"hyb_auto_{link:g}"] = fig(**hyb, pcie_bw_gbps=link, tail_cpu_frac=-1)
    c["hyb_default"] = fig(**hyb, pcie_bw_gbps=25.0)                  # the request's default: auto
    c["hyb_off"] = fig(**hyb, pcie_bw_gbps=25.0, tail_cpu_frac=0)
    c["hyb_fixed"] = fig(**hyb, tail_cpu_frac=0.5)
    c["hyb_unknown_cpu"] = fig(**{**hyb, "cpu_attn_gbps": 0}, tail_cpu_frac=-1)
    c["hyb_measured"] = fig(**{**hyb, "cpu_attn_gbps": 0}, tail_cpu_frac=-1, pcie_bw_gbps=0, cpu_attn_measured_gbps=40.0,
                            link_measured_gbps=6.5)
    c["hyb_rows"] = fig(**{**hyb, "cpu_attn_gbps": 0}, tail_cpu_frac=-1, pcie_bw_gbps=0, cpu_attn_measured_gbps=40.0,
                        link_measured_gbps=6.5, cpu_attn_measured_gbps_2=30.0, cpu_attn_measured_gbps_4=16.0,
                        cpu_attn_measured_gbps_8=8.0)
    # the per-layer terms measured on the device (a slow host hand-off, a fast one), against the constants
    c["hyb_calib_slow"] = fig(**hyb, pcie_bw_gbps=25.0, tail_cpu_frac=-1, layer_decode_measured_ms=0.02,
                              cpu_part_latency_measured_ms=20.0)
    c["hyb_calib_fast"] = fig(**hyb, pcie_bw_gbps=25.0, tail_cpu_frac=-1, layer_decode_measured_ms=0.02,
                              cpu_part_latency_measured_ms=0.01)
    c["hyb_calib_fixed"] = fig(**hyb, tail_cpu_frac=0.5, layer_decode_measured_ms=0.02, cpu_part_latency_measured_ms=20.0)
    c["hyb_fast_cpu_no_gain"] = fig(**{**hyb, "cpu_attn_gbps": 0.5}, tail_cpu_frac=-1, pcie_bw_gbps=53.5)
    c["hyb_q4_1"] = fig(**hyb, tail_cpu_frac=-1, pcie_bw_gbps=6.5, type_k_tail="q4_1", type_v_tail="q4_1")
    c["hyb_host"] = fig(**hyb, tail_cpu_frac=-1, pcie_bw_gbps=6.5, host_memory=True)
    # the H200's synthetic 28-layer model at 16384 cells, half of them in an f16 or q4_0 tail, with the figures the bench
    # of docs/perf/2026-12-03-h200-head-split measured (link 54.65 GB/s, CPU attention f16 69.64 / q4_0 43.19 GB/s)
    h200 = dict(mode="window", kv_size=16416, n_layer=28, weights_mib=5755, mem_bw_gbps=3947.58, pcie_bw_gbps=54.65, window_cells=8192,
                tail_cpu_frac=-1)
    c["h200_f16"] = fig(**h200, cpu_attn_gbps=69.64)
    c["h200_q4_0"] = fig(**h200, cpu_attn_gbps=43.19, type_k_tail="q4_0", type_v_tail="q4_0")
    # the head split (8 KV heads of 128 per layer: n_embd_k_gqa / head_k)
    c["head_explicit"] = fig(mode="head", device_heads=3)
    c["head_explicit_all"] = fig(mode="head", device_heads=8)
    c["head_explicit_more"] = fig(mode="head", device_heads=100)
    c["head_auto_n"] = fig(mode="auto", device_heads=2, vram_target_mib=12000)
    c["head_budget"] = fig(mode="head", vram_target_mib=12000)
    c["head_budget_q8"] = fig(mode="head", vram_target_mib=12000, type_k="q8_0", type_v="q8_0", type_k_tail="q4_0", type_v_tail="q4_0")
    c["head_fits"] = fig(mode="head", vram_target_mib=FIT_MIB)
    c["head_below_min"] = fig(mode="head", vram_target_mib=HEAD_MIN_MIB - 1)
    c["head_at_min"] = fig(mode="head", vram_target_mib=HEAD_MIN_MIB)
    c["head_no_target_host"] = fig(mode="head", host_memory=True)
    c["head_mqa"] = fig(mode="head", device_heads=1, n_embd_k_gqa=128, n_embd_v_gqa=128)
    c["head_alibi"] = fig(mode="head", device_heads=1, refuse_head="ALiBi: slopes")
    c["head_layers"] = fig(mode="head", vram_target_mib=9000, n_layer=4, n_head_kv=[8, 2, 4, 8], kv_size=1048576)
    c["head_layers_n"] = fig(mode="head", device_heads=3, n_layer=4, n_head_kv=[8, 2, 4, 8])
    c["head_layers_mqa"] = fig(mode="head", device_heads=1, n_layer=4, n_head_kv=[8, 1, 4, 8])
    c["head_two_gpus"] = fig(mode="head", vram_target_mib=9000, devices=[{"name": "CUDA0", "n_layer": 16, "weights_mib": 2000},
                                                                        {"name": "CUDA1", "n_layer": 16, "weights_mib": 2500}])
    c["head_bad_list"] = fig(mode="head", n_head_kv=[8, 8])
    # auto between the window and the head split
    c["auto_tie"] = fig(vram_target_mib=12000)
    # (no ring: a small KV whose whole would otherwise fit in the room the ring takes from a split)
    c["auto_coarse_window"] = fig(kv_size=1024, ring_mib=0, weights_mib=500,                     # a 256-cell step: 25 % of the KV
                                  vram_target_mib=NO_RING_MIB - GPU["weights_mib"] + 500 + 125)
    c["auto_no_window"] = fig(kv_size=512, ring_mib=0, vram_target_mib=NO_RING_MIB + 25)        # < 256 cells fit, heads do
    c["auto_mqa"] = fig(vram_target_mib=6000, n_embd_k_gqa=128, n_embd_v_gqa=128)
    c["auto_mqa_no_window"] = fig(kv_size=512, ring_mib=0, vram_target_mib=NO_RING_MIB + 1, n_embd_k_gqa=128, n_embd_v_gqa=128)
    # the synthetic 28-layer model (8 KV heads x 128, f16) at -c 102400 with --vram-target 9000, as llama-server makes its
    # cache: one stream for -np 1 and the default (4 slots on one unified cache), one per slot for -np 4 and -np 8
    synth = dict(n_layer=28, weights_mib=5564, compute_mib=150, vram_target_mib=9000, mem_bw_gbps=2870.0)
    for name, n_stream in (("np1", 1), ("unified", 1), ("np4", 4), ("np8", 8)):
        c[f"synth_{name}"] = fig(**synth, kv_size=102400 // n_stream, n_stream=n_stream)
    c["synth_np4_ub256"] = fig(**synth, kv_size=25600, n_stream=4, n_ubatch=256)
    c["synth_np4_host"] = fig(**{**synth, "weights_mib": 0}, kv_size=25600, n_stream=4, host_memory=True)
    for t in SWEEP:
        c[f"sweep{t}"] = fig(vram_target_mib=t)
    for t in TAIL_TYPES:
        c[f"tail_{t}"] = fig(vram_target_mib=12000, type_k_tail=t, type_v_tail=t)
    return c


CASES = _cases()


@pytest.fixture(scope="module")
def sim(cpu_build) -> dict:
    """Every case of CASES through the library's planner: one process per environment (_env), since the library
    reads its ROLLINGKV_* knobs once per process."""
    groups: dict[str, dict] = {}
    for name, case in CASES.items():
        groups.setdefault(json.dumps(case.get("_env", {}), sort_keys=True), {})[name] = case
    out: dict = {}
    for env, cases in groups.items():
        out.update(run_python(_SIMULATE, cpu_build.lib_dir, env_extra={**json.loads(env), "RKV_CASES": json.dumps(cases)}))
    return out


def _plain(name: str) -> dict:
    return {k: v for k, v in CASES[name].items() if not k.startswith("_")}


# ------------------------------------------------------------------------------ fits / does not fit


def test_fits_resident(sim):
    p, e = sim["fits"], Expect(CASES["fits"])
    assert e.fits  # the figures: exactly at the boundary
    assert p["mode_chosen"] == "resident" and not p["split"] and p["eligible"] and p["error"] is None
    assert p["window_cells"] == 0 and p["tail_cells"] == 0 and p["host_bytes"] == 0
    assert p["device_bytes"] == e.kv_resident == 16384 * MiB
    assert len(p["layers"]) == 32 and not any(layer["split"] for layer in p["layers"])
    b = p["budget"]
    assert b["budgeted"] and b["vram_target_mib"] == FIT_MIB and b["reserve_bytes"] == 0
    assert (b["weights_bytes"], b["compute_bytes"], b["ring_bytes"]) == (4500 * MiB, 300 * MiB, 96 * MiB)
    assert b["kv_resident_bytes"] == e.kv_resident and b["min_target_mib"] == e.min_target_mib
    # a resident plan streams nothing: the link is reported, no per-token estimate
    assert p["link"]["link_bw_gbps"] == pytest.approx(53.5) and p["estimate"]["ms_per_token"] is None


def test_barely_does_not_fit(sim):
    p, e = sim["barely"], Expect(CASES["barely"])
    assert not e.fits
    assert p["mode_chosen"] == "window" and p["split"] and p["mode_requested"] == "auto"
    # one MiB short: the ring (96 MiB = 768 cells) plus that MiB come off the top, then down to a multiple of 256
    assert p["window_cells"] == e.window == 130048
    assert p["tail_cells"] == 131072 - 130048
    assert (p["window_cells"] + ALIGN + 1) * e.cell > e.kv_budget  # the largest aligned window
    assert p["device_bytes"] == 32 * (e.window + 1) * e.row_w
    assert p["host_bytes"] == 32 * (131072 - e.window + 1) * e.row_t
    assert p["device_bytes"] <= p["budget"]["devices"][0]["kv_budget_bytes"]
    assert "256" in p["reason"] and "vram_target" in p["reason"]


def test_far_from_fitting_and_link_model(sim):
    f = CASES["far"]
    p, e = sim["far"], Expect(f)
    assert p["window_cells"] == e.window == 19456  # (8000 - 4500 - 300 - 640 - 96) MiB / 128 KiB, less the trash row, aligned
    tail = f["kv_size"] - e.window
    assert p["tail_cells"] == tail
    link, est = p["link"], p["estimate"]
    assert link["mem_bw_gbps"] == pytest.approx(3000.0) and link["link_bw_gbps"] == pytest.approx(25.0)
    assert "pcie_bw_gbps" in link["link_bw_source"]
    device_bytes = e.weights + e.window * 32 * e.row_w
    tail_bytes = tail * 32 * e.row_t
    assert est["device_bytes_per_token"] == pytest.approx(device_bytes, rel=1e-5)
    assert est["tail_bytes_per_token"] == pytest.approx(tail_bytes, rel=1e-5)
    assert est["t_resident_ms"] == pytest.approx(device_bytes / 3000e9 * 1e3, rel=1e-4)
    assert est["t_tail_ms"] == pytest.approx(tail_bytes / 25e9 * 1e3, rel=1e-4)
    assert est["ms_per_token"] == pytest.approx(est["t_resident_ms"] + est["t_tail_ms"], rel=1e-4)
    assert est["t_tail_ms"] > 100 * est["t_resident_ms"]  # 128 GiB of tail over 25 GB/s


def test_target_below_weights_refused_with_minimum(sim, cpu_build):
    p, e = sim["below_weights"], Expect(CASES["below_weights"])
    assert p["mode_chosen"] == "refused" and not p["split"] and p["layers"] == []
    assert p["budget"]["min_target_mib"] == e.min_target_mib == 4500 + 300 + RUNTIME_MIB + 96 + math.ceil(257 * 131072 / MiB)
    assert f"minimum of {e.min_target_mib} MiB" in p["error"] and "4000 MiB" in p["error"]
    for term in ("weights 4500 MiB", "compute", f"GPU runtime ~{RUNTIME_MIB} MiB", "ring 96 MiB", "256-cell"):
        assert term in p["error"]
    # the minimum is exact: at it, a 256-cell window; one MiB less, refused
    r = run_python(_SIMULATE, cpu_build.lib_dir, env_extra={"RKV_CASES": json.dumps({
        "at": fig(vram_target_mib=e.min_target_mib), "under": fig(vram_target_mib=e.min_target_mib - 1)})})
    assert r["at"]["window_cells"] == ALIGN and r["at"]["error"] is None
    assert r["under"]["mode_chosen"] == "refused" and f"minimum of {e.min_target_mib} MiB" in r["under"]["error"]


def test_window_alignment_sweep(sim):
    windows = []
    for t in SWEEP:
        p, e = sim[f"sweep{t}"], Expect(CASES[f"sweep{t}"])
        wc = p["window_cells"]
        assert p["split"] and wc % ALIGN == 0 and wc == e.window, t
        assert (wc + 1) * e.cell <= e.kv_budget < (wc + ALIGN + 1) * e.cell, t
        assert all(layer["window_cells"] == wc and layer["tail_cells"] == 131072 - wc for layer in p["layers"])
        windows.append(wc)
    assert windows == sorted(windows) and len(set(windows)) > 5


def test_tail_type_changes_host_bytes_not_window(sim):
    plans = {t: sim[f"tail_{t}"] for t in TAIL_TYPES}
    wc = plans["f16"]["window_cells"]
    assert wc > 0 and all(p["window_cells"] == wc for p in plans.values())
    assert len({p["device_bytes"] for p in plans.values()}) == 1
    tail = 131072 - wc
    for t, p in plans.items():
        assert p["type_k_tail"] == t and p["type_v_tail"] == t
        assert p["host_bytes"] == 32 * (tail + 1) * 2 * row(t, 1024), t
        assert p["estimate"]["tail_bytes_per_token"] == pytest.approx(32 * tail * 2 * row(t, 1024), rel=1e-5)
    t_tail = [plans[t]["estimate"]["t_tail_ms"] for t in TAIL_TYPES]
    assert t_tail[0] > t_tail[1] > t_tail[2]
    assert t_tail[1] / t_tail[0] == pytest.approx(34 / 64, rel=1e-4)


def test_quantized_window_counts_the_flash_attention_copy(sim):
    p, e = sim["q8_window"], Expect(CASES["q8_window"])
    d = p["budget"]["devices"][0]
    assert d["conv_cell_bytes"] == 2 * 1024 * 2
    assert d["cell_bytes"] == e.cell == 32 * 2 * 1088 + 4096
    assert p["window_cells"] == e.window and p["window_cells"] % ALIGN == 0


def test_streams_multiply_the_cell(sim):
    p, e = sim["streams"], Expect(CASES["streams"])
    assert p["n_stream"] == 4 and e.cell == 4 * 32 * 4096
    assert p["window_cells"] == e.window and 0 < e.window < 32768
    assert p["layers"][0]["device_bytes"] == (e.window + 1) * 4096 * 4


def test_several_streams_count_one_more_kq_mask(sim):
    """-np 4 on an H100 (the synthetic model, -c 102400, --vram-target 9000) peaked 515-695 MiB over the target: each
    layer's per-stream ops took views of the KQ mask of their own, which the scheduler copied to the GPU one by one, a
    copy of the whole mask per layer (27 x 25 MiB). The views are now one per stream for every layer
    (tests/test_rolling_kv.py::test_every_layer_shares_one_view_of_each_graph_input): together one mask. The plan for
    several streams counts one mask more in the GPU's compute buffer (what a head split holds: its device heads read
    the mask whole beside the views), not one per layer; one stream (-np 1, the unified default) and host memory (one
    backend: nothing is copied) count none."""
    mask = 512 * 25600 * 2  # one f16 KQ mask of a 512-token ubatch at 25600 cells per stream: 25 MiB
    for name in ("synth_np1", "synth_unified", "synth_np4", "synth_np8", "synth_np4_ub256", "synth_np4_host"):
        p, e = sim[name], Expect(CASES[name])
        d = p["budget"]["devices"][0]
        assert d["stream_mask_bytes"] == e.stream_masks, name
        assert d["compute_bytes"] == round(CASES[name]["compute_mib"] * MiB) + e.stream_masks, name
        assert p["window_cells"] == e.window, name
    assert sim["synth_np4"]["budget"]["devices"][0]["stream_mask_bytes"] == mask  # 25 MiB, not 27 x 25 MiB
    assert sim["synth_np8"]["budget"]["devices"][0]["stream_mask_bytes"] == mask // 2
    assert sim["synth_np4_ub256"]["budget"]["devices"][0]["stream_mask_bytes"] == mask // 2
    assert sim["synth_np1"]["budget"]["devices"][0]["stream_mask_bytes"] == 0
    assert sim["synth_unified"]["budget"]["devices"][0]["stream_mask_bytes"] == 0
    assert sim["synth_np4_host"]["budget"]["devices"][0]["stream_mask_bytes"] == 0
    # the window (all streams' device cells, 112 KiB per cell of one stream) is smaller by the one mask than -np 1's
    # (aligned down to 256 cells of every stream), not by the 675 MiB of a copy per layer
    cell = 28 * 4096
    one, four = sim["synth_np1"]["window_cells"], sim["synth_np4"]["window_cells"] * 4
    assert one - four == pytest.approx(mask / cell, abs=5 * ALIGN)
    assert one - four < 27 * mask / cell - 5 * ALIGN


def test_other_caches_come_off_the_budget(sim):
    with_other, e = sim["other_kv"], Expect(CASES["other_kv"])
    plain = sim["tail_f16"]  # same figures without the SWA cache
    assert with_other["window_cells"] == e.window
    assert plain["window_cells"] - with_other["window_cells"] == pytest.approx(2048 * MiB / e.cell, abs=ALIGN)
    assert with_other["budget"]["other_kv_bytes"] == 2048 * MiB


def test_a_hybrid_models_recurrent_state_comes_off_the_budget(sim):
    """A hybrid model's recurrent state (what llama_rkv_note_recurrent records before the attention cache plans) never
    splits: it takes the budget an SWA cache of its size would, and the plan reports it apart. One MiB of it turns the
    target at which the whole KV just fits into a split; on two GPUs only the device holding it loses the window."""
    recr, other = sim["recurrent"], sim["other_kv"]
    assert recr["window_cells"] == other["window_cells"] == Expect(CASES["other_kv"]).window > 0
    assert recr["budget"]["other_kv_bytes"] == recr["budget"]["recurrent_bytes"] == 2048 * MiB
    assert recr["budget"]["devices"][0]["recurrent_bytes"] == 2048 * MiB
    assert recr["recurrent"] == {"split": False, "layers": [], "bytes": 2048 * MiB}
    assert other["recurrent"] is None and other["budget"]["recurrent_bytes"] == 0
    assert sim["fits"]["mode_chosen"] == "resident"
    tipped = sim["recurrent_fits"]
    assert tipped["split"] and tipped["window_cells"] == Expect({**CASES["fits"], "other_kv_mib": 1}).window
    two = sim["recurrent_two_gpus"]["budget"]["devices"]
    assert [d["recurrent_bytes"] for d in two] == [1500 * MiB, 0]
    assert two[0]["kv_budget_bytes"] == two[1]["kv_budget_bytes"] - 1500 * MiB


def test_gpu_runtime_counts_against_a_target_only(sim):
    """NVML counts the CUDA context, cuBLAS and the pools per process: a vram_target must leave room for them."""
    default, given, env = sim["tail_f16"], sim["runtime_given"], sim["runtime_env"]
    assert default["budget"]["runtime_bytes"] == RUNTIME_MIB * MiB == default["budget"]["devices"][0]["runtime_bytes"]
    assert given["budget"]["runtime_bytes"] == 100 * MiB and env["budget"]["runtime_bytes"] == 1000 * MiB
    for name in ("runtime_given", "runtime_env"):
        assert sim[name]["window_cells"] == Expect({**CASES[name], **({"runtime_mib": 1000} if name == "runtime_env" else {})}).window
    # every MiB of runtime is a MiB less of window
    cell = 32 * 4096
    assert given["window_cells"] - default["window_cells"] == pytest.approx((RUNTIME_MIB - 100) * MiB / cell, abs=ALIGN)
    assert default["window_cells"] - env["window_cells"] == pytest.approx((1000 - RUNTIME_MIB) * MiB / cell, abs=ALIGN)
    # without a target the budget is free memory (the context is gone from it already) minus the reserve
    assert sim["runtime_no_target"]["window_cells"] == sim["no_target"]["window_cells"]
    assert sim["runtime_no_target"]["budget"]["min_target_mib"] == sim["no_target"]["budget"]["min_target_mib"] + 5000 - RUNTIME_MIB


# ------------------------------------------------------------------------------------ budget sources


def test_no_target_is_free_minus_reserve(sim):
    for name, reserve in (("no_target", 1024), ("no_target_reserve", 100)):
        p, e = sim[name], Expect(CASES[name])
        assert p["budget"]["reserve_bytes"] == reserve * MiB and p["budget"]["devices"][0]["avail_bytes"] == (9000 - reserve) * MiB
        assert p["window_cells"] == e.window > 0
        assert "free VRAM" in p["reason"]
    assert sim["no_target_reserve"]["window_cells"] > sim["no_target"]["window_cells"]


def test_free_memory_caps_the_target(sim):
    p, e = sim["free_caps_target"], Expect(CASES["free_caps_target"])
    assert p["budget"]["devices"][0]["avail_bytes"] == 9000 * MiB
    assert p["window_cells"] == e.window > 0


def test_ring_from_environment(sim):
    """ROLLINGKV_SLOTS x ROLLINGKV_SLOT_MIB, read as the CUDA op reads them (atoi, slots clamped to [2, 8], MiB to [1, 4096])."""
    p = sim["ring_env"]
    assert p["budget"]["ring_slots"] == 5 and p["budget"]["ring_bytes"] == 80 * MiB
    assert p["window_cells"] == Expect({**_plain("ring_env"), "ring_mib": 80}).window
    assert sim["ring_default"]["budget"]["ring_slots"] == 3 and sim["ring_default"]["budget"]["ring_bytes"] == 96 * MiB
    low = sim["ring_env_low"]["budget"]  # atoi("three") = 0 -> 2 slots; 0 MiB -> 1 MiB, grown to one 256-cell K+V chunk
    assert low["ring_slots"] == 2 and low["ring_slot_bytes"] == 256 * 2048 * 2 + 256 and low["ring_bytes"] == 2 * low["ring_slot_bytes"]
    high = sim["ring_env_high"]["budget"]
    assert high["ring_slots"] == 8 and high["ring_bytes"] == 8 * 64 * MiB


def test_ring_slot_holds_one_chunk_of_the_widest_layer(sim):
    b = sim["ring_big_rows"]["budget"]
    row = 8192 * 4  # f32
    slot = -(-(256 * row * 8) // 256) * 256 + 256 * row * 8 + 256  # K padded to 256 bytes, V, one header
    assert b["ring_slot_bytes"] == slot > 32 * MiB and b["ring_bytes"] == 3 * slot


def test_two_devices_the_tighter_one_decides(sim):
    p = sim["two_gpus"]
    devs = {d["name"]: d for d in p["budget"]["devices"]}
    assert set(devs) == {"CUDA0", "CUDA1"} and p["budget"]["weights_bytes"] == 7000 * MiB
    # CUDA1 holds 3000 MiB more weights: its budget binds
    cell = 16 * 4096
    kv_budget = (10000 - 5000 - 300 - RUNTIME_MIB - 96) * MiB
    assert devs["CUDA1"]["kv_budget_bytes"] == kv_budget and devs["CUDA1"]["fit_cells"] < devs["CUDA0"]["fit_cells"]
    assert p["window_cells"] == (kv_budget // cell - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------------------ eligibility and modes


def test_eligibility_and_modes(sim):
    r = sim["refuse"]
    assert r["mode_chosen"] == "resident" and not r["eligible"] and r["reason"] == "flash attention is off"
    assert sim["off"]["mode_chosen"] == "off" and sim["off"]["eligible"] and not sim["off"]["split"]
    ex = sim["explicit"]
    assert ex["mode_chosen"] == "window" and ex["window_cells"] == 1000 and ex["reason"].startswith("window: explicit")
    assert not ex["budget"]["budgeted"] and ex["estimate"]["ms_per_token"] > 0
    assert sim["explicit_whole"]["mode_chosen"] == "resident" and "whole cache" in sim["explicit_whole"]["reason"]
    below = sim["explicit_below"]  # an explicit window does not lift the floor of weights + compute + ring
    assert below["mode_chosen"] == "refused" and "4000 MiB is below the minimum" in below["error"]


def test_estimate_needs_both_bandwidths(sim):
    assert sim["no_link"]["split"] and sim["no_link"]["estimate"]["ms_per_token"] is None
    assert sim["no_link"]["estimate"]["t_resident_ms"] > 0 and "probe pcie" in sim["no_link"]["link"]["link_bw_source"]
    assert sim["no_mem_bw"]["estimate"]["ms_per_token"] is None and sim["no_mem_bw"]["estimate"]["t_tail_ms"] > 0


@pytest.mark.parametrize("name, message", [("bad_key", "unknown key windw_cells"), ("bad_tail", "tail type"),
                                           ("missing", "kv_size is required"), ("bad_devices", "add up")])
def test_invalid_input(sim, name, message):
    p = sim[name]
    assert p.get("invalid_input") is True and message in p["error"]


def test_serve_prints_the_budget_and_the_estimate(sim):
    from rollingkv_cli.serve import status

    far = sim["far"]
    assert status.describe_plan(far).startswith("residency: window")
    lines = status.describe_plan_details(far)
    assert lines[0].startswith("budget on GPU0: target 8000 MiB; weights 4500 + compute ~300 + other KV 0 + streaming ring 96 MiB")
    assert f"minimum target {far['budget']['min_target_mib']} MiB" in lines[0]
    assert lines[1].startswith(f"expected {far['estimate']['ms_per_token']:.2f} ms/token") and "25.0 GB/s" in lines[1]
    assert "residency: resident" in status.describe_plan(sim["fits"]) and len(status.describe_plan_details(sim["fits"])) == 1
    assert status.describe_plan_details({"mode_chosen": "off", "split": False}) == []  # an older build's plan
    recr = status.describe_plan_details(sim["recurrent"])
    assert "+ other KV 2048 (recurrent state 2048) + streaming ring 96 MiB" in recr[0]
    assert recr[1].startswith("hybrid model: the attention layers' cache (32 layers) splits; the recurrent state (0 layers, 2048.0 MiB)")


# ------------------------------------------------------------------------ the live planner on the CPU build

_LIVE = LIB_PRELUDE + """model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
def cparams(n_ctx=8192):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1; cp.n_threads = 2; cp.n_threads_batch = 2
    return cp
def plan(**kw):
    ctx = ext.init_context(model, cparams(), ext.make_params(**kw))
    if not ctx:
        return {"refused": ext.last_error()}
    p = ext.plan(ctx)
    llama_cpp.llama_free(ctx)
    return p
out = {"auto": plan(mode="auto"), "off": plan(mode="off"), "window": plan(mode="window", window_cells=256),
       "target": plan(mode="auto", vram_target_mib=300)}
m = out["target"]["budget"]["min_target_mib"]
out["at_min"] = plan(mode="auto", vram_target_mib=m)
out["under_min"] = plan(mode="auto", vram_target_mib=m - 1)
out["big_target"] = plan(mode="auto", vram_target_mib=100000)
out["error_after_success"] = ext.last_error()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def live(cpu_build, demo_model) -> dict:
    return run_python(_LIVE, cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model)})


def test_live_cpu_resident_and_off(live):
    assert live["auto"]["mode_chosen"] == "resident" and "no GPU" in live["auto"]["reason"] and live["auto"]["budget"] is None
    assert live["off"]["mode_chosen"] == "off"
    assert live["big_target"]["mode_chosen"] == "resident" and live["big_target"]["budget"]["budgeted"]


def test_live_cpu_explicit_window_measures_host_memory(live):
    p = live["window"]
    assert p["split"] and p["window_cells"] == 256
    link, est = p["link"], p["estimate"]
    assert link["mem_bw_gbps"] > 0.1 and "copy" in link["mem_bw_source"]
    assert link["link_bw_gbps"] == link["mem_bw_gbps"]  # no PCIe on a CPU run: the tail is read from host memory
    assert est["ms_per_token"] == pytest.approx(est["t_resident_ms"] + est["t_tail_ms"], rel=1e-4)
    assert est["tail_bytes_per_token"] == pytest.approx(30 * (8192 - 256) * 2 * 3 * 64 * 2, rel=1e-5)


def test_live_cpu_target_sizes_the_window(live, demo_model):
    p = live["target"]
    assert p["split"] and p["mode_chosen"] == "window" and p["window_cells"] % ALIGN == 0
    d = p["budget"]["devices"][0]
    assert d["host_memory"] and d["name"] == "host memory" and d["ring_bytes"] == 0
    # the weights are the model's buffers: a little under the file size
    assert 0.8 * demo_model.stat().st_size < d["weights_bytes"] <= demo_model.stat().st_size
    # compute estimate: at least the 512-token logits (49152-token vocabulary, f32)
    assert d["compute_bytes"] >= 512 * 49152 * 4 and "512-token ubatch" in p["budget"]["compute_note"]
    cell = 30 * 2 * 3 * 64 * 2
    assert d["cell_bytes"] == cell and d["kv_budget_bytes"] == 300 * MiB - d["weights_bytes"] - d["compute_bytes"]
    assert (p["window_cells"] + 1) * cell <= d["kv_budget_bytes"] < (p["window_cells"] + ALIGN + 1) * cell
    assert p["device_bytes"] == 30 * (p["window_cells"] + 1) * 2 * 3 * 64 * 2
    assert p["estimate"]["ms_per_token"] > 0


def test_live_cpu_minimum_target_is_exact(live):
    m = live["target"]["budget"]["min_target_mib"]
    assert live["at_min"]["window_cells"] == ALIGN
    assert f"below the minimum of {m} MiB" in live["under_min"]["refused"]
    assert live["error_after_success"] == ""  # the next context that succeeds clears it


def test_server_refuses_a_target_below_the_minimum(cpu_build, demo_model):
    proc = subprocess.run([str(cpu_build.artifact("llama-server")), "-m", str(demo_model), "-t", "2", "-c", "4096",
                           "--vram-target", "50", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "vram_target 50 MiB is below the minimum of" in proc.stdout + proc.stderr


def test_server_reports_the_budget_in_props(cpu_build, demo_model, tmp_path):
    from rollingkv_cli.serve.server import ServerProcess

    env = {**os.environ, "ROLLINGKV_SLOTS": "2"}
    with ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(demo_model), "-t", "2", "-c", "8192", "-np", "1", "-fa", "on",
                                                            "--vram-target", "300", "--pcie-bw-gbps", "20"],
                       log_path=tmp_path / "srv.log", env=env) as srv:
        plan = srv.request("/props")["rolling_kv"]
    assert plan["mode_requested"] == "auto" and plan["split"] and plan["window_cells"] % ALIGN == 0
    # host memory streams nothing: no ring, whatever ROLLINGKV_SLOTS says (the ring is the GPU backend's figure)
    assert plan["budget"]["vram_target_mib"] == 300 and plan["budget"]["ring_slots"] == 0 and plan["budget"]["ring_bytes"] == 0
    assert plan["link"]["link_bw_gbps"] == pytest.approx(20.0) and plan["estimate"]["ms_per_token"] > 0
    # the server's one line at start (the library's own budget lines are below its default log level)
    assert f"chosen window, window {plan['window_cells']} + tail" in (tmp_path / "srv.log").read_text()


_ISWA = LIB_PRELUDE + """model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
out = {}
for swa_full in (True, False):
    logs.clear()
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1; cp.n_threads = 2; cp.swa_full = swa_full
    ctx = ext.init_context(model, cp, ext.make_params(mode="auto", vram_target_mib=60))
    text = "".join(logs)
    swa = re.search(r"creating +SWA KV cache.*?KV buffer size = +([0-9.]+) MiB", text, re.S)
    out[str(swa_full)] = {"plan": ext.plan(ctx), "swa_mib": float(swa.group(1))}
    llama_cpp.llama_free(ctx)
print(json.dumps(out))
"""


def test_live_iswa_counts_the_swa_cache(cpu_build, tmp_path):
    """An iSWA model: the SWA cache never splits and is allocated after the planning cache, so the budget holds it
    ("other KV"), sized as llama_kv_cache_iswa sizes it (full, or n_swa + n_ubatch padded to 256)."""
    from rollingkv_cli import models

    model = models.write_synthetic(tmp_path / "g2.gguf", models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=1000,
                                                                          ctx=4096, arch="gemma2", sliding_window=128))
    r = run_python(_ISWA, cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(model)})
    row = 2 * 2 * 64 * 2  # K + V, 2 KV heads x 64, f16
    for swa_full, cells in (("True", 4096), ("False", 768)):
        plan, swa_mib = r[swa_full]["plan"], r[swa_full]["swa_mib"]
        other = plan["budget"]["other_kv_bytes"]
        assert other == 2 * cells * row  # layers 0 and 2 are the SWA ones
        assert other == pytest.approx(swa_mib * MiB, abs=0.01 * MiB)  # what the SWA cache then allocated
        d = plan["budget"]["devices"][0]
        assert d["kv_budget_bytes"] == d["avail_bytes"] - d["compute_bytes"] - other
        assert sorted(layer["il"] for layer in plan["layers"]) == [1, 3]  # only the global layers can split
    full, small = r["True"]["plan"], r["False"]["plan"]
    assert full["split"]
    # 3.25 MiB less SWA cache leave a larger window, or room for the whole KV (4 MiB)
    assert (small["window_cells"] > full["window_cells"]) or small["mode_chosen"] == "resident"


# ------------------------------------------------------------------------------ the hybrid tail's share


CPU_PART_LATENCY_MS = 0.09  # LLAMA_RKV_CPU_PART_LATENCY_MS, per split layer (the H200 latency probe)
LAYER_DECODE_MS = 0.06      # LLAMA_RKV_LAYER_DECODE_MS, per split layer (the H200's resident decode beyond its bytes)


def _best_share(p: dict, cpu_gbps: float, link_gbps: float, scale: float = 1.0, layer_ms: float = LAYER_DECODE_MS,
                latency_ms: float = CPU_PART_LATENCY_MS) -> float:
    """The documented model (llama-kv-residency.h): f in steps of 1/64 minimizing
    max(t_res + n_layer x layer + f x tail/cpu + n_layer x latency, (1 - f) x tail/link); none when that gains < 3 %.
    scale: the tail in use over the full context's (auto chooses again as the tail grows); layer_ms, latency_ms: the
    per-layer terms (measured on the device, else the planner's constants)."""
    est = p["estimate"]
    n_layer = sum(1 for layer in p["layers"] if layer["split"])
    t_res, tail = est["t_resident_ms"] + n_layer * layer_ms, scale * est["tail_bytes_per_token"]

    def t(f):
        return max(t_res + f * tail / (cpu_gbps * 1e9) * 1e3 + (n_layer * latency_ms if f > 0 else 0.0),
                   (1 - f) * tail / (link_gbps * 1e9) * 1e3)
    best = min((i / 64 for i in range(65)), key=lambda f: (t(f), f))
    return 0.0 if t(best) > 0.97 * t(0.0) else best


@pytest.mark.parametrize("link", [6.5, 25.0, 53.5])
def test_auto_share_follows_the_link(sim, link):
    """A slower link leaves more of the tail to the CPU: most of it on PCIe 3.0 x8 (6.5 GB/s) against 40 GB/s of CPU
    attention, about half on PCIe 4.0 x16, less on Gen5; exactly the share the documented model gives."""
    p = sim[f"hyb_auto_{link:g}"]
    tc = p["tail_cpu"]
    assert p["split"] and tc["requested"] == "auto" and tc["cpu_attn_source"] == "request"
    assert tc["cpu_attn_gbps"] == pytest.approx(40.0)
    assert tc["frac"] == pytest.approx(_best_share(p, 40.0, link), abs=1e-6)
    assert tc["reason"].startswith("auto: ") and f"link {link:.1f} GB/s" in tc["reason"]
    assert p["estimate"]["t_token_hybrid_ms"] < p["estimate"]["ms_per_token"]
    if link == 6.5:
        assert tc["frac"] > 0.8
    elif link == 25.0:
        assert 0.5 < tc["frac"] < 0.7


@pytest.mark.parametrize("link", [6.5, 25.0, 53.5])
def test_auto_share_is_chosen_again_as_the_tail_grows(sim, link):
    """The CPU part's per-layer cost does not shrink with the tail, so a short tail (just past the window) is streamed
    whole and the share grows towards the full context's: the plan names the shortest tail (in 256-cell steps of n_kv)
    with a CPU part, exactly where the documented model, its tail terms scaled to that tail, first takes one."""
    p = sim[f"hyb_auto_{link:g}"]
    tc, full = p["tail_cpu"], p["tail_cells"]
    steps = [min(c, full) for c in range(256, full + 256, 256)]
    first = next(c for c in steps if _best_share(p, 40.0, link, c / full) > 0)
    assert tc["from_tail_cells"] == first and f"none below {first} cells" in tc["reason"]
    assert 256 < first < full  # neither bound: the test could not tell a model that ignores the tail from one that does not
    assert _best_share(p, 40.0, link, (first - 256) / full) == 0
    assert sim["hyb_fixed"]["tail_cpu"]["from_tail_cells"] is None  # a requested share is used at every tail
    assert sim["hyb_off"]["tail_cpu"]["from_tail_cells"] is None


def test_auto_share_on_the_h200s_figures(sim):
    """What auto takes with the figures the H200 bench measured (docs/perf/2026-12-03-h200-head-split): about 0.37 of an f16
    tail (the fixed shares measured 0.39 and 0.5 near each other), and no CPU part for a q4_0 tail, where that run's auto
    took 0.078 and lost 23 % to the GPU alone (6.91 against 5.63 ms): the model without a layer's decode cost beyond its
    bytes (t_resident 1.77 ms against 3.45 measured) saw the CPU part as free."""
    f16, q4 = sim["h200_f16"], sim["h200_q4_0"]
    assert f16["window_cells"] == 8192 and f16["estimate"]["t_resident_ms"] == pytest.approx(1.77, abs=0.05)
    assert f16["tail_cpu"]["frac"] == pytest.approx(_best_share(f16, 69.64, 54.65), abs=1e-6)
    assert 0.3 < f16["tail_cpu"]["frac"] < 0.45
    assert q4["tail_cpu"]["frac"] == 0 and "gain < 3 %" in q4["tail_cpu"]["reason"]
    assert _best_share(q4, 43.19, 54.65) == 0


def test_auto_share_is_monotone_in_the_link(sim):
    shares = [sim[f"hyb_auto_{link:g}"]["tail_cpu"]["frac"] for link in (6.5, 25.0, 53.5)]
    assert shares[0] > shares[1] > shares[2] > 0


def test_the_default_request_is_auto(sim):
    """Auto unless asked otherwise (on the H200 the CPU part pays for f16 and q8_0 tails, and auto declines where its model
    says it would not: docs/perf/2026-12-03-h200-hybrid-tail): the same share as an explicit auto."""
    tc = sim["hyb_default"]["tail_cpu"]
    assert tc["requested"] == "auto" and tc["frac"] == sim["hyb_auto_25"]["tail_cpu"]["frac"] > 0
    assert sim["hyb_default"]["estimate"]["t_token_hybrid_ms"] is not None
    off = sim["hyb_off"]["tail_cpu"]
    assert off["requested"] == 0 and off["frac"] == 0 and "off" in off["reason"]
    assert sim["hyb_off"]["estimate"]["t_token_hybrid_ms"] is None


def test_a_requested_share_is_used_as_given(sim):
    p = sim["hyb_fixed"]
    assert p["tail_cpu"]["frac"] == pytest.approx(0.5) and p["tail_cpu"]["reason"] == "requested"
    assert p["estimate"]["t_token_hybrid_ms"] == pytest.approx(
        max(p["estimate"]["t_resident_ms"] + 32 * LAYER_DECODE_MS + 0.5 * p["estimate"]["tail_bytes_per_token"] / 40e9 * 1e3 + 32 * CPU_PART_LATENCY_MS,
            0.5 * p["estimate"]["tail_bytes_per_token"] / 53.5e9 * 1e3), rel=1e-4)


def test_auto_without_a_cpu_bandwidth_stays_off(sim):
    tc = sim["hyb_unknown_cpu"]["tail_cpu"]
    assert tc["frac"] == 0 and "CPU attention bandwidth is unknown" in tc["reason"] and tc["cpu_attn_gbps"] is None


def test_auto_measures_what_the_request_leaves_out(sim):
    p = sim["hyb_measured"]
    tc = p["tail_cpu"]
    assert tc["cpu_attn_source"] == "given (measured)" and tc["cpu_attn_gbps"] == pytest.approx(40.0)
    assert p["link"]["link_bw_gbps"] == pytest.approx(6.5) and p["link"]["link_bw_source"] == "given (measured)"
    assert tc["frac"] == pytest.approx(sim["hyb_auto_6.5"]["tail_cpu"]["frac"])


def test_auto_measures_the_cpu_part_at_several_rows_per_cell(sim):
    """A step of several sequences over a shared prefix dots each of its cells once per row: auto measures the CPU part
    at 2, 4 and 8 rows and keeps its slowdown against one row for each count (interpolated between), which the share
    each step takes follows; the share at full context (one row) does not change. Without the measurement: 1 everywhere."""
    tc, base = sim["hyb_rows"]["tail_cpu"], sim["hyb_measured"]["tail_cpu"]
    assert tc["cpu_attn_rows_gbps"] == {"2": pytest.approx(30.0), "4": pytest.approx(16.0), "8": pytest.approx(8.0)}
    assert tc["cpu_rows_slowdown"] == pytest.approx([1.0, 4 / 3, (4 / 3 + 2.5) / 2, 2.5, 2.5 + 2.5 / 4, 2.5 + 2.5 / 2,
                                                     2.5 + 2.5 * 3 / 4, 5.0], rel=1e-4)
    assert tc["frac"] == pytest.approx(base["frac"])
    assert base["cpu_rows_slowdown"] == [1.0] * 8 and base["cpu_attn_rows_gbps"] == {"2": None, "4": None, "8": None}


def test_auto_measures_the_per_layer_terms_where_it_runs(sim):
    """Issue 26, 4: auto's time model takes a decode layer's cost beyond its bytes and a CPU part's hand-off as the
    device measures them (plan-simulate gives what the probes would), shows them and their source in the plan, and its
    share follows them: a slow hand-off leaves less of the tail to the CPU than a fast one. Without a measurement (a
    backend without the probe), the constants, said to be the H200's."""
    slow, fast = sim["hyb_calib_slow"], sim["hyb_calib_fast"]
    for p, latency in ((slow, 20.0), (fast, 0.01)):
        tc = p["tail_cpu"]
        assert tc["layer_decode_ms"] == pytest.approx(0.02) and tc["cpu_part_latency_ms"] == pytest.approx(latency)
        assert tc["layer_decode_source"] == tc["cpu_part_latency_source"] == "given (measured)"
        assert tc["frac"] == pytest.approx(_best_share(p, 40.0, 25.0, layer_ms=0.02, latency_ms=latency), abs=1e-6)
        assert f"{latency:.3f} ms per CPU part" in tc["reason"] and "0.020 ms of decode beyond its bytes" in tc["reason"]
    assert 0 < slow["tail_cpu"]["frac"] < fast["tail_cpu"]["frac"]
    # the constants where nothing was measured, and said so
    tc = sim["hyb_auto_25"]["tail_cpu"]
    assert tc["layer_decode_ms"] == pytest.approx(LAYER_DECODE_MS) and tc["cpu_part_latency_ms"] == pytest.approx(CPU_PART_LATENCY_MS)
    assert tc["layer_decode_source"].startswith("assumed: the H200's") and tc["cpu_part_latency_source"].startswith("assumed")
    # a requested share measures nothing (auto only): the constants
    fixed = sim["hyb_calib_fixed"]["tail_cpu"]
    assert fixed["frac"] == pytest.approx(0.5) and fixed["cpu_part_latency_ms"] == pytest.approx(CPU_PART_LATENCY_MS)
    # no split, no CPU part: no terms
    assert sim["hyb_off"]["tail_cpu"]["layer_decode_ms"] is None and sim["hyb_off"]["tail_cpu"]["cpu_part_latency_ms"] is None


def test_auto_takes_none_when_the_cpu_is_too_slow_to_gain(sim):
    tc = sim["hyb_fast_cpu_no_gain"]["tail_cpu"]
    assert tc["frac"] == 0 and "gain < 3 %" in tc["reason"]


def test_no_cpu_part_for_a_tail_type_it_cannot_read_or_without_gpu(sim):
    assert sim["hyb_q4_1"]["tail_cpu"]["frac"] == 0 and "q4_1" in sim["hyb_q4_1"]["tail_cpu"]["reason"]
    assert sim["hyb_host"]["tail_cpu"]["frac"] == 0 and "no GPU" in sim["hyb_host"]["tail_cpu"]["reason"]


# ------------------------------------------------------------------------------ the head split


def _heads(p: dict) -> list[int]:
    return [layer["device_heads"] for layer in p["layers"]]


def test_head_explicit(sim):
    """--kv-device-heads N: N KV heads of every layer on the device for every cell, the other 8 - N in host memory; every
    token streams the host heads of all n_kv cells (at full context in the estimate)."""
    p = sim["head_explicit"]
    assert p["mode_chosen"] == "head" and p["split"] and p["reason"].startswith("head: explicit 3 device KV heads per layer")
    assert p["heads"] == {"requested": 3, "eligible": True, "refuse": None, "split": True, "device": 96, "host": 160,
                          "summary": "3 of 8 KV heads on the device, 32 of 32 layers split", "per_layer": [3] * 32}
    kv = GPU["kv_size"]
    for layer in p["layers"]:
        assert (layer["n_head_kv"], layer["device_heads"], layer["host_heads"]) == (8, 3, 5)
        assert layer["device_bytes"] == kv * 3 * HEAD_BYTES and layer["host_bytes"] == kv * 5 * HEAD_BYTES
        assert layer["split"] and layer["tail_cells"] == kv
    assert p["window_cells"] == 0 and p["tail_cells"] == kv  # every cell is "tail" for the host heads
    est = p["estimate"]
    # (the plan's JSON numbers have 6 significant digits)
    assert est["tail_bytes_per_token"] == pytest.approx(kv * 32 * 5 * HEAD_BYTES, rel=1e-5)
    assert est["device_bytes_per_token"] == pytest.approx(4500 * MiB + kv * 32 * 3 * HEAD_BYTES, rel=1e-5)
    assert est["ms_per_token"] == pytest.approx(est["device_bytes_per_token"] / 4000e9 * 1e3 + est["tail_bytes_per_token"] / 53.5e9 * 1e3, rel=1e-5)
    assert not p["budget"]["budgeted"]


def test_head_explicit_all_heads_is_resident(sim):
    for name in ("head_explicit_all", "head_explicit_more"):
        p = sim[name]
        assert p["mode_chosen"] == "resident" and not p["split"] and "resident" in p["reason"], name
        assert _heads(p) == [8] * 32 and p["heads"]["device"] == 0


def test_auto_with_device_heads_means_head(sim):
    p = sim["head_auto_n"]
    assert p["mode_requested"] == "auto" and p["mode_chosen"] == "head" and _heads(p) == [2] * 32
    assert p["auto"] is None  # an explicit head split: nothing to compare


def _fill(kv_budget: int, n_layers: list[int], head_bytes: int, kv: int, conv_head: int = 0) -> list[int]:
    """The documented fill, written out: one head per layer, then one at a time to the first layer with the fewest that
    can take one while the device bytes (+ the f16 copy of one layer's device heads) fit."""
    h = [1] * len(n_layers)
    full = [False] * len(n_layers)

    def used():
        return (sum(h) * head_bytes + max(x * conv_head for x in h)) * kv
    while True:
        cand = [i for i in range(len(h)) if not full[i] and h[i] < n_layers[i]]
        if not cand:
            return h
        i = min(cand, key=lambda j: (h[j], j))
        h[i] += 1
        if used() > kv_budget:
            h[i] -= 1
            full[i] = True


def test_head_budget_fills_heads_round_robin(sim):
    """With a budget: as many KV heads per layer as fit, at most one apart, the first layers first; the bytes left over are
    less than one head of one layer (the head split's granularity)."""
    p = sim["head_budget"]
    kv = GPU["kv_size"]
    d = p["budget"]["devices"][0]
    assert p["mode_chosen"] == "head" and p["budget"]["budgeted"] and p["reason"].startswith("head: the most KV heads per layer")
    h = _heads(p)
    assert h == _fill(d["kv_budget_bytes"], [8] * 32, HEAD_BYTES, kv)
    assert max(h) - min(h) <= 1 and h == sorted(h, reverse=True)
    used = sum(h) * HEAD_BYTES * kv
    assert used <= d["kv_budget_bytes"] < used + HEAD_BYTES * kv
    assert p["device_bytes"] == used and p["host_bytes"] == (256 - sum(h)) * HEAD_BYTES * kv
    # the same budget as the window mode's: kv_budget = target - weights - compute - runtime - ring
    assert d["kv_budget_bytes"] == (12000 - WEIGHTS_ETC_MIB) * MiB


def test_head_budget_counts_the_flash_attention_copy_and_the_tail_types(sim):
    p = sim["head_budget_q8"]
    kv = GPU["kv_size"]
    hb_w = 2 * row("q8_0", 128)
    d = p["budget"]["devices"][0]
    assert _heads(p) == _fill(d["kv_budget_bytes"], [8] * 32, hb_w, kv, conv_head=2 * 128 * 2)
    assert p["host_bytes"] == sum(8 - h for h in _heads(p)) * 2 * row("q4_0", 128) * kv
    assert p["type_k_tail"] == "q4_0" and p["type_v"] == "q8_0"


def test_head_budget_fits_and_minimum(sim):
    assert sim["head_fits"]["mode_chosen"] == "resident" and "fits" in sim["head_fits"]["reason"]
    below, at = sim["head_below_min"], sim["head_at_min"]
    assert below["mode_chosen"] == "refused" and f"below the head split's minimum of {HEAD_MIN_MIB} MiB" in below["error"]
    assert "one KV head of each of 32 layers" in below["error"] and below["budget"]["min_target_mib"] == HEAD_MIN_MIB
    assert at["mode_chosen"] == "head" and _heads(at) == [1] * 32
    assert "no GPU and no vram_target" in sim["head_no_target_host"]["reason"]


def test_head_refused_for_mqa_and_alibi(sim):
    """An explicit head split of a model that cannot split by head is refused (no context), with the reason."""
    for name, why in (("head_mqa", "one KV head (MQA)"), ("head_alibi", "ALiBi"), ("head_layers_mqa", "one KV head (MQA)")):
        p = sim[name]
        assert p["mode_chosen"] == "refused" and why in p["error"] and "head split is not possible" in p["error"], name
        assert p["heads"]["eligible"] is False and why in p["heads"]["refuse"]


def test_head_layers_of_different_head_counts(sim):
    n = [8, 2, 4, 8]
    ex = sim["head_layers_n"]
    assert _heads(ex) == [3, 2, 3, 3]  # min(N, the layer's heads): a layer of 2 stays whole
    assert [layer["split"] for layer in ex["layers"]] == [True, False, True, True]
    assert ex["heads"]["summary"] == "2-3 of 2-8 KV heads on the device, 3 of 4 layers split"
    p = sim["head_layers"]
    kv = 1048576
    d = p["budget"]["devices"][0]
    assert _heads(p) == _fill(d["kv_budget_bytes"], n, HEAD_BYTES, kv)
    assert all(1 <= h <= hk for h, hk in zip(_heads(p), n))


def test_head_two_devices_each_fill_their_own(sim):
    p = sim["head_two_gpus"]
    kv = GPU["kv_size"]
    devs = p["budget"]["devices"]
    h = _heads(p)
    assert h[:16] == _fill(devs[0]["kv_budget_bytes"], [8] * 16, HEAD_BYTES, kv)
    assert h[16:] == _fill(devs[1]["kv_budget_bytes"], [8] * 16, HEAD_BYTES, kv)
    assert sum(h[:16]) > sum(h[16:])  # CUDA1 holds 500 MiB more weights


def test_head_invalid_input(sim):
    assert sim["head_bad_list"].get("invalid_input") and "one count per layer" in sim["head_bad_list"]["error"]


def test_auto_ties_go_to_the_window(sim):
    """Both splits keep about the same bytes on the device for the same budget; at full context they stream about the
    same, apart from their granularity; at any shorter context the window streams less. auto takes the window unless the
    head split is more than 3 % cheaper both at full context and on average over a sequence growing to it."""
    p = sim["auto_tie"]
    a = p["auto"]
    assert p["mode_chosen"] == "window" and a["window"]["candidate"] and a["head"]["candidate"]
    w, h = a["window"], a["head"]
    assert h["ms_per_token"] >= 0.97 * w["ms_per_token"]
    # over a sequence growing to full context the window streams far less (nothing while it fits the window)
    assert h["tail_bytes_per_token_mean"] > 1.5 * w["tail_bytes_per_token_mean"] and h["ms_per_token_mean"] > w["ms_per_token_mean"]
    kv, wc = GPU["kv_size"], p["window_cells"]
    assert w["tail_bytes_per_token_mean"] == pytest.approx((kv - wc) ** 2 / (2 * kv) * 32 * 4096, rel=1e-5)
    assert h["tail_bytes_per_token_mean"] == pytest.approx(h["tail_bytes_per_token"] / 2, rel=1e-5)
    assert a["reason"].startswith("auto: window: the head split")
    assert w["tail_bytes_per_token"] == p["estimate"]["tail_bytes_per_token"]
    assert _heads(p) == [8] * 32 and p["heads"]["device"] == 0


def test_auto_takes_the_head_split_where_it_is_cheaper(sim):
    """A 1024-cell context whose budget holds ~1000 cells: the window must round down to 768 cells (a 256-cell step is a
    quarter of the KV) and streams 256 cells of every layer; the head split leaves out a few heads of 1024 cells."""
    p = sim["auto_coarse_window"]
    a = p["auto"]
    assert p["mode_chosen"] == "head" and a["reason"].startswith("auto: head")
    assert a["head"]["ms_per_token"] < 0.97 * a["window"]["ms_per_token"]
    assert a["head"]["ms_per_token_mean"] < 0.97 * a["window"]["ms_per_token_mean"]
    assert a["window"]["tail_bytes_per_token"] == pytest.approx(256 * 32 * 4096, rel=1e-5)
    assert p["estimate"]["tail_bytes_per_token"] == a["head"]["tail_bytes_per_token"] < a["window"]["tail_bytes_per_token"]


def test_auto_takes_the_head_split_where_no_window_fits(sim):
    p = sim["auto_no_window"]
    assert p["mode_chosen"] == "head" and "the window does not fit" in p["auto"]["reason"]
    assert p["auto"]["window"]["candidate"] is False and "256-cell KV window" in p["auto"]["window"]["why_not"]
    assert p["budget"]["min_target_mib"] == NO_RING_MIB + 8  # one head of each layer: 32 x 512 cells x 512 bytes


def test_auto_never_splits_mqa_by_head(sim):
    p = sim["auto_mqa"]
    assert p["mode_chosen"] == "window" and p["auto"]["head"]["candidate"] is False
    assert "MQA" in p["auto"]["head"]["why_not"] and p["auto"]["reason"].startswith("auto: window, no head split")
    q = sim["auto_mqa_no_window"]
    assert q["mode_chosen"] == "refused" and "256-cell KV window" in q["error"]


def test_serve_describes_a_head_plan(sim):
    from rollingkv_cli.serve import status

    d = status.describe_plan(sim["head_budget"])
    assert d.startswith("residency: head") and "of 8 KV heads on the device" in d and "per layer" in d
    lines = status.describe_plan_details(sim["auto_tie"])
    assert any(line.startswith("auto: window") for line in lines)


def test_auto_two_unequal_devices_keep_the_window(sim):
    """Two GPUs whose budgets differ: the window is one size for all layers, so the tighter device decides it and the other
    leaves room unused; a head split fills each device and streams less at full context, but over a sequence growing
    to it the window streams less: auto keeps the window."""
    a = sim["two_gpus"]["auto"]
    assert sim["two_gpus"]["mode_chosen"] == "window" and a["head"]["candidate"]
    assert a["head"]["ms_per_token"] < 0.97 * a["window"]["ms_per_token"]
    assert a["head"]["ms_per_token_mean"] > a["window"]["ms_per_token_mean"]
