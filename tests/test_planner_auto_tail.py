"""Auto tail types (-ctkt/-ctvt auto): the planner's choice of a split's tail type (llama_rkv_choose_tail_types).

The rule, written out independently here from the docs (docs/reference/llama-server.md, "Auto tail types"):

    nothing spills (resident)            the window's type
    floor(window)                        q8_0 for f32/f16/bf16, else the window's own type
    t_link = tail bytes per token at full context at the floor types / link bandwidth
    t_res  = (weights + other KV + the device's KV) / memory bandwidth
    q4_0   where t_link > 1 x t_res      (for windows wider than q4_0), else the floor

Most tests run it on given figures through rollingkv_plan_simulate (the planner test library); the last ones run the
real planner on the CPU build with the demo model, llama-server and llama-bench.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import LIB_PRELUDE, run_python
from test_planner import ALIGN, GPU, MiB, _SIMULATE, fig, row

pytestmark = pytest.mark.build

Q4_RATIO = 1.0
AUTO = dict(type_k_tail="auto", type_v_tail="auto")
WINDOW_12000 = 51456  # the window the GPU figures give at a 12000 MiB target (test_planner's arithmetic, f16 window)


def floor_of(t: str) -> str:
    return "q8_0" if t in ("f32", "f16", "bf16") else t


def times(f: dict, wc: int, tk: str, tv: str) -> tuple[float, float]:
    """(t_res, t_link) in ms for a window split of wc cells of figures f, the tail at tk/tv (one device, one stream)."""
    n_layer, nk, nv = f["n_layer"], f["n_embd_k_gqa"], f["n_embd_v_gqa"]
    wk, wv = f.get("type_k", "f16"), f.get("type_v", "f16")
    device = f["weights_mib"] * MiB + f.get("other_kv_mib", 0) * MiB + wc * n_layer * (row(wk, nk) + row(wv, nv))
    tail = (f["kv_size"] - wc) * n_layer * (row(tk, nk) + row(tv, nv))
    return device / (f["mem_bw_gbps"] * 1e9) * 1e3, tail / (f["pcie_bw_gbps"] * 1e9) * 1e3


def expected(f: dict, wc: int) -> tuple[str, str]:
    """The rule for a window split of wc cells, both axes auto."""
    wk, wv = f.get("type_k", "f16"), f.get("type_v", "f16")
    fk, fv = floor_of(wk), floor_of(wv)
    t_res, t_link = times(f, wc, fk, fv)
    if t_link > Q4_RATIO * t_res:
        wider = lambda t: row(t, 64) > row("q4_0", 64)  # noqa: E731
        return ("q4_0" if wider(wk) else fk), ("q4_0" if wider(wv) else fv)
    return fk, fv


# a tail of 1024 cells behind an explicit window: q8_0's link time 1.33 ms against 5.4 ms resident (the floor)
SMALL_TAIL = dict(mode="window", window_cells=130048)
TARGETS = (8000, 12000, 14000, 16000, 20000, 22000)


def tie_link(f: dict, wc: int) -> float:
    """The link bandwidth (GB/s) at which the floor tail's link time equals the resident time."""
    t_res, t_link = times(f, wc, floor_of(f.get("type_k", "f16")), floor_of(f.get("type_v", "f16")))
    return f["pcie_bw_gbps"] * t_link / t_res


