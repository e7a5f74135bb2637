"""Bad input and hostile conditions end in one clear line, write nothing and leave nothing running.

One row per class of failure (the robustness issue's list):
  1  text with brackets is shown as is (rich markup never eats or chokes on it)
  2  every user file / environment variable read gives a one-line error (OS, decode, parse)
  3  config values are checked by the flags' validator; bad values exit 2 either way
  4  a host name that does not resolve is said so
  5  head residency mode is refused before anything starts
  6  children die with the supervisor (SIGHUP, SIGKILL), a second Ctrl-C still kills
  7  a child killed by a signal is reported by the signal's name, cause and log
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from test_cli import run_main

REPO = Path(__file__).resolve().parent.parent
LATIN1 = "caf\u00e9 cr\u00e8me\n".encode("latin-1")  # not UTF-8


def _standin(sig: str) -> str:
    """A child that writes a line and kills itself with `sig` (no core file)."""
    return ("import os, resource, signal, sys\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
            f"sys.stderr.write('stand-in: about to die by {sig}\\n'); sys.stderr.flush()\n"
            f"os.kill(os.getpid(), signal.{sig})\n")


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


def _children(pid: int | None = None) -> list[int]:
    """Live (not zombie) processes whose parent is pid (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, not reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def _report(tmp: Path, **over) -> Path:
    from rollingkv_cli.bench.tail import SCHEMA

    doc = {"schema": SCHEMA, "config": {"depths": [1024], "n_gen": 4, "window_type": "f16", "tail_types": ["f16"]},
           "bandwidth": {"gbps": None, "source": None, "note": "no link"}, "cells": [], "depths": {}, "build": {"backend": "CPU"},
           "model": {"path": "m.gguf"}, "notes": [], "targets": []}
    doc.update(over)
    p = tmp / "report.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture
def standin_build(monkeypatch, isolated_cache, tmp_path):
    """The active build: an empty libllama.so and a llama-server that dies by SIGILL at once."""
    from rollingkv_cli.lib import builder

    bdir = tmp_path / "build"
    bin_dir = bdir / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "libllama.so").write_bytes(b"")
    server = bin_dir / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + _standin("SIGILL"))
    server.chmod(0o755)
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": {}}))
    return bdir


def _free_port() -> int:
    from rollingkv_cli.serve.server import free_port

    return free_port()


@dataclass
class Row:
    """argv (with {tmp} and {gguf}) run through main(); env; files made first; what the one error line says."""

    args: list[str]
    code: int
    expect: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes | str] = field(default_factory=dict)
    setup: Callable | None = None  # (tmp_path, monkeypatch) -> None
    build: bool = False  # needs the stand-in build
    writes: bool = False  # a run that starts a child writes its log (and names it)
    hint: list[str] = field(default_factory=list)


def _fifo(path: Path) -> None:
    """A FIFO no one writes: opening it to read blocks for ever. Should the refusal regress, a timer opens it for
    writing after 10 s (a reader then sees its end) so that the row fails instead of hanging."""
    import threading

    os.mkfifo(path)

    def unblock():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO when no one reads: nothing to unblock
        except OSError:
            pass

    t = threading.Timer(10, unblock)
    t.daemon = True
    t.start()


def _no_matplotlib(tmp, monkeypatch):
    from rollingkv_cli.bench import plot as bench_plot

    monkeypatch.setattr(bench_plot, "have_matplotlib", lambda: False)


