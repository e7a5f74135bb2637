"""`rollingkv serve`: a supervised llama-server with the rolling-KV flags, a config file and live status."""

from __future__ import annotations

from pathlib import Path

import click

from rollingkv_cli.cliopts import PassThroughCommand
from rollingkv_cli.serve.settings import SETTINGS, SettingError, check_setting, config_value, load_config

CONFIG = "rollingkv.serve.config"  # ctx.meta: the --config file's path and its extra_args, once read
DefaultMap = click.core.ParameterSource.DEFAULT_MAP


def _config_source(ctx: click.Context) -> str:
    return f"config file {ctx.meta[CONFIG]['path']}"


class SettingType(click.ParamType):
    """A serve setting checked by the same Setting as the config file's key (settings.SETTINGS): one validator. A value
    from the command line is text; one from the config file (click's default_map: see _read_config) is YAML's, checked
    as such, and its error names the file and the key."""

    def __init__(self, key: str):
        self.key = key
        self.setting = SETTINGS.get(key)
        self.name = {"int": "integer", "float": "float", "choice": "choice", "str": "text", "bool": "boolean",
                     "fraction_or_auto": "fraction or auto", None: "text"}[self.setting.kind if self.setting else None]

    def get_metavar(self, param, ctx=None) -> str | None:
        if self.setting and self.setting.choices:
            return "[" + "|".join(self.setting.choices) + "]"
        if self.setting and self.setting.kind == "fraction_or_auto":
            return "F|auto"
        return None

    def convert(self, value, param, ctx):
        if ctx is not None and param is not None and ctx.get_parameter_source(param.name) == DefaultMap:
            return config_value(self.key, value, _config_source(ctx))
        if not isinstance(value, str) or self.setting is None:
            return value  # a default, or a value click already converted
        try:
            return check_setting(self.key, value, from_text=True)
        except SettingError as e:
            self.fail(str(e), param, ctx)


def _read_config(ctx: click.Context, param, path: str | None) -> Path | None:
    """--config (eager: read before any other parameter): the file's settings become the command's defaults (click's
    default_map), so that a flag given wins over the file's key, and a key left to the file is converted and checked by
    its parameter's type (SettingType). Its extra_args go to llama-server unless arguments follow `--` (_extra)."""
    if path is None or ctx.resilient_parsing:
        return path
    if not path.strip():  # Path('') is the current directory: "cannot read config file .: it is a directory"
        raise click.BadParameter("an empty path (an unset shell variable?): give the path of a YAML file", ctx, param)
    path = Path(path)
    config = load_config(path)
    ctx.meta[CONFIG] = {"path": path, "extra_args": config.pop("extra_args", None)}
    ctx.default_map = {**(ctx.default_map or {}), **{("model_spec" if k == "model" else k): v for k, v in config.items()}}
    return path


def _extra(ctx: click.Context, param, value: tuple[str, ...]) -> tuple[list[str], str]:
    """(llama-server's own arguments, where they came from): those after `--`, else the config file's extra_args (not
    through default_map: click would split a string there and refuse a non-list in its own words)."""
    from rollingkv_cli.cliopts import pass_through

    value = pass_through(ctx, value, "rollingkv serve MODEL [serve options]")
    if value or CONFIG not in ctx.meta:
        return list(value), "after `--`"
    source = _config_source(ctx)
    return config_value("extra_args", ctx.meta[CONFIG]["extra_args"] or [], source) or [], f"in {source}: extra_args"


def _setting(*decls: str, key: str, **kw):
    return click.option(*decls, type=SettingType(key), **kw)