def _cases() -> dict:
    c = {
        "big_tail": fig(vram_target_mib=12000, **AUTO),
        "big_tail_f16": fig(vram_target_mib=12000),
        "small_tail": fig(**SMALL_TAIL, **AUTO),
        "fits": fig(vram_target_mib=40000, kv_size=8192, **AUTO),
        "no_link": fig(vram_target_mib=12000, pcie_bw_gbps=0, **AUTO),
        "no_mem_bw": fig(vram_target_mib=12000, mem_bw_gbps=0, **AUTO),
        "link_measured": fig(vram_target_mib=12000, pcie_bw_gbps=0, link_measured_gbps=53.5, **AUTO),
        "k_only": fig(vram_target_mib=12000, type_k_tail="auto"),
        "k_only_small": fig(**SMALL_TAIL, type_k_tail="auto", type_v_tail="f32"),
        "no_q4": fig(vram_target_mib=12000, op_unsupported_tails=["q4_0"], **AUTO),
        "no_q8": fig(vram_target_mib=12000, op_unsupported_tails=["q8_0", "q4_0"], **AUTO),
        "host": fig(vram_target_mib=12000, host_memory=True, pcie_bw_gbps=0, **AUTO),
        "off": fig(mode="off", **AUTO),
        "off_k": fig(mode="off", type_k_tail="auto"),
        "whole_window": fig(mode="window", window_cells=131072, **AUTO),
        "all_heads": fig(mode="head", device_heads=8, **AUTO),
        "head": fig(mode="head", device_heads=3, **AUTO),
        "head_40": fig(mode="head", device_heads=3, n_embd_k_gqa=320, n_embd_v_gqa=320, head_k=40, head_v=40, **AUTO),
        "window_40": fig(vram_target_mib=8000, n_embd_k_gqa=320, n_embd_v_gqa=320, head_k=40, head_v=40, **AUTO),
        "bad": fig(type_k_tail="automatic"),
    }
    for t in ("f32", "bf16", "q8_0", "q5_1", "q4_1", "q4_0"):
        c[f"win_{t}_big"] = fig(vram_target_mib=7000, type_k=t, type_v=t, **AUTO)
        c[f"win_{t}_small"] = fig(**SMALL_TAIL, type_k=t, type_v=t, **AUTO)
    # the link bandwidth just either side of the tie between the q8_0 tail's link time and the resident time
    tie = tie_link(fig(**SMALL_TAIL), SMALL_TAIL["window_cells"])
    c["tie_below"] = fig(**SMALL_TAIL, **AUTO, pcie_bw_gbps=tie * 0.99)  # the link is slower: it dominates
    c["tie_above"] = fig(**SMALL_TAIL, **AUTO, pcie_bw_gbps=tie * 1.01)
    # the same model at growing targets over a fast link (900 GB/s: a GH200's C2C): the window grows, the tail shrinks, and the
    # choice follows each plan (q4_0, then the q8_0 floor, then resident: the window's type)
    for t in TARGETS:
        c[f"target{t}"] = fig(vram_target_mib=t, pcie_bw_gbps=900, **AUTO)
    return c


CASES = _cases()


@pytest.fixture(scope="module")
def sim(cpu_build) -> dict:
    return run_python(_SIMULATE, cpu_build.lib_dir, env_extra={"RKV_CASES": json.dumps(CASES)})


def types_of(p: dict) -> tuple[str, str]:
    return p["tail_types"]["k"], p["tail_types"]["v"]


def test_a_long_tail_gets_q4_0(sim):
    f, p = CASES["big_tail"], sim["big_tail"]
    wc = p["window_cells"]
    assert p["split"] and wc == WINDOW_12000 == sim["big_tail_f16"]["window_cells"]  # the budget is the window's, whatever the tail
    t_res, t_link = times(f, wc, "q8_0", "q8_0")
    assert t_link > 30 * t_res  # 80 K cells over 53.5 GB/s against 4.5 GiB at 4 TB/s
    tt = p["tail_types"]
    assert (tt["requested_k"], tt["requested_v"], tt["auto"]) == ("auto", "auto", True)
    assert types_of(p) == expected(f, wc) == ("q4_0", "q4_0") and (p["type_k_tail"], p["type_v_tail"]) == ("q4_0", "q4_0")
    assert tt["t_resident_ms"] == pytest.approx(t_res, rel=1e-4) and tt["t_link_floor_ms"] == pytest.approx(t_link, rel=1e-4)
    assert tt["q4_ratio"] == Q4_RATIO and "exceeds 1 x the resident time" in tt["reason"]
    # the tail is allocated, streamed and estimated at the chosen type
    tail_q4 = f["n_layer"] * 2 * row("q4_0", 1024)
    assert p["host_bytes"] == (f["kv_size"] - wc + 1) * tail_q4
    assert p["estimate"]["tail_bytes_per_token"] == pytest.approx((f["kv_size"] - wc) * tail_q4, rel=1e-5)
    assert sim["big_tail_f16"]["tail_types"]["auto"] is False and sim["big_tail_f16"]["tail_types"]["requested_k"] is None


