"""What the benchmark needs to know about a GGUF: per-layer weight bytes and the KV row shape, from its header
(gguf_header.read_header, the package's one GGUF reader)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from rollingkv_cli.bench.arithmetic import KVShape, WeightSplit
from rollingkv_cli.console import abort
from rollingkv_cli.lib.gguf_header import GGUFHeader, read_header


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
    matmul_params: int = 0  # weights a token multiplies: the blocks' matrices and the output (token_embd when tied)

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


_BLK = re.compile(r"^blk\.(\d+)\.")

# hybrid architectures whose attention layers are every full_attention_interval-th (the pin's default interval) unless
# attention.recurrent_layers lists the recurrent ones; the others mark theirs with 0 KV heads (head_count_kv per layer)
_INTERVAL_HYBRIDS = {"qwen35": 4, "qwen35moe": 4, "qwen3next": 4, "minimax-01": 8}


def _recurrent_layers(header: GGUFHeader, arch: str, n_layer: int) -> set[int]:
    """The recurrent layers of a hybrid model that counts them by interval, as the pin's loader does (the trailing
    nextn_predict_layers MTP layers attend); empty for other models."""
    if arch not in _INTERVAL_HYBRIDS:
        return set()
    flags = header.get(f"{arch}.attention.recurrent_layers")
    if isinstance(flags, list) and len(flags) == n_layer:
        return {il for il, f in enumerate(flags) if f}
    interval = int(header.get(f"{arch}.full_attention_interval") or _INTERVAL_HYBRIDS[arch])
    trunk = n_layer - int(header.get(f"{arch}.nextn_predict_layers") or 0)
    return {il for il in range(trunk) if (il + 1) % max(1, interval) != 0}


def read_model(path: Path) -> ModelInfo:
    header = read_header(path)
    arch = header.get("general.architecture")
    if not isinstance(arch, str):
        abort(f"{path} has no general.architecture")
    name = header.get("general.name") or path.stem

    def need(key: str):
        v = header.get(f"{arch}.{key}")
        if v is None:
            abort(f"{path}: {arch}.{key} is missing", "the benchmark reads the attention shape from the GGUF metadata")
        return v

    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    heads = need("attention.head_count")
    n_head = int(max(heads) if isinstance(heads, list) else heads)
    kv_heads = header.get(f"{arch}.attention.head_count_kv")
    if kv_heads is None:
        kv_heads = n_head
    n_head_kv = [int(h) for h in kv_heads] if isinstance(kv_heads, list) else [int(kv_heads)] * n_layer
    head_dim_k = int(header.get(f"{arch}.attention.key_length") or n_embd // n_head)
    head_dim_v = int(header.get(f"{arch}.attention.value_length") or n_embd // n_head)
    sliding = header.get(f"{arch}.attention.sliding_window")

    blocks = [0] * n_layer
    other: dict[str, int] = {}
    matmul = {"blk": 0, "output.weight": 0, "token_embd.weight": 0}
    for t in header.tensors:
        if len(t.dims) >= 2 and (t.name.startswith("blk.") or t.name in matmul):  # norms and biases are vectors
            n = 1
            for x in t.dims:
                n *= int(x)
            matmul["blk" if t.name.startswith("blk.") else t.name] += n
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
    recurrent = _recurrent_layers(header, arch, n_layer)
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
                     tied_output=tied, sliding_window=int(sliding) if sliding else None, notes=notes,
                     matmul_params=matmul["blk"] + matmul["token_embd.weight" if tied else "output.weight"])


def check_host_kv(info: ModelInfo, cells: int, types: list[tuple[str, str]], what: str, hint: str) -> None:
    """Where the whole KV cache is in host memory (a CPU build), refuse before anything starts a cache larger than the
    host's MemAvailable, counted at the smallest of the K/V type pairs it may use (a split's tail may be smaller than
    its window): `bench tail -d 2000000000` failed every cell's context one after another, and `serve -c 2000000000`
    had llama-server killed by the kernel's out-of-memory killer (which may pick another process)."""
    from rollingkv_cli.hw.hostinfo import mem_available_bytes
    from rollingkv_cli.lib.units import human_bytes

    avail = mem_available_bytes()
    sizes = []
    for k, v in types:
        try:
            sizes.append((info.kv.row_bytes(k, v) * cells, k, v))
        except ValueError:  # a type the model's shape does not take (or auto): said elsewhere, not counted
            continue
    if avail is None or not sizes:
        return
    need, k, v = min(sizes)
    if need > avail:
        abort(f"{what}: the KV cache of {cells} cells ({k}/{v}) alone would take {human_bytes(need)} of memory, and the "
              f"host has {human_bytes(avail)} available (MemAvailable)", hint)
