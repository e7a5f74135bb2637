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
    `--cache-ram 0` where the cache may split, in llama-server's default unified cache too (idle sequences stay in place,
    their blocks demoted, purged by llama-server only when their cells are needed: tests/serve/test_serve_rolling.py), and
    leaves it alone where the cache stays whole and where the user set it."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.delenv("LLAMA_ARG_CACHE_RAM", raising=False)
    window = ["demo", "-c", "4096", "--kv-residency-mode", "window", "--kv-window-cells", "512"]
    for split in (_argv(capsys, *window, "-np", "2"), _argv(capsys, *window),  # -np, and the default unified cache
                  _argv(capsys, *window, "-np", "2", "--", "--kv-unified")):
        assert split[split.index("--cache-ram") + 1] == "0"
    heads = _argv(capsys, "demo", "-c", "4096", "-np", "4", "--kv-residency-mode", "head", "--kv-device-heads", "1")
    assert heads[heads.index("--cache-ram") + 1] == "0"
    for kept in (["demo", "-c", "4096", "-np", "2", "--kv-residency-mode", "off"],  # whole
                 ["demo", "-c", "4096", "-np", "2"], ["demo", "-c", "4096"]):  # auto on a CPU build without a budget: whole
        assert "--cache-ram" not in _argv(capsys, *kept), kept
    own = _argv(capsys, *window, "-np", "2", "--", "--cache-ram", "100")
    assert own.count("--cache-ram") == 1 and own[own.index("--cache-ram") + 1] == "100"
    monkeypatch.setenv("LLAMA_ARG_CACHE_RAM", "200")
    assert "--cache-ram" not in _argv(capsys, *window, "-np", "2")