def test_a_short_tail_gets_the_q8_0_floor(sim):
    f, p = CASES["small_tail"], sim["small_tail"]
    t_res, t_link = times(f, SMALL_TAIL["window_cells"], "q8_0", "q8_0")
    assert t_link < t_res
    assert types_of(p) == ("q8_0", "q8_0") == expected(f, SMALL_TAIL["window_cells"])
    assert "the floor" in p["tail_types"]["reason"] and "within 1 x" in p["tail_types"]["reason"]
    assert p["host_bytes"] == (f["kv_size"] - SMALL_TAIL["window_cells"] + 1) * f["n_layer"] * 2 * row("q8_0", 1024)


def test_the_ratio_is_the_boundary(sim):
    """Just below the tie the link dominates (q4_0), just above it does not (q8_0)."""
    assert types_of(sim["tie_below"]) == ("q4_0", "q4_0")
    assert types_of(sim["tie_above"]) == ("q8_0", "q8_0")
    tt = sim["tie_below"]["tail_types"]
    assert tt["t_link_floor_ms"] == pytest.approx(tt["t_resident_ms"] / 0.99, rel=1e-3)


def test_nothing_spills_keeps_the_window_types(sim):
    p = sim["fits"]
    assert p["mode_chosen"] == "resident" and types_of(p) == ("f16", "f16")
    assert "nothing spills" in p["tail_types"]["reason"] and p["tail_types"]["t_link_floor_ms"] is None


@pytest.mark.parametrize("t", ["f32", "bf16", "q8_0", "q5_1", "q4_1", "q4_0"])
def test_the_window_type_sets_the_floor(sim, t):
    for size in ("big", "small"):
        name = f"win_{t}_{size}"
        f, p = CASES[name], sim[name]
        assert p["split"], name
        assert types_of(p) == expected(f, p["window_cells"]), name
    assert types_of(sim[f"win_{t}_small"]) == (floor_of(t), floor_of(t))
    assert types_of(sim[f"win_{t}_big"]) == ("q4_0", "q4_0")  # every window here is as wide as q4_0 or wider


def test_each_axis_on_its_own(sim):
    """K auto, V explicit: V keeps its type and counts in the link time at it."""
    f, p = CASES["k_only"], sim["k_only"]
    assert types_of(p) == ("q4_0", "f16")
    assert p["tail_types"]["requested_v"] is None  # V: the window's type, not asked for
    f, p = CASES["k_only_small"], sim["k_only_small"]
    wc = SMALL_TAIL["window_cells"]
    t_res, t_link = times(f, wc, "q8_0", "f32")
    assert t_link < t_res and types_of(p) == ("q8_0", "f32") and p["tail_types"]["requested_v"] == "f32"
    assert p["tail_types"]["t_link_floor_ms"] == pytest.approx(t_link, rel=1e-4)


def test_unknown_bandwidths_keep_the_floor(sim):
    for name in ("no_link", "no_mem_bw"):
        p = sim[name]
        assert types_of(p) == ("q8_0", "q8_0"), name
        assert "cannot be weighed" in p["tail_types"]["reason"], name
    # a link the request leaves out is measured where the device has one (a GPU), as the hybrid tail's is
    assert types_of(sim["link_measured"]) == ("q4_0", "q4_0")


