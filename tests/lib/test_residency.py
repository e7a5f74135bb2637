"""THE residency request (lib/residency.py): its exclusion rules, stated once for every command, and its one rendering as
llama-server / llama-bench flags and as the library's parameters.

Seen failing: with the `one_size` rule dropped (window and budget together), the first test failed; with the window cells
rendered before the mode, the rendering test did (llama-bench's tests in tests/bench hold the cells' exact command lines).
"""

from __future__ import annotations

import pytest

from rollingkv_cli.lib.residency import ResidencyConflict, ResidencyRequest


@pytest.mark.parametrize("request_, one_size, words", [
    (ResidencyRequest(window_cells=8, vram_target=100), True, "give --kv-window-cells or --vram-target, not both"),
    (ResidencyRequest(device_heads=1, vram_target=100), True, "one of them"),
    (ResidencyRequest(device_heads=1, window_cells=8), False, "--kv-device-heads and --kv-window-cells exclude each other"),
    (ResidencyRequest(mode="window", device_heads=1), False, "--kv-device-heads 1 sets a head split, which --kv-residency-mode window does not make"),
    (ResidencyRequest(mode="off", device_heads=2), False, "--kv-residency-mode off does not make: use head"),
    (ResidencyRequest(mode="head", window_cells=256), False, "use --kv-device-heads N"),
    (ResidencyRequest(mode="off", type_v_tail="auto"), False, "-ctvt auto chooses the type of a split's tail, and --kv-residency-mode off never splits"),
])
def test_conflicts(request_, one_size, words):
    with pytest.raises(ResidencyConflict, match=words.replace("(", r"\(").replace(")", r"\)")):
        request_.check(one_size=one_size)


def test_serve_lets_a_budget_bound_an_explicit_split():
    """llama-server takes a window (or head split) with a --vram-target (it warns past the budget): only a measuring
    command asks for one size."""
    ResidencyRequest(window_cells=8, vram_target=100).check()
    ResidencyRequest(mode="head", device_heads=1, vram_target=100).check()


def test_conflicts_name_the_settings_as_given():
    """serve's config file names keys, not flags."""
    with pytest.raises(ResidencyConflict, match="kv_device_heads in c.yaml and kv_window_cells in c.yaml exclude each other"):
        ResidencyRequest(device_heads=2, window_cells=512).check({"device_heads": "kv_device_heads in c.yaml",
                                                                   "window_cells": "kv_window_cells in c.yaml"})


def test_server_args():
    assert ResidencyRequest(mode="off", window_cells=8, type_k_tail="q8_0").server_args() == ["--kv-residency-mode", "off"]
    assert ResidencyRequest().server_args() == []  # llama-server's defaults
    assert ResidencyRequest(mode="window", window_cells=512, type_k_tail="f16", type_v_tail="f16", tail_cpu_frac=0.25,
                            pcie_bw_gbps=6.5, windows="static").server_args() == [
        "--kv-residency-mode", "window", "--kv-window-cells", "512", "-ctkt", "f16", "-ctvt", "f16",
        "--kv-tail-cpu-frac", "0.25", "--pcie-bw-gbps", "6.5", "--kv-windows", "static"]
    # 0 means "the planner decides": not passed
    assert ResidencyRequest(mode="auto", window_cells=0, vram_target=0).server_args() == ["--kv-residency-mode", "auto"]
    assert ResidencyRequest(mode="window", tail_cpu_frac=0.0).server_args()[-2:] == ["--kv-tail-cpu-frac", "0"]


def test_params_round_trip():
    r = ResidencyRequest(mode="head", device_heads=2, vram_target=900, type_k_tail="q8_0", type_v_tail="q8_0", pcie_bw_gbps=25.0)
    params = r.params()
    assert params["vram_target_mib"] == 900 and params["window_cells"] == 0 and params["device_heads"] == 2
    assert ResidencyRequest.from_params(params) == r
    assert ResidencyRequest.from_params(None) == ResidencyRequest(mode="off")
