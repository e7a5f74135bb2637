"""llama_ext's mirror of struct llama_rolling_kv_params and the hybrid tail's part of the Extension, on a stand-in
library (no build needed): the struct's layout, the params builder (None = the library's default, off = 0; auto = -1;
F; the CPU attention figure), the API version rules (an older library takes the defaults only, a newer one is refused),
and the calibration's binding.
The real library: tests/test_hybrid_tail.py."""

from __future__ import annotations

import ctypes

import pytest

from rollingkv_cli.lib import llama_ext
from rollingkv_cli.console import RollingKVError


class FakeLib:
    """The functions Extension binds, as plain Python callables (ctypes' restype/argtypes become attributes)."""

    def __init__(self, api: int, measure: bool = True, default_frac: float = -1.0):
        self._name = "/fake/libllama.so"
        self.api = api
        self.default_frac = default_frac
        self.calls: list[tuple] = []
        self.llama_rolling_kv_build_info = lambda: f"rollingkv api={api} pin=x series=y".encode()
        self.llama_rolling_kv_api_version = lambda: api
        self.llama_rolling_kv_sizeof_context_params = lambda: 0
        self.llama_rolling_kv_sizeof_model_params = lambda: 0
        self.llama_rolling_kv_default_params = lambda: self._defaults()  # functions: bound methods take no attributes
        self.llama_init_from_model_rolling_kv = lambda m, cp, p: None
        self.llama_rolling_kv_plan_json = lambda ctx, buf, n: -1
        self.llama_kv_residency_mode_from_str = lambda s: 1
        self.llama_rolling_kv_last_error = lambda: b""
        if measure:
            self.llama_rolling_kv_measure_cpu_attn_gbps = lambda n, t: self._measure(n, t)

    def _defaults(self):
        p = llama_ext.RollingKVParams()
        p.mode, p.type_k_tail, p.type_v_tail = 1, 39, 39
        # an API 3 library writes only the fields it knows: the trailing ones hold whatever the buffer held
        # API 4's default: auto in this series (-1), off (0) in its builds from before 2026-12-03
        p.tail_cpu_frac, p.cpu_attn_gbps = (self.default_frac, 0.0) if self.api >= 4 else (123.0, 456.0)
        # API 5's device_heads lies in an older struct's padding: whatever the buffer held
        p.device_heads = 0 if self.api >= 5 else 77
        return p

    def _measure(self, n_threads, type_):
        self.calls.append((n_threads, type_))
        return {1: 64.9, 8: 36.8, 2: 16.4}.get(type_, -1.0)


@pytest.fixture
def ext(monkeypatch):
    monkeypatch.setattr(llama_ext, "_context_params_type", lambda: ctypes.c_int)

    def make(api: int = 4, measure: bool = True, default_frac: float = -1.0) -> llama_ext.Extension:
        return llama_ext.Extension(FakeLib(api, measure, default_frac))

    return make


def test_struct_layout_appends_the_fields():
    """The C struct (x86-64 / aarch64 ABI): mode 0, vram_target_mib 8, window_cells 16, type_k_tail 24, type_v_tail 28,
    pcie_bw_gbps 32, then API 4's tail_cpu_frac 36 and cpu_attn_gbps 40, then API 5's device_heads 44, in what was the
    padding, then API 7's windows 48 and API 11's placement 52, in the tail padding (56 bytes). The fields before them do
    not move, so an older library reads its prefix unchanged."""
    P = llama_ext.RollingKVParams
    assert [f[0] for f in P._fields_] == ["mode", "vram_target_mib", "window_cells", "type_k_tail", "type_v_tail", "pcie_bw_gbps",
                                          "tail_cpu_frac", "cpu_attn_gbps", "device_heads", "windows", "placement"]
    offsets = {name: getattr(P, name).offset for name, _ in P._fields_}
    assert offsets == {"mode": 0, "vram_target_mib": 8, "window_cells": 16, "type_k_tail": 24, "type_v_tail": 28,
                       "pcie_bw_gbps": 32, "tail_cpu_frac": 36, "cpu_attn_gbps": 40, "device_heads": 44, "windows": 48,
                       "placement": 52}
    assert P.tail_cpu_frac.size == P.cpu_attn_gbps.size == P.device_heads.size == P.windows.size == P.placement.size == 4 and ctypes.sizeof(P) == 56
    assert llama_ext.API_VERSION == 11 and llama_ext.API_PLACEMENT == 11 and llama_ext.API_EVAL_TIMES == 10 and llama_ext.API_TEST_HOOKS == 8 and llama_ext.API_MEASURE_LINK == 9 and llama_ext.API_HEAD_SPLIT == 5 and llama_ext.API_LIVE_STATS == 6
    # blocks (2): a library before block residency refuses it with "invalid window policy 2"
    assert llama_ext.API_ELASTIC_WINDOWS == 7 and llama_ext.WINDOW_POLICIES == {"elastic": 0, "static": 1, "blocks": 2}
    assert llama_ext.API_TAIL_AUTO == 7
    assert llama_ext.PLACEMENTS == {"auto": 0, "upstream": 1, "sequences": 2}


