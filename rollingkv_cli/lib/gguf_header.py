"""The package's one GGUF header reader: the metadata and the tensor infos, read the way the pin's gguf.cpp reads them,
with any file it would refuse (or that would hang or crash a reader) refused as one line naming the file and the field.

Not gguf-py's GGUFReader: on hostile files it loops without end (an array whose count is past the end of the file: it
reads empty values one by one, 2^40 times), recurses into 5000 nested arrays (RecursionError) and fails with whatever
exception numpy raises; and it wraps every value of every token in numpy views of a memmap, which made reading the demo's
header 4 s instead of 0.1 s. gguf-py stays the writer (model synth) and the source of the quant block sizes.
"""

from __future__ import annotations

import importlib
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollingkv_cli.lib import paths
from rollingkv_cli.console import abort

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what the pin's gguf.cpp reads (v1 is refused, v0 and newer ones too)
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, UINT32 = 8, 9, 4
_HINT = "download or convert it again"


def gguf_py_candidates() -> list[Path]:
    """gguf-py directories of llama.cpp trees we know of: $ROLLINGKV_LLAMA_CPP_SOURCE, the active build's
    source and private tree, the extracted pin in the cache (never downloads)."""
    from rollingkv_cli.lib import upstream

    trees: list[Path] = []
    env = os.environ.get(paths.ENV_SOURCE_DIR)
    if env:
        trees.append(Path(env))
    try:
        from rollingkv_cli.lib import builder

        b = builder.active_build(required=False)
    except Exception:
        b = None
    if b is not None:
        src = b.manifest.get("source")
        if src and src != "sdist":
            trees.append(Path(src))
        trees.append(b.dir / "src")
    trees.append(paths.upstream_dir() / upstream.PIN.short)
    out, seen = [], set()
    for t in trees:
        d = (t / "gguf-py").expanduser()
        if d.is_dir() and (d / "gguf" / "__init__.py").is_file() and str(d) not in seen:
            seen.add(str(d))
            out.append(d)
    return out


def import_gguf():
    """The gguf module (gguf-py): installed, else from a llama.cpp tree's gguf-py (a GPU host may have the tree and not
    the package); a clear error otherwise."""
    try:
        return importlib.import_module("gguf")
    except ImportError as e:
        first = e
    tried = []
    for d in gguf_py_candidates():
        sys.path.insert(0, str(d))
        try:
            return importlib.import_module("gguf")
        except ImportError as e:
            tried.append(f"{d} ({e})")
            sys.path.remove(str(d))
    abort(f"cannot import gguf (gguf-py): {first}" + (f"; tried {', '.join(tried)}" if tried else ""),
          f"pip install gguf, or put <llama.cpp tree>/gguf-py on PYTHONPATH (or set {paths.ENV_SOURCE_DIR})")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml's ne: the row length first
    type: int  # ggml_type
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]  # scalars as Python values, strings as str, arrays as lists
    types: dict[str, int]  # each key's GGUF value type
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int  # where the tensor data starts (the header padded to the alignment)
    file_size: int

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    @property
    def data_end(self) -> int:
        """The byte where the last tensor's data ends (gguf.cpp pads to the data section only when there are tensors)."""
        return max((self.data_offset + t.offset + t.n_bytes for t in self.tensors), default=self.data_offset)


class _Short(Exception):
    """A read past the end of the file."""


def read_header(path: Path, name: str | None = None) -> GGUFHeader:
    """The file's header, or one line (exit 1) naming the file and what is wrong: not a GGUF, a version or byte order
    llama.cpp does not read, cut inside its header or its tensor data, a corrupt field or tensor info."""
    name = name or str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(24)
            if head[:4] != GGUF_MAGIC:
                abort(f"{name} is not a GGUF file (bad magic)", "convert it with llama.cpp's convert_hf_to_gguf.py")
            if len(head) < 24:
                abort(f"{name} is truncated: {size} bytes, shorter than a GGUF header", _HINT)
            version = int.from_bytes(head[4:8], "little")
            if version & 0xFFFF == 0 and version:
                abort(f"{name} is a big-endian GGUF", "llama.cpp on this machine reads little-endian files only")
            if version not in GGUF_VERSIONS:
                abort(f"{name} is GGUF version {version}; llama.cpp reads versions {' and '.join(map(str, GGUF_VERSIONS))}",
                      "convert it again with a current llama.cpp")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                header = _walk(mm, name, version)
    except OSError as e:
        unreadable(name, e)
    if header.data_end > size:
        abort(f"{name} is truncated: {size} bytes, its tensors end at byte {header.data_end}", _HINT)
    return header


