"""`rollingkv serve`: a supervised llama-server with the rolling-KV flags, a config file and live status."""

from __future__ import annotations

from pathlib import Path

import click

from rollingkv_cli.serving import CACHE_TYPES, RESIDENCY_MODES


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("model_spec", metavar="MODEL", required=False)
@click.option("--kv-residency-mode", type=click.Choice(RESIDENCY_MODES), help="KV residency: auto (default), window, head, off.")
@click.option("--vram-target", type=click.IntRange(min=1), metavar="MiB", help="Device memory budget for weights + KV + buffers.")
@click.option("--kv-window-cells", type=click.IntRange(min=1), metavar="N", help="Explicit window size in cells per sequence stream.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=64), metavar="N", help="Context size (all slots together).")
@click.option("-np", "--parallel", type=click.IntRange(1, 256), metavar="N", help="Number of slots (concurrent sequences).")
@click.option("-ctk", "--cache-type-k", type=click.Choice(CACHE_TYPES), help="K cache type (window).")
@click.option("-ctv", "--cache-type-v", type=click.Choice(CACHE_TYPES), help="V cache type (window).")
@click.option("-ctkt", "--cache-type-k-tail", type=click.Choice(CACHE_TYPES), help="K cache type of the host tail (default: the window's).")
@click.option("-ctvt", "--cache-type-v-tail", type=click.Choice(CACHE_TYPES), help="V cache type of the host tail (default: the window's).")
@click.option("--pcie-bw-gbps", type=float, help="Host->device bandwidth to plan with (default: the probed profile).")
@click.option("--host", help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535), help="Port (default 8080; 0 picks a free one).")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML file with the same keys as these flags (flags win).")
@click.option("--print-args", is_flag=True, help="Print the exact llama-server command line and exit.")
@click.option("-q", "--quiet", is_flag=True, help="No live status; only start-up and shutdown lines.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def serve(ctx: click.Context, model_spec, config_file, print_args, quiet, extra, **flags) -> None:
    """Run the patched llama-server (OpenAI-compatible API) on MODEL (a GGUF path or `demo`).

    Arguments after `--` go to llama-server unchanged. The server's output goes to a log file whose
    path is printed; Ctrl-C or SIGTERM stop it gracefully.
    """
    from rollingkv_cli import serving

    explicit = {k for k in flags if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE}
    settings = serving.resolve_settings(model_spec, flags, explicit, config_file, list(extra))
    serving.serve(settings, print_args=print_args, quiet=quiet)
