"""`rollingkv run`: answer one prompt with a model through llama_cpp's ctypes bindings on our library.

Only the answer goes to stdout (`rollingkv run ... > answer.txt`); the banner, progress and timings go to stderr.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath


def _temperature(ctx, param, value: float) -> float:
    import math

    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"must be a finite number of at least 0 (0 = greedy), not {value:g}")
    return value


@click.command(short_help="Answer one prompt with MODEL on the active build.")
@click.argument("model_spec", metavar="MODEL")
@click.option("-p", "--prompt", help="The user message.")
@click.option("-f", "--prompt-file", type=NonEmptyPath(path_type=Path),
              help="Read the user message from a file (UTF-8 text).")
@click.option("-n", "--max-tokens", type=click.IntRange(1, 65536), default=64, show_default=True)
@click.option("-c", "--ctx-size", type=click.IntRange(64, 1 << 22), default=2048, show_default=True, help="Context size in tokens (llama.cpp rounds it up to a multiple of 256).")
@click.option("--seed", type=click.IntRange(0, 2**32 - 2), default=0, show_default=True,
              help="The sampler's seed, 0 to 4294967294 (llama.cpp's is 32 bits: a larger or negative one wrapped onto "
                   "another; 4294967295 means a random seed there).")
@click.option("--temperature", type=float, default=0.0, show_default=True, callback=_temperature, help="0 = greedy; at least 0.")
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's own log.")
def run(model_spec, prompt, prompt_file, max_tokens, ctx_size, seed, temperature, verbose) -> None:
    """Answer PROMPT with MODEL (a GGUF path or `demo`), using the active build."""
    from rollingkv_cli import models
    from rollingkv_cli.lib import child
    from rollingkv_cli.console import err_console

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give the message with -p/--prompt or -f/--prompt-file (one of them)")
    text = _prompt_text(prompt, prompt_file)
    from rollingkv_cli.userinput import check_native_knobs

    check_native_knobs()  # the library this loads reads them itself: refused here, not ignored or clamped there
    if model_spec == "demo":  # no build: said before the demo model is downloaded (94 MiB for nothing)
        from rollingkv_cli.lib import builder

        builder.active_build(required=True)
    path = models.resolve_model(model_spec, log=lambda m: err_console.print(m, style="dim", markup=False, soft_wrap=True))
    child.run_isolated(lambda: _answer(path, model_spec, text, max_tokens, ctx_size, seed, temperature, verbose),
                       f"running {model_spec}", verbose)


def _prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """The message as text, checked before anything is tokenized: strict UTF-8 (llama_cpp encodes it as UTF-8 and
    failed with a traceback on anything else) and no NUL (binary data, not a message)."""
    from rollingkv_cli.console import abort

    if prompt_file is not None:
        from rollingkv_cli import userinput

        what = f"prompt file {prompt_file}"
        text = userinput.read_text(prompt_file, "prompt file")
    else:
        what = "--prompt"
        text = prompt
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes from argv arrive as surrogates
            abort(f"--prompt is not UTF-8 text (character {e.start})", "pass UTF-8 text (check the terminal's locale), or use --prompt-file")
    if not text.strip():
        raise click.UsageError(f"{what} is empty: give the message to answer" if prompt_file is None
                               else f"{what} is empty (or only blanks): give the message to answer")
    if "\0" in text:
        abort(f"{what} holds a NUL byte at character {text.index(chr(0))}: not text", "give a text file, not a binary one")
    return text


def _template_failed(e: BaseException) -> bool:
    """Whether e came out of the model's Jinja chat template (a jinja2 error, or an exception the template raised:
    llama_cpp's raise_exception() is a ValueError, raised in a frame of the compiled template)."""
    import traceback

    from jinja2 import TemplateError

    return isinstance(e, TemplateError) or any(f.filename == "<template>" for f in traceback.extract_tb(e.__traceback__))


def _answer(path: Path, name: str, text: str, max_tokens: int, ctx_size: int, seed: int, temperature: float, verbose: bool) -> None:
    """In run_isolated's child: load, answer, print the answer alone on stdout."""
    import time

    from rollingkv_cli.lib import llama_ext
    from rollingkv_cli.console import abort, err_console, esc

    llama_cpp, ext = llama_ext.load()
    err_console.print(ext.build_info(), style="dim", markup=False, soft_wrap=True)
    with err_console.status(f"loading {esc(path.name)}"):
        llm = llama_ext.open_model(llama_cpp, path, name, n_ctx=ctx_size, seed=seed, verbose=verbose, flash_attn=True)
    t0 = time.monotonic()
    # the line a caller (tests/test_bad_input_run_model_build.py) waits for: from here on llama.cpp decodes
    err_console.print(f"generating (at most {max_tokens} tokens)", style="dim", markup=False, soft_wrap=True)
    try:
        out = llm.create_chat_completion(
            messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=temperature, seed=seed,
        )
    except Exception as e:
        if _template_failed(e):  # "internal error: ValueError: System role not supported" before
            abort(f"the chat template of {name} (tokenizer.chat_template) fails on this message: {str(e)[:200]}",
                  "the file's template is broken or expects other messages: fix its tokenizer.chat_template, or use "
                  "`rollingkv serve` with -- --chat-template chatml")
        m = re.search(r"Requested tokens \((\d+)\) exceed context window of (\d+)", str(e)) if isinstance(e, ValueError) else None
        if m is None:
            raise
        padded = f", -c {ctx_size} rounded up to a multiple of {llama_ext.CTX_PAD}" if int(m[2]) != ctx_size else ""
        abort(f"the prompt is {m[1]} tokens with the chat template and does not fit the context of {m[2]} tokens{padded}",
              "raise -c/--ctx-size or shorten the prompt")
    click.echo(out["choices"][0]["message"]["content"].strip())
    usage = out.get("usage") or {}
    stopped = (f"; stopped at -n {max_tokens} (the answer may be cut: raise -n/--max-tokens)"
               if out["choices"][0].get("finish_reason") == "length" else "")
    err_console.print(f"{usage.get('prompt_tokens', '?')} prompt + {usage.get('completion_tokens', '?')} generated tokens "
                      f"in {time.monotonic() - t0:.1f} s{stopped}", style="dim", markup=False, soft_wrap=True)
