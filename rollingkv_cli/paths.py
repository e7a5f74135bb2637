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

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollingkv"


def sdist_dir() -> Path:
    return cache_dir() / "sdist"


def upstream_dir() -> Path:
    """Pristine extracted upstream trees, one per pin."""
    return cache_dir() / "upstream"


def builds_dir() -> Path:
    return cache_dir() / "builds"


def models_dir() -> Path:
    return cache_dir() / "models"


def active_build_file() -> Path:
    return cache_dir() / "active-build"


def data_dir(name: str) -> Path:
    """`patches` or `native`: the repository's copy when run from a checkout, else the wheel's."""
    in_repo = REPO_ROOT / name
    if in_repo.is_dir():
        return in_repo
    return Path(__file__).resolve().parent / "_data" / name


def offline() -> bool:
    return os.environ.get(ENV_OFFLINE, "") not in ("", "0", "false", "no")