def test_host_memory_weighs_the_tail_against_the_device_bytes(sim):
    """Without a GPU the tail is read from the same memory: t_link / t_res = tail bytes / device bytes."""
    f, p = CASES["host"], sim["host"]
    assert p["link"]["link_bw_gbps"] == pytest.approx(4000)
    assert types_of(p) == expected({**f, "pcie_bw_gbps": f["mem_bw_gbps"]}, p["window_cells"])


def test_a_type_the_device_cannot_stream_falls_back(sim):
    p = sim["no_q4"]
    assert types_of(p) == ("q8_0", "q8_0") and "cannot run the streaming op with a q4_0/q4_0 tail" in p["tail_types"]["reason"]
    p = sim["no_q8"]
    assert types_of(p) == ("f16", "f16") and "the window's types" in p["tail_types"]["reason"]


def test_the_choice_follows_each_plan(sim):
    """Growing targets: a larger window, a shorter tail; each plan's choice is the rule on its own split."""
    seen = []
    for t in TARGETS:
        f, p = CASES[f"target{t}"], sim[f"target{t}"]
        if p["mode_chosen"] == "resident":
            assert types_of(p) == ("f16", "f16")
        else:
            assert types_of(p) == expected(f, p["window_cells"]), t
        seen.append(types_of(p))
    assert seen[0] == ("q4_0", "q4_0") and seen[-1] == ("f16", "f16") and ("q8_0", "q8_0") in seen


def test_refusals(sim):
    for name, words in (("off", "mode off never splits"), ("off_k", "mode off never splits"),
                        ("whole_window", "window_cells 131072 holds the whole cache"),
                        ("all_heads", "keeps every KV head on the device"),
                        ("head_40", "host heads (K head size 40) cannot take the q8_0 tail")):
        p = sim[name]
        assert p["mode_chosen"] == "refused" and words in p["error"], name
    assert "-ctkt" in sim["head_40"]["error"]
    assert sim["bad"].get("invalid_input") and "unknown tail type" in sim["bad"]["error"]


def test_head_split(sim):
    """A head split's tail is its host heads of every cell: q4_0 here; a window split of 40-wide heads still takes q8_0/q4_0
    (whole rows of 320 are whole blocks), which the head split's host heads could not."""
    f, p = CASES["head"], sim["head"]
    assert p["mode_chosen"] == "head" and types_of(p) == ("q4_0", "q4_0")
    assert p["host_bytes"] == f["kv_size"] * f["n_layer"] * (8 - 3) * 2 * row("q4_0", 128)
    assert types_of(sim["window_40"]) == ("q4_0", "q4_0") and sim["window_40"]["mode_chosen"] == "window"


def test_serve_describes_the_choice(sim):
    from rollingkv_cli.serve import status

    line = status.describe_tail_types(sim["big_tail"])
    assert line.startswith("tail types (asked auto/auto): K q4_0, V q4_0 — auto: K q4_0, V q4_0: the tail's link-only time")
    assert status.describe_tail_types(sim["big_tail_f16"]) is None
    assert line in status.describe_plan_details(sim["big_tail"])


# ------------------------------------------------------------------------ the live planner on the CPU build

_LIVE = LIB_PRELUDE + """model = llama_cpp.llama_model_load_from_file(os.environ["RKV_TEST_MODEL"].encode(), llama_cpp.llama_model_default_params())
def plan(n_ctx, **kw):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx; cp.n_batch = 512; cp.n_ubatch = 512; cp.flash_attn_type = 1; cp.n_threads = 2; cp.n_threads_batch = 2
    ctx = ext.init_context(model, cp, ext.make_params(**kw))
    if not ctx:
        return {"refused": ext.last_error()}
    p = ext.plan(ctx)
    llama_cpp.llama_free(ctx)
    return p
A = dict(type_k_tail="auto", type_v_tail="auto")
print(json.dumps({"short": plan(4096, mode="window", window_cells=256, **A), "long": plan(16384, mode="window", window_cells=256, **A),
                  "off": plan(4096, mode="off", **A), "whole": plan(4096, mode="window", window_cells=4096, **A),
                  "resident": plan(4096, mode="auto", vram_target_mib=100000, **A)}))
"""


