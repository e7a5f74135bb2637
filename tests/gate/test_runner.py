"""The gate runner (gate/runner.py), called as functions and as the child gate equiv starts: its arguments, the library
it binds, its refusals in one line, and a real tokenize + decode on the demo model.

Seen failing: with _context_refused ignoring last_error, the refusal tests (no reason in the message); with parse_args
accepting --tokens without --ctx, test_parse_args_refuses (no SystemExit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rollingkv_cli.gate import runner


class FakeExt:
    has_planner = True

    def __init__(self, text: str):
        self.text = text

    def last_error(self) -> str:
        return self.text


@pytest.mark.parametrize("argv", [
    ["--lib-dir", "x", "--model", "m"],  # no tokens source
    ["--lib-dir", "x", "--model", "m", "--synthetic", "8"],  # no --tokens-out
    ["--lib-dir", "x", "--model", "m", "--tokens", "t.npy", "--save-logits", "o.npy"],  # no --ctx
    ["--lib-dir", "x", "--model", "m", "--tokens", "t.npy", "--ctx", "64"],  # neither save nor compare
    ["--lib-dir", "x", "--model", "m", "--tokens", "t.npy", "--ctx", "64", "--save-logits", "o", "--n-seq", "0"],
    ["--lib-dir", "x", "--model", "m", "--synthetic", "0", "--tokens-out", "t.npy"],
])
def test_parse_args_refuses(argv, capsys):
    with pytest.raises(SystemExit) as e:
        runner.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_parse_args_takes_a_decode_run():
    a = runner.parse_args(["--lib-dir", "x", "--model", "m", "--tokens", "t.npy", "--ctx", "64", "--reference-logits", "r.npy",
                           "--residency", '{"mode": "window"}'])
    assert a.ctx == 64 and a.n_batch == 512 and json.loads(a.residency) == {"mode": "window"}


def test_resolve_lib_dir(tmp_path):
    lib = tmp_path / "libllama.so"
    lib.write_bytes(b"")
    assert runner.resolve_lib_dir(lib) == tmp_path.resolve() == runner.resolve_lib_dir(tmp_path)
    with pytest.raises(runner.RunnerError, match="no libllama.so in"):
        runner.resolve_lib_dir(tmp_path / "nowhere")


def test_a_refusal_with_the_library_reason():
    e = runner._context_refused(FakeExt("rolling KV: device_heads 5 keeps every KV head on the device"), {"mode": "head"})
    assert e.message == ("llama.cpp could not create the context with these residency parameters: device_heads 5 keeps every "
                         "KV head on the device") and e.hint is None


@pytest.mark.parametrize("ext", [None, FakeExt(""), FakeExt("llama_init_from_model failed (see the log)")])
def test_a_refusal_without_a_reason_points_at_the_log(ext):
    e = runner._context_refused(ext, None)
    assert e.message == "llama.cpp could not create the context" and "log" in e.hint


def _runner(cpu_build, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollingkv_cli.gate.runner", "--lib-dir", str(cpu_build.lib_dir), *argv],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.mark.build
def test_tokenize_then_decode_split_on_the_demo_model(cpu_build, demo_model, tmp_path):
    """The child protocol: RESULT lines and JSON; a window of 64 cells over 96 tokens reports a split plan."""
    toks = tmp_path / "t.npy"
    p = _runner(cpu_build, "--model", str(demo_model), "--synthetic", "96", "--tokens-out", str(toks), "--out", str(tmp_path / "tok.json"))
    assert p.returncode == 0 and p.stdout.splitlines()[-1].startswith("RESULT "), p.stdout + p.stderr
    # the tokenize phase reports as the decode does (issue 39): its stages, then the tokens found of those wanted
    kinds = [ln.split(" ", 1) for ln in p.stdout.splitlines()]
    assert kinds[0] == ["STAGE", "loading the vocabulary"] and ["PROGRESS", "0 96"] in kinds and ["PROGRESS", "96 96"] in kinds, kinds
    assert np.load(toks).shape == (96,)
    ref = tmp_path / "ref.npy"
    p = _runner(cpu_build, "--model", str(demo_model), "--tokens", str(toks), "--ctx", "256", "--threads", "2",
                "--save-logits", str(ref), "--out", str(tmp_path / "ref.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    p = _runner(cpu_build, "--model", str(demo_model), "--tokens", str(toks), "--ctx", "256", "--threads", "2",
                "--reference-logits", str(ref), "--residency", '{"mode": "window", "window_cells": 64}',
                "--out", str(tmp_path / "cand.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "cand.json").read_text())
    assert r["plan"]["window_cells"] == 64 and r["summary"]["n"] == 96


@pytest.mark.build
def test_the_child_says_the_library_reason(cpu_build, demo_model, tmp_path):
    toks = tmp_path / "t.npy"
    np.save(toks, np.arange(1, 33, dtype=np.int32))
    p = _runner(cpu_build, "--model", str(demo_model), "--tokens", str(toks), "--ctx", "256", "--reference-logits", str(toks),
                "--residency", '{"mode": "head", "device_heads": 5, "type_k_tail": "auto", "type_v_tail": "auto"}')
    assert p.returncode == 1
    kind, payload = p.stdout.strip().splitlines()[-1].split(" ", 1)
    assert kind == "ERROR" and "device_heads 5 keeps every KV head on the device" in json.loads(payload)["message"]
