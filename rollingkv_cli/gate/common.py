"""What the gates share: exit codes, which build (library + llama-server) they run, logs, llama-server runs.

`gate equiv` drives libllama through ctypes (gate/runner.py, one process per library); `gate needle` and
`gate vram` drive llama-server processes (rollingkv_cli/serve/server.py), the way users run the split cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.console import EXIT_USAGE, RollingKVError, abort  # noqa: F401  (EXIT_USAGE: a bad flag value)
from rollingkv_cli.kvtypes import TAIL_TYPE_CHOICES, TAIL_TYPES

EXIT_PASS = 0
EXIT_FAIL = 1  # a bound failed, answers differ, or an error
EXIT_NO_GPU = 3  # gate vram without an NVIDIA GPU / NVML: the same code as `rollingkv probe pcie`
EXIT_INCONCLUSIVE = 4  # gate needle: the resident model itself does not retrieve the needle

# the split's types, the library's list (kvtypes: a tiny module, registering commands stays cheap)
CACHE_TYPES = list(TAIL_TYPES)
TAIL_CHOICES = list(TAIL_TYPE_CHOICES)  # -ctkt/-ctvt: a type, or auto (the planner's when the cache spills)


@dataclass
class GateBuild:
    """The library and server the gates run: the active build, a build directory, or a bare lib directory."""

    lib_dir: Path
    server: Path | None
    cuda: bool
    dir: Path | None = None
    manifest: dict = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def on_gpu(self, n_gpu_layers: int | None) -> bool:
        """A CUDA build with layers offloaded (-ngl 0 runs every op of the model on the CPU)."""
        return self.cuda and n_gpu_layers != 0

    def require_server(self) -> Path:
        if self.server is None or not self.server.is_file():
            where = self.dir or self.lib_dir
            abort(f"no llama-server in {where}", "run `rollingkv build` (it builds llama-server next to libllama.so)")
        return self.server

    def describe(self) -> dict:
        return {"dir": str(self.dir) if self.dir else None, "lib_dir": str(self.lib_dir), "backend": self.backend,
                "pin": self.manifest.get("pin"), "series_hash": self.manifest.get("series_hash"),
                "options": self.manifest.get("options")}


def resolve_build(build_dir: Path | None = None, lib_dir: Path | None = None) -> GateBuild:
    """--build DIR (a `rollingkv build` directory), --lib-dir DIR (llama.cpp's build/bin of our series), or
    the active build ($ROLLINGKV_BUILD, else the one `rollingkv build` activated)."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # every gate runs the library: its own variables are checked first (userinput.NATIVE_KNOBS)
    if build_dir is not None and lib_dir is not None:
        abort("give --build or --lib-dir, not both")
    if lib_dir is not None:
        p = Path(lib_dir).expanduser()
        if p.is_file():
            p = p.parent
        if not (p / "libllama.so").is_file():
            abort(f"--lib-dir {lib_dir}: no libllama.so there", "give the directory holding libllama.so and llama-server (llama.cpp's build/bin)")
        p = p.resolve()
        server = p / "llama-server"
        cuda = any(p.glob("libggml-cuda.so*"))
        return GateBuild(p, server if server.is_file() else None, cuda)
    if build_dir is not None:
        b = builder.Build.load(Path(build_dir).expanduser())
        if b is None:
            abort(f"--build {build_dir} is not a finished rollingkv build (no valid manifest.json)",
                  "give the directory `rollingkv build --print-dir` prints")
    else:
        b = builder.active_build(required=True)
    assert b is not None
    if not (b.lib_dir / "libllama.so").is_file():
        abort(f"the build {b.dir} has no libllama.so", "run `rollingkv build`")
    server = b.artifact("llama-server")
    cuda = bool(b.manifest.get("options", {}).get("cuda"))
    return GateBuild(b.lib_dir, server if server.is_file() else None, cuda, b.dir, b.manifest)


def logs_dir() -> Path:
    """This run's own log folder, <cache>/gate/<time>-<pid> (concurrent gates shared fixed names like tokenize.log);
    the oldest beyond paths.KEEP_RUN_LOGS are removed (paths.prune_run_logs, as serve's logs)."""
    from rollingkv_cli.lib import paths

    root = paths.cache_dir() / "gate"
    try:
        root.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}-", dir=root))
    except OSError:
        return Path(tempfile.mkdtemp(prefix="rollingkv-gate-logs-"))
    paths.prune_run_logs(root)
    return d


OWNER_FILE = ".rollingkv-owner"  # in a gate's temporary work folder: "pid start-time" of the process that made it


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _stale(d: Path) -> bool:
    """A work folder whose owner is gone (killed: SIGKILL leaves no chance to clean up), or is another process by now."""
    try:
        pid_text, start = (d / OWNER_FILE).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # not ours to judge (no owner file: an older run, or someone else's)
    return _start_time(pid) != start


def remove_stale_work_dirs(root: Path, prefix: str) -> list[Path]:
    """Remove root/<prefix>* folders whose owner process is gone; returns them."""
    gone = []
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return gone
    for d in candidates:
        if _stale(d):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def work_root(work_dir: Path | str | None) -> Path:
    """Where a gate's work folders go: --work-dir, checked before any work and made if missing (one line when it
    cannot be), else the system's temporary directory."""
    if not work_dir:
        return Path(tempfile.gettempdir())
    from rollingkv_cli.userinput import check_output_dir

    root = Path(work_dir)
    check_output_dir(root, "--work-dir")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        abort(f"cannot use --work-dir {root}: {e.strerror or e}")
    return root


