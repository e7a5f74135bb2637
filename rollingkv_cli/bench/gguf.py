"""What the benchmark needs to know about a GGUF: per-layer weight bytes and the KV row shape, read with
gguf-py (the pip package, or the copy in the pinned llama.cpp tree where no package is installed, as on
the GPU machine)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli import paths
from rollingkv_cli.bench.arithmetic import KVShape, WeightSplit
from rollingkv_cli.console import abort


def gguf_py_candidates() -> list[Path]:
    """gguf-py directories of llama.cpp trees we know of: $ROLLINGKV_LLAMA_CPP_SOURCE, the active build's
    source and private tree, the extracted pin in the cache (never downloads)."""
    from rollingkv_cli import upstream

    trees: list[Path] = []
    env = os.environ.get(paths.ENV_SOURCE_DIR)
    if env:
        trees.append(Path(env))
    try:
        from rollingkv_cli import builder

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
    """The gguf module: installed, else from a llama.cpp tree's gguf-py; a clear error otherwise."""
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


@dataclass
class ModelInfo:
    path: Path
    arch: str
    name: str
    n_layer: int
    n_head: int
    n_head_kv: list[int]
    head_dim_k: int
    head_dim_v: int
    weights: WeightSplit
    file_bytes: int
    tied_output: bool
    sliding_window: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def kv(self) -> KVShape:
        return KVShape(tuple(h * self.head_dim_k for h in self.n_head_kv), tuple(h * self.head_dim_v for h in self.n_head_kv))

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "name": self.name, "arch": self.arch, "file_bytes": self.file_bytes,
            "n_layer": self.n_layer, "n_head": self.n_head, "n_head_kv": self.n_head_kv,
            "head_dim_k": self.head_dim_k, "head_dim_v": self.head_dim_v, "tied_output": self.tied_output,
            "weights": {"block_bytes": list(self.weights.block_bytes), "output_bytes": self.weights.output_bytes,
                        "input_bytes": self.weights.input_bytes, "device_bytes_ngl99": self.weights.device_bytes_all},
            "kv_bytes_per_token_f16": self.kv.row_bytes("f16", "f16"),
            "notes": self.notes,
        }


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    if hasattr(f, "contents"):
        return f.contents()
    return f.parts[f.data[0]].tolist() if len(f.data) == 1 else [f.parts[i].tolist() for i in f.data]


_BLK = re.compile(r"^blk\.(\d+)\.")

# hybrid architectures whose attention layers are every full_attention_interval-th (the pin's default interval) unless
# attention.recurrent_layers lists the recurrent ones; the others mark theirs with 0 KV heads (head_count_kv per layer)
_INTERVAL_HYBRIDS = {"qwen35": 4, "qwen35moe": 4, "qwen3next": 4, "minimax-01": 8}


def _recurrent_layers(reader, arch: str, n_layer: int) -> set[int]:
    """The recurrent layers of a hybrid model that counts them by interval, as the pin's loader does (the trailing
    nextn_predict_layers MTP layers attend); empty for other models."""
    if arch not in _INTERVAL_HYBRIDS:
        return set()
    flags = _field(reader, f"{arch}.attention.recurrent_layers")
    if isinstance(flags, list) and len(flags) == n_layer:
        return {il for il, f in enumerate(flags) if f}
    interval = int(_field(reader, f"{arch}.full_attention_interval") or _INTERVAL_HYBRIDS[arch])
    trunk = n_layer - int(_field(reader, f"{arch}.nextn_predict_layers") or 0)
    return {il for il in range(trunk) if (il + 1) % max(1, interval) != 0}


def read_model(path: Path) -> ModelInfo:
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file
        abort(f"cannot read {path} as GGUF: {e}")
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        abort(f"{path} has no general.architecture")
    name = _field(reader, "general.name") or path.stem

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            abort(f"{path}: {arch}.{key} is missing", "the benchmark reads the attention shape from the GGUF metadata")
        return v

    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    heads = need("attention.head_count")
    n_head = int(max(heads) if isinstance(heads, list) else heads)
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    if kv_heads is None:
        kv_heads = n_head
    n_head_kv = [int(h) for h in kv_heads] if isinstance(kv_heads, list) else [int(kv_heads)] * n_layer
    head_dim_k = int(_field(reader, f"{arch}.attention.key_length") or n_embd // n_head)
    head_dim_v = int(_field(reader, f"{arch}.attention.value_length") or n_embd // n_head)
    sliding = _field(reader, f"{arch}.attention.sliding_window")

    blocks = [0] * n_layer
    other: dict[str, int] = {}
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m and int(m.group(1)) < n_layer:
            blocks[int(m.group(1))] += int(t.n_bytes)
        else:
            other[t.name] = int(t.n_bytes)
    input_bytes = other.pop("token_embd.weight", 0)
    tied = "output.weight" not in other
    output_bytes = sum(other.values()) + (input_bytes if tied else 0)  # a tied output is a device copy of token_embd
    notes = []
    if len(n_head_kv) != n_layer:
        abort(f"{path}: {len(n_head_kv)} KV head counts for {n_layer} layers")
    recurrent = _recurrent_layers(reader, arch, n_layer)
    if recurrent:  # a hybrid model whose metadata gives the KV heads of its attention layers to every layer
        n_head_kv = [0 if il in recurrent else h for il, h in enumerate(n_head_kv)]
    if any(h <= 0 for h in n_head_kv):
        notes.append(f"{sum(1 for h in n_head_kv if h <= 0)} layers have no KV cache (0 KV heads"
                     + (": recurrent layers of a hybrid model, their state stays whole on the device)" if recurrent else ")"))
        n_head_kv = [max(0, h) for h in n_head_kv]
    if sliding:
        notes.append(f"the model has sliding-window layers (window {sliding}); they stay whole on the device, but the "
                     "tail bytes here count every layer: read the tail figures as an upper bound")
    return ModelInfo(path=path, arch=arch, name=str(name), n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                     head_dim_k=head_dim_k, head_dim_v=head_dim_v,
                     weights=WeightSplit(tuple(blocks), output_bytes, input_bytes), file_bytes=path.stat().st_size,
                     tied_output=tied, sliding_window=int(sliding) if sliding else None, notes=notes)
