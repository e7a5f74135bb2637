"""Bad input to `run`, `model synth` and `build`: one line `error: ...` (no traceback), the right exit status,
nothing written (no OUT / OUT.part, no builds/<key>) and nothing left running.

One matrix, one row per bad input; a row's setup makes its files and returns (argv, paths that must not exist).
Rows that need a real process (run loads llama.cpp, which binds once per process and may abort) run
`python -m rollingkv_cli` as a subprocess; the others go through cli.main in-process (test_cli.run_main)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from test_cli import run_main


@dataclass
class Ctx:
    tmp: Path
    cache: Path
    monkeypatch: pytest.MonkeyPatch
    env: dict = field(default_factory=dict)  # for subprocess rows
    demo: Path | None = None


@dataclass
class Row:
    setup: Callable[[Ctx], tuple[list[str], list[Path]]]
    message: str  # a fragment of the one `error:` line
    code: int = 1
    proc: bool = False  # a subprocess (else in-process through cli.main)
    needs_build: bool = False  # ROLLINGKV_BUILD points at the CPU build, and the demo model is there


def _proc(args: list[str], env: dict, timeout: float = 300) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    return proc.returncode, proc.stdout, proc.stderr


def _running_with(marker: str) -> list[str]:
    """Processes (other than us) whose command line mentions marker: what a failed command must not leave behind."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{d.name}: {cmd}")
    return found


# ------------------------------------------------------------------------------------------- build rows

def _build_nothing_written(ctx: Ctx) -> list[Path]:
    return [ctx.cache / "builds"]


def _needs_nvcc_without_gpu():
    from rollingkv_cli import builder

    if not builder.nvcc_path():
        pytest.skip("no nvcc on this machine")
    if builder.gpu_compute_capabilities():
        pytest.skip("this machine has an NVIDIA GPU: --cuda resolves its arch")


def build_cuda_no_gpu(ctx: Ctx):
    _needs_nvcc_without_gpu()  # the real nvcc, the real NVML: no mocks
    return ["build", "--cuda"], _build_nothing_written(ctx)


def build_cuda_native_no_gpu(ctx: Ctx):
    _needs_nvcc_without_gpu()
    return ["build", "--cuda", "--cuda-arch", "native"], _build_nothing_written(ctx)


def build_source_missing(ctx: Ctx):
    return ["build", "--no-cuda", "--source", str(ctx.tmp / "nonexistent")], _build_nothing_written(ctx)


def _fake_tree(ctx: Ctx, cmake: str) -> Path:
    """A tree that passes as llama.cpp with --allow-unpinned; the series is not applied (it is for the real tree)."""
    from rollingkv_cli import patchset

    tree = ctx.tmp / "llama.cpp"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text("/* fake */\n")
    (tree / "CMakeLists.txt").write_text(cmake)
    ctx.monkeypatch.setattr(patchset, "apply_series", lambda *a, **k: None)
    ctx.monkeypatch.setattr(tempfile, "tempdir", str(ctx.tmp))  # where a removed build's configure log is kept
    return tree


def build_configure_fails(ctx: Ctx):
    from rollingkv_cli import builder, patchset

    tree = _fake_tree(ctx, 'cmake_minimum_required(VERSION 3.14)\nproject(fake NONE)\nmessage(FATAL_ERROR "rkv-test-boom")\n')
    bdir = builder.build_dir_for(builder.BuildOptions(source=str(tree.resolve()), pinned=False), patchset.load_series())
    return ["build", "--no-cuda", "-q", "--source", str(tree), "--allow-unpinned"], [bdir]


# ------------------------------------------------------------------------------------------- synth rows

SMALL = ["--layers", "2", "--embd", "64", "--heads", "4", "--kv-heads", "2", "--ff", "128", "--vocab", "300", "--ctx", "1024"]


def _synth(*shape: str, out: str = "m.gguf"):
    def setup(ctx: Ctx):
        target = ctx.tmp / out
        return ["model", "synth", str(target), *shape], [target, target.with_name(target.name + ".part")]
    return setup


def synth_no_room(ctx: Ctx):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    ctx.monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, (10 << 30) - (100 << 20), 100 << 20))
    return _synth()(ctx)  # the default shape: ~5.6 GiB on a filesystem with 100 MiB free


def synth_parent_is_a_file(ctx: Ctx):
    (ctx.tmp / "afile").write_text("x")
    return _synth(*SMALL, out="afile/m.gguf")(ctx)


ROWS = {
    "synth odd head_dim": Row(_synth("--embd", "66", "--heads", "2"), "head_dim 33 (--embd 66 / --heads 2) is odd"),
    "synth embd not a multiple of heads": Row(_synth("--embd", "100", "--heads", "3"), "not a multiple of --heads"),
    "synth kv-heads do not divide heads": Row(_synth("--heads", "24", "--kv-heads", "5"), "not a multiple of --kv-heads 5"),
    "synth too many layers": Row(_synth("--layers", "600"), "at most 512 layers"),
    "synth zero size": Row(_synth("--ff", "0"), "--ff 0 is out of range"),
    "synth negative vocab": Row(_synth("--vocab", "-5"), "--vocab -5 is out of range"),
    "synth q8_0 unaligned": Row(_synth("--type", "q8_0", "--embd", "80", "--heads", "4", "--kv-heads", "2"), "multiples of 32"),
    "synth no room on the filesystem": Row(synth_no_room, "free; writing m.gguf needs 5.6"),
    "synth parent is a file": Row(synth_parent_is_a_file, "could not write"),
    "build --cuda, nvcc but no GPU": Row(build_cuda_no_gpu, "no NVIDIA GPU found to build for: pass --cuda-arch, e.g. 90"),
    "build --cuda-arch native, no GPU": Row(build_cuda_native_no_gpu, "no NVIDIA GPU found to build for"),
    "build --source missing": Row(build_source_missing, "is not a directory"),
    "build: configure fails": Row(build_configure_fails, "cmake configure failed"),
}