def test_placement_is_written_and_refused_where_unknown(ext):
    """API 11's placement: its value in the struct; an unknown name refused with the choices; "sequences" on an older
    library (which places as upstream does) refused with what to do, auto and upstream written (never read there)."""
    e = ext(11)
    assert e.make_params().placement == 0
    assert e.make_params(placement="upstream").placement == 1 and e.make_params(placement="sequences").placement == 2
    with pytest.raises(RollingKVError, match="unknown placement 'by-seq'"):
        e.make_params(placement="by-seq")
    old = ext(10)
    assert old.make_params(placement="upstream").placement == 1
    with pytest.raises(RollingKVError, match="placement sequences needs rolling-KV API 11; this build has API 10"):
        old.make_params(placement="sequences")


@pytest.mark.parametrize("given,want", [(None, None), ("auto", -1.0), ("AUTO", -1.0), (" auto ", -1.0), (0, 0.0), (0.0, 0.0),
                                        (0.25, 0.25), (1, 1.0)])
def test_tail_cpu_frac_values(given, want):
    """None leaves the library's default (make_params does not write it); auto is asked for by name."""
    assert llama_ext.tail_cpu_frac_value(given) == want
    assert llama_ext.TAIL_CPU_AUTO == -1.0


@pytest.mark.parametrize("bad", [-0.5, 1.01, float("nan"), float("inf"), "half", True])
def test_tail_cpu_frac_refused(bad):
    with pytest.raises(ValueError):
        llama_ext.tail_cpu_frac_value(bad)


def test_make_params_api4(ext):
    e = ext(4)
    assert e.api == 4 and e.has_tail_cpu
    p = e.make_params(mode="window", window_cells=256)  # the library's default: auto in this series
    assert p.tail_cpu_frac == -1.0 and p.cpu_attn_gbps == 0.0 and p.mode == 3 and p.window_cells == 256
    assert ext(4, default_frac=0.0).make_params().tail_cpu_frac == 0.0  # an API 4 build from before: its default, off
    p = e.make_params(mode="window", window_cells=256, tail_cpu_frac="auto")
    assert p.tail_cpu_frac == -1.0 and p.cpu_attn_gbps == 0.0
    p = e.make_params(tail_cpu_frac="AUTO", cpu_attn_gbps=55.5)
    assert p.tail_cpu_frac == -1.0 and p.cpu_attn_gbps == 55.5
    p = e.make_params(mode="window", window_cells=256, tail_cpu_frac=0.5, cpu_attn_gbps=40.0)
    assert p.tail_cpu_frac == 0.5 and p.cpu_attn_gbps == 40.0
    p = e.make_params(tail_cpu_frac=0)
    assert p.tail_cpu_frac == 0.0
    p = e.make_params(cpu_attn_gbps=-3)  # <= 0: libllama calibrates
    assert p.cpu_attn_gbps == 0.0
    with pytest.raises(RollingKVError, match="not auto or a fraction from 0 to 1"):
        e.make_params(tail_cpu_frac=2)
    with pytest.raises(RollingKVError, match="not a number"):
        e.make_params(cpu_attn_gbps=float("nan"))


def test_an_api3_library_takes_the_defaults_only(ext):
    """The fields an API 3 library would ignore are always written (its default_params left garbage there); it has no
    CPU part, so the default (None) and an explicit 0 are what it does, while asking for auto, a share or a CPU bandwidth
    on it is refused with what to do."""
    e = ext(3, measure=False)
    assert e.api == 3 and not e.has_tail_cpu
    p = e.make_params(mode="window", window_cells=512)
    assert (p.tail_cpu_frac, p.cpu_attn_gbps) == (0.0, 0.0)
    p = e.make_params(mode="window", tail_cpu_frac=0)
    assert (p.tail_cpu_frac, p.cpu_attn_gbps) == (0.0, 0.0)
    for kw in ({"tail_cpu_frac": 0.5}, {"tail_cpu_frac": "auto"}, {"cpu_attn_gbps": 30.0}):
        with pytest.raises(RollingKVError) as exc:
            e.make_params(mode="window", **kw)
        assert "hybrid tail" in exc.value.message and "API 3" in exc.value.message and "rollingkv build" in exc.value.hint
    with pytest.raises(RollingKVError, match="API 3"):
        e.measure_cpu_attn_gbps(4, "f16")


