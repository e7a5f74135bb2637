"""The package's one GGUF header reader (rollingkv_cli/lib/gguf_header.py): what it reads equals gguf-py's GGUFReader on
well-formed files, and the files that hang or crash GGUFReader are one line, at once (issue 27: 6)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from rollingkv_cli import models
from rollingkv_cli.console import RollingKVError
from rollingkv_cli.lib import gguf_header
from rollingkv_cli.lib.gguf_header import read_header

REPO = Path(__file__).resolve().parent.parent


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _gguf(tmp_path: Path, kvs: list[bytes], n_tensors: int = 0, tail: bytes = b"") -> Path:
    p = tmp_path / "crafted.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + tail)
    return p


ARCH = _key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama"


@pytest.mark.parametrize("arch, wtype", [("llama", "f16"), ("llama", "q8_0"), ("gemma2", "f16"), ("qwen35", "f16"), ("lfm2", "f16")])
def test_reads_what_gguf_py_reads(tmp_path, arch, wtype):
    """Every key's value, every tensor's name, shape, type, bytes and place: as gguf-py's own reader has them."""
    import gguf

    spec = models.SynthSpec(layers=4, embd=256, heads=4, kv_heads=2, ff=512, vocab=300, ctx=1024, arch=arch, type=wtype,
                            attn_interval=2)
    out = models.write_synthetic(tmp_path / "m.gguf", spec)
    header = read_header(out)
    ref = gguf.GGUFReader(str(out))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(header.fields) == keys
    for k in keys:
        assert header.fields[k] == ref.fields[k].contents(), k
        assert header.types[k] == ref.fields[k].types[0], k
    assert header.data_offset == ref.data_offset and header.alignment == ref.alignment
    assert [(t.name, list(t.dims), t.type, t.n_bytes, header.data_offset + t.offset) for t in header.tensors] == \
           [(t.name, t.shape.tolist(), int(t.tensor_type), int(t.n_bytes), int(t.data_offset)) for t in ref.tensors]
    assert header.data_end == out.stat().st_size  # the writer pads nothing after the last tensor


class _CountingStruct:
    """The struct module as gguf_header sees it, counting the values it unpacks; past LIMIT reads it fails the test."""

    def __init__(self, limit: int):
        self.calls, self.limit = 0, limit

    def __getattr__(self, name):
        return getattr(struct, name)

    def unpack_from(self, fmt, buf, offset=0):
        self.calls += 1
        if self.calls > self.limit:
            raise AssertionError(f"{self.calls} reads of a file of {len(buf)} bytes: the header walk does not end")
        return struct.unpack_from(fmt, buf, offset)


def test_an_array_counted_past_the_end_is_refused_at_once(tmp_path, monkeypatch):
    """An array of 2^40 bytes in a file of 100: GGUFReader reads its empty values one by one (it does not end); here the
    count is checked against the file before anything is read."""
    # structural, not a wall-clock bound (1 s on a loaded 2-core CI was the check): the count is checked against the file
    # before any item is read or made, so the walk makes only the header's reads (9 here), not one per item of the 64
    # bytes after the count. Seen failing with the count check in gguf_header._walk removed and the items read one by one
    # ("73 reads").
    p = _gguf(tmp_path, [ARCH, _key("x.big") + struct.pack("<IIQ", 9, 0, 2**40)], tail=bytes(64))
    reads = _CountingStruct(limit=1000)
    monkeypatch.setattr(gguf_header, "struct", reads)
    with pytest.raises(RollingKVError, match="crafted.gguf is truncated: .* it ends inside its own header"):
        read_header(p)
    assert reads.calls <= 16, f"{reads.calls} reads: the walk read the array's items before checking its count"
    p = _gguf(tmp_path, [ARCH, _key("x.strings") + struct.pack("<IIQ", 9, 8, 2**40)])
    with pytest.raises(RollingKVError, match="ends inside its own header"):
        read_header(p)


@pytest.mark.parametrize("kvs, message", [
    ([ARCH, ARCH], "its key general.architecture is given twice"),
    ([ARCH, _key("x.odd") + struct.pack("<IIQ", 9, 13, 1)], "its key x.odd is an array of an unknown GGUF value type 13"),
    ([ARCH, _key("x.odd") + struct.pack("<I", 99)], "its key x.odd has an unknown GGUF value type 99"),
    ([ARCH, _key("x.deep") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)],
     "its key x.deep is an array of arrays"),
], ids=["duplicate-key", "array-of-unknown-type", "unknown-type", "nested-arrays"])
def test_corrupt_fields_are_named(tmp_path, kvs, message):
    with pytest.raises(RollingKVError, match=message):
        read_header(_gguf(tmp_path, kvs))


def test_tensor_infos_are_checked(tmp_path):
    info = _key("w") + struct.pack("<I", 1) + struct.pack("<Q", 48) + struct.pack("<IQ", 8, 0)  # q8_0: blocks of 32
    with pytest.raises(RollingKVError, match="tensor w has 48 columns, not a multiple of its type's block of 32"):
        read_header(_gguf(tmp_path, [ARCH], n_tensors=1, tail=info))
    info = _key("w") + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<IQ", 1000, 0)
    with pytest.raises(RollingKVError, match="tensor w has an unknown type 1000"):
        read_header(_gguf(tmp_path, [ARCH], n_tensors=1, tail=info))
    info = _key("w") + struct.pack("<I", 5) + struct.pack("<5Q", 1, 1, 1, 1, 1) + struct.pack("<IQ", 0, 0)
    with pytest.raises(RollingKVError, match="tensor w has 5 dimensions"):
        read_header(_gguf(tmp_path, [ARCH], n_tensors=1, tail=info))


def test_one_reader_in_the_package():
    """No module but gguf_header.py reads a GGUF header: no GGUFReader, no second walk of the format."""
    readers = sorted(p.name for p in (REPO / "rollingkv_cli").rglob("*.py")
                     if p.name != "gguf_header.py" and ("GGUFReader(" in (text := p.read_text()) or '"<Q"' in text))
    assert readers == []


def test_a_file_without_tensors_is_not_truncated(tmp_path):
    """gguf.cpp pads the header to the alignment only before tensor data: a file of metadata alone ends right after it
    (it was called truncated: "its tensors end at byte 192")."""
    p = _gguf(tmp_path, [ARCH])
    header = read_header(p)
    assert header.tensors == () and header.data_end == p.stat().st_size and header.data_end % 32 != 0
