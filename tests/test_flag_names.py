"""One name per thing across commands (issue 38, 4): MODEL is the first argument of every command that takes a model,
the context is -c/--ctx-size, the split cells' window --kv-window-cells; the old spellings (the gates' --model and
--ctx, bench load's --window-cells) still work and are not shown in --help. serve offers --kv-windows.

Seen failing before the change: the gates' help listed --model and --ctx and refused a positional MODEL ("Got unexpected
extra argument"); bench load's help showed --window-cells; serve refused --kv-windows ("No such option").
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from rollingkv_cli.cli import rollingkv
from test_cli import run_main

OLD = re.compile(r"--model\b|--ctx\b(?!-)|--window-cells\b")


def _help(*cmd: str) -> str:
    result = CliRunner().invoke(rollingkv, [*cmd, "--help"], catch_exceptions=False, terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("cmd", [("gate", "equiv"), ("gate", "needle"), ("gate", "vram"), ("gate", "matrix"),
                                 ("bench", "tail"), ("bench", "load"), ("serve",), ("run",)])
def test_help_shows_one_spelling(cmd):
    text = _help(*cmd)
    usage = text.split("\n\n")[0]
    assert "MODEL" in usage, usage
    assert not OLD.findall(text), OLD.findall(text)


@pytest.mark.parametrize("cmd", [("gate", "equiv"), ("gate", "needle"), ("gate", "vram")])
def test_gates_take_ctx_size(cmd):
    assert re.search(r"-c, --ctx-size", _help(*cmd))


@pytest.mark.parametrize("spelling", [["{m}", "-c", "512"], ["{m}", "--ctx-size", "512"], ["--model", "{m}", "--ctx", "512"],
                                      ["--model={m}", "--ctx=512"]])
def test_gate_equiv_old_and_new_spellings_reach_the_same_check(capsys, isolated_cache, fake_gguf, spelling):
    """Each spelling is parsed into the same settings: the same usage error about the context follows."""
    args = [a.replace("{m}", str(fake_gguf)) for a in spelling]
    code, _, err = run_main(["gate", "equiv", *args, "--synthetic-tokens", "600"], capsys)
    assert code == 2 and "600 tokens do not fit --ctx 512" in err, err


def test_gate_vram_old_and_new_model_spellings(capsys, isolated_cache, fake_gguf):
    for model in ([str(fake_gguf)], ["--model", str(fake_gguf)]):
        code, _, err = run_main(["gate", "vram", *model, "--vram-target", "100", "-c", "4096", "--prompt-tokens", "4000"], capsys)
        assert code == 2 and "exceed --ctx 4096" in err, err


def test_two_different_models_are_refused(capsys, isolated_cache, fake_gguf, tmp_path):
    code, _, err = run_main(["gate", "needle", str(fake_gguf), "--model", str(tmp_path / "other.gguf")], capsys)
    assert code == 2 and "give one" in err


def test_a_gate_without_a_model_is_a_usage_error(capsys, isolated_cache):
    code, _, err = run_main(["gate", "equiv"], capsys)
    assert code == 2 and "Missing argument 'MODEL'" in err


@pytest.mark.parametrize("flag", ["--kv-window-cells", "--window-cells"])
def test_bench_load_window_cells_both_spellings(capsys, isolated_cache, fake_gguf, flag):
    code, _, err = run_main(["bench", "load", str(fake_gguf), flag, "8", "--vram-target", "100", "--dry-run"], capsys)
    assert code == 2 and "give --kv-window-cells or --vram-target, not both" in err, err


def test_serve_offers_kv_windows(capsys, isolated_cache, tmp_path, monkeypatch):
    """--kv-windows and the config key kv_windows reach llama-server's command line; a bad value is one line."""
    assert "--kv-windows [elastic|static|blocks]" in _help("serve")
    code, _, err = run_main(["serve", "demo", "--kv-windows", "steady", "--print-args"], capsys)
    assert code == 2 and "'steady' is not one of elastic, static, blocks" in err
    config = tmp_path / "c.yaml"
    config.write_text("model: demo\nkv_windows: sometimes\n")
    code, _, err = run_main(["serve", "--config", str(config), "--print-args"], capsys)
    assert code == 2 and "kv_windows" in err and "sometimes" in err


def test_serve_offers_kv_placement(capsys, isolated_cache, tmp_path):
    """--kv-placement and the config key kv_placement reach llama-server's command line; a bad value is one line, and
    one after `--` too (llama-server would start, load the model and then fail)."""
    assert "--kv-placement [auto|upstream|sequences]" in _help("serve")
    code, _, err = run_main(["serve", "demo", "--kv-placement", "bysequence", "--print-args"], capsys)
    assert code == 2 and "'bysequence' is not one of auto, upstream, sequences" in err and "Traceback" not in err
    config = tmp_path / "c.yaml"
    config.write_text("model: demo\nkv_placement: sometimes\n")
    code, _, err = run_main(["serve", "--config", str(config), "--print-args"], capsys)
    assert code == 2 and "kv_placement" in err and "sometimes" in err
    code, _, err = run_main(["serve", "demo", "--print-args", "--", "--kv-placement", "bogus"], capsys)
    assert code == 2 and "--kv-placement after `--`: 'bogus' is not one of auto, upstream, sequences" in err, err


@pytest.mark.build
def test_serve_passes_kv_windows(cpu_build, demo_model, monkeypatch, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)}
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {demo_model}\nkv_windows: static\nparallel: 2\nkv_placement: upstream\n")
    for args in (["serve", str(demo_model), "-np", "2", "--kv-windows", "static", "--kv-placement", "upstream", "--print-args"],
                 ["serve", "--config", str(config), "--print-args"]):
        proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and "--kv-windows static" in proc.stdout, proc.stdout + proc.stderr
        assert "--kv-placement upstream" in proc.stdout, proc.stdout
