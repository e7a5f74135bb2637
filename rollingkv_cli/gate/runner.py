"""Child process of `rollingkv gate`: teacher-forced logits of a token sequence on one libllama.

llama_cpp binds its library once per process, so every library (the reference's, the candidate's) gets
its own interpreter running this module:

    python -m rollingkv_cli.gate.runner --lib-dir DIR --model PATH --tokenize FILE|--synthetic N --tokens-out T.npy
    python -m rollingkv_cli.gate.runner --lib-dir DIR --model PATH --tokens T.npy --ctx N --n-batch B
            [--threads N] [-ctk TYPE -ctv TYPE] [--residency JSON]
            (--save-logits REF.npy | --reference-logits REF.npy | both) --out OUT.json

The reference run saves every position's f32 logits as one (n_tokens, n_vocab) .npy; the candidate run
compares each decoded batch against that file (memory-mapped) with metrics.py as it goes, so there is
never a second full logits file (a baseline run does both: it is compared, and saved as the reference of
later runs). The library may be ours (then llama_ext binds it and the residency API
is used when --residency asks for it) or an unpatched libllama (plain llama_init_from_model).

Protocol, stdout (one line each; stderr carries llama.cpp's own log):
    STAGE <name>                 what is running now
    PROGRESS <done> <total>      positions decoded so far (tokenize: tokens found of those wanted)
    ERROR <json>                 {"message": ..., "hint": ...}: an expected failure; exit status 1
    RESULT <path>                the JSON result was written to <path>; exit status 0
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from rollingkv_cli.lib.text import synthetic_text

BUILD_INFO_SYMBOL = "llama_rolling_kv_build_info"
RESIDENCY_SYMBOL = "llama_init_from_model_rolling_kv"


class RunnerError(Exception):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


def emit(kind: str, payload: str) -> None:
    sys.stdout.write(f"{kind} {payload}\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ library

def resolve_lib_dir(spec: str | Path) -> Path:
    """A directory holding libllama.so, or a path to the libllama.so file itself."""
    p = Path(spec).expanduser()
    if p.is_file():
        p = p.parent
    p = p.resolve()
    if not (p / "libllama.so").is_file():
        raise RunnerError(f"no libllama.so in {p}", "give the directory of a llama.cpp build's libllama.so (build/bin)")
    return p


def is_rollingkv_lib(lib_dir: Path) -> bool:
    try:
        lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    except OSError as e:
        raise RunnerError(f"cannot load {lib_dir / 'libllama.so'}: {e}") from None
    return hasattr(lib, BUILD_INFO_SYMBOL)


def load_bindings(lib_dir: Path):
    """(llama_cpp, Extension or None, info dict) with llama_cpp bound to lib_dir's libllama."""
    from rollingkv_cli.lib.llama_ext import preload_cxx_runtime

    preload_cxx_runtime()  # before the first load of any of the build's libraries (is_rollingkv_lib loads libllama)
    ours = is_rollingkv_lib(lib_dir)
    info: dict = {"lib": str(lib_dir / "libllama.so"), "rollingkv": ours}
    if ours:
        from rollingkv_cli.lib import llama_ext
        from rollingkv_cli.console import RollingKVError

        try:
            mod = llama_ext.import_llama_cpp(lib_dir)
        except RollingKVError as e:
            raise RunnerError(e.message, e.hint) from None
        ext = llama_ext.Extension(mod.llama_cpp._lib)
        bad = ext.abi_mismatches(mod)
        if bad:
            raise RunnerError(f"struct layout mismatch between the library and llama_cpp: {'; '.join(bad)}",
                              "the bindings and the library must come from the same pin: rebuild with `rollingkv build`")
        info.update(build_info=ext.build_info(), api_version=ext.api_version(), has_residency=ext.has_residency)
        return mod, ext, info
    if "llama_cpp" in sys.modules:
        raise RunnerError("llama_cpp was imported before the library was chosen")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        import llama_cpp as mod
    except Exception as e:  # ImportError, OSError, RuntimeError, AttributeError from a mismatched library
        raise RunnerError(f"llama_cpp could not load {lib_dir / 'libllama.so'}: {e}",
                          "the library must come from the llama.cpp commit llama-cpp-python 0.3.36 pins") from None
    from rollingkv_cli.lib.llama_ext import loaded_library_path

    loaded = loaded_library_path(mod)
    if loaded is None or loaded.resolve() != (lib_dir / "libllama.so").resolve():
        raise RunnerError(f"llama_cpp is bound to {loaded}, not to {lib_dir / 'libllama.so'}")
    info.update(build_info=None, api_version=None, has_residency=False)
    return mod, None, info