# ------------------------------------------------------------------------------------------- the matrix

def _params() -> list:
    return [pytest.param(row, id=name, marks=[pytest.mark.build] if row.needs_build else []) for name, row in ROWS.items()]


@pytest.mark.parametrize("row", _params())
def test_bad_input(row: Row, tmp_path, isolated_cache, monkeypatch, capsys, request):
    ctx = Ctx(tmp=tmp_path, cache=isolated_cache, monkeypatch=monkeypatch, env={"ROLLINGKV_CACHE_DIR": str(isolated_cache), "ROLLINGKV_OFFLINE": "1"})
    if row.needs_build:
        ctx.env["ROLLINGKV_BUILD"] = str(request.getfixturevalue("cpu_build").dir)
        ctx.demo = request.getfixturevalue("demo_model")
    argv, must_not_exist = row.setup(ctx)
    if row.proc:
        code, out, err = _proc(argv, ctx.env)
    else:
        code, out, err = run_main(argv, capsys)
    assert "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"want one error line:\n{err}"
    assert row.message in errors[0], err
    assert code == row.code, err
    for p in must_not_exist:
        assert not p.exists(), f"{p} was left behind"
    assert not _running_with(str(tmp_path)), "a child process outlived the command"


def test_configure_failure_keeps_its_log(tmp_path, isolated_cache, monkeypatch, capsys):
    """The removed directory's configure log is kept where the error line says."""
    ctx = Ctx(tmp=tmp_path, cache=isolated_cache, monkeypatch=monkeypatch)
    argv, _ = build_configure_fails(ctx)
    code, _, err = run_main(argv, capsys)
    assert code == 1
    log = Path(err.split("full log: ", 1)[1].split(")", 1)[0])
    assert log.parent == tmp_path and "rkv-test-boom" in log.read_text()


def test_failed_compile_keeps_its_tree_and_says_where_the_log_is(tmp_path, isolated_cache, monkeypatch, capsys):
    """Past configure, a failure keeps the directory (a rerun resumes) and the error names its build.log."""
    cmake = "cmake_minimum_required(VERSION 3.14)\nproject(fake NONE)\n" + "".join(
        f"add_custom_target({t} COMMAND false)\n" for t in ("llama", "llama-server", "llama-bench"))
    tree = _fake_tree(Ctx(tmp=tmp_path, cache=isolated_cache, monkeypatch=monkeypatch), cmake)
    code, _, err = run_main(["build", "--no-cuda", "-q", "--source", str(tree), "--allow-unpinned"], capsys)
    assert code == 1 and "build failed" in err and "resumes" in err
    (bdir,) = (isolated_cache / "builds").iterdir()
    assert f"full log: {bdir / 'build.log'}" in err.replace("\n", "")
    assert (bdir / "build" / "build.ninja").is_file() and not (bdir / "manifest.json").exists()


# ------------------------------------------------------------------------------------------- synth: existing OUT, interrupts

BIG = ["--layers", "8", "--embd", "2048", "--heads", "16", "--kv-heads", "4", "--ff", "8192"]  # ~1.2 GiB: a few seconds


def test_synth_existing_out(tmp_path, capsys):
    """Refused without --force (untouched); with --force replaced whole (the new file is complete, no .part)."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    code, _, err = run_main(["model", "synth", str(out), *SMALL], capsys)
    assert code == 1 and "--force" in err and out.read_bytes() == b"keep me"
    code, _, err = run_main(["model", "synth", str(out), *SMALL, "--force"], capsys)
    assert code == 0, err
    import gguf

    assert gguf.GGUFReader(str(out)).fields["llama.block_count"].parts[-1][0] == 2
    assert not out.with_name("m.gguf.part").exists()


def test_synth_says_its_size_before_writing(tmp_path, capsys):
    from rollingkv_cli import models

    code, out, _ = run_main(["model", "synth", str(tmp_path / "m.gguf"), *SMALL], capsys)
    assert code == 0
    first = out.splitlines()[0]
    assert first.startswith(f"writing {tmp_path / 'm.gguf'}: ") and "KiB" in first
    spec = models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300, ctx=1024)
    size = (tmp_path / "m.gguf").stat().st_size
    assert size <= models.synth_nbytes(spec) < size + 8192  # an upper bound, and a close one


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "force-over-existing"])
def test_synth_interrupted_leaves_nothing(tmp_path, sig, code, existing):
    out = tmp_path / "big.gguf"
    part = tmp_path / "big.gguf.part"
    if existing:
        out.write_bytes(b"the old model")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollingkv_cli", "model", "synth", str(out), *BIG, *(["--force"] if existing else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's background job may ignore SIGINT
    )
    try:
        deadline = time.monotonic() + 120
        while not (part.exists() and part.stat().st_size > (64 << 20)):  # mid-write
            assert proc.poll() is None, f"synth ended before it was interrupted: {proc.communicate()}"
            assert time.monotonic() < deadline, "synth never started writing"
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stdout + stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr  # "aborted" (Ctrl-C) or the SIGTERM error line
    assert not part.exists()
    assert (out.read_bytes() == b"the old model") if existing else not out.exists()
