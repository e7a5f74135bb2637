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
    from rollingkv_cli.lib import builder

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


def build_sdist_not_cached(ctx: Ctx):
    from rollingkv_cli.lib import builder, patchset

    bdir = builder.build_dir_for(builder.BuildOptions(), patchset.load_series())  # isolated_cache is offline, no sdist
    return ["build", "--no-cuda", "-q"], [bdir]


def _fake_tree(ctx: Ctx, cmake: str) -> Path:
    """A tree that passes as llama.cpp with --allow-unpinned; the series is not applied (it is for the real tree)."""
    from rollingkv_cli.lib import patchset

    tree = ctx.tmp / "llama.cpp"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text("/* fake */\n")
    (tree / "CMakeLists.txt").write_text(cmake)
    ctx.monkeypatch.setattr(patchset, "apply_series", lambda *a, **k: None)
    ctx.monkeypatch.setattr(tempfile, "tempdir", str(ctx.tmp))  # where a removed build's configure log is kept
    return tree


def build_configure_fails(ctx: Ctx):
    from rollingkv_cli.lib import builder, patchset

    tree = _fake_tree(ctx, 'cmake_minimum_required(VERSION 3.14)\nproject(fake NONE)\nmessage(FATAL_ERROR "rkv-test-boom")\n')
    bdir = builder.build_dir_for(builder.BuildOptions(source=str(tree.resolve()), pinned=False), patchset.load_series())
    return ["build", "--no-cuda", "-q", "--source", str(tree), "--allow-unpinned"], [bdir]


# ------------------------------------------------------------------------------------------- run rows

def _small_model(ctx: Ctx, name: str = "s.gguf", unchecked: bool = False, **shape) -> Path:
    from rollingkv_cli import models

    class Unchecked(models.SynthSpec):  # a file an older or foreign writer could have made
        def validate(self) -> None:
            pass

    spec = dict(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300, ctx=1024) | shape
    return models.write_synthetic(ctx.tmp / name, (Unchecked if unchecked else models.SynthSpec)(**spec))


def _run(model: Path | str, *args: str) -> list[str]:
    return ["run", str(model), *(args or ("-p", "hi"))]


def run_truncated_demo(ctx: Ctx):
    t = ctx.tmp / "t.gguf"
    t.write_bytes(ctx.demo.read_bytes()[:1_000_000])  # `head -c 1000000 demo.gguf > t.gguf`
    return _run(t), []


def run_truncated_synth(ctx: Ctx):
    s = _small_model(ctx)
    t = ctx.tmp / "t.gguf"
    t.write_bytes(s.read_bytes()[: s.stat().st_size // 2])
    return _run(t), []


def run_cut_in_header(ctx: Ctx):
    s = _small_model(ctx)
    t = ctx.tmp / "t.gguf"
    t.write_bytes(s.read_bytes()[:3000])  # inside the token list
    return _run(t), []


def run_header_only(ctx: Ctx):
    t = ctx.tmp / "h.gguf"
    t.write_bytes(b"GGUF" + b"\0" * 60)  # the magic, version 0
    return _run(t), []


def run_prompt_too_long(ctx: Ctx):
    return _run(ctx.demo, "-c", "64", "-p", "word " * 400), []


def run_unknown_arch(ctx: Ctx):
    import gguf

    t = ctx.tmp / "a.gguf"
    w = gguf.GGUFWriter(str(t), "no-such-arch")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _run(t), []


def run_odd_head_dim(ctx: Ctx):
    return _run(_small_model(ctx, "odd.gguf", unchecked=True, embd=66, heads=2, kv_heads=2)), []


def run_llama_cpp_aborts(ctx: Ctx):
    """A gemma2 file that rotates more dimensions than a head has: passes check_gguf, then GGML_ASSERTs in llama.cpp
    (ggml_rope: n_dims <= ne0). The CLI must survive that abort and say it in one line."""
    import gguf

    real = gguf.GGUFWriter.add_rope_dimension_count
    ctx.monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: real(self, 4 * n))
    m = _small_model(ctx, "rot.gguf", arch="gemma2")
    ctx.monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", real)
    return _run(m), []


def _gguf_bytes(kvs: list[bytes], n_tensors: int = 0) -> bytes:
    """A GGUF v3 header by hand: kvs are encoded key/value pairs (what gguf-py's writer will not make)."""
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs)


