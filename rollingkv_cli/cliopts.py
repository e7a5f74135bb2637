"""click pieces every command family shares: one spelling per thing across commands (MODEL as the first argument,
-c/--ctx-size, --kv-window-cells, ...), with the older spellings still taken but left out of --help."""

from __future__ import annotations

import functools

import click

from rollingkv_cli.lib.limits import MAX_THREADS, MAX_THREADS_WHY


def threads_in_range(ctx, param, value):
    """A click callback: None, or a thread count from 1 to MAX_THREADS."""
    if value is not None and not 1 <= value <= MAX_THREADS:
        raise click.BadParameter(f"must be from 1 to {MAX_THREADS} ({MAX_THREADS_WHY}), not {value}")
    return value


class NonEmptyPath(click.Path):
    """click.Path that refuses an empty or blank value (an unset shell variable): Path('') is the current directory, so
    `gate needle --json ''` said "cannot write report .: it is a directory", `gate matrix --out ''` wrote its reports
    into ./ and `gate equiv --work-dir ''` worked there. Every path option and argument takes this type; one for a file
    also refuses a path that ends in `/`."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            what = "a file" if not self.dir_okay else "a directory" if not self.file_okay else "a file or a directory"
            self.fail(f"an empty path (an unset shell variable?): give the path of {what}", param, ctx)
        if isinstance(value, str) and not self.dir_okay and value.endswith(("/", "/.")):
            # Path('out/') is Path('out'): `gate needle --json out/` wrote the report as a file named out
            self.fail(f"{value} names a directory: give the path of a file (in it, or beside it)", param, ctx)
        return super().convert(value, param, ctx)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan and inf, which pass its bounds (a comparison with nan is false): `bench load
    --arrival-mean inf` ended in "internal error: ZeroDivisionError", `--arrival-mean nan` scheduled arrivals "at nans",
    `--time-budget nan` meant no budget at all."""

    def convert(self, value, param, ctx):
        import math

        if not math.isfinite(click.FLOAT.convert(value, param, ctx)):  # before the bounds: they would name inf
            self.fail(f"must be a finite number of seconds, not {value}", param, ctx)
        return super().convert(value, param, ctx)


AFTER_DASHES = "rollingkv.after_dashes"  # ctx.meta: the raw arguments after the first `--` (PassThroughCommand)
MODEL_AFTER_DASHES = "rollingkv.model_after_dashes"  # ctx.meta: no MODEL came before that `--`


class PassThroughCommand(click.Command):
    """A command whose first argument is MODEL and whose last (nargs=-1) takes a child's own arguments after `--` (serve,
    bench load). click hands every positional word to those two in turn, before `--` or after it: `serve demo foo`
    passed `foo` to llama-server, and `serve --config c.yaml -- -t 2` took `-t` as MODEL (over the file's model) and
    passed only `2`. So the raw arguments after the first `--` are kept in ctx.meta, with whether a MODEL came before
    it (the words before `--` parsed alone, nothing converted or called), for pass_through."""

    def parse_args(self, ctx, args):
        ctx.meta[AFTER_DASHES] = list(args[args.index("--") + 1:]) if "--" in args else []
        ctx.meta[MODEL_AFTER_DASHES] = "--" in args and self._no_model_before(ctx, list(args[:args.index("--")]))
        return super().parse_args(ctx, args)

    def _no_model_before(self, ctx, before: list[str]) -> bool:
        try:
            opts, _, _ = self.make_parser(ctx).parse_args(args=before)
        except click.ClickException:  # `--host --`: that `--` is an option's value; the real parse says what is wrong
            return False
        return not isinstance(opts.get("model_spec"), str)


def pass_through(ctx: click.Context, value, usage: str, child: str = "llama-server") -> list[str]:
    """The pass-through argument's value as the child's arguments: those after `--`. A word before `--` that is not MODEL
    (`serve demo foo`) is a click.UsageError (exit 2). When no MODEL came before `--`, the first word after it, which
    click took as MODEL, goes back to the child, and MODEL is what it would have been without it (the config file's
    model, else None: the command's own "no MODEL" error). usage: the command's form, `rollingkv serve MODEL [options]`."""
    import shlex

    after = ctx.meta.get(AFTER_DASHES, [])
    value = list(value)
    if ctx.meta.get(MODEL_AFTER_DASHES):
        param = next(p for p in ctx.command.params if p.name == "model_spec")
        default = ctx.lookup_default("model_spec")
        if default is None and param.required:
            raise click.UsageError(f"Missing argument 'MODEL': give it before `--` ({usage} -- {shlex.join(after)})", ctx)
        if default is not None:
            ctx.set_parameter_source("model_spec", click.core.ParameterSource.DEFAULT_MAP)
            default = param.type_cast_value(ctx, default)
        ctx.params["model_spec"] = default
        return after
    if len(value) >= len(after) and value[len(value) - len(after):] == after:
        stray = value[:len(value) - len(after)]
    else:  # `--` was an option's value (`--host --`), not the end of the options: its own check says what is wrong
        stray = []
    if stray:
        word = "argument" if len(stray) == 1 else "arguments"
        raise click.UsageError(f"unexpected {word} {shlex.join(stray)} after MODEL: {child}'s own arguments go after `--` "
                               f"({usage} -- {shlex.join(stray + after)})", ctx)
    return value


class HiddenAliasOption(click.Option):
    """An option whose old spellings (hidden_aliases) still work, shown neither in --help nor in its error messages."""

    def __init__(self, *decls, hidden_aliases: tuple[str, ...] = (), **kw):
        super().__init__(*decls, **kw)
        self.hidden_aliases = tuple(hidden_aliases)

    def _shown(self, method, ctx):
        opts = self.opts
        self.opts = [o for o in opts if o not in self.hidden_aliases]
        try:
            return method(ctx)
        finally:
            self.opts = opts

    def get_help_record(self, ctx):
        return self._shown(super().get_help_record, ctx)

    def get_error_hint(self, ctx):
        return self._shown(super().get_error_hint, ctx)


def option(*decls, hidden_aliases: tuple[str, ...] = (), **kw):
    """click.option with old spellings that still work and are not shown."""
    return click.option(*decls, *hidden_aliases, cls=HiddenAliasOption, hidden_aliases=hidden_aliases, **kw)


def ctx_size_option(**kw):
    """-c/--ctx-size, as in run and serve (the gates' old --ctx still works)."""
    return option("-c", "--ctx-size", "n_ctx", hidden_aliases=("--ctx",), type=int, metavar="N", **kw)


def model_argument(default: str | None = None):
    """MODEL (a GGUF path or `demo`) as the first argument, as in run, serve and bench; the gates' old `--model PATH`
    still works (hidden). The command gets it as model_spec."""

    def decorate(f):
        @functools.wraps(f)
        def command(*args, model_spec=None, model_option=None, **kw):
            if model_spec is not None and model_option is not None and model_spec != model_option:
                raise click.UsageError(f"two models: MODEL {model_spec} and --model {model_option}: give one")
            chosen = model_spec or model_option or default
            if chosen is None:
                raise click.UsageError("Missing argument 'MODEL' (a GGUF path or `demo`).")
            return f(*args, model_spec=chosen, **kw)

        command = click.option("--model", "model_option", hidden=True, default=None)(command)
        return click.argument("model_spec", metavar="MODEL" if default is None else "[MODEL]", required=False)(command)

    return decorate
