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