def _key(name: str) -> bytes:
    import struct

    return struct.pack("<Q", len(name)) + name.encode()


def run_nested_arrays(ctx: Ctx):
    """5000 arrays each holding the next: the header walk ended in RecursionError ("internal error")."""
    import struct

    nested = struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000)) + struct.pack("<IQ", 4, 0)
    t = ctx.tmp / "nested.gguf"
    t.write_bytes(_gguf_bytes([_key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama", _key("x.deep") + nested]))
    return _run(t), []


def run_array_counted_past_the_end(ctx: Ctx):
    """An array of 2^40 bytes in a file of 100: gguf-py's GGUFReader reads it value by value and never ends."""
    import struct

    t = ctx.tmp / "bigarray.gguf"
    t.write_bytes(_gguf_bytes([_key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama",
                               _key("x.big") + struct.pack("<IIQ", 9, 0, 2**40)]))
    return _run(t), []


def run_alignment_a_string(ctx: Ctx):
    """general.alignment as a string: the header walk ended in TypeError ("internal error")."""
    import struct

    t = ctx.tmp / "align.gguf"
    t.write_bytes(_gguf_bytes([_key("general.alignment") + struct.pack("<IQ", 8, 2) + b"32"], n_tensors=1)
                  + _key("w") + struct.pack("<IQIQ", 1, 32, 0, 0))
    return _run(t), []


def run_alignment_not_a_power_of_two(ctx: Ctx):
    import struct

    t = ctx.tmp / "align3.gguf"
    t.write_bytes(_gguf_bytes([_key("general.alignment") + struct.pack("<II", 4, 48)], n_tensors=1) + _key("w") + struct.pack("<IQIQ", 1, 32, 0, 0))
    return _run(t), []


def run_no_tensors_unpadded(ctx: Ctx):
    """A GGUF with no tensors and no padding after its header was called truncated ("its tensors end at byte 192")."""
    import struct

    t = ctx.tmp / "empty.gguf"
    t.write_bytes(_gguf_bytes([_key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama"]))
    return _run(t), []


def run_model_is_a_directory(ctx: Ctx):
    (ctx.tmp / "d.gguf").mkdir()
    return _run(ctx.tmp / "d.gguf"), []


def run_model_missing(ctx: Ctx):
    return _run(ctx.tmp / "nope.gguf"), []


def run_model_unreadable(ctx: Ctx):
    # root reads a chmod-000 file; /proc/self/mem is a regular file whose first bytes no one can read (EIO)
    return _run("/proc/self/mem"), []


def run_model_chmod_000(ctx: Ctx):
    if os.geteuid() == 0:
        pytest.skip("root reads a chmod-000 file (the /proc/self/mem row covers an unreadable model)")
    s = _small_model(ctx)
    s.chmod(0)
    return _run(s), []


def run_binary_prompt_file(ctx: Ctx):
    f = ctx.tmp / "prompt.bin"
    f.write_bytes(bytes(range(256)) * 8)
    return _run(_small_model(ctx), "--prompt-file", str(f)), []


def run_prompt_file_with_nul(ctx: Ctx):
    f = ctx.tmp / "prompt.txt"
    f.write_bytes(b"hello\0world\n")  # valid UTF-8, still not text
    return _run(_small_model(ctx), "--prompt-file", str(f)), []


def run_prompt_not_utf8(ctx: Ctx):
    return _run(_small_model(ctx), "-p", os.fsdecode(b"caf\xe9")), []  # latin-1 bytes in argv


# ------------------------------------------------------------------------------------------- synth rows

SMALL = ["--layers", "2", "--embd", "64", "--heads", "4", "--kv-heads", "2", "--ff", "128", "--vocab", "300", "--ctx", "1024"]


def _parts(target: Path) -> list[Path]:
    """The temporary files a synth run to target writes (OUT.<random>.part), for the "nothing left behind" checks."""
    return sorted(target.parent.glob(target.name + ".*part")) if target.parent.is_dir() else []


class _NoPart:
    """A must-not-exist entry for every OUT.*.part of target (evaluated when checked, after the run)."""

    def __init__(self, target: Path):
        self.target = target

    def exists(self) -> bool:
        return bool(_parts(self.target))

    def __str__(self) -> str:
        return f"{self.target}.*.part"


def _synth(*shape: str, out: str = "m.gguf", force: bool = False):
    """The bad values over a small shape: should the refusal regress, the test writes kilobytes, not the default ~6 GiB."""
    def setup(ctx: Ctx):
        target = ctx.tmp / out
        return ["model", "synth", str(target), *SMALL, *shape, *(["--force"] if force else [])], [target, _NoPart(target)]
    return setup


def synth_out_is_a_device(ctx: Ctx):
    """`model synth /dev/full --force` as root replaced the character device with a regular file. The device here is a
    node of /dev/null's numbers made in the test's directory: should the refusal regress, only that node is replaced."""
    import stat

    dev = ctx.tmp / "full"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root (the case of the report: root replaced /dev/full)")
    return ["model", "synth", str(dev), *SMALL, "--force"], [_NoPart(dev)]


def synth_out_is_a_fifo(ctx: Ctx):
    fifo = ctx.tmp / "m.gguf"
    os.mkfifo(fifo)
    return ["model", "synth", str(fifo), *SMALL, "--force"], [_NoPart(fifo)]


def synth_out_is_a_symlink(ctx: Ctx):
    real = ctx.tmp / "real.gguf"
    real.write_bytes(b"keep me")
    link = ctx.tmp / "m.gguf"
    link.symlink_to(real)
    return ["model", "synth", str(link), *SMALL, "--force"], [_NoPart(link)]


def synth_vocab_huge(ctx: Ctx):
    """A billion-token vocabulary is refused by its size before anything is allocated (it grew for minutes, silently)."""
    target = ctx.tmp / "m.gguf"
    # 1e9 x 8192 x 2 bytes, twice (embedding and output): 32 TB, more than any test machine has free
    return ["model", "synth", str(target), *SMALL, "--vocab", "1000000000", "--embd", "8192", "--heads", "64"], [target, _NoPart(target)]


def synth_no_room(ctx: Ctx):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    ctx.monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, (10 << 30) - (100 << 10), 100 << 10))
    return _synth()(ctx)  # ~230 KiB (+ headroom) on a filesystem with 100 KiB free


def synth_read_only(ctx: Ctx):
    """A read-only filesystem (as statvfs reports it) was described by its free space ("64 KiB free")."""
    real = os.statvfs

    def statvfs(p):
        r = real(p)
        fake = {k: getattr(r, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_files", "f_ffree", "f_favail", "f_fsid",
                                           "f_namemax")}
        return type("statvfs_result", (), {**fake, "f_flag": r.f_flag | os.ST_RDONLY, "f_bavail": 16, "f_frsize": 4096})()

    ctx.monkeypatch.setattr(os, "statvfs", statvfs)
    return _synth()(ctx)


def synth_parent_is_a_file(ctx: Ctx):
    (ctx.tmp / "afile").write_text("x")
    return _synth(out="afile/m.gguf")(ctx)


def synth_parent_missing(ctx: Ctx):
    """issue 39: 13. `model synth /nonexistent_dir/x.gguf` made /nonexistent_dir, silently (seen before the fix: exit 0,
    the folder and the model written)."""
    return _synth(out="nodir/deeper/m.gguf")(ctx)[0], [ctx.tmp / "nodir"]


def gate_window_past_the_context(ctx: Ctx):
    """The same usage error as gate needle's (exit 2), though found only once the text is tokenized (issue 27: 14)."""
    return ["gate", "equiv", "--model", str(ctx.demo), "--synthetic-tokens", "300", "--kv-window-cells", "99999", "--threads", "2",
            "--work-dir", str(ctx.tmp / "wd")], []


ROWS = {
    "run truncated demo (head -c 1000000)": Row(run_truncated_demo, "t.gguf is truncated: 1000000 bytes", proc=True, needs_build=True),
    "run truncated GGUF": Row(run_truncated_synth, "bytes, its tensors end at byte", proc=True),
    "run GGUF cut inside its header": Row(run_cut_in_header, "t.gguf is truncated: 3000 bytes, it ends inside its own header", proc=True),
    "run GGUF header only, version 0": Row(run_header_only, "is GGUF version 0; llama.cpp reads versions 2 and 3", proc=True),
    "run prompt longer than the context": Row(run_prompt_too_long, "does not fit the context of 256 tokens, -c 64 rounded up", proc=True, needs_build=True),
    "run GGUF llama.cpp refuses": Row(run_unknown_arch, "llama.cpp could not load", proc=True, needs_build=True),
    "run GGUF with odd head_dim": Row(run_odd_head_dim, "rotates 33 dimensions per head", proc=True, needs_build=True),
    "run GGUF llama.cpp aborts on": Row(run_llama_cpp_aborts, "llama.cpp aborted while running", proc=True, needs_build=True),
    "run GGUF of 5000 nested arrays": Row(run_nested_arrays, "its key x.deep is an array of arrays, which llama.cpp does not read", proc=True),
    "run GGUF array counted past its end": Row(run_array_counted_past_the_end, "bigarray.gguf is truncated: 98 bytes, it ends inside its own header",
                                               proc=True),
    "run GGUF alignment a string": Row(run_alignment_a_string, "its key general.alignment is '32'; llama.cpp needs a uint32 power of 2", proc=True),
    "run GGUF alignment 48": Row(run_alignment_not_a_power_of_two, "its key general.alignment is 48", proc=True),
    "run GGUF without tensors, unpadded": Row(run_no_tensors_unpadded, "llama.cpp could not load", proc=True, needs_build=True),
    "run model is a directory": Row(run_model_is_a_directory, "is not a file", proc=True),
    "run model missing": Row(run_model_missing, "not found", proc=True),
    "run model unreadable (EIO)": Row(run_model_unreadable, "cannot read model /proc/self/mem", proc=True),
    "run model chmod 000": Row(run_model_chmod_000, "cannot read model", proc=True),
    "run binary --prompt-file": Row(run_binary_prompt_file, "is not UTF-8 text", proc=True),
    "run --prompt-file with a NUL": Row(run_prompt_file_with_nul, "holds a NUL byte", proc=True),
    "run --prompt not UTF-8": Row(run_prompt_not_utf8, "--prompt is not UTF-8 text", proc=True),
    "synth odd head_dim": Row(_synth("--embd", "66", "--heads", "2"), "head_dim 33 (--embd 66 / --heads 2) is odd", code=2),
    "synth embd not a multiple of heads": Row(_synth("--embd", "100", "--heads", "3"), "not a multiple of --heads", code=2),
    "synth kv-heads do not divide heads": Row(_synth("--embd", "96", "--heads", "24", "--kv-heads", "5"), "not a multiple of --kv-heads 5", code=2),
    "synth too many layers": Row(_synth("--layers", "600"), "at most 512 layers", code=2),
    "synth zero size": Row(_synth("--ff", "0"), "--ff 0 is out of range", code=2),
    "synth negative vocab": Row(_synth("--vocab", "-5"), "--vocab -5 is out of range", code=2),
    "synth q8_0 unaligned": Row(_synth("--type", "q8_0", "--embd", "80", "--heads", "4", "--kv-heads", "2"), "multiples of 32", code=2),
    "synth hybrid without recurrent layers": Row(_synth("--arch", "qwen35", "--attn-interval", "1"), "every layer an attention layer", code=2),
    "synth hybrid without attention layers": Row(_synth("--arch", "lfm2", "--attn-interval", "3"), "no attention layer", code=2),
    "synth qwen35 head_dim not a multiple of 8": Row(_synth("--arch", "qwen35", "--attn-interval", "2", "--embd", "72", "--heads", "6", "--kv-heads", "2"),
                                                     "head_dim 12 (--embd 72 / --heads 6) is not a multiple of 8", code=2),
    "synth qwen35 value heads per group": Row(_synth("--arch", "qwen35", "--attn-interval", "2", "--ssm-heads", "3"),
                                              "--ssm-heads 3 is not a multiple of --ssm-groups 2", code=2),
    "synth qwen35 q8_0 delta net width": Row(_synth("--arch", "qwen35", "--attn-interval", "2", "--type", "q8_0", "--embd", "128", "--ff", "256",
                                                    "--ssm-state", "4", "--ssm-heads", "4"), "16 is not", code=2),
    "synth lfm2 convolution of 1": Row(_synth("--arch", "lfm2", "--attn-interval", "2", "--conv-kernel", "1"), "needs a length of 2 or more", code=2),
    "synth lfm2 with a delta net option": Row(_synth("--arch", "lfm2", "--attn-interval", "2", "--ssm-state", "16"), "applies to --arch qwen35", code=2),
    "synth llama with a hybrid option": Row(_synth("--conv-kernel", "4"), "applies to the hybrid architectures", code=2),
    "synth negative attention interval": Row(_synth("--arch", "qwen35", "--attn-interval", "-2"), "--attn-interval -2 is out of range", code=2),
    "synth no room on the filesystem": Row(synth_no_room, "has 100 KiB free; writing m.gguf needs 23"),
    "synth OUT is a device (--force)": Row(synth_out_is_a_device, "full is a device, not a regular file"),
    "synth OUT is a FIFO (--force)": Row(synth_out_is_a_fifo, "m.gguf is a FIFO, not a regular file"),
    "synth OUT is a symbolic link (--force)": Row(synth_out_is_a_symlink, "m.gguf is a symbolic link, not a regular file"),
    "synth vocab of a billion": Row(synth_vocab_huge, "writing m.gguf needs"),
    "synth parent is a file": Row(synth_parent_is_a_file, "afile is not a directory"),
    "synth parent missing": Row(synth_parent_missing, "nodir/deeper does not exist"),
    "synth on a read-only filesystem": Row(synth_read_only, "is on a read-only filesystem: m.gguf cannot be written there"),
    "gate equiv window past the context": Row(gate_window_past_the_context, "--kv-window-cells 99999 must be smaller than the context (768)",
                                              code=2, proc=True, needs_build=True),
    "build --cuda, nvcc but no GPU": Row(build_cuda_no_gpu, "no NVIDIA GPU found to build for: pass --cuda-arch, e.g. 90"),
    "build --cuda-arch native, no GPU": Row(build_cuda_native_no_gpu, "no NVIDIA GPU found to build for"),
    "build --source missing": Row(build_source_missing, "is not a directory"),
    "build: configure fails": Row(build_configure_fails, "cmake configure failed"),
    "build offline, sdist not cached": Row(build_sdist_not_cached, "is not cached and ROLLINGKV_OFFLINE is set"),
}


# ------------------------------------------------------------------------------------------- the matrix

def _params() -> list:
    return [pytest.param(row, id=name, marks=[pytest.mark.build] if row.needs_build else []) for name, row in ROWS.items()]


@pytest.mark.parametrize("row", _params())
def test_bad_input(row: Row, tmp_path, monkeypatch, capsys, request):
    build = request.getfixturevalue("cpu_build") if row.needs_build else None  # from the user cache, before isolating
    demo = request.getfixturevalue("demo_model") if row.needs_build else None
    cache = request.getfixturevalue("isolated_cache")
    ctx = Ctx(tmp=tmp_path, cache=cache, monkeypatch=monkeypatch, env={"ROLLINGKV_CACHE_DIR": str(cache), "ROLLINGKV_OFFLINE": "1"}, demo=demo)
    if build is not None:
        ctx.env["ROLLINGKV_BUILD"] = str(build.dir)
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
        f"add_custom_target({t} COMMAND false)\n" for t in ("llama", "llama-server", "llama-bench", "llama-batched-bench"))
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
    assert not _parts(out)
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()  # the mode of a plain open(), not the temporary file's 0600


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_synth_runs_to_one_out_write_files_of_their_own(tmp_path, monkeypatch):
    """Two runs to one OUT: each writes a temporary file of its own, created exclusively, so neither can rename the other's
    half-written content over OUT (they shared OUT.part)."""
    from rollingkv_cli import models

    seen = []
    real = os.replace

    def replace(src, dst):
        seen.append(Path(src).name)
        if len(seen) == 1:  # the first run is about to finish: the second one runs to completion meanwhile
            models.write_synthetic(tmp_path / "m.gguf", models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300,
                                                                         ctx=1024, seed=1))
        real(src, dst)

    monkeypatch.setattr(models.os, "replace", replace)
    spec = models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=300, ctx=1024, seed=0)
    models.write_synthetic(tmp_path / "m.gguf", spec)
    assert len(seen) == 2 and seen[0] != seen[1] and all(n.startswith("m.gguf.") and n.endswith(".part") for n in seen)
    assert not _parts(tmp_path / "m.gguf")
    import gguf

    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["llama.block_count"].parts[-1][0] == 2  # a whole file


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_synth_size_is_counted_not_built(monkeypatch):
    """synth_nbytes of a huge vocabulary is counted, not built, and matches the token list it stands for. Structural, not a
    wall-clock bound (1 s on a loaded 2-core CI was the check): the token list is never made and the count's memory stays
    under 1 MiB for a billion tokens; counting from the list instead (as before issue 27) makes 100x that for a million
    tokens, which the last assertion shows (the check bites)."""
    from rollingkv_cli import models

    for n in (260, 300, 1000, 12345):
        tokens, _, _ = models._tokenizer(n)
        assert models._tokenizer_nbytes(n) == sum(8 + len(t.encode()) for t in tokens) + 8 * len(tokens)
    real_tokenizer = models._tokenizer

    def never(n):
        raise AssertionError(f"synth_nbytes built the token list of {n}")

    monkeypatch.setattr(models, "_tokenizer", never)
    big = models.SynthSpec(layers=2, embd=64, heads=4, kv_heads=2, ff=128, vocab=10**9, ctx=1024)
    assert _peak_bytes(lambda: models.synth_nbytes(big)) < 2**20
    built = _peak_bytes(lambda: sum(8 + len(t.encode()) for t in real_tokenizer(10**6)[0]))
    assert built > 100 * 2**20


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
    if existing:
        out.write_bytes(b"the old model")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollingkv_cli", "model", "synth", str(out), *BIG, *(["--force"] if existing else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's background job may ignore SIGINT
    )
    try:
        deadline = time.monotonic() + 120
        while not ((parts := _parts(out)) and parts[0].stat().st_size > (64 << 20)):  # mid-write
            assert proc.poll() is None, f"synth ended before it was interrupted: {proc.communicate()}"
            assert time.monotonic() < deadline, "synth never started writing"
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        assert proc.returncode == code, stderr
        assert "Traceback" not in stdout + stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, stderr  # "aborted" (Ctrl-C) or the SIGTERM error line
        assert not _parts(out)
        assert (out.read_bytes() == b"the old model") if existing else not out.exists()
    finally:  # a failing run must not keep a GiB in pytest's kept temp dirs
        for p in _parts(out):
            p.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- run: stdout, the guard

