"""Options and value checks the gate subcommands share."""

from __future__ import annotations

from pathlib import Path

import click

from rollingkv_cli.cliopts import NonEmptyPath
from rollingkv_cli.gate.common import CACHE_TYPES, TAIL_CHOICES


def positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be at least 1")
    return value


def non_negative(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter("must be at least 0")
    return value


def fraction_list(ctx, param, value):
    """'0.25,0.5' or several uses of the option -> a tuple of fractions in (0, 1)."""
    if value is None:
        return None
    items = value if isinstance(value, (tuple, list)) else (value,)
    out = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                f = float(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a number") from None
            if not 0 < f < 1:
                raise click.BadParameter(f"{part} is not a fraction strictly between 0 and 1")
            out.append(f)
    if not out and items:
        raise click.BadParameter("give at least one fraction")
    return tuple(out) or None


def type_list(ctx, param, value, allowed: list[str] = CACHE_TYPES):
    if value is None:
        return None
    out = [t.strip() for t in value.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)}: not a cache type ({', '.join(allowed)})")
    if not out:
        raise click.BadParameter("give at least one type")
    return tuple(dict.fromkeys(out))


def tail_type_list(ctx, param, value):
    """A comma list of tail types, auto among them."""
    return type_list(ctx, param, value, TAIL_CHOICES)


def tail_cpu_frac(ctx, param, value):
    """--kv-tail-cpu-frac: auto or a share of the tail from 0 to 1, checked by serve's validator (one rule for every command)."""
    if value is None:
        return None
    from rollingkv_cli.serve.settings import SettingError, check_setting

    try:
        return check_setting("kv_tail_cpu_frac", value, from_text=True)
    except SettingError as e:
        raise click.BadParameter(str(e)) from None


def build_options(f):
    f = click.option("--lib-dir", type=NonEmptyPath(path_type=Path), default=None, metavar="DIR",
                     help="Run the libllama.so and llama-server in DIR (llama.cpp's build/bin of this series) instead of the active build.")(f)
    f = click.option("--build", "build_dir", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
                     metavar="DIR",
                     help="Run this `rollingkv build` directory (what `rollingkv build --print-dir` prints) instead of the active build.")(f)
    return f


def ngl_option(default=None, help_default="the library's default"):
    return click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, callback=non_negative, default=default,
                        help=f"Layers to offload to the GPU (0: none).  [default: {help_default}]")


def cache_type_options(f):
    f = click.option("-ctvt", "--cache-type-v-tail", "ctvt", type=click.Choice(TAIL_CHOICES), default=None,
                     help="Type of V in the host tail (auto: the planner's when the cache spills). Default: -ctv.")(f)
    f = click.option("-ctkt", "--cache-type-k-tail", "ctkt", type=click.Choice(TAIL_CHOICES), default=None,
                     help="Type of K in the host tail (auto: the planner's when the cache spills, lossy). Default: -ctk.")(f)
    f = click.option("-ctv", "--cache-type-v", "ctv", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of V (the window's, and the reference's).")(f)
    f = click.option("-ctk", "--cache-type-k", "ctk", type=click.Choice(CACHE_TYPES), default="f16", show_default=True, help="Type of K (the window's, and the reference's).")(f)
    return f