def unreadable(name: str, e: OSError) -> None:
    abort(f"cannot read model {name}: {e.strerror or e}", "check its permissions (ls -l)" if isinstance(e, PermissionError) else None)


def _walk(mm, name: str, version: int) -> GGUFHeader:
    gguf = import_gguf()
    n = len(mm)

    def take(fmt: str, pos: int):
        k = struct.calcsize(fmt)
        if pos + k > n:
            raise _Short
        return struct.unpack_from(fmt, mm, pos)[0], pos + k

    def string(pos: int) -> tuple[str, int]:
        length, pos = take("<Q", pos)
        if length > n - pos:
            raise _Short
        return bytes(mm[pos:pos + length]).decode("utf-8", errors="replace"), pos + length

    def value(vtype: int, pos: int, key: str):
        if vtype in _SCALAR:
            return take(_SCALAR[vtype], pos)
        if vtype == STRING:
            return string(pos)
        if vtype == ARRAY:
            itype, pos = take("<I", pos)
            count, pos = take("<Q", pos)
            if itype == ARRAY:  # gguf.cpp reads no array of arrays (a walk into 5000 of them overflowed Python's stack)
                abort(f"{name} is corrupt: its key {key} is an array of arrays, which llama.cpp does not read", _HINT)
            if itype in _SCALAR:
                width = struct.calcsize(_SCALAR[itype])
                if count > (n - pos) // width:  # checked before reading: a count past the file must not be walked
                    raise _Short
                items = list(struct.unpack_from(f"<{count}{_SCALAR[itype][1]}", mm, pos))
                return items, pos + count * width
            if itype != STRING:
                abort(f"{name} is corrupt: its key {key} is an array of an unknown GGUF value type {itype}", _HINT)
            if count > (n - pos) // 8:  # each string takes at least its 8-byte length
                raise _Short
            items = []
            for _ in range(count):
                s, pos = string(pos)
                items.append(s)
            return items, pos
        abort(f"{name} is corrupt: its key {key} has an unknown GGUF value type {vtype}", _HINT)

    try:
        pos = 8
        n_tensors, pos = take("<Q", pos)
        n_kv, pos = take("<Q", pos)
        fields: dict = {}
        types: dict = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            vtype, pos = take("<I", pos)
            if key in fields:
                abort(f"{name} is corrupt: its key {key} is given twice", _HINT)
            types[key] = vtype
            fields[key], pos = value(vtype, pos, key)
        infos = []
        for _ in range(n_tensors):
            tname, pos = string(pos)
            n_dims, pos = take("<I", pos)
            if n_dims > GGML_MAX_DIMS:
                abort(f"{name} is corrupt: tensor {tname} has {n_dims} dimensions", _HINT)
            dims = []
            for _ in range(n_dims):
                d, pos = take("<Q", pos)
                dims.append(d)
            ttype, pos = take("<I", pos)
            offset, pos = take("<Q", pos)
            infos.append((tname, tuple(dims), ttype, offset))
    except _Short:
        abort(f"{name} is truncated: {n} bytes, it ends inside its own header", _HINT)
    align = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in fields:  # gguf.cpp: a uint32, a power of 2
        align = fields["general.alignment"]
        if types["general.alignment"] != UINT32 or not align or align & (align - 1):
            shown = "an array" if types["general.alignment"] == ARRAY else repr(align)
            abort(f"{name} is corrupt: its key general.alignment is {shown}; llama.cpp needs a uint32 power of 2", _HINT)
    data_offset = -(-pos // align) * align if infos else pos
    tensors = []
    for tname, dims, ttype, offset in infos:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            abort(f"{name}: tensor {tname} has an unknown type {ttype}", "the file is corrupt or newer than this llama.cpp")
        if dims and dims[0] % block:
            abort(f"{name}: tensor {tname} has {dims[0]} columns, not a multiple of its type's block of {block}", "the file is corrupt")
        elements = 1
        for d in dims:
            elements *= d
        tensors.append(TensorInfo(tname, dims, ttype, offset, elements // block * type_size))
    return GGUFHeader(version=version, fields=fields, types=types, tensors=tuple(tensors), alignment=align,
                      data_offset=data_offset, file_size=n)
