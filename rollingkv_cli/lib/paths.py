"""Where rollingkv keeps things, and the environment variables that move them (one place for all names)."""

from __future__ import annotations

import os
from pathlib import Path

# Environment variables (shown in option help, documented in README).
ENV_CACHE_DIR = "ROLLINGKV_CACHE_DIR"  # root of everything below
ENV_BUILD_DIR = "ROLLINGKV_BUILD"  # use this build instead of the active one
ENV_SOURCE_DIR = "ROLLINGKV_LLAMA_CPP_SOURCE"  # a local llama.cpp tree instead of the sdist
ENV_OFFLINE = "ROLLINGKV_OFFLINE"  # never touch the network
ENV_PCIE_BW = "ROLLINGKV_PCIE_BW_GBPS"  # explicit link bandwidth
ENV_SERVE_START_TIMEOUT = "ROLLINGKV_SERVE_START_TIMEOUT"  # seconds llama-server may take to become healthy
ENV_TRACEBACK = "ROLLINGKV_TRACEBACK"  # show the full traceback of an internal error
ENV_CPU_PART_THREADS = "ROLLINGKV_CPU_PART_THREADS"  # threads of the hybrid tail's CPU part (libllama reads it too)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


_usable: set[Path] = set()


def cache_dir(write: bool = True) -> Path:
    """The cache root. To write there (write=True): created if missing, and a one-line error when it is a file or cannot
    be written (a read-only filesystem: the command must write, and says so). To read (write=False: the active build, a
    cached model, the PCIe profile): only a file in its place is refused, nothing is created, a read-only cache serves
    (it refused `rollingkv info` and every other command)."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        p = Path(explicit).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        p = Path(base) / "rollingkv"
    if not write:
        if p.exists() and not p.is_dir():
            _check_cache_dir(p, explicit)  # the one line for a file in its place
        return p
    if p not in _usable:
        _check_cache_dir(p, explicit)
        _usable.add(p)
    return p


def _check_cache_dir(p: Path, explicit: str | None) -> None:
    from rollingkv_cli.console import abort

    what = f"${ENV_CACHE_DIR}={explicit}" if explicit else f"the cache directory {p}"
    hint = (f"point {ENV_CACHE_DIR} at a directory you can write (it is created if missing), or unset it" if explicit
            else f"set {ENV_CACHE_DIR} to a directory you can write")
    if p.exists() and not p.is_dir():
        abort(f"{what} is a file, not a directory", hint)
    try:
        vfs = os.statvfs(p) if p.is_dir() else None
    except OSError:
        vfs = None
    if vfs is not None and vfs.f_blocks == 0:  # /proc, /sys: root may "write" there, and `model demo` then failed inside
        abort(f"{what} is not on a disk (a pseudo filesystem such as /proc or /sys)", hint)
    read_only = vfs is not None and bool(vfs.f_flag & os.ST_RDONLY)
    if read_only:
        abort(f"{what} is on a read-only filesystem, and this command writes there (builds, logs, downloads)", hint)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except NotADirectoryError:
        abort(f"{what} cannot be created: a part of the path is a file", hint)
    except OSError as e:
        abort(f"{what} cannot be created: {e.strerror or e}", hint)
    if not os.access(p, os.W_OK | os.X_OK):
        abort(f"{what} is not writable", hint)


KEEP_RUN_LOGS = 20  # the newest runs' logs kept: a gate's log folders under <cache>/gate, serve's logs under <cache>/logs


def prune_run_logs(root: Path, prefix: str = "", keep: int = KEEP_RUN_LOGS) -> list[Path]:
    """Remove all but the `keep` newest runs' logs in root: the entries named <prefix><YYYYmmdd-HHMMSS>... (folders or
    files; the name's time orders them), nothing else. Returns what went; an entry that cannot be removed stays."""
    import shutil

    try:
        runs = sorted((p for p in root.iterdir() if p.name.startswith(prefix) and p.name[len(prefix):len(prefix) + 8].isdigit()
                       and (p.is_dir() or p.is_file()) and not p.is_symlink()), key=lambda p: p.name)
    except OSError:
        return []
    gone = []
    for old in runs[:-keep] if keep > 0 else runs:
        try:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
            gone.append(old)
        except OSError:
            pass
    return gone


# the paths below are for reading and writing alike: whoever writes there calls cache_dir() first (write=True)

def sdist_dir() -> Path:
    return cache_dir(write=False) / "sdist"


def upstream_dir() -> Path:
    """Pristine extracted upstream trees, one per pin."""
    return cache_dir(write=False) / "upstream"


def builds_dir() -> Path:
    return cache_dir(write=False) / "builds"


def models_dir() -> Path:
    return cache_dir(write=False) / "models"


def active_build_file() -> Path:
    return cache_dir(write=False) / "active-build"


def data_dir(name: str) -> Path:
    """`patches` or `native`: the repository's copy when run from a checkout, else the wheel's."""
    in_repo = REPO_ROOT / name
    if in_repo.is_dir():
        return in_repo
    return Path(__file__).resolve().parent.parent / "_data" / name


def pcie_bw_env() -> float | None:
    """$ROLLINGKV_PCIE_BW_GBPS as a positive number of GB/s, None when unset."""
    from rollingkv_cli.userinput import env_float

    return env_float(ENV_PCIE_BW, positive=True, unit="GB/s", example="the host<->GPU bandwidth per direction, e.g. 25 or 53.5")


def serve_start_timeout() -> float:
    from rollingkv_cli.userinput import env_float

    return env_float(ENV_SERVE_START_TIMEOUT, 600.0, positive=True, unit="seconds", example="a number of seconds such as 600")


def offline() -> bool:
    """$ROLLINGKV_OFFLINE as every on/off variable reads: 1/true/yes/on offline, 0/false/no/off (or unset, or blank)
    online, anything else one line (exit 1). It was "anything but empty, 0, false or no": `=off` meant offline."""
    from rollingkv_cli.userinput import env_flag

    return env_flag(ENV_OFFLINE, False, example="1 (never download) or 0 (download what is missing)")