class _ServeCommand(PassThroughCommand):
    """An option serve does not know is most often one of llama-server's (`serve demo -t 2`): the error says where it goes."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            if e.option_name in ("-m", "--model"):  # after `--` it would be refused too: the model is MODEL
                e.message = (f"{e.message.rstrip('.')}: the model is serve's MODEL argument "
                             f"(rollingkv serve MODEL [serve options], MODEL a GGUF path or `demo`)")
                e.possibilities = []  # not "Did you mean '--help'?"
            else:
                e.message = (f"{e.message.rstrip('.')}: llama-server's own options go after `--`, unchanged "
                             f"(rollingkv serve MODEL [serve options] -- {e.option_name} ...)")
            raise


@click.command(cls=_ServeCommand, context_settings={"ignore_unknown_options": False},
               short_help="llama-server (OpenAI API) with the KV split as needed.")
@click.argument("model_spec", metavar="MODEL", required=False, type=SettingType("model"))
@_setting("--kv-residency-mode", key="kv_residency_mode",
          help="KV residency: auto (default: a split only where the KV does not fit, by window unless the head split costs "
               "less), window, head (each layer's first KV heads on the device, the others in host memory), off.")
@_setting("--vram-target", key="vram_target", metavar="MiB", help="Device memory budget for weights + KV + buffers.")
@_setting("--kv-window-cells", key="kv_window_cells", metavar="N", help="Explicit window size in cells per sequence stream.")
@_setting("--kv-device-heads", key="kv_device_heads", metavar="N",
          help="Head split: KV heads of each layer kept on the device (more than a layer has: the whole layer); with auto it "
               "means head mode. Not with window or off mode, nor with --kv-window-cells.")
@_setting("-c", "--ctx-size", key="ctx_size", metavar="N", help="Context size (all slots together), at least 64.")
@_setting("-np", "--parallel", key="parallel", metavar="N", help="Number of slots (concurrent sequences), 1 to 256.")
@_setting("-ctk", "--cache-type-k", key="cache_type_k", help="K cache type (window).")
@_setting("-ctv", "--cache-type-v", key="cache_type_v", help="V cache type (window).")
@_setting("-ctkt", "--cache-type-k-tail", key="cache_type_k_tail",
          help="K cache type of the host tail (default: the window's); auto: the planner's when the cache spills (q8_0 under an "
               "f16/bf16/f32 window, q4_0 where the link would dominate; lossy, opt-in).")
@_setting("-ctvt", "--cache-type-v-tail", key="cache_type_v_tail", help="V cache type of the host tail (default: the window's; auto as -ctkt).")
@_setting("--pcie-bw-gbps", key="pcie_bw_gbps", metavar="GBPS", help="Host->device bandwidth to plan with (default: the probed profile).")
@_setting("--kv-tail-cpu-frac", key="kv_tail_cpu_frac",
          help="Share of each split layer's host tail attended on the CPU while the rest streams: auto (llama-server's "
               "default: from the link and CPU attention bandwidths, none where it would not pay), 0 (none) or up to 1 "
               "(the whole tail).")
@_setting("--kv-windows", key="kv_windows",
          help="The device window: elastic (llama-server's default) makes the slots' windows one pool that follows the "
               "load with -np; blocks (opt-in) moves the default unified cache's 256-cell blocks with the load; static "
               "keeps each window where it is.")
@_setting("--kv-placement", key="kv_placement",
          help="Where the default unified cache puts new tokens: sequences gives each slot's sequence 256-cell blocks of "
               "its own, so a split cache streams and moves only the blocks of the slots a batch reads; upstream takes "
               "the first free cells; auto (llama-server's default) is sequences for a window split.")
@_setting("--kv-share-prefix", key="kv_share_prefix", metavar="N",
          help="A new prompt that shares at least N tokens with a sequence another slot holds in the default unified "
               "cache (busy or idle) takes its cells instead of prefilling and storing them again (default 256; 0: off).")
@_setting("--host", key="host", help="Address to bind (default 127.0.0.1).")
@_setting("--port", key="port", metavar="PORT", help="Port (default 8080; 0 picks a free one).")
@click.option("--slot-save", "slot_save", is_flag=True, default=False, type=SettingType("slot_save"),
              help="Turn on llama-server's slot save/restore (--slot-save-path CACHE/slots). Off by default: with it ANY client "
                   "that reaches the server can write KV cache files (each as large as a slot's cache) into that folder and "
                   "read them back (POST /slots/N?action=save|restore); use it only with an API key or on loopback.")
@click.option("--config", "config_file", type=click.Path(), is_eager=True, callback=_read_config, expose_value=False,
              help="YAML file (JSON for a .json file) with the same keys as these flags (flags win).")
@click.option("--print-args", is_flag=True, help="Print the exact llama-server command line and exit.")
@click.option("-q", "--quiet", is_flag=True, help="No live status; only start-up and shutdown lines.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, callback=_extra)
@click.pass_context
def serve(ctx: click.Context, model_spec, print_args, quiet, extra, **flags) -> None:
    """Run the patched llama-server (OpenAI-compatible API) on MODEL (a GGUF path or `demo`).

    Arguments after `--` go to llama-server unchanged (one that contradicts serve's own, such as --port or
    -m, is refused), e.g. `-- -t 8 --api-key KEY`; a word before `--` other than MODEL is refused. A --host other than loopback without an API key is
    warned about. The server's output goes to a log file whose
    path is printed; Ctrl-C, SIGTERM or SIGHUP stop it (SIGTERM, then SIGKILL after 3 s: a request in flight
    holds it), and it never outlives this command.
    The config file's values are checked as the flags are: a bad value of either exits with status 2.
    """
    from rollingkv_cli.serve import launch, settings

    def where(key: str) -> str:  # a flag's name, or the config file's key it came from
        return f"{_config_source(ctx)}: {key}" if ctx.get_parameter_source(key) == DefaultMap else SETTINGS[key].flag

    extra_args, extra_where = extra
    s = settings.resolve_settings(model_spec, flags, {k: where(k) for k in flags}, extra_args, extra_where)
    launch.serve(s, print_args=print_args, quiet=quiet)
