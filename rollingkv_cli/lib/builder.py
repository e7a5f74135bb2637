"""Configure and build the patched llama.cpp (CMake + Ninja) into a directory keyed by what went into it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollingkv_cli.lib import paths, patchset, upstream
from rollingkv_cli.console import abort, console, log_panel, note

MANIFEST = "manifest.json"
BASE_TARGETS = ("llama", "llama-server", "llama-bench", "llama-batched-bench")
OP_TEST_TARGET = "test-rolling-kv-ops"
CPU_DECODE_TEST_TARGET = "test-rolling-kv-cpu-decode"  # the hybrid tail's CPU attention: check and bench
BACKEND_OPS_TEST_TARGET = "test-backend-ops"  # upstream's op test, with the streaming op's cases (patch 0023)
_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")


@dataclass(frozen=True)
class BuildOptions:
    cuda: bool = False
    cuda_arch: str | None = None
    backend_dl: bool = False
    toolchain: str = "gcc"  # or "cosmocc"
    source: str | None = None  # a local tree; None = the pinned sdist
    pinned: bool = True
    unpatched: bool = False  # the pin with only the upstream fixes (a reference for equivalence gates); libllama only
    lab: bool = False  # the lab series on top of ours (patches/lab/, native-lab/): instruments the product never contains

    def key(self, series_hash: str) -> str:
        options = asdict(self)
        for added_later in ("unpatched", "lab"):
            if not options[added_later]:
                del options[added_later]  # options added later stay out of the key at their default: old builds keep their keys
        h = hashlib.sha256()
        h.update(json.dumps({"pin": upstream.PIN.llama_cpp_commit, "series": series_hash, "options": options}, sort_keys=True).encode())
        return h.hexdigest()[:16]


@dataclass
class Build:
    """A finished build: what `manifest.json` says about one build directory."""

    dir: Path
    manifest: dict = field(default_factory=dict)

    @property
    def bin_dir(self) -> Path:
        return self.dir / "build" / "bin"

    def artifact(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def lib_dir(self) -> Path:
        return self.bin_dir  # llama.cpp puts shared libraries next to the executables

    @classmethod
    def load(cls, build_dir: Path) -> "Build | None":
        m = build_dir / MANIFEST
        try:
            data = json.loads(m.read_text())
        except (OSError, ValueError):  # not UTF-8, not JSON, or an integer past Python's 4300 digits: not a build's
            return None
        if not isinstance(data, dict):  # `[]` was "internal error: AttributeError"
            return None
        if not all((build_dir / "build" / "bin" / a).exists() for a in data.get("artifacts", [])):
            return None
        return cls(build_dir, data)


def nvcc_path() -> str | None:
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx and Path(cudacxx).is_file():
        return cudacxx
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def gpu_compute_capabilities() -> list[str]:
    """['90', ...] from NVML; [] without an NVIDIA GPU or driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        caps = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
            caps.append(f"{major}{minor}")
        return sorted(set(caps))
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def resolve_cuda(cuda: bool | None, cuda_arch: str | None) -> tuple[bool, str | None]:
    """--cuda / --no-cuda / auto (CUDA only when nvcc and an NVIDIA GPU are both present)."""
    nvcc = nvcc_path()
    if cuda is True and not nvcc:
        abort("--cuda needs nvcc, and none was found on PATH, in CUDACXX or /usr/local/cuda/bin", "install the CUDA toolkit or build with --no-cuda")
    caps = gpu_compute_capabilities()
    if cuda is None:
        cuda = bool(nvcc and caps)
    if not cuda:
        return False, None
    if cuda_arch is None and caps:
        cuda_arch = ";".join(caps)
    _check_cuda_arch(cuda_arch, caps)
    return True, cuda_arch


_CUDA_ARCH_LIST = re.compile(r"(native|all|all-major|\d+[a-z]?(-real|-virtual)?(;\d+[a-z]?(-real|-virtual)?)*)")


def _check_cuda_arch(cuda_arch: str | None, caps: list[str]) -> None:
    # CMake's `native` asks the driver for the GPUs: without one, configure fails after the tree was copied and patched
    if cuda_arch is None or (cuda_arch == "native" and not caps):
        given = " (--cuda-arch native asks the GPU)" if cuda_arch else ""
        abort(f"no NVIDIA GPU found to build for{given}: pass --cuda-arch, e.g. 90",
              "name the compute capability of the GPU the build will run on (86;90 for several)")
    if not _CUDA_ARCH_LIST.fullmatch(cuda_arch):
        abort(f"--cuda-arch {cuda_arch!r} is not a CUDA architecture list", "use e.g. 90, 86;90 or native")