def load_model(llama_cpp, lib_dir: Path, model: Path, vocab_only: bool = False, n_gpu_layers: int | None = None):
    from rollingkv_cli.lib.llama_ext import register_backend_modules

    register_backend_modules(lib_dir)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = vocab_only
    if n_gpu_layers is not None:
        mp.n_gpu_layers = n_gpu_layers
    m = llama_cpp.llama_model_load_from_file(str(model).encode(), mp)
    if not m:
        raise RunnerError(f"llama.cpp could not load the model {model}", "llama.cpp says why in its log")
    return m


# ------------------------------------------------------------------ modes

def tokenize(args) -> dict:
    """The tokens of the text, saved to --tokens-out; STAGE and PROGRESS lines as it goes (tokens found of those wanted:
    the gate shows them as the other phases' bars)."""
    emit("STAGE", "loading the vocabulary")
    lib_dir = resolve_lib_dir(args.lib_dir)
    llama_cpp, ext, info = load_bindings(lib_dir)
    model = load_model(llama_cpp, lib_dir, Path(args.model), vocab_only=True)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        if args.synthetic is not None:
            want = int(args.synthetic)
            emit("PROGRESS", f"0 {want}")
            chars = max(256, want * 6)
            while True:
                emit("STAGE", f"tokenizing {chars} characters of built-in text")
                toks = _tokenize_text(llama_cpp, vocab, synthetic_text(chars, args.seed).encode())
                emit("PROGRESS", f"{min(len(toks), want)} {want}")
                if len(toks) >= want:
                    break
                chars *= 2
            toks = toks[:want]
            source = {"kind": "synthetic", "n_tokens": want, "seed": args.seed}
        else:
            text = Path(args.tokenize).read_bytes()
            emit("STAGE", f"tokenizing {len(text)} bytes of {Path(args.tokenize).name}")
            toks = _tokenize_text(llama_cpp, vocab, text)
            if args.max_tokens:
                toks = toks[: args.max_tokens]
            emit("PROGRESS", f"{len(toks)} {len(toks)}")
            source = {"kind": "file", "path": str(Path(args.tokenize).resolve()), "bytes": len(text)}
        emit("STAGE", f"saving {len(toks)} tokens")
        arr = np.asarray(toks, dtype=np.int32)
        np.save(args.tokens_out, arr)
    finally:
        llama_cpp.llama_model_free(model)
    return {"mode": "tokenize", **info, "n_tokens": int(arr.shape[0]), "n_vocab": n_vocab,
            "source": source, "tokens": str(Path(args.tokens_out).resolve())}


def _tokenize_text(llama_cpp, vocab, text: bytes) -> list[int]:
    n_max = len(text) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n_max, True, False)
    if n < 0:
        n_max = -n
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n_max, True, False)
    if n < 0:
        raise RunnerError("tokenization failed")
    return list(buf[:n])