@pytest.mark.build
def test_run_stdout_is_the_answer_alone(cpu_build, demo_model):
    """`rollingkv run ... > answer.txt` captures the answer only; banner, progress and timings are on stderr."""
    code, out, err = _proc(["run", "demo", "-p", "What is the capital of France? Answer in one word.", "-n", "8"],
                           {"ROLLINGKV_BUILD": str(cpu_build.dir)})
    assert code == 0, err
    assert "Paris" in out and len(out.strip().splitlines()) == 1
    assert "rollingkv api=" not in out and "rollingkv api=" in err and "prompt +" in err
    assert "generating (at most 8 tokens)" in err and "generating" not in out


def _guarded(body: str) -> subprocess.CompletedProcess:
    code = f"""
import os, sys
from rollingkv_cli.lib import child as lib_child
from rollingkv_cli.console import RollingKVError, abort, print_error
def child():
{body}
try:
    lib_child.run_isolated(child, "testing the guard")
except RollingKVError as e:
    print_error(e)
    sys.exit(e.code)
print("parent goes on")
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("body, code, out, err", [
    ("    os.abort()", 1, "", "error: llama.cpp crashed (SIGABRT) while testing the guard"),
    ("    os.kill(os.getpid(), 11)", 1, "", "error: llama.cpp crashed (SIGSEGV) while testing the guard"),
    ("    abort('bad input', 'a hint', code=3)", 3, "", "error: bad input"),
    ("    print('the answer')", 0, "the answer\nparent goes on\n", ""),
    ("    sys.exit(5)", 5, "", ""),
], ids=["abort", "segfault", "error", "answer", "exit"])
def test_run_isolated_survives_the_child(body, code, out, err):
    """What llama.cpp does to the child (abort, segfault) comes back as one error line; errors and exits as they were."""
    proc = _guarded(body)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == out
    assert (err in proc.stderr) if err else proc.stderr == ""
    assert "Traceback" not in proc.stderr


@pytest.mark.build
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_interrupted_leaves_nothing_running(tmp_path, cpu_build, demo_model, sig):
    """The signal reaches the child that runs llama.cpp; the command exits 128 + its number (130 for SIGINT, 143 for
    SIGTERM: it said 130 for both before issue 39) and no process of it is left."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Write a very long story about a dragon and a lighthouse.")
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollingkv_cli", "run", str(demo_model), "--prompt-file", str(prompt), "-n", "4000", "-c", "8192"],
            stdout=subprocess.PIPE, stderr=err_file, text=True, env={**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 120
            while "generating (at most 4000 tokens)" not in err_path.read_text():  # the child is inside llama.cpp's decode
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(sig)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = err_path.read_text()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    # the child may take a moment to be reaped after the command exited: poll with a deadline (a sleep of 0.2 s was the
    # synchronisation); one still there 10 s on, while a 4000-token generation would run for minutes, outlived it
    deadline = time.monotonic() + 10
    while _running_with(str(prompt)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running_with(str(prompt)), "the child running llama.cpp outlived the command"


def test_synth_reports_its_progress(tmp_path):
    """Issue 27 (19): the write reports bytes written as it goes (a 2 GiB write was silent), up to the whole file."""
    from rollingkv_cli import models

    seen = []
    spec = models.SynthSpec(layers=4, embd=1024, heads=8, kv_heads=2, ff=4096, vocab=4000, ctx=1024)
    models.write_synthetic(tmp_path / "m.gguf", spec, progress=lambda done, total: seen.append((done, total)))
    size = (tmp_path / "m.gguf").stat().st_size
    assert seen and seen[-1][0] == size and all(t == models.synth_nbytes(spec) for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