def validate_options(opts: BuildOptions) -> None:
    """Everything about opts that can be refused without writing anything (also for callers that skip resolve_cuda)."""
    if opts.unpatched and opts.lab:
        abort("--lab and --unpatched exclude each other", "the reference build applies the upstream fixes alone; drop one of them")
    if opts.cuda:
        if not nvcc_path():
            abort("--cuda needs nvcc, and none was found on PATH, in CUDACXX or /usr/local/cuda/bin", "install the CUDA toolkit or build with --no-cuda")
        _check_cuda_arch(opts.cuda_arch, gpu_compute_capabilities() if opts.cuda_arch == "native" else [])
    elif opts.cuda_arch:
        abort("--cuda-arch given but this is not a CUDA build", "add --cuda")


def cmake_flags(opts: BuildOptions, build_dir: Path, series_hash: str) -> list[str]:
    flags = [
        "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DGGML_CCACHE=ON",
        f"-DROLLINGKV_PIN={upstream.PIN.llama_cpp_commit}",
        f"-DROLLINGKV_SERIES={series_hash[:16]}",
    ]
    if opts.cuda:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}"]
        nvcc = nvcc_path()
        if nvcc:
            flags.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    if opts.backend_dl:
        # llamafile-style: every ggml backend is a module loaded at run time; an explicit directory so
        # that hosts other than llama-server (a Python interpreter) find them too.
        # GGML_NATIVE cannot be combined with DL: every CPU variant is built, the best one loads at run time.
        flags += ["-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON",
                  f"-DGGML_BACKEND_DIR={build_dir / 'build' / 'bin'}"]
    if opts.toolchain == "cosmocc":
        flags += ["-DCMAKE_C_COMPILER=cosmocc", "-DCMAKE_CXX_COMPILER=cosmoc++", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TOOLS=ON"]
    return flags


def targets_for(opts: BuildOptions, cmake_dir: Path) -> list[str]:
    if opts.unpatched:
        return ["llama"]
    targets = list(BASE_TARGETS)
    known = _ninja_targets(cmake_dir)
    if opts.backend_dl:
        targets += sorted(t for t in known if re.fullmatch(r"ggml-cpu(-\w+)?", t))
        if opts.cuda:
            targets.append("ggml-cuda")
    targets += [t for t in (OP_TEST_TARGET, CPU_DECODE_TEST_TARGET, BACKEND_OPS_TEST_TARGET) if t in known]
    return targets


def _ninja_targets(cmake_dir: Path) -> set[str]:
    proc = subprocess.run(["ninja", "-C", str(cmake_dir), "-t", "targets", "all"], capture_output=True, text=True)
    return {line.split(":", 1)[0] for line in proc.stdout.splitlines() if ":" in line}


def artifacts_for(targets: list[str]) -> list[str]:
    """File names in bin/: libraries for library targets, the target name for executables."""
    return [f"lib{t}.so" if t == "llama" or t.startswith("ggml-") else t for t in targets]


def check_toolchain(opts: BuildOptions) -> None:
    for tool, hint in (("cmake", "pip install cmake"), ("ninja", "pip install ninja"), ("git", "install git")):
        if not shutil.which(tool):
            abort(f"{tool} not found on PATH", hint)
    if opts.toolchain == "cosmocc":
        if not shutil.which("cosmocc") or not shutil.which("cosmoc++"):
            abort("--toolchain cosmocc: cosmocc/cosmoc++ not found on PATH", "unpack a cosmocc release and put its bin/ on PATH, or drop --toolchain cosmocc")
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cc or not cxx:
        abort("no C/C++ compiler found (cc/gcc/clang and c++/g++/clang++)", "install one, e.g. apt-get install build-essential")


def prepare_tree(source: Path, dest: Path, series: patchset.Series, log=print) -> Path:
    """A private copy of the source with the series applied; reused while its marker matches."""
    marker = dest / ".rollingkv-prepared.json"
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("series") == series.hash:
                return dest
        except (ValueError, AttributeError):  # not our JSON: prepared again
            pass
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, ignore=_top_level_excludes(source), symlinks=True)
    patchset.apply_series(tmp, series, log=log)
    (tmp / ".rollingkv-prepared.json").write_text(json.dumps({"series": series.hash}) + "\n")
    os.replace(tmp, dest)
    return dest


def _top_level_excludes(source: Path):
    """Skip upstream.TREE_EXCLUDES at the top of the tree only (tools/mtmd/models is source code)."""
    top = source.resolve()

    def ignore(directory: str, names: list[str]) -> set[str]:
        if Path(directory).resolve() == top:
            return {n for n in names if n in upstream.TREE_EXCLUDES or n.startswith(".rollingkv-")}
        return set()

    return ignore