def logits(args) -> dict:
    from rollingkv_cli.gate import metrics
    from rollingkv_cli.lib.llama_ext import GGML_TYPES

    t0 = time.perf_counter()
    lib_dir = resolve_lib_dir(args.lib_dir)
    tokens = np.load(args.tokens).astype(np.int32)
    n_seq = args.n_seq
    # n_seq > 1: the text as n_seq contiguous sequences of L tokens, decoded side by side (every batch holds b
    # positions of each, in one unified KV cache, as llama-server's parallel slots); logit row k*L + p is
    # sequence k at position p, in both runs
    seq_len = int(tokens.shape[0]) // n_seq
    n = seq_len*n_seq
    tokens = tokens[:n]
    if n == 0:
        raise RunnerError("no tokens to decode" if n_seq == 1 else f"fewer tokens than the {n_seq} sequences")
    if n > args.ctx:
        raise RunnerError(f"{n} tokens do not fit a context of {args.ctx}")
    residency = json.loads(args.residency) if args.residency else None
    for t in (args.ctk, args.ctv):
        if t not in GGML_TYPES:
            raise RunnerError(f"unknown cache type {t!r}", f"use one of {', '.join(GGML_TYPES)}")

    emit("STAGE", "loading")
    llama_cpp, ext, info = load_bindings(lib_dir)
    model = load_model(llama_cpp, lib_dir, Path(args.model), n_gpu_layers=args.n_gpu_layers)
    ctx = None
    batch = None
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        if int(tokens.max()) >= n_vocab or int(tokens.min()) < 0:
            raise RunnerError(f"token ids out of range for this model's vocabulary of {n_vocab}")

        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = args.ctx
        cp.n_batch = args.n_batch
        cp.n_ubatch = args.n_ubatch or args.n_batch
        cp.n_seq_max = n_seq
        if n_seq > 1:
            cp.kv_unified = True  # one cache for all sequences (llama-server's default with parallel slots)
        cp.n_threads = args.threads
        cp.n_threads_batch = args.threads
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = GGML_TYPES[args.ctk]
        cp.type_v = GGML_TYPES[args.ctv]
        cp.embeddings = False
        ctx, plan, via = _init_context(llama_cpp, ext, model, cp, residency)
        if not ctx:
            raise _context_refused(ext, residency)
        n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        t_load = time.perf_counter() - t0

        ref = out_mm = None
        acc = metrics.GateAccumulator(topk=args.topk)
        max_abs = 0.0
        bitwise_rows = 0
        bitwise_flags: list[np.ndarray] = []  # per compared row, in the accumulator's order
        if args.save_logits:
            out_mm = np.lib.format.open_memmap(args.save_logits, mode="w+", dtype=np.float32, shape=(n, n_vocab))
        if args.reference_logits:
            ref = np.load(args.reference_logits, mmap_mode="r")
            if ref.shape != (n, n_vocab):
                raise RunnerError(f"reference logits {ref.shape} do not match {n} tokens x {n_vocab} vocabulary")

        B = args.n_batch
        b = max(1, B // n_seq)  # positions of each sequence per batch
        batch = llama_cpp.llama_batch_init(max(B, n_seq), 0, 1)
        t_decode = t_compare = 0.0
        emit("STAGE", "decoding")
        emit("PROGRESS", f"0 {n}")
        for s in range(0, seq_len, b):
            e = min(seq_len, s + b)
            w = e - s
            m = w*n_seq
            batch.n_tokens = m
            for k in range(n_seq):
                for i in range(w):
                    j = k*w + i
                    batch.token[j] = int(tokens[k*seq_len + s + i])
                    batch.pos[j] = s + i
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = k
                    batch.logits[j] = 1
            t1 = time.perf_counter()
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                raise RunnerError(f"llama_decode failed with status {rc} at positions {s}..{e - 1}"
                                  + (f" of {n_seq} sequences" if n_seq > 1 else ""))
            ptr = llama_cpp.llama_get_logits(ctx)
            if not ptr:
                raise RunnerError("llama_get_logits returned NULL")
            rows = np.ctypeslib.as_array(ptr, shape=(m, n_vocab))
            t2 = time.perf_counter()
            t_decode += t2 - t1
            for k in range(n_seq):
                g0, g1 = k*seq_len + s, k*seq_len + e  # logit rows of sequence k at positions s..e-1
                part = rows[k*w:(k + 1)*w]
                if out_mm is not None:
                    out_mm[g0:g1] = part
                if ref is not None:
                    r = np.asarray(ref[g0:g1])
                    c = np.array(part, copy=True)
                    acc.add(r, c, start=g0)
                    d = np.abs(r.astype(np.float64) - c.astype(np.float64))
                    max_abs = max(max_abs, float(np.nanmax(d)) if np.isfinite(d).any() else float("inf"))
                    same = (r.view(np.uint32) == c.view(np.uint32)).all(axis=-1)
                    bitwise_flags.append(same)
                    bitwise_rows += int(same.sum())
            t_compare += time.perf_counter() - t2
            emit("PROGRESS", f"{e*n_seq} {n}")
        if out_mm is not None:
            out_mm.flush()
            del out_mm
        cpu_part_runs = _cpu_part_runs(ext, ctx) if residency else None
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)

    result = {
        "mode": "candidate" if ref is not None else "reference",
        **info,
        "context_via": via,
        "plan": plan,
        "residency": residency,
        "cpu_part_runs": cpu_part_runs,
        "n_tokens": n,
        "n_seq": n_seq,
        "n_vocab": n_vocab,
        "n_ctx": n_ctx,
        "n_batch": args.n_batch,
        "n_ubatch": args.n_ubatch or args.n_batch,
        "threads": args.threads,
        "type_k": args.ctk,
        "type_v": args.ctv,
        "timings": {"load_s": round(t_load, 3), "decode_s": round(t_decode, 3),
                    "tokens_per_s": round(n / t_decode, 1) if t_decode > 0 else None,
                    "compare_s" if ref is not None else "save_s": round(t_compare, 3),
                    "total_s": round(time.perf_counter() - t0, 3)},
    }
    if ref is not None:
        emit("STAGE", "comparing: the summary over every position")  # seconds on a long text: not silent
        summary = acc.summary(real_margin_nats=args.real_margin_nats)
        summary["max_abs_logit_diff"] = metrics._f(max_abs)
        summary["bitwise_equal_rows"] = bitwise_rows
        summary["bitwise_identical"] = bitwise_rows == n
        result["summary"] = summary
        if args.positions_out:
            emit("STAGE", "writing the per-position metrics")
            pos, m = acc.metrics()
            np.savez_compressed(args.positions_out, pos=pos, tv=m.tv, kl=m.kl, top1_ref=m.top1_ref, top1_cand=m.top1_cand,
                                margin=m.margin, topk_agree=m.topk_agree, nonfinite=m.nonfinite,
                                bitwise=np.concatenate(bitwise_flags) if bitwise_flags else np.zeros(0, dtype=bool))
    if args.save_logits:
        result["logits"] = str(Path(args.save_logits).resolve())
    return result


