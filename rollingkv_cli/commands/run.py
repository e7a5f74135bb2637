"""`rollingkv run`: answer one prompt with a model through llama_cpp's ctypes bindings on our library."""

from __future__ import annotations

import click


@click.command()
@click.argument("model_spec", metavar="MODEL")
@click.option("-p", "--prompt", required=True, help="The user message.")
@click.option("-n", "--max-tokens", type=click.IntRange(1, 65536), default=64, show_default=True)
@click.option("-c", "--ctx-size", type=click.IntRange(64, 1 << 22), default=2048, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's own log.")
def run(model_spec, prompt, max_tokens, ctx_size, seed, temperature, verbose) -> None:
    """Answer PROMPT with MODEL (a GGUF path or `demo`), using the active build."""
    from rollingkv_cli import llama_ext, models
    from rollingkv_cli.console import console

    path = models.resolve_model(model_spec, log=lambda m: console.print(f"[dim]{m}[/]"))
    llama_cpp, ext = llama_ext.load()
    with console.status(f"loading {path.name}"):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx_size, seed=seed, verbose=verbose, flash_attn=True)
    console.print(f"[dim]{ext.build_info()}[/]")
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=temperature, seed=seed,
    )
    click.echo(out["choices"][0]["message"]["content"].strip())