def test_api4_without_the_measure_function_is_not_hybrid(ext):
    e = ext(4, measure=False)
    assert not e.has_tail_cpu
    with pytest.raises(RollingKVError, match="without llama_rolling_kv_measure_cpu_attn_gbps"):
        e.make_params(tail_cpu_frac=0.5)


def test_a_newer_library_is_refused(ext):
    e = ext(12)
    with pytest.raises(RollingKVError, match="version 12, newer than the 11"):
        e.make_params(mode="window")


def test_auto_tail_types(ext):
    """API 7: "auto" is LLAMA_ROLLING_KV_TAIL_TYPE_AUTO (GGML_TYPE_COUNT + 1 of the pin) per axis, a type its ggml_type;
    an older library, which would refuse the value as an invalid type, is refused here with what to do."""
    e = ext(7)
    p = e.make_params(mode="window", type_k_tail="auto", type_v_tail="q8_0")
    assert p.type_k_tail == llama_ext.TAIL_TYPE_AUTO == 44 and p.type_v_tail == 8
    p = e.make_params(type_v_tail="auto")
    assert p.type_v_tail == 44 and p.type_k_tail != 44
    with pytest.raises(RollingKVError) as exc:
        ext(6).make_params(type_k_tail="auto")
    assert "API 7" in exc.value.message and "API 6" in exc.value.message and "rollingkv build" in exc.value.hint
    with pytest.raises(RollingKVError, match="unknown cache type 'q2_K'") as exc:
        e.make_params(type_k_tail="q2_K")
    assert "auto" in exc.value.hint


def test_head_split_params(ext):
    """API 5: head mode and device_heads; an API 4 library (whose struct has padding where device_heads lies) gets 0 written
    there and refuses head mode and device heads with what to do."""
    e = ext(5)
    p = e.make_params(mode="head", device_heads=2)
    assert p.mode == 2 and p.device_heads == 2
    assert e.make_params(mode="head").device_heads == 0 and e.make_params(mode="auto", device_heads=1).device_heads == 1
    for bad in (-1, True, 2.5, "2", 2**31):
        with pytest.raises(RollingKVError, match="not a number of KV heads"):
            e.make_params(mode="head", device_heads=bad)
    old = ext(4)
    assert old.make_params(mode="window", window_cells=256).device_heads == 0  # the padding's 77 overwritten
    for kw, what in (({"mode": "head"}, "head mode"), ({"mode": "auto", "device_heads": 2}, "device_heads 2")):
        with pytest.raises(RollingKVError) as exc:
            old.make_params(**kw)
        assert what in exc.value.message and "API 5" in exc.value.message and "API 4" in exc.value.message
        assert "rollingkv build" in exc.value.hint


def test_measure_binding(ext):
    e = ext(4)
    lib = e._lib
    fn = lib.llama_rolling_kv_measure_cpu_attn_gbps
    assert fn.restype is ctypes.c_double and fn.argtypes == [ctypes.c_int32, ctypes.c_int]
    assert e.measure_cpu_attn_gbps(15, "f16") == 64.9
    assert e.measure_cpu_attn_gbps(3, "q8_0") == 36.8 and e.measure_cpu_attn_gbps(3, "q4_0") == 16.4
    assert lib.calls == [(15, 1), (3, 8), (3, 2)]  # ggml_type: f16 1, q8_0 8, q4_0 2
    with pytest.raises(RollingKVError, match="not 'q5_0'"):
        e.measure_cpu_attn_gbps(4, "q5_0")
    with pytest.raises(RollingKVError, match="at least 1"):
        e.measure_cpu_attn_gbps(0, "f16")
    with pytest.raises(AttributeError, match="no llama_rolling_kv_measure_cpu_attn_gbps"):
        llama_ext.measure_cpu_attn_gbps(FakeLib(3, measure=False), 1, "f16")