def _cpu_part_runs(ext, ctx) -> int | None:
    """The hybrid tail's CPU parts that ran in this process (the proof that the path ran; None: a library without it)."""
    try:
        st = ext.stats(ctx) if ext is not None else None
    except Exception:
        return None
    return st.get("cpu_part_runs") if isinstance(st, dict) else None


def _context_refused(ext, residency: dict | None) -> RunnerError:
    """The library's own reason when it gave one (last_error), else where to look for it."""
    what = "llama.cpp could not create the context" + (" with these residency parameters" if residency else "")
    reason = None
    if ext is not None and getattr(ext, "has_planner", False):
        from rollingkv_cli.lib.llama_ext import refusal_reason

        reason = refusal_reason(ext.last_error())
    if reason:
        return RunnerError(f"{what}: {reason}")
    return RunnerError(what, "see the llama.cpp log for why (e.g. an impossible window or an unsupported tail type)")


def _init_context(llama_cpp, ext, model, cp, residency: dict | None):
    """(ctx, plan, how): through the residency API when asked for and present; mode off works without it."""
    if residency is None:
        return llama_cpp.llama_init_from_model(model, cp), None, "llama_init_from_model"
    mode = residency.get("mode", "auto")
    if ext is not None and ext.has_residency:
        from rollingkv_cli.console import RollingKVError

        try:
            rkv = ext.make_params(**residency)
        except RollingKVError as e:
            raise RunnerError(e.message, e.hint) from None
        except TypeError as e:
            raise RunnerError(f"bad residency parameters {residency}: {e}") from None
        ctx = ext.init_context(model, cp, rkv)
        plan = None
        if ctx:
            try:
                plan = ext.plan(ctx)
            except Exception as e:  # a plan we cannot read must not hide the logits
                plan = {"error": f"plan unavailable: {e}"}
        return ctx, plan, "llama_init_from_model_rolling_kv"
    if mode == "off":
        plan = {"mode_requested": "off", "mode": "off", "via": "llama_init_from_model",
                "reason": "the library has no KV residency API; mode off is the plain upstream context"}
        return llama_cpp.llama_init_from_model(model, cp), plan, "llama_init_from_model"
    raise RunnerError("this build has no KV residency API; rebuild", "run `rollingkv build` with a patch series that implements llama_init_from_model_rolling_kv")