def _run_logged(cmd: list[str], log_file, env: dict, progress=None, task=None) -> int:
    """Run a command, append its output to log_file, advance the progress bar from ninja's [n/N]."""
    log_file.write(f"$ {' '.join(cmd)}\n")
    log_file.flush()
    from rollingkv_cli.lib.procs import popen_tied

    # tied to us: a closed terminal or a killed `rollingkv build` never leaves ninja and the compilers running
    proc = popen_tied(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log_file.write(line)
            m = _NINJA_PROGRESS.match(line)
            if m:
                log_file.flush()  # someone may be tailing the log
            if m and progress is not None:
                done, total, what = int(m.group(1)), int(m.group(2)), m.group(3)
                progress.update(task, completed=done, total=total, description=_short(what))
        rc = proc.wait()
        log_file.flush()
        return rc
    except BaseException:
        log_file.flush()
        # Ctrl-C or anything else: take ninja and the compilers down with us, never orphan them.
        from rollingkv_cli.lib.procs import stop_group

        stop_group(proc)
        raise


def _short(what: str) -> str:
    what = what.replace("Building CXX object ", "").replace("Building C object ", "").replace("Building CUDA object ", "")
    return (what[:60] + "…") if len(what) > 61 else what


def log_tail(log_path: Path, n: int = 30) -> str:
    try:
        with open(log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return ""


def series_for(opts: BuildOptions) -> patchset.Series:
    """What a build with these options applies: the upstream fixes alone (--unpatched), our series, or ours and the lab's."""
    return reference_series() if opts.unpatched else patchset.load_series(lab=opts.lab)


def build_dir_for(opts: BuildOptions, series: patchset.Series) -> Path:
    return paths.builds_dir() / opts.key(series.hash)


def reference_series() -> patchset.Series:
    """What the `--unpatched` reference build applies: the upstream fixes, nothing of ours."""
    return patchset.load_series().fixes_only()


def build(opts: BuildOptions, series: patchset.Series | None = None, jobs: int | None = None, quiet: bool = False,
          activate: bool = True) -> Build:
    if opts.unpatched and opts.lab:
        validate_options(opts)  # refuses
    series = reference_series() if opts.unpatched else (series or patchset.load_series(lab=opts.lab))
    if series.lab != opts.lab:
        raise ValueError(f"a {'lab' if opts.lab else 'product'} build needs a {'lab' if opts.lab else 'product'} series")
    check_toolchain(opts)
    bdir = build_dir_for(opts, series)
    existing = Build.load(bdir)
    if existing is not None:
        if activate and not opts.unpatched:
            set_active(bdir)
        return existing  # nothing changed: a no-op
    # everything that can be refused is refused before the build directory exists
    validate_options(opts)
    log = (lambda m: None) if quiet else note
    # a local tree is checked here; the sdist is fetched and extracted under the lock (one extraction at a time)
    local = opts.source or os.environ.get(paths.ENV_SOURCE_DIR)
    source = upstream.resolve_source(Path(local), allow_unpinned=not opts.pinned, log=log)[0] if local else None
    paths.cache_dir()  # a cache we can write, or one line
    fresh = not bdir.exists()
    bdir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(bdir):
            # another process may have finished the same build while we waited for the lock
            existing = Build.load(bdir)
            if existing is not None:
                if activate and not opts.unpatched:
                    set_active(bdir)
                return existing
            return _build_locked(opts, series, bdir, source, fresh, jobs, quiet, activate)
    except BaseException:
        # a directory this run made that never got past configure (CMake writes build.ninja only after a
        # successful configure) is only a patched copy of the source: remove it. A failed compile's tree stays, to resume.
        if fresh and not (bdir / "build" / "build.ninja").exists():
            shutil.rmtree(bdir, ignore_errors=True)
        raise


@contextlib.contextmanager
def _build_lock(bdir: Path):
    """One build per directory at a time (parallel test sessions or two terminals would otherwise share a tree)."""
    with open(bdir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            console.print(f"[dim]waiting for another build of {bdir.name} to finish[/]")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_locked(opts: BuildOptions, series: patchset.Series, bdir: Path, source: Path | None, fresh: bool, jobs: int | None,
                  quiet: bool, activate: bool) -> Build:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    log = (lambda m: None) if quiet else note
    if source is None:
        source = upstream.pristine_tree(log)
    bdir.mkdir(parents=True, exist_ok=True)
    (bdir / MANIFEST).unlink(missing_ok=True)  # never leave a stale manifest describing a half build
    tree = prepare_tree(source, bdir / "src", series, log=log)
    cmake_dir = bdir / "build"
    flags = cmake_flags(opts, bdir, series.hash)
    env = dict(os.environ)
    # ccache hits across build directories of different keys (same sources, different paths)
    env.setdefault("CCACHE_BASEDIR", str(paths.builds_dir()))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    if opts.toolchain == "cosmocc":
        env["CC"], env["CXX"] = "cosmocc", "cosmoc++"
    jobs = jobs or os.cpu_count() or 2
    log_path = bdir / "build.log"
    t0 = time.time()
    with open(log_path, "a") as lf, Progress(
        SpinnerColumn(), TextColumn("{task.description}", style="dim"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=quiet,
    ) as progress:
        task = progress.add_task("configuring", total=None)
        rc = _run_logged(["cmake", "-S", str(tree), "-B", str(cmake_dir), *flags], lf, env)
        if rc != 0:
            if fresh:  # build() removes this directory: keep its log where the user can read it
                kept = Path(tempfile.gettempdir()) / f"rollingkv-configure-{bdir.name}.log"
                shutil.copyfile(log_path, kept)
                _fail("cmake configure failed", kept, "the build directory was removed; fix the cause above and run `rollingkv build` again")
            _fail("cmake configure failed", log_path)
        targets = targets_for(opts, cmake_dir)
        progress.update(task, description="compiling")
        rc = _run_logged(["cmake", "--build", str(cmake_dir), "-j", str(jobs), "--target", *targets], lf, env, progress, task)
        if rc != 0:
            from rollingkv_cli.lib.procs import describe_exit

            _fail(f"build failed ({describe_exit(rc)})" if rc < 0 else "build failed", log_path)
    artifacts = artifacts_for(targets)
    missing = [a for a in artifacts if not (cmake_dir / "bin" / a).exists()]
    if missing:
        _fail(f"build finished but {', '.join(missing)} are missing", log_path)
    manifest = {
        "pin": upstream.PIN.llama_cpp_commit,
        "bindings": f"{upstream.PIN.bindings_package}=={upstream.PIN.bindings_version}",
        "source": opts.source or "sdist",
        "pinned_source": opts.pinned,
        "series_hash": series.hash,
        "patches": series.patch_hashes(),
        "native_files": list(series.native_files),
        "lab": series.lab,
        **({"lab_native_files": list(series.lab_native_files)} if series.lab else {}),
        "options": asdict(opts),
        "cmake_flags": flags,
        "cuda_arch": opts.cuda_arch,
        "targets": targets,
        "artifacts": artifacts,
        "ccache": bool(shutil.which("ccache")),
        "build_seconds": round(time.time() - t0, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = bdir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, bdir / MANIFEST)  # the manifest appears only complete, only after a full build
    if activate and not opts.unpatched:
        set_active(bdir)  # an unpatched reference build never becomes the active one
    return Build(bdir, manifest)


def _fail(what: str, log_path: Path, hint: str = "fix the cause above and run `rollingkv build` again: it resumes where it stopped") -> None:

    log_panel(log_tail(log_path), f"last lines of {log_path}", console)  # literally: compiler output is full of brackets
    abort(f"{what} (full log: {log_path})", hint)


def set_active(bdir: Path) -> None:
    """Point the cache's active-build file at bdir. The path is written absolute, as every version of rollingkv reads it
    (a cache may be shared by several); _active_pointer resolves it inside a copy of the cache."""
    f = paths.active_build_file()
    try:
        if Path(f.read_text().strip()).resolve() == bdir.resolve():
            return  # already active: nothing to write (a read-only cache serves a no-op build)
    except OSError:
        pass
    paths.cache_dir()  # a cache we can write, or one line
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(str(Path(os.path.abspath(bdir))) + "\n")
    os.replace(tmp, f)


def _active_pointer() -> Path | None:
    """The build the active-build file means, resolved relative to this cache's root when it lies inside a cache: a path
    <some cache>/builds/NAME means this cache's builds/NAME when this cache has that build (a copy of the cache, `cp -a`,
    or a moved one, uses its own copy, not the original's); a relative path is taken from the cache root; any other
    path as written."""
    try:
        text = paths.active_build_file().read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    root = paths.cache_dir(write=False)  # reading the pointer writes nothing: a read-only cache serves it
    where = Path(text)
    if not where.is_absolute():
        return root / where
    own = root / "builds" / where.name
    if where.parent.name == "builds" and where != own and (own / MANIFEST).is_file():
        return own
    return where


def active_build(required: bool = True) -> Build | None:
    env = os.environ.get(paths.ENV_BUILD_DIR)
    where = Path(env) if env else None
    if where is None:
        where = _active_pointer()
    b = Build.load(where) if where else None
    if b is None and required:
        if env:
            abort(f"{paths.ENV_BUILD_DIR}={env} is not a finished rollingkv build (no valid manifest.json)", "unset it or run `rollingkv build`")
        abort("no rollingkv build yet", "run `rollingkv build` first")
    return b