def _crafted_gguf_and_llama_bench(tmp, monkeypatch):
    """A GGUF whose array is counted past its end (gguf-py's GGUFReader never finished it) and a llama-bench in the
    stand-in build, so that bench tail reaches the model's header."""
    import struct

    key = lambda k: struct.pack("<Q", len(k)) + k.encode()  # noqa: E731
    kvs = [key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama", key("x.big") + struct.pack("<IIQ", 9, 0, 2**40)]
    (tmp / "crafted.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    bench = tmp / "build" / "build" / "bin" / "llama-bench"
    bench.write_text("#!/bin/sh\nexit 1\n")
    bench.chmod(0o755)


def _runner_dies(tmp, monkeypatch):
    from rollingkv_cli.gate import equiv as gate_equiv

    monkeypatch.setattr(gate_equiv, "runner_cmd", lambda args: [sys.executable, "-c", _standin("SIGSEGV")])


ROWS = {
    # 1: markup
    "1-brackets-in-a-path": Row(["bench", "show", "{tmp}/model[v2].json"], 1, ["{tmp}/model[v2].json"]),
    "1-closing-tag-in-a-path": Row(["bench", "show", "{tmp}/a[/]b.json"], 1, ["{tmp}/a[/]b.json"]),
    "1-plot-hint-keeps-[plot]": Row(["bench", "plot", "{tmp}/report.json"], 1, ["matplotlib is not installed"],
                                    setup=lambda tmp, mp: (_report(tmp), _no_matplotlib(tmp, mp)), hint=["pip install 'rollingkv[plot]'"]),
    # 2: reading user input
    "2-config-not-utf8": Row(["serve", "--config", "{tmp}/serve.yaml", "--print-args"], 1, ["config file", "serve.yaml", "not UTF-8"],
                             files={"serve.yaml": b"model: demo\n# " + LATIN1}),
    "2-thresholds-not-utf8": Row(["gate", "equiv", "--model", "{gguf}", "--thresholds", "{tmp}/t.yaml"], 1, ["thresholds file", "not UTF-8"],
                                 files={"t.yaml": b"max_mean_tv: 1e-5 # " + LATIN1}),
    "2-prompt-file-not-utf8": Row(["gate", "equiv", "--model", "{gguf}", "--prompt-file", "{tmp}/p.txt"], 1, ["prompt file", "p.txt", "not UTF-8"],
                                  files={"p.txt": LATIN1}),
    "2-report-not-utf8": Row(["bench", "show", "{tmp}/r.json"], 1, ["r.json", "not UTF-8"], files={"r.json": b'{"note": "' + LATIN1 + b'"}'}),
    "2-report-not-json": Row(["bench", "show", "{tmp}/r.json"], 1, ["r.json", "not valid JSON", "line 1"], files={"r.json": "{oops"}),
    "2-malformed-report-show": Row(["bench", "show", "{tmp}/report.json"], 1, ["malformed", "cells[0].status"],
                                   setup=lambda tmp, mp: _report(tmp, cells=[{"label": "x", "depth": 1024, "kind": "window"}])),
    "2-malformed-report-plot": Row(["bench", "plot", "{tmp}/report.json"], 1, ["malformed", "config.depths"],
                                   setup=lambda tmp, mp: _report(tmp, config={"depths": "1024"})),
    "2-env-not-a-number": Row(["serve", "{gguf}", "--port", "0", "-q"], 1, ["$ROLLINGKV_SERVE_START_TIMEOUT='soon'", "not a number"],
                              env={"ROLLINGKV_SERVE_START_TIMEOUT": "soon"}, build=True),
    "2-env-pcie-not-a-number": Row(["gate", "equiv", "--model", "{gguf}"], 1, ["$ROLLINGKV_PCIE_BW_GBPS='fast'", "GB/s"],
                                   env={"ROLLINGKV_PCIE_BW_GBPS": "fast"}),
    "2-cache-dir-is-a-file": Row(["model", "demo"], 1, ["$ROLLINGKV_CACHE_DIR=", "is a file, not a directory"],
                                 env={"ROLLINGKV_CACHE_DIR": "{tmp}/afile"}, files={"afile": "x"}),
    "2-cache-dir-cannot-be-made": Row(["model", "demo"], 1, ["$ROLLINGKV_CACHE_DIR=/proc/rollingkv-cache", "cannot be created"],
                                      env={"ROLLINGKV_CACHE_DIR": "/proc/rollingkv-cache"}),
    # 3: config values checked as flags, exit 2 for both
    "3-config-port": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["c.yaml", "port must be an integer from 0 to 65535, not 70000"],
                         files={"c.yaml": "model: demo\nport: 70000\n"}),
    "3-flag-port": Row(["serve", "demo", "--port", "70000", "--print-args"], 2, ["must be an integer from 0 to 65535, not 70000"]),
    "3-config-parallel-1000-ctx-10": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["ctx_size must be an integer of at least 64"],
                                         files={"c.yaml": "model: demo\nparallel: 1000\nctx_size: 10\n"}),
    "3-config-fewer-cells-than-slots": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["ctx_size 100 has fewer cells than", "parallel 200"],
                                           files={"c.yaml": "model: demo\nparallel: 200\nctx_size: 100\n"}),
    "3-flag-pcie-negative": Row(["serve", "demo", "--pcie-bw-gbps", "-1", "--print-args"], 2, ["must be a positive number"]),
    "3-config-pcie-negative": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["pcie_bw_gbps must be a positive number"],
                                  files={"c.yaml": "model: demo\npcie_bw_gbps: -1\n"}),
    # 4: host that does not resolve
    "4-host-does-not-resolve": Row(["serve", "{gguf}", "--host", "no.such.host.invalid", "-q"], 1, ["cannot resolve host 'no.such.host.invalid'"],
                                   build=True),
    # 5: the head split's flags that contradict each other (head mode itself is accepted: tests/test_head_split.py)
    "5-head-window-flags": Row(["serve", "demo", "--kv-residency-mode", "window", "--kv-device-heads", "1", "--print-args"], 2,
                               ["--kv-device-heads 1 sets a head split, which --kv-residency-mode window does not make"]),
    "5-head-zero": Row(["serve", "demo", "--kv-device-heads", "0", "--print-args"], 2, ["must be an integer of at least 1, not 0"]),
    "5-head-config-window-cells": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2,
                                      ["kv_device_heads and", "kv_window_cells exclude each other"],
                                      files={"c.yaml": "model: demo\nkv_device_heads: 2\nkv_window_cells: 512\n"}),
    "5-head-mode-window-cells": Row(["serve", "demo", "--kv-residency-mode", "head", "--kv-window-cells", "256", "--print-args"], 2,
                                    ["--kv-window-cells 256 sets a window, which --kv-residency-mode head does not make"]),
    # issue 27 (9): arguments after `--` that contradict serve's own
    "9-port-after-dashes": Row(["serve", "demo", "--print-args", "--", "--port", "9999"], 2, ["--port after `--` clashes with serve's own --port"],
                               hint=["rollingkv serve MODEL --port VALUE"]),
    "9-host-after-dashes": Row(["serve", "demo", "--print-args", "--", "--host=0.0.0.0"], 2, ["--host after `--` clashes"]),
    "9-model-after-dashes": Row(["serve", "demo", "--print-args", "--", "-m", "{gguf}"], 2, ["-m after `--` clashes with serve's MODEL"]),
    "9-setting-twice": Row(["serve", "demo", "-c", "2048", "--print-args", "--", "-c", "4096"], 2, ["-c after `--` clashes with --ctx-size"]),
    "9-config-extra-args-port": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["--port in config file", "extra_args clashes"],
                                    files={"c.yaml": "model: demo\nextra_args: ['--port', '9999']\n"}),
    # issue 39 (4): bench load's arguments after `--` checked as serve's (it accepted --port, then ran for long)
    "39-4-bench-load-port-after-dashes": Row(["bench", "load", "{gguf}", "--dry-run", "--", "--port", "1234"], 2,
                                             ["--port after `--` clashes with bench load, which runs each llama-server on a free loopback port"]),
    "39-4-bench-load-model-after-dashes": Row(["bench", "load", "{gguf}", "--dry-run", "--", "-m", "{gguf}"], 2, ["-m after `--` clashes with bench load's MODEL"]),
    "39-4-bench-load-slots-after-dashes": Row(["bench", "load", "{gguf}", "--dry-run", "--", "-np", "2"], 2, ["-np after `--` clashes with bench load's -np/--slots"]),
    # two tail types for the split cells: llama-server would take the later one
    "bench-load-tail-type-twice": Row(["bench", "load", "{gguf}", "--dry-run", "--kv-tail-type", "q8_0", "--", "-ctvt", "q4_0"], 2,
                                      ["-ctvt after `--` clashes with bench load's --kv-tail-type"]),
    # issue 39 (16): the residency flags' values after `--` (llama-server started, loaded, then failed in a log box)
    "39-16-kv-windows-bogus": Row(["serve", "demo", "--print-args", "--", "--kv-windows", "bogus"], 2,
                                  ["--kv-windows after `--`: 'bogus' is not one of elastic, static"]),
    "39-16-window-cells-negative": Row(["serve", "demo", "--print-args", "--", "--kv-window-cells=-3"], 2,
                                       ["--kv-window-cells after `--` must be an integer of at least 0, not -3"]),
    "39-16-tail-type-without-a-value": Row(["serve", "demo", "--print-args", "--", "-ctkt"], 2, ["-ctkt after `--` has no value"]),
    "39-16-config-extra-args-mode": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2,
                                        ["--kv-residency-mode in config file", "extra_args: 'sideways' is not one of auto, window, head, off"],
                                        files={"c.yaml": "model: demo\nextra_args: ['--kv-residency-mode', 'sideways']\n"}),
    "39-16-bench-load-cpu-frac": Row(["bench", "load", "{gguf}", "--dry-run", "--", "--kv-tail-cpu-frac", "2"], 2,
                                     ["--kv-tail-cpu-frac after `--` must be auto or a fraction from 0 to 1"]),
    # issue 39: a hint that led to another error (`serve --model demo` suggested `-- --model demo`, which serve refuses)
    "39-serve-model-option": Row(["serve", "--model", "demo"], 2,
                                 ["No such option '--model': the model is serve's MODEL argument (rollingkv serve MODEL [serve options]"]),
    # issue 39 (12): a path that cannot be the directory asked for (internal error: NotADirectoryError / FileNotFoundError)
    "39-12-patches-checkout-dev-null": Row(["patches", "checkout", "/dev/null"], 1,
                                           ["cannot use checkout directory /dev/null: it is a device, not a directory"]),
    "39-12-patches-checkout-in-proc": Row(["patches", "checkout", "/proc/x"], 1,
                                          ["cannot use checkout directory /proc/x: /proc is not on a disk (a pseudo filesystem"]),
    # issue 27 (15): messages that point the right way
    "15-run-demo-without-a-build": Row(["run", "demo", "-p", "hi"], 1, ["no rollingkv build yet"], hint=["rollingkv build"]),
    "15-model-symlink-loop": Row(["run", "{tmp}/loop.gguf", "-p", "hi"], 1, ["loop.gguf is a loop of symbolic links"],
                                 setup=lambda tmp, mp: (tmp / "loop.gguf").symlink_to(tmp / "loop.gguf")),
    "15-model-dangling-symlink": Row(["run", "{tmp}/gone.gguf", "-p", "hi"], 1, ["gone.gguf is a symbolic link to", "which does not exist"],
                                     setup=lambda tmp, mp: (tmp / "gone.gguf").symlink_to(tmp / "nowhere.gguf")),
    "15-needle-depth-zero": Row(["gate", "needle", "--model", "{gguf}", "--depth", "0"], 2, ["--depth", "strictly between 0 and 1"]),
    "15-synth-sliding-window-llama": Row(["model", "synth", "{tmp}/m.gguf", "--layers", "2", "--embd", "64", "--heads", "4", "--kv-heads", "2",
                                          "--ff", "128", "--vocab", "300", "--sliding-window", "64"], 2,
                                         ["--sliding-window applies to --arch gemma2"]),
    # issue 27 (21): an option of llama-server's given to serve
    "21-serve-llama-option": Row(["serve", "demo", "-t", "2", "--print-args"], 2, ["No such option '-t'", "go after `--`", "-- -t ...)"]),
    # issue 27 (11): values llama-server would refuse only after start-up
    "11-vram-target-huge": Row(["serve", "demo", "--vram-target", "1000000000000000000000", "--print-args"], 2,
                               ["--vram-target", "must be at most 16777216 (what llama-server takes)"]),
    "11-config-window-huge": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["kv_window_cells must be at most 2147483647"],
                                 files={"c.yaml": "model: demo\nkv_window_cells: 4294967296\n"}),
    "11-slot-save-not-a-bool": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2, ["slot_save must be true or false, not 'yes please'"],
                                   files={"c.yaml": "model: demo\nslot_save: yes please\n"}),
    "11-run-temperature-nan": Row(["run", "{gguf}", "-p", "hi", "--temperature", "nan"], 2, ["--temperature", "finite number of at least 0", "not nan"]),
    "11-run-temperature-inf": Row(["run", "{gguf}", "-p", "hi", "--temperature", "inf"], 2, ["--temperature", "not inf"]),
    "11-run-temperature-negative": Row(["run", "{gguf}", "-p", "hi", "--temperature", "-1"], 2, ["--temperature", "not -1"]),
    "11-run-empty-prompt": Row(["run", "{gguf}", "-p", ""], 2, ["--prompt is empty"]),
    "11-run-blank-prompt-file": Row(["run", "{gguf}", "-f", "{tmp}/p.txt"], 2, ["prompt file", "is empty (or only blanks)"], files={"p.txt": " \n\n"}),
    # issue 27 (10): a type only an unsplit cache takes, where the cache splits (llama-server aborted after start-up)
    "10-window-iq4_nl-split": Row(["serve", "demo", "-ctk", "iq4_nl", "--kv-window-cells", "256", "-c", "1024", "--print-args"], 2,
                                  ["--cache-type-k iq4_nl: only an unsplit cache takes iq4_nl, and this one may split"],
                                  hint=["--kv-residency-mode off"]),
    "10-config-iq4_nl-budget": Row(["serve", "--config", "{tmp}/c.yaml", "--print-args"], 2,
                                   ["c.yaml: cache_type_v iq4_nl: only an unsplit cache takes iq4_nl"],
                                   files={"c.yaml": "model: demo\ncache_type_v: iq4_nl\nvram_target: 300\n"}),
    # issue 27 (12): the window is per slot
    "12-window-larger-than-a-slot": Row(["serve", "demo", "--kv-window-cells", "512", "-c", "1024", "-np", "4", "--print-args"], 2,
                                        ["--kv-window-cells 512 is larger than each slot's context", "= 256 cells"]),
    # issue 27 (14): usage errors exit 2
    "14-serve-no-model": Row(["serve", "--config", "{tmp}/empty.yaml", "--print-args"], 2, ["no MODEL given"], files={"empty.yaml": ""}),
    # a file given to read that is missing or not a regular file is not a usage error (exit 1, console.EXIT_USAGE): the
    # same line and status for every such option (serve --config and the gates' files were click's exit 2 before)
    "14-serve-config-dev-null": Row(["serve", "--config", "/dev/null", "--print-args"], 1, ["config file /dev/null", "a device"]),
    "14-serve-config-missing": Row(["serve", "--config", "{tmp}/none.yaml", "--print-args"], 1, ["config file {tmp}/none.yaml: no such file"]),
    "14-serve-config-a-directory": Row(["serve", "--config", "{tmp}", "--print-args"], 1, ["config file {tmp}: it is a directory"]),
    "14-gate-prompt-file-missing": Row(["gate", "equiv", "--model", "{gguf}", "--prompt-file", "{tmp}/none.txt"], 1,
                                       ["prompt file {tmp}/none.txt: no such file"]),
    "14-gate-filler-file-a-directory": Row(["gate", "needle", "--model", "{gguf}", "--filler-file", "{tmp}"], 1,
                                           ["filler file {tmp}: it is a directory"], build=True),
    "14-bench-show-a-directory": Row(["bench", "show", "{tmp}"], 1, ["report {tmp}: it is a directory"]),
    "14-gate-thresholds-a-directory": Row(["gate", "equiv", "--model", "{gguf}", "--thresholds", "{tmp}"], 1,
                                          ["thresholds file {tmp}: it is a directory"]),
    # issue 27 (13): the library's own variables, one parser each, refused wherever the library runs
    "13-part-threads-not-a-number-serve": Row(["serve", "{gguf}", "--port", "0", "-q"], 1, ["$ROLLINGKV_CPU_PART_THREADS='abc'", "not a whole number"],
                                              env={"ROLLINGKV_CPU_PART_THREADS": "abc"}, build=True),
    "13-part-threads-negative-gate": Row(["gate", "equiv", "--model", "{gguf}"], 1, ["$ROLLINGKV_CPU_PART_THREADS='-1'", "at least 0"],
                                         env={"ROLLINGKV_CPU_PART_THREADS": "-1"}),
    "13-part-threads-too-many-run": Row(["run", "{gguf}", "-p", "hi"], 1, ["$ROLLINGKV_CPU_PART_THREADS='100000'", "more than the library takes (1024)"],
                                        env={"ROLLINGKV_CPU_PART_THREADS": "100000"}),
    "13-slots-zero-serve": Row(["serve", "{gguf}", "--port", "0", "-q"], 1, ["$ROLLINGKV_SLOTS='0'", "at least 2"], env={"ROLLINGKV_SLOTS": "0"},
                               build=True),
    "13-slot-mib-negative-serve": Row(["serve", "{gguf}", "--port", "0", "-q"], 1, ["$ROLLINGKV_SLOT_MIB='-5'", "at least 1"],
                                      env={"ROLLINGKV_SLOT_MIB": "-5"}, build=True),
    "13-runtime-mib-not-a-number-serve": Row(["serve", "{gguf}", "--port", "0", "-q"], 1, ["$ROLLINGKV_RUNTIME_MIB='abc'", "not a whole number"],
                                             env={"ROLLINGKV_RUNTIME_MIB": "abc"}, build=True),
    "13-slots-too-many-bench": Row(["bench", "tail", "{gguf}", "--dry-run"], 1, ["$ROLLINGKV_SLOTS='9'", "more than the library takes (8)"],
                                   env={"ROLLINGKV_SLOTS": "9"}),
    # issue 39 (11): the must-fail controls' switch, which the library read as 0 ("abc") or took below -1 (every tail
    # score flipped): refused before anything loads the library or starts a child
    "39-11-perturb-below-minus-one-serve": Row(["serve", "{gguf}", "--port", "0", "-q"], 1,
                                               ["$ROLLINGKV_DEBUG_PERTURB_TAIL='-2'", "must be above -1"],
                                               env={"ROLLINGKV_DEBUG_PERTURB_TAIL": "-2"}, build=True),
    "39-11-perturb-not-a-number-run": Row(["run", "{gguf}", "-p", "hi"], 1, ["$ROLLINGKV_DEBUG_PERTURB_TAIL='abc'", "is not a number"],
                                          env={"ROLLINGKV_DEBUG_PERTURB_TAIL": "abc"}),
    "39-11-perturb-minus-one-bench-load": Row(["bench", "load", "{gguf}", "--dry-run"], 1,
                                              ["$ROLLINGKV_DEBUG_PERTURB_TAIL='-1'", "must be above -1"],
                                              env={"ROLLINGKV_DEBUG_PERTURB_TAIL": "-1"}),
    "39-11-perturb-not-a-number-gate": Row(["gate", "equiv", "--model", "{gguf}"], 1,
                                           ["$ROLLINGKV_DEBUG_PERTURB_TAIL='1e-3x'", "is not a number"],
                                           env={"ROLLINGKV_DEBUG_PERTURB_TAIL": "1e-3x"}),
    # issue 36 (10): the block move test hook, which the library ignored with a warning when it was neither 1 nor 2 (a
    # must-fail control that silently did not perturb): refused by the commands as by libllama
    "36-10-perturb-move-three-bench-load": Row(["bench", "load", "{gguf}", "--dry-run"], 1,
                                               ["$ROLLINGKV_DEBUG_PERTURB_MOVE='3'", "neither 1 nor 2"],
                                               env={"ROLLINGKV_DEBUG_PERTURB_MOVE": "3"}),
    # issue 27 (4): only regular files are read, and only so much of them (a device or a FIFO hung or ate memory)
    "4-run-prompt-file-dev-zero": Row(["run", "{gguf}", "-f", "/dev/zero"], 1, ["prompt file /dev/zero", "a device, not a regular file"]),
    "4-run-prompt-file-fifo": Row(["run", "{gguf}", "-f", "{tmp}/fifo"], 1, ["prompt file {tmp}/fifo", "a FIFO (named pipe), not a regular file"],
                                  setup=lambda tmp, mp: _fifo(tmp / "fifo")),
    "4-serve-config-dev-zero": Row(["serve", "--config", "/dev/zero", "--print-args"], 1, ["config file /dev/zero", "a device"]),
    "4-bench-show-dev-zero": Row(["bench", "show", "/dev/zero"], 1, ["report /dev/zero", "a device"]),
    "4-bench-show-fifo": Row(["bench", "show", "{tmp}/fifo"], 1, ["report {tmp}/fifo", "a FIFO"], setup=lambda tmp, mp: _fifo(tmp / "fifo")),
    "4-gate-needle-filler-dev-zero": Row(["gate", "needle", "--model", "{gguf}", "--filler-file", "/dev/zero"], 1, ["filler file /dev/zero", "a device"],
                                         build=True),
    "4-report-too-large": Row(["bench", "show", "{tmp}/r.json"], 1, ["r.json: it holds more than 1 MiB"], files={"r.json": b" " * (2 << 20)},
                              setup=lambda tmp, mp: mp.setattr("rollingkv_cli.userinput.MAX_INPUT_BYTES", 1 << 20)),
    # issue 27 (6): one GGUF reader (gguf_header.py) for every command that reads a header
    "6-bench-tail-array-past-the-end": Row(["bench", "tail", "{tmp}/crafted.gguf", "--dry-run"], 1,
                                           ["crafted.gguf is truncated: 98 bytes, it ends inside its own header"],
                                           setup=_crafted_gguf_and_llama_bench, build=True),
    # 7: a child killed by a signal
    "7-llama-server-sigill": Row(["serve", "{gguf}", "--port", "{port}", "-q"], 1, ["exited during start-up", "killed by SIGILL", "instruction"],
                                 build=True, writes=True, hint=["--no-repack", "log: "]),
    "7-gate-runner-sigsegv": Row(["gate", "equiv", "--model", "{gguf}"], 1, ["run failed", "killed by SIGSEGV"],
                                 setup=_runner_dies, build=True, writes=True, hint=["--no-repack", "full log: "]),
}