# ------------------------------------------------------------------ entry point

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rollingkv_cli.gate.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", required=True)
    ap.add_argument("--model", required=True)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tokenize", metavar="FILE", help="tokenize this text file (with BOS when the model adds one)")
    src.add_argument("--synthetic", type=int, metavar="N", help="tokenize N tokens of built-in deterministic text")
    src.add_argument("--tokens", metavar="FILE.npy", help="decode these token ids (int32 .npy)")
    ap.add_argument("--tokens-out", metavar="FILE.npy")
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--n-ubatch", type=int, default=0)
    ap.add_argument("--n-seq", type=int, default=1, help="decode the tokens as N sequences side by side (one unified KV cache)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-gpu-layers", type=int, default=None)
    ap.add_argument("-ctk", "--cache-type-k", dest="ctk", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", dest="ctv", default="f16")
    ap.add_argument("--residency", metavar="JSON", help='llama_rolling_kv_params as JSON, e.g. {"mode": "window", "window_cells": 256}')
    ap.add_argument("--save-logits", metavar="OUT.npy", help="reference run: save all logits here")
    ap.add_argument("--reference-logits", metavar="REF.npy", help="candidate run: compare against these (with --save-logits too: a baseline that is compared and saved)")
    ap.add_argument("--out", metavar="OUT.json", help="the JSON result")
    ap.add_argument("--positions-out", metavar="OUT.npz", help="candidate run: per-position metrics")
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--real-margin-nats", type=float, default=0.5)
    a = ap.parse_args(argv)
    if a.tokenize is None and a.synthetic is None and a.tokens is None:
        ap.error("one of --tokenize, --synthetic, --tokens is required")
    if a.tokens is None:
        if not a.tokens_out:
            ap.error("--tokenize/--synthetic need --tokens-out")
    else:
        if a.ctx is None:
            ap.error("--tokens needs --ctx")
        if not (a.save_logits or a.reference_logits):
            ap.error("--tokens needs --save-logits or --reference-logits")
        if a.n_batch < 1 or a.ctx < 1 or a.threads < 1 or a.n_seq < 1:
            ap.error("--ctx, --n-batch, --n-seq and --threads must be positive")
    if a.synthetic is not None and a.synthetic < 1:
        ap.error("--synthetic must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = logits(args) if args.tokens is not None else tokenize(args)
    except RunnerError as e:
        emit("ERROR", json.dumps({"message": e.message, "hint": e.hint}))
        return 1
    text = json.dumps(result, indent=2, allow_nan=False, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
        emit("RESULT", str(Path(args.out).resolve()))
    else:
        emit("RESULT", "-")
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