@pytest.fixture(scope="module")
def live(cpu_build, demo_model) -> dict:
    return run_python(_LIVE, cpu_build.lib_dir, env_extra={"RKV_TEST_MODEL": str(demo_model)})


DEMO_ROW = {t: 30 * 2 * row(t, 3 * 64) for t in ("f16", "q8_0", "q4_0")}  # 30 layers of 3 KV heads of 64, K + V


@pytest.mark.parametrize("name,n_ctx", [("short", 4096), ("long", 16384)])
def test_live_cpu_chooses_by_the_rule(live, name, n_ctx):
    """The demo model on the CPU: the tail is in the same memory as the device's bytes (link = memory bandwidth), so q4_0
    where the q8_0 tail holds more bytes than the weights and the window: 4096 cells do not, 16384 do."""
    p = live[name]
    assert p["split"] and p["window_cells"] == 256 and p["tail_types"]["auto"]
    device = p["estimate"]["device_bytes_per_token"]
    q8_tail = (n_ctx - 256) * DEMO_ROW["q8_0"]
    want = "q4_0" if q8_tail > Q4_RATIO * device else "q8_0"
    assert types_of(p) == (want, want) and want == {"short": "q8_0", "long": "q4_0"}[name]
    assert p["tail_types"]["t_link_floor_ms"] / p["tail_types"]["t_resident_ms"] == pytest.approx(q8_tail / device, rel=1e-3)
    assert p["host_bytes"] == (n_ctx - 256 + 1) * DEMO_ROW[want]


def test_live_cpu_refusals(live):
    assert "mode off never splits" in live["off"]["refused"]
    assert "window_cells 4096 holds the whole cache" in live["whole"]["refused"]
    assert live["resident"]["mode_chosen"] == "resident" and types_of(live["resident"]) == ("f16", "f16")


def test_server_takes_auto_and_reports_it_in_props(cpu_build, demo_model, tmp_path):
    from rollingkv_cli.serve.server import ServerProcess

    with ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(demo_model), "-t", "2", "-c", "4096", "-np", "1",
                                                            "-fa", "on", "--kv-window-cells", "256", "-ctkt", "auto", "-ctvt", "auto"],
                       log_path=tmp_path / "srv.log") as srv:
        plan = srv.request("/props")["rolling_kv"]
    assert plan["split"] and plan["tail_types"]["requested_k"] == "auto" and types_of(plan) == ("q8_0", "q8_0")
    assert plan["type_k_tail"] == "q8_0"
    proc = subprocess.run([str(cpu_build.artifact("llama-server")), "-m", str(demo_model), "-t", "2", "-c", "4096",
                           "--kv-residency-mode", "off", "-ctkt", "auto", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "mode off never splits" in proc.stdout + proc.stderr
    proc = subprocess.run([str(cpu_build.artifact("llama-server")), "-ctkt", "q2_K", "--port", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "q5_1, auto)" in proc.stdout + proc.stderr


def test_bench_reports_the_chosen_types(cpu_build, demo_model):
    proc = subprocess.run([str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "-t", "2", "-fa", "1", "-p", "0", "-n", "2",
                           "-r", "1", "-d", "512", "--kv-residency-mode", "window", "--kv-window-cells", "256", "-ctkt", "auto,f16",
                           "-ctvt", "auto", "-o", "json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    got = [(r["type_k_tail"], r["type_v_tail"], r["type_k_tail_chosen"], r["type_v_tail_chosen"]) for r in rows]
    assert got == [("auto", "auto", "q8_0", "q8_0"), ("f16", "auto", "f16", "q8_0")]
