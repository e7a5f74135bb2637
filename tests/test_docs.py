"""The docs keep up with the code.

- Every long option of every `rollingkv` command (the click tree, walked recursively) appears in the command's own
  section of docs/reference/cli.md: the text under a heading that names it (`rollingkv gate equiv` or `gate equiv`).
- Every environment variable the package or the native sources read (`ROLLINGKV_*`, `GGML_RKV_*`, `LLAMA_RKV_*` as
  string literals) appears in docs/reference/environment.md.
- Every relative link in README.md and docs/**/*.md points at a file that exists, and an anchor into a markdown
  file names one of its headings.

When a test here fails on a new option or variable, document it (its --help says what it does); do not loosen the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from rollingkv_cli.cli import rollingkv

REPO = Path(__file__).resolve().parent.parent
CLI_DOC = REPO / "docs" / "reference" / "cli.md"
ENV_DOC = REPO / "docs" / "reference" / "environment.md"
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    """(path, command) for the root and every command and group below it."""
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd, info_name=" ".join(("rollingkv",) + path))
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _commands(sub, path + (name,))


def _long_flags(cmd: click.Command) -> list[str]:
    flags = []
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            hidden = getattr(p, "hidden_aliases", ())  # old spellings that still work, not shown (cliopts.option)
            flags += [f for f in (*p.opts, *p.secondary_opts) if f.startswith("--") and f not in hidden]
    return flags


def _sections(text: str) -> list[tuple[int, str, str]]:
    """(level, heading, body up to the next heading of the same or a higher level) for every heading outside code."""
    lines = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines()
    raw = text.splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := _HEADING.match(line))]
    out = []
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(raw))
        out.append((level, title, "\n".join(raw[i:end])))
    return out


def _section_of(path: tuple[str, ...], sections) -> str:
    names = {f"`rollingkv {' '.join(path)}`", f"`{' '.join(path)}`"}
    return "\n".join(body for _, title, body in sections if any(n in title for n in names))


def _mentions(text: str, flag: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def test_the_command_walk_sees_the_whole_tree():
    paths = {p for p, _ in _commands(rollingkv)}
    assert {("gate", "equiv"), ("bench", "tail"), ("patches", "export"), ("model", "synth")} <= paths
    flags = {f for _, c in _commands(rollingkv) for f in _long_flags(c)}
    assert {"--version", "--order-floor", "--no-order-floor", "--kv-window-cells", "--print-dir"} <= flags


def test_every_command_has_a_section_in_the_cli_reference():
    sections = _sections(CLI_DOC.read_text(encoding="utf-8"))
    missing = [" ".join(p) for p, c in _commands(rollingkv)
               if p and not isinstance(c, click.Group) and not _section_of(p, sections)]
    assert not missing, f"no heading naming these commands in {CLI_DOC.relative_to(REPO)}: {missing}"


def test_every_long_option_is_in_its_commands_section_of_the_cli_reference():
    text = CLI_DOC.read_text(encoding="utf-8")
    sections = _sections(text)
    missing = []
    for path, cmd in _commands(rollingkv):
        where = _section_of(path, sections) if path else text
        missing += [f"rollingkv {' '.join(path)} {f}".replace("  ", " ") for f in _long_flags(cmd) if not _mentions(where, f)]
    assert not missing, (f"options not documented in their command's section of {CLI_DOC.relative_to(REPO)} "
                         f"(add each with what its --help says): {missing}")


def _env_names() -> set[str]:
    literal = re.compile(r"[\"']((?:ROLLINGKV|GGML_RKV|LLAMA_RKV)_[A-Z0-9_]+)[\"']")
    names = set()
    for root, pattern in ((REPO / "rollingkv_cli", "*.py"), (REPO / "native", "*")):
        for f in root.rglob(pattern):
            if f.is_file() and f.suffix not in (".pyc",):
                names |= set(literal.findall(f.read_text(encoding="utf-8", errors="replace")))
    return names


def test_every_environment_variable_is_in_the_environment_reference():
    names = _env_names()
    assert {"ROLLINGKV_CACHE_DIR", "ROLLINGKV_SLOTS"} <= names
    text = ENV_DOC.read_text(encoding="utf-8")
    missing = sorted(n for n in names if not _mentions(text, n))
    assert not missing, f"environment variables not in {ENV_DOC.relative_to(REPO)}: {missing}"


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title, _ in _sections(md.read_text(encoding="utf-8")):
        s = _slug(title)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_existing_files(md: Path):
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        if not dest.exists():
            broken.append(f"{target} (no {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"broken links in {md.relative_to(REPO)}: {broken}"


_OPTION_ROW = re.compile(r"^\|\s*`(--[\w-]+)[^|]*\|(.*)\|\s*$")
_DEFAULT = re.compile(r"\(default:? ([^()]*?)\)")


def test_the_defaults_in_the_option_tables_are_the_codes():
    """An option table row of docs/reference/cli.md that says "(default X)" for an option whose --help shows its default
    says the same X (the text before a ';' or ', '). issue 39: gate matrix's --tail-types was documented without the
    `auto` its default holds. Seen failing before the fix on that row (f16,q8_0,q4_0 against f16,q8_0,q4_0,auto)."""
    sections = _sections(CLI_DOC.read_text(encoding="utf-8"))
    wrong, checked = [], 0
    for path, cmd in _commands(rollingkv):
        params = {f: p for p in cmd.params if isinstance(p, click.Option) for f in p.opts if f.startswith("--")}
        for line in _section_of(path, sections).splitlines() if path else []:
            m = _OPTION_ROW.match(line)
            d = _DEFAULT.search(m.group(2)) if m else None
            p = params.get(m.group(1)) if m else None
            if d is None or p is None or not p.show_default or p.default is None or isinstance(p.default, bool):
                continue
            code = ",".join(map(str, p.default)) if isinstance(p.default, (tuple, list)) else str(p.default)
            doc = re.split(r";|, ", d.group(1))[0].strip().strip("`")
            checked += 1
            if doc != code:
                wrong.append(f"{' '.join(path)} {m.group(1)}: the doc says {doc}, the code {code}")
    assert checked >= 20, checked  # the rows this reads are there
    assert not wrong, "\n".join(wrong)
