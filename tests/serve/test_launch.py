"""serve/launch.py: what `rollingkv serve` adds to llama-server's command line, through --print-args (CPU build, demo
model)."""

from __future__ import annotations

import shlex

from test_cli import run_main


def _argv(capsys, *args):
    code, out, err = run_main(["serve", "--print-args", *args], capsys)
    assert code == 0, err
    return shlex.split(out.strip().splitlines()[-1])


def test_the_prompt_cache_is_off_where_the_cache_may_split(capsys, monkeypatch, cpu_build):
    """llama-server's RAM prompt cache copies every idle slot's state at each new task (a split cache's tail is already
    in host memory; measured on an H100: 40 % of the split default server's time to first token): serve passes
    `--cache-ram 0` where the cache may split, and leaves it alone where it stays whole or the user set it."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.delenv("LLAMA_ARG_CACHE_RAM", raising=False)
    split = _argv(capsys, "demo", "-c", "4096", "--kv-residency-mode", "window", "--kv-window-cells", "512")
    assert split[split.index("--cache-ram") + 1] == "0"
    budget = _argv(capsys, "demo", "-c", "4096", "--kv-residency-mode", "head", "--kv-device-heads", "1")
    assert budget[budget.index("--cache-ram") + 1] == "0"
    for whole in (["demo", "-c", "4096", "--kv-residency-mode", "off"], ["demo", "-c", "4096"]):  # auto on a CPU build
        assert "--cache-ram" not in _argv(capsys, *whole), whole                                   # without a budget
    own = _argv(capsys, "demo", "-c", "4096", "--kv-residency-mode", "window", "--kv-window-cells", "512", "--",
                "--cache-ram", "100")
    assert own.count("--cache-ram") == 1 and own[own.index("--cache-ram") + 1] == "100"
    monkeypatch.setenv("LLAMA_ARG_CACHE_RAM", "200")
    assert "--cache-ram" not in _argv(capsys, "demo", "-c", "4096", "--kv-residency-mode", "window", "--kv-window-cells", "512")
