"""The pinned llama.cpp: the one vendored in the llama-cpp-python sdist whose ctypes bindings we use.

This module is the single place the pin is recorded. Bumping it means changing PIN below,
re-running `rollingkv patches checkout` / `export` against the new tree, and the tests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollingkv_cli.lib import paths
from rollingkv_cli.console import abort


@dataclass(frozen=True)
class Pin:
    bindings_package: str
    bindings_version: str
    sdist_filename: str
    sdist_sha256: str
    llama_cpp_commit: str
    # sha256 over FINGERPRINT_FILES of the pristine tree: identifies the pin in trees without .git
    tree_fingerprint: str

    @property
    def short(self) -> str:
        return self.llama_cpp_commit[:12]


PIN = Pin(
    bindings_package="llama-cpp-python",
    bindings_version="0.3.36",
    sdist_filename="llama_cpp_python-0.3.36.tar.gz",
    sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    llama_cpp_commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f",
    tree_fingerprint="2ccb96bd8ae7108c2855bcc5c8dc420995cc0731e2a0d73272118dfbbfff9a56",
)

FINGERPRINT_FILES = (
    "CMakeLists.txt",
    "include/llama.h",
    "ggml/include/ggml.h",
    "ggml/src/ggml.c",
    "ggml/src/ggml-cpu/ops.cpp",
    "ggml/src/ggml-cuda/fattn.cu",
    "src/llama-kv-cache.cpp",
    "src/llama-graph.cpp",
    "common/arg.cpp",
    "tools/server/server-context.cpp",
)

# Parts of the vendored tree no build of ours reads (vocab test models, docs, media): not copied.
TREE_EXCLUDES = ("models", "docs", "media", ".git", ".github", "build")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_fingerprint(tree: Path) -> str | None:
    h = hashlib.sha256()
    for rel in FINGERPRINT_FILES:
        p = tree / rel
        if not p.is_file():
            return None
        h.update(rel.encode() + b"\0" + sha256_file(p).encode() + b"\n")
    return h.hexdigest()


def _git_head(tree: Path) -> str | None:
    if not (tree / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def identify_tree(tree: Path) -> tuple[bool, str]:
    """(is the pin, how we know). A git tree is judged by HEAD, any other tree by its fingerprint."""
    if not (tree / "CMakeLists.txt").is_file() or not (tree / "include" / "llama.h").is_file():
        return False, f"{tree} is not a llama.cpp source tree (no CMakeLists.txt / include/llama.h)"
    head = _git_head(tree)
    if head is not None:
        if head == PIN.llama_cpp_commit:
            return True, f"git HEAD {head[:12]}"
        return False, f"git HEAD is {head[:12]}, the pin is {PIN.short}"
    fp = tree_fingerprint(tree)
    if fp == PIN.tree_fingerprint:
        return True, "content fingerprint matches the pin"
    return False, f"its content does not match llama.cpp {PIN.short} (fingerprint {str(fp)[:12]})"


def cached_sdist() -> Path:
    return paths.sdist_dir() / PIN.sdist_filename


def fetch_sdist(log=print) -> Path:
    """The pinned sdist, downloaded once with pip and verified by sha256."""
    target = cached_sdist()
    if target.is_file():
        if sha256_file(target) == PIN.sdist_sha256:
            return target
        target.unlink()  # a corrupt or truncated download: fetch again
    if paths.offline():
        abort(
            f"{PIN.sdist_filename} is not cached and {paths.ENV_OFFLINE} is set",
            f"put the file in {target.parent} or pass --source DIR with a llama.cpp tree at {PIN.short}",
        )
    paths.cache_dir()  # a cache we can write, or one line
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PIN.bindings_package}=={PIN.bindings_version} sdist (pinned llama.cpp {PIN.short})")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-d", tmp, f"{PIN.bindings_package}=={PIN.bindings_version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / PIN.sdist_filename
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            abort(
                f"could not download {PIN.sdist_filename}: {last}",
                "check the network, or pass --source DIR with a local llama.cpp tree at the pin",
            )
        digest = sha256_file(got)
        if digest != PIN.sdist_sha256:
            abort(
                f"{PIN.sdist_filename} has sha256 {digest[:16]}…, expected {PIN.sdist_sha256[:16]}…",
                "the index served a different file; refusing to build from it",
            )
        os.replace(got, target)
    return target


def pristine_tree(log=print) -> Path:
    """The vendored llama.cpp of the pinned sdist, extracted once into the cache and never modified."""
    dest = paths.upstream_dir() / PIN.short
    if (dest / ".rollingkv-extracted").is_file():
        return dest
    sdist = fetch_sdist(log)
    paths.cache_dir()  # a cache we can write, or one line
    log(f"extracting vendor/llama.cpp from {sdist.name}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
    try:
        prefix = f"{PIN.sdist_filename[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(prefix) or m.name == prefix:
                    continue
                rel = m.name[len(prefix):]
                if rel.split("/", 1)[0] in TREE_EXCLUDES:
                    continue
                m.name = rel
                members.append(m)
            kwargs = {"filter": "data"} if sys.version_info >= (3, 12) else {}
            tar.extractall(tmp, members=members, **kwargs)
        (tmp / ".rollingkv-extracted").write_text(PIN.llama_cpp_commit + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_source(source: Path | None, allow_unpinned: bool, log=print) -> tuple[Path, bool]:
    """(tree, is_pinned): the sdist's tree, or a local tree checked against the pin."""
    if source is None:
        env = os.environ.get(paths.ENV_SOURCE_DIR)
        source = Path(env) if env else None
    if source is None:
        return pristine_tree(log), True
    source = source.expanduser().resolve()
    if not source.is_dir():
        abort(f"--source {source} is not a directory")
    pinned, why = identify_tree(source)
    if not pinned and not allow_unpinned:
        abort(
            f"refusing llama.cpp tree {source}: {why}",
            f"use a tree at {PIN.short} (the one vendored in {PIN.bindings_package} {PIN.bindings_version}) or pass --allow-unpinned",
        )
    return source, pinned