ROW_TIMEOUT_S = 60  # a row answers in seconds; past this it hangs (a FIFO read, a walk that never ends)


class _Hung(BaseException):
    """Raised in the command by the row's timer: a BaseException, so the CLI's last-resort net does not catch it."""


@contextlib.contextmanager
def _no_hang(seconds: int):
    """A row that hangs fails after `seconds` instead of hanging the suite (pure-Python loops see the signal)."""
    def hung(signum, frame):
        raise _Hung(f"the command did not end within {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    except _Hung as e:
        pytest.fail(str(e))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input(name, capsys, isolated_cache, tmp_path, monkeypatch, fake_gguf, request):
    row = ROWS[name]
    if row.build:
        request.getfixturevalue("standin_build")
    sub = lambda s: s.replace("{tmp}", str(tmp_path)).replace("{gguf}", str(fake_gguf)).replace("{port}", str(port))  # noqa: E731
    port = _free_port()
    for rel, content in row.files.items():
        (tmp_path / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
    for k, v in row.env.items():
        monkeypatch.setenv(k, sub(v))
    if row.setup:
        row.setup(tmp_path, monkeypatch)
    before = _files(tmp_path)

    with _no_hang(ROW_TIMEOUT_S):
        code, out, err = run_main([sub(a) for a in row.args], capsys)

    assert code == row.code, err
    errors = [line for line in err.splitlines() if line.startswith(("error:", "Error:"))]
    assert len(errors) == 1, err
    for e in row.expect:
        assert sub(e) in errors[0], err
    hints = [line for line in err.splitlines() if line.startswith("hint:")]
    for h in row.hint:
        assert hints and h in hints[0], err
    assert "Traceback" not in out + err
    if not row.writes:
        assert _files(tmp_path) == before, "nothing written"
    assert _children() == [], "nothing left running"


def test_internal_error_is_one_line_with_a_way_to_the_traceback(capsys, isolated_cache, monkeypatch):
    """The last-resort net (no expected failure may rely on it)."""
    from rollingkv_cli.serve import settings

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(settings, "resolve_settings", boom)
    code, _, err = run_main(["serve", "demo"], capsys)
    assert code == 1 and err.splitlines()[0] == "internal error: ZeroDivisionError: a bug"
    assert "ROLLINGKV_TRACEBACK=1" in err
    monkeypatch.setenv("ROLLINGKV_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        run_main(["serve", "demo"], capsys)


# ---------------------------------------------------------------- 6: children die with us

def _spawn_parent(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A stand-in supervisor: starts `sleep` through popen_tied in its own session, prints its pid, waits."""
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"  # as a supervisor would, even under nohup (which ignores it)
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "from rollingkv_cli.lib.procs import popen_tied\n"
            "p = popen_tied(['sleep', '120'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    return parent, child


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name)
def test_tied_child_dies_with_its_parent(tmp_path, sig):
    parent, child = _spawn_parent(tmp_path)
    try:
        assert not _gone(child)
        parent.send_signal(sig)
        parent.wait(timeout=10)
        assert _wait_gone(child, 5), f"the child outlived its parent's {sig.name}"
    finally:
        for pid in (child, parent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait()


def test_second_interrupt_still_kills():
    """Ctrl-C while stop_group waits on a child that ignores SIGTERM: it is killed and reaped, then the interrupt goes on."""
    from rollingkv_cli.lib.procs import popen_tied, stop_group

    proc = popen_tied([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            stop_group(proc, grace=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == -signal.SIGKILL, "killed, not abandoned"


def test_every_child_is_started_tied():
    """One mechanism: no long-lived child is started with a bare subprocess.Popen outside procs.py."""
    # builder._run_logged (the build's ninja) belongs to the build work; it is to switch to procs.popen_tied too
    pending: set[str] = set()
    bare = sorted(p.name for p in (REPO / "rollingkv_cli").rglob("*.py")
                  if "subprocess.Popen(" in p.read_text() and p.name not in {"procs.py"} | pending)
    assert bare == []


def _serve(cpu_build, port) -> subprocess.Popen:
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", "demo", "-c", "1024", "--port", str(port), "-q", "--", "-t", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _server_child(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    """The llama-server pid once `serve` says it serves."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("serve exited before serving:\n" + "".join(seen))
        seen.append(line)
        if "serving " in line:
            kids = _children(proc.pid)
            assert len(kids) == 1, kids
            assert "llama-server" in Path(f"/proc/{kids[0]}/cmdline").read_bytes().decode(errors="replace")
            return kids[0], "".join(seen)
    raise AssertionError("serve did not report serving:\n" + "".join(seen))


@pytest.mark.build
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_serve_child_dies_with_the_supervisor(cpu_build, demo_model, sig):
    proc = _serve(cpu_build, _free_port())
    server = None
    try:
        server, _ = _server_child(proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert _wait_gone(server, 10), f"llama-server outlived `rollingkv serve`'s {sig.name}"
        if sig == signal.SIGHUP:  # handled as SIGTERM: a clean stop, and the status that names the signal
            assert proc.returncode == 128 + signal.SIGHUP and "llama-server stopped (SIGHUP)" in out, out
    finally:
        for pid in (server, proc.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()


# ---------------------------------------------------------------- 7: deaths by a signal, described

@pytest.mark.parametrize("sig,words", [("SIGILL", ["instruction", "AMX", "AVX-512", "rollingkv info", "--no-repack", "rollingkv build"]),
                                       ("SIGSEGV", ["crash", "--no-repack"]),
                                       ("SIGKILL", ["out-of-memory"])])
def test_describe_exit_names_the_signal(tmp_path, sig, words):
    from rollingkv_cli.lib.procs import describe_exit, popen_tied

    log = tmp_path / "child.log"
    with open(log, "w") as f:
        proc = popen_tied([sys.executable, "-c", _standin(sig)], stderr=f)
        rc = proc.wait(timeout=30)
    assert rc == -getattr(signal, sig)
    text = describe_exit(rc, log)
    assert f"killed by {sig} (signal {-rc})" in text and f"log: {log}" in text
    for w in words:
        assert w in text, text
    assert describe_exit(3, log) == f"exit status 3; log: {log}"


def test_server_process_reports_a_signal_death(tmp_path):
    from rollingkv_cli.console import RollingKVError
    from rollingkv_cli.serve.server import ServerProcess

    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + _standin("SIGSEGV"))
    binary.chmod(0o755)
    srv = ServerProcess(binary, [], log_path=tmp_path / "s.log")
    srv.start()
    with pytest.raises(RollingKVError) as e:
        srv.wait_healthy(timeout=30)
    srv.stop()
    assert "killed by SIGSEGV (signal 11)" in e.value.message and str(tmp_path / "s.log") in e.value.hint
    assert "about to die" in (tmp_path / "s.log").read_text()


# ---------------------------------------------------------------- issue 27 (1): safe by default

@pytest.mark.parametrize("extra, env, warned", [([], {}, True), (["--", "--api-key", "k"], {}, False), ([], {"LLAMA_API_KEY": "k"}, False)],
                         ids=["no-key", "api-key-after-dashes", "LLAMA_API_KEY"])
def test_non_loopback_host_without_an_api_key_warns(extra, env, warned, capsys, isolated_cache, standin_build, fake_gguf, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LLAMA_API_KEY", raising=False) if not env else None
    code, _, err = run_main(["serve", str(fake_gguf), "--host", "0.0.0.0", "--port", str(_free_port()), "-q", *extra], capsys)
    assert code == 1 and "exited during start-up" in err  # the stand-in dies: the warning came before it started
    assert ("no API key is set" in err) == warned, err
    assert _children() == []


@pytest.mark.parametrize("extra, warned", [([], None), (["--slot-save"], "--slot-save: any client"),
                                           (["--", "--slot-save-path", "{tmp}/s"], "--slot-save-path: any client")],
                         ids=["off", "slot-save", "slot-save-path-after-dashes"])
def test_slot_save_is_off_unless_asked_and_warned_about(extra, warned, capsys, isolated_cache, standin_build, fake_gguf, tmp_path,
                                                        monkeypatch):
    """Slot save/restore lets any client write files: llama-server gets --slot-save-path only when asked, either way, and
    serve warns then, naming the folder."""
    monkeypatch.setenv("LLAMA_API_KEY", "k")  # no warning about the host to tell apart
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    code, _, err = run_main(["serve", str(fake_gguf), "--port", str(_free_port()), "-q", *extra], capsys)
    assert code == 1 and "exited during start-up" in err
    log = (isolated_cache / "logs").glob("serve-*.log")
    argv = next(log).read_text().splitlines()[0]
    assert ("--slot-save-path" in argv) == (warned is not None), argv
    warnings = [line for line in err.splitlines() if line.startswith("warning:") and "slot" in line]
    assert (len(warnings) == 1 and warned in warnings[0] and "KV cache files in" in warnings[0]) if warned else warnings == [], err


def test_loopback_hosts():
    from rollingkv_cli.serve.launch import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("no.such.host.invalid")


def test_api_key_is_found_where_llama_server_reads_it(tmp_path, monkeypatch):
    from rollingkv_cli.serve.launch import api_key

    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    monkeypatch.delenv("LLAMA_ARG_API_KEY_FILE", raising=False)
    assert api_key(["-t", "2"]) is None
    assert api_key(["--api-key", "a,b"]) == "a" and api_key(["--api-key=c"]) == "c"
    f = tmp_path / "keys"
    f.write_text("# comment\n\nsecret\n")
    assert api_key(["--api-key-file", str(f)]) == "secret"
    monkeypatch.setenv("LLAMA_API_KEY", "env")
    assert api_key([]) == "env" and api_key(["--api-key", "flag"]) == "flag"
