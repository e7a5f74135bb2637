"""One rule for reading what the user gives us: files and environment variables.

Every read of a user's file or variable goes through here, so that an OS, decode or parse error becomes
the tool's one-line error (RollingKVError, exit status 1) naming the file or variable, what is wrong with
it, and what to do, never a traceback. `what` names the file's role ("config file", "thresholds file").
"""

from __future__ import annotations

import errno
import json
import math
import os
import reprlib
import stat
import sys
from pathlib import Path
from typing import Any

from rollingkv_cli.console import abort


# the most any file the user gives us may hold: configs, thresholds, reports and prompts are far smaller (a prompt of a
# million tokens is a few MiB); past it, reading stops (`run -f /dev/zero` had read 13 GB in 10 s)
MAX_INPUT_BYTES = 256 << 20
# the most a settings file (serve --config, --thresholds: a few dozen lines) may hold: YAML is parsed in Python, and a
# 6 MB flow list of small numbers, no alias in it, took more than 60 s and 1.9 GB before any check saw it
MAX_SETTINGS_BYTES = 64 << 10


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def read_bytes(path: Path | str, what: str, limit: int | None = None) -> bytes:
    """A regular file's bytes, at most `limit` of them. A FIFO, a device or a socket is refused without reading it (it
    could block forever or never end): opened without blocking, checked, then read."""
    p = Path(path)
    limit = MAX_INPUT_BYTES if limit is None else limit
    fd = None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            abort(f"cannot read {what} {p}: it is a directory", "give the path of a file")
        if not stat.S_ISREG(mode):
            abort(f"cannot read {what} {p}: it is {_kind(mode)}, not a regular file", "give the path of a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(limit + 1)  # a size stat does not tell (/proc files say 0) is bounded too
        if len(data) > limit:
            abort(f"cannot read {what} {p}: it holds more than {_size(limit)}, the most rollingkv reads from a {what}",
                  "give a smaller file")
        return data
    except FileNotFoundError:
        abort(f"cannot read {what} {p}: no such file", "check the path")
    except IsADirectoryError:
        abort(f"cannot read {what} {p}: it is a directory", "give the path of a file")
    except PermissionError:
        abort(f"cannot read {what} {p}: permission denied", "check its permissions (ls -l), or give a copy you can read")
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            abort(f"cannot read {what} {p}: a part of the path is a file, not a directory", "check the path")
        if e.errno == errno.ELOOP:
            abort(f"cannot read {what} {p}: a loop of symbolic links", "check the path (ls -l)")
        abort(f"cannot read {what} {p}: {e.strerror or e}")
    finally:
        if fd is not None:
            os.close(fd)


def decode_utf8(data: bytes, path: Path | str, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        abort(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line {line})",
              "save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`")


def read_text(path: Path | str, what: str) -> str:
    """The file's text, strictly UTF-8 (a byte-order mark is dropped)."""
    text = decode_utf8(read_bytes(path, what), path, what)
    return text[1:] if text.startswith("\ufeff") else text


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    """json's object hook: a key given twice is refused (json keeps the last one silently, as YAML did)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def read_json(path: Path | str, what: str, limit: int | None = None) -> Any:
    text = decode_utf8(read_bytes(path, what, limit), path, what)
    text = text[1:] if text.startswith("\ufeff") else text
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        abort(f"{what} {path}: the key {shown(e.args[0], 40)} is given twice", "give each key once")
    except json.JSONDecodeError as e:
        abort(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
              "fix the file, or give another one")
    except ValueError as e:  # an integer of more than 4300 digits (Python's limit): "internal error: ValueError" before
        abort(f"{what} {path} is not usable JSON: {_unreadable_value(e)}", "fix the file, or give another one")
    except RecursionError:
        abort(f"{what} {path} is not usable JSON: nested too deeply")


def _unreadable_value(e: ValueError) -> str:
    """What a ValueError from a parser's value constructor says, in words for the file's author."""
    if "integer string conversion" in str(e):
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"a value that cannot be read ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"


def shown(value: Any, limit: int = 60) -> str:
    """A value as an error line shows it: its repr, cut short. A config value may be huge (a YAML alias bomb's repr is
    gigabytes, and the error message once built it all): reprlib walks a few items of a few levels only."""
    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 2, 3, 3, 3, 3
    r.maxstring = r.maxother = r.maxlong = limit
    s = r.repr(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


class _AliasFound(Exception):
    def __init__(self, event):
        super().__init__(event.anchor)
        self.event = event


def _loader():
    """yaml.SafeLoader that refuses aliases (`*name`): a few nested anchors (`b: [*a, *a, ...]`) make a value of
    billions of items that anything walking it (a check, an error message) expands."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise _AliasFound(self.peek_event())
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            # a key given twice: YAML keeps the last one silently (`model: demo` then `model: other` served other)
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, _ in node.value:
                    if isinstance(key_node, yaml.ScalarNode):
                        key = self.construct_object(key_node)
                        if key in first:
                            raise yaml.constructor.ConstructorError(
                                None, None, f"the key {shown(key, 40)} is given twice (first on line {first[key] + 1})",
                                key_node.start_mark)
                        first[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    return NoAliasLoader


def read_yaml(path: Path | str, what: str, limit: int | None = MAX_SETTINGS_BYTES) -> Any:
    """A YAML file (a settings file: at most MAX_SETTINGS_BYTES unless `limit` says otherwise), aliases and keys given
    twice refused."""
    import yaml

    text = decode_utf8(read_bytes(path, what, limit), path, what)
    text = text[1:] if text.startswith("\ufeff") else text
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader, less aliases)
    except _AliasFound as e:
        mark = e.event.start_mark
        abort(f"{what} {path} uses a YAML alias (*{shown(e.event.anchor, 30)[1:-1]}, line {mark.line + 1}, column {mark.column + 1}), "
              "which rollingkv does not expand", "write the value out in full")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        abort(f"{what} {path} is not valid YAML: {problem}{where}", "fix the file, or give another one")
    except ValueError as e:  # a value its constructor cannot make (a date 2001-13-45, `!!int abc`, 5000 digits): it was
        # "internal error: ValueError"
        abort(f"{what} {path} is not usable YAML: {_unreadable_value(e)}", "fix the file, or give another one")
    except RecursionError:
        abort(f"{what} {path} is not usable YAML: nested too deeply")


def read_data(path: Path | str, what: str) -> Any:
    """A settings file: JSON for a .json file, else YAML (which reads JSON too); at most MAX_SETTINGS_BYTES."""
    return read_json(path, what, MAX_SETTINGS_BYTES) if Path(path).suffix.lower() == ".json" else read_yaml(path, what)


# ------------------------------------------------------------------ files we write

def _stat_and_parent(p: Path, say: str) -> tuple[os.stat_result | None, Path]:
    """p's stat (None when absent) and where a write would land: p itself when it exists, else its nearest existing
    parent, which must be a directory. A path through a file, or one that cannot be looked at: one line, `say: why`."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        abort(f"{say}: a part of the path is a file, not a directory", "check the path")
    except OSError as e:
        abort(f"{say}: {e.strerror or e}", "check the path")
    if st is not None:
        return st, p
    if os.path.islink(p):  # a link to nothing: a write lands at its target, whose directory a write does not make
        target = Path(os.path.realpath(p))
        if not target.parent.is_dir():  # `--json link` ran the whole gate, then "No such file or directory"
            abort(f"{say}: it is a symbolic link to {target}, whose directory does not exist",
                  "give another path, or make that directory first")
        return None, target.parent
    where = p.absolute().parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        abort(f"{say}: {where} is a file, not a directory", "check the path")
    return None, where


def check_output_file(path: Path | str, what: str) -> None:
    """Before a run, that `path` can take the file it will write: absent, in a directory we may write into (or that can
    be made), or a regular file we may replace. A device, FIFO, socket or directory is refused (`--json /dev/full` ran
    the whole gate, then failed, and a companion file was made in /dev), and so is a place that cannot be written (a
    read-only filesystem, no permission, a part of the path that is a file). Nothing is created here."""
    p = Path(path)
    say = f"cannot write {what} {p}"
    st, where = _stat_and_parent(p, say)
    if st is not None and not stat.S_ISREG(st.st_mode):
        abort(f"{say}: it is {_kind(st.st_mode)}, not a regular file", "give the path of a new file, or of a regular file to replace")
    try:
        vfs = os.statvfs(where)
    except OSError:
        vfs = None
    if vfs is not None and vfs.f_blocks == 0:  # `gate needle --json /proc/x.json` ran the whole gate, then failed
        abort(f"{say}: {where} is not on a disk (a pseudo filesystem such as /proc or /sys)",
              "give a path on a disk, e.g. under /tmp or your home")
    if vfs is not None and vfs.f_flag & os.ST_RDONLY:
        abort(f"{say}: {where} is on a read-only filesystem", "write it to another directory")
    if not os.access(where, os.W_OK | (0 if st is not None else os.X_OK)):
        abort(f"{say}: permission denied ({where})", "check its permissions (ls -ld), or write it elsewhere")


def check_output_dir(path: Path | str, what: str) -> None:
    """Before a run, that `path` can be (or be made) a directory to write into: an existing directory, or absent under
    one. A file or device in its place, a part of the path that is a file, a pseudo filesystem (/proc, /sys: `gate equiv
    --work-dir /proc` ended in "internal error: FileNotFoundError"), a read-only filesystem or no permission: one line
    naming the path. Nothing is created here."""
    p = Path(path)
    say = f"cannot use {what} {p}"
    st, where = _stat_and_parent(p, say)
    if st is None and os.path.islink(p):  # mkdir cannot make a directory through a link to nothing
        abort(f"{say}: it is a symbolic link to {os.path.realpath(p)}, which does not exist",
              "give the path of a directory (new or existing), or make the link's target first")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        abort(f"{say}: it is {'a file' if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)}, not a directory",
              "give the path of a directory (new or existing)")
    try:
        vfs = os.statvfs(where)
    except OSError:
        vfs = None
    if vfs is not None and vfs.f_blocks == 0:
        abort(f"{say}: {where} is not on a disk (a pseudo filesystem such as /proc or /sys)",
              "give a directory on a disk, e.g. under /tmp or your home")
    if vfs is not None and vfs.f_flag & os.ST_RDONLY:
        abort(f"{say}: {where} is on a read-only filesystem", "give a directory on a writable filesystem")
    if not os.access(where, os.W_OK | os.X_OK):
        abort(f"{say}: permission denied ({where})", "check its permissions (ls -ld), or give another directory")


# ------------------------------------------------------------------ environment variables

def env_str(name: str) -> str | None:
    """The variable's value with surrounding blanks removed; None when unset or blank."""
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    return v.strip()


def _unset_hint(name: str, example: str) -> str:
    return f"set it to {example}, or unset it (`unset {name}`)"


def env_float(name: str, default: float | None = None, *, positive: bool = False, minimum: float | None = None,
              unit: str = "", example: str = "a number such as 2.5") -> float | None:
    raw = env_str(name)
    if raw is None:
        return default
    units = f" of {unit}" if unit else ""
    try:
        v = float(raw)
    except ValueError:
        abort(f"${name}={os.environ[name]!r} is not a number{units}", _unset_hint(name, example))
    if not math.isfinite(v) or (positive and v <= 0) or (minimum is not None and v < minimum):
        need = "a positive number" if positive else f"a number >= {minimum:g}" if minimum is not None else "a finite number"
        need = need if math.isfinite(v) else "a finite number"  # `inf` "must be a positive number" said it was none
        abort(f"${name}={os.environ[name]!r} must be {need}{units}", _unset_hint(name, example))
    return v


def env_int(name: str, default: int | None = None, *, minimum: int | None = None, example: str = "a whole number such as 3") -> int | None:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        v = int(raw, 10)
    except ValueError:
        abort(f"${name}={os.environ[name]!r} is not a whole number", _unset_hint(name, example))
    if minimum is not None and v < minimum:
        abort(f"${name}={os.environ[name]!r} must be at least {minimum}", _unset_hint(name, example))
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False, example: str = "1 or 0") -> bool:
    """An on/off variable: 1/true/yes/on, 0/false/no/off (any case), unset or blank: default; else one line, exit 1."""
    raw = env_str(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    abort(f"${name}={os.environ[name]!r} is neither on nor off", _unset_hint(name, example))


# ------------------------------------------------------------------ the library's own knobs

# The variables libllama / libggml read themselves (ggml-rolling-kv.c, ggml_rkv_knobs): there a bad value is silently
# ignored and one out of range silently clamped. Every command that loads the library or starts a child that does
# checks them here first, with one parser each, so a value means the same everywhere or is refused with one line.
# name: (lowest, highest, example). The library clamps SLOTS, SLOT_MIB and CPU_PART_THREADS to their highest; RUNTIME_MIB
# it takes as it is, times 2^20 in a size_t (2^44 MiB and more wrapped): its highest is the most device memory any GPU
# has, where a runtime's own share is a few hundred MiB.
NATIVE_KNOBS: dict[str, tuple[int, int | None, str]] = {
    "ROLLINGKV_SLOTS": (2, 8, "a number of slots from 2 to 8, such as 3"),
    "ROLLINGKV_SLOT_MIB": (1, 4096, "a size in MiB from 1 to 4096, such as 32"),
    "ROLLINGKV_RUNTIME_MIB": (0, 262144, "a size in MiB from 0 to 262144, such as 640"),
    "ROLLINGKV_CPU_PART_THREADS": (0, 1024, "a number of threads from 1 to 1024, such as 15, or 0 for the default"),
    "ROLLINGKV_CPU_PART_SPIN_US": (0, 1000000, "microseconds from 0 to 1000000, such as 300"),
    # atoi, clamped to 0..1: `abc` was off and `yes` too, silently
    "ROLLINGKV_CPU_PART_STATS": (0, 1, "1 (the CPU part's statistics at exit) or 0"),
}
_NOT_CLAMPED = ("ROLLINGKV_RUNTIME_MIB",)


def native_knob(name: str, default: int | None = None) -> int | None:
    """The library knob's value as the library takes it (NATIVE_KNOBS), default when unset or empty; a value the library
    would ignore, misread or clamp: one line, exit 1. The library reads the raw text with atoi or strtoll: only plain
    ASCII digits (a sign before them) mean the same there as here. Python's int() also takes blanks around, `1_000` and
    other scripts' digits, which atoi reads as 1 (or 0), and a blank value, which the library takes as 0 where Python
    saw none."""
    import re

    lo, hi, example = NATIVE_KNOBS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":  # the library's unset (ggml_rkv_env)
        return default
    if not re.fullmatch(r"[+-]?[0-9]+", raw):
        abort(f"${name}={raw!r} is not a whole number in plain digits (no blanks, no `_`): the library would misread it",
              _unset_hint(name, example))
    v = int(raw)
    if v < lo:
        abort(f"${name}={raw!r} must be at least {lo}", _unset_hint(name, example))
    if hi is not None and v > hi:
        if name in _NOT_CLAMPED:
            abort(f"${name}={raw!r} is more than any GPU's memory ({hi} MiB); a GPU runtime's own memory is a few hundred "
                  "MiB", _unset_hint(name, example))
        abort(f"${name}={raw!r} is more than the library takes ({hi}): it would use {hi}", _unset_hint(name, example))
    return v


# The must-fail controls' test hooks, which libllama reads once per context (llama_init_from_model_rolling_kv: the
# context's llama_rolling_kv_test_hooks) and refuses the context on a value it cannot take: PERTURB_TAIL, every tail score
# times (1 + x), so x must be a finite number above -1; PERTURB_MOVE, block promotions written wrong, 1 or 2. Checked
# here too, so that a command stops in one line before it starts anything.
ENV_PERTURB_TAIL = "ROLLINGKV_DEBUG_PERTURB_TAIL"
ENV_PERTURB_MOVE = "ROLLINGKV_DEBUG_PERTURB_MOVE"


def perturb_tail() -> float | None:
    """ROLLINGKV_DEBUG_PERTURB_TAIL as the library takes it; None when unset; any other value: one line, exit 1."""
    example = "a number above -1 such as 0.1 (a test switch that makes a split's outputs wrong on purpose)"
    v = env_float(ENV_PERTURB_TAIL, None, example=example)
    if v is not None and not v > -1.0:
        abort(f"${ENV_PERTURB_TAIL}={os.environ[ENV_PERTURB_TAIL]!r} must be above -1 (every tail score is multiplied by "
              "1 + x)", _unset_hint(ENV_PERTURB_TAIL, example))
    return v


def perturb_move() -> int | None:
    """ROLLINGKV_DEBUG_PERTURB_MOVE as the library takes it (1 or 2); None when unset; any other value: one line, exit 1."""
    raw = env_str(ENV_PERTURB_MOVE)
    if raw is None:
        return None
    if raw not in ("1", "2"):
        abort(f"${ENV_PERTURB_MOVE}={os.environ[ENV_PERTURB_MOVE]!r} is neither 1 nor 2 (a test hook: block promotions "
              "written wrong on purpose)", _unset_hint(ENV_PERTURB_MOVE, "1 or 2"))
    return int(raw)


def check_native_knobs() -> None:
    """Every knob of NATIVE_KNOBS that is set, and the test hooks, checked (before a command loads the library or starts
    llama-server or llama-bench)."""
    for name in NATIVE_KNOBS:
        native_knob(name)
    perturb_tail()
    perturb_move()