@contextlib.contextmanager
def work_dir(root: Path, prefix: str):
    """A temporary folder under root for a gate's logits (hundreds of MiB), removed on the way out, and removed by the
    next gate when this process was killed before it could (an owner file says whose it is)."""
    from rollingkv_cli.console import note

    gone = remove_stale_work_dirs(root, prefix)
    if gone:
        note(f"removed {len(gone)} work folder(s) of gates that were killed: {', '.join(str(g) for g in gone)}")
    try:
        tmp = tempfile.TemporaryDirectory(prefix=prefix, dir=root)
        (Path(tmp.name) / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    except OSError as e:
        abort(f"cannot make a work folder in {root}: {e.strerror or e}", "point --work-dir at a writable directory on a disk")
    with tmp as td:
        yield td


def write_json(path: Path, doc: dict) -> None:
    import json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n")
    except OSError as e:
        abort(f"cannot write {path}: {e.strerror or e}")


def check_request(request) -> None:
    """A gate measures one split: the residency flags' rules (lib/residency.py) as a usage error (exit 2)."""
    from rollingkv_cli.lib.residency import ResidencyConflict

    try:
        request.check(one_size=True)
    except ResidencyConflict as e:
        raise RollingKVError(e.message, e.hint, EXIT_USAGE) from None


# ------------------------------------------------------------------ llama-server runs

def server_args(model: Path, n_ctx: int, threads: int | None, n_gpu_layers: int | None, ctk: str, ctv: str,
                residency: dict | None, n_parallel: int = 1, kv_unified: bool = False) -> list[str]:
    """llama-server flags of a gate run: one slot unless told (-np, -kvu), flash attention, no auto-fitting, our
    residency flags.

    residency: None or {"mode": "off"} for the resident reference; else mode/window_cells/device_heads/vram_target_mib/
    type_k_tail/type_v_tail as in llama_rolling_kv_params."""
    args = ["-m", str(model), "-fa", "on", "-c", str(n_ctx), "-np", str(n_parallel), "-ctk", ctk, "-ctv", ctv,
            "--no-warmup", "-fit", "off", "--seed", "0"]
    if kv_unified:
        args.append("-kvu")
    if threads:
        args += ["-t", str(threads), "-tb", str(threads)]
    if n_gpu_layers is not None:
        args += ["-ngl", str(n_gpu_layers)]
    from rollingkv_cli.lib.residency import ResidencyRequest

    request = ResidencyRequest.from_params({"mode": "off", **(residency or {})})
    args += request.server_args()
    return args


SCRATCH_SERVER_STOP_GRACE = 2.0  # seconds a gate's or a bench cell's llama-server gets after SIGTERM


def start_server(binary: Path, args: list[str], log_path: Path, timeout: float | None = None, env: dict | None = None):
    """A healthy ServerProcess, or a RollingKVError naming its log (the last log lines are printed)."""
    from rollingkv_cli.lib import paths
    from rollingkv_cli.serve.server import ServerProcess

    timeout = timeout or paths.serve_start_timeout()  # a bad value refused before anything starts
    # a gate's server holds nothing worth waiting for: stopped mid-prefill (Ctrl-C, SIGTERM) it finished its batch
    # first, and the gate took 15 s to exit; 2 s, then SIGKILL
    srv = ServerProcess(binary, args, log_path=log_path, env=env, stop_grace=SCRATCH_SERVER_STOP_GRACE)
    srv.start()
    try:
        srv.wait_healthy(timeout=timeout)
    except RollingKVError as e:
        srv.stop()
        if not srv.failure_reason:  # the error's line says why when the log did: no log box then
            print_log_tail(log_path)
        raise e
    except BaseException:
        srv.stop()
        raise
    return srv


def print_log_tail(log_path: Path, n: int = 15) -> None:
    from rollingkv_cli.lib.builder import log_tail
    from rollingkv_cli.console import log_panel

    log_panel(log_tail(log_path, n), f"last lines of {log_path}")


def request(srv, path: str, payload: dict | None = None, timeout: float = 3600.0) -> dict:
    """srv.request with an HTTP or connection failure turned into a one-line error naming the log."""
    import urllib.error

    try:
        return srv.request(path, payload, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            body = e.read().decode(errors="replace")[:300]
        except Exception:
            body = ""
        raise RollingKVError(f"llama-server answered {path} with HTTP {e.code}: {body}",
                             f"see its log: {srv.log_path}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        if srv.alive():
            raise RollingKVError(f"llama-server did not answer {path}: {e}", f"see its log: {srv.log_path}") from None
        from rollingkv_cli.lib.procs import exit_parts

        what, advice = exit_parts(srv.proc.returncode if srv.proc else None, srv.log_path)
        raise RollingKVError(f"llama-server died during {path} ({what})", advice) from None


def plan_of(srv) -> dict | None:
    try:
        return request(srv, "/props", timeout=30).get("rolling_kv")
    except RollingKVError:
        return None
