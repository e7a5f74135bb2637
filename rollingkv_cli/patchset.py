"""The patch series: whole new files under native/, small hook patches under patches/.

Rules (ollama's llama/ workflow, adapted):
- a file that does not exist upstream is *native*: it lives whole under native/ at its tree path;
- a change to an upstream file is a *hook*: it lives in a numbered git patch under patches/;
- applying is idempotent (a patch whose reverse applies is already in) and refuses foreign changes;
- patches/ is never edited by hand: `rollingkv patches checkout DIR`, commit, `rollingkv patches export DIR`.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollingkv_cli import paths
from rollingkv_cli.console import abort
from rollingkv_cli.upstream import PIN

BASE_TAG = "rollingkv-base"
NATIVE_TAG = "rollingkv-native"
SYNC_STAMP = "rollingkv-native-synced.json"  # in the checkout's .git: native/ as of the last checkout or export
# Fixed identities and dates make checkout -> export reproducible byte for byte.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "rollingkv",
    "GIT_AUTHOR_EMAIL": "dev@rollingkv.invalid",
    "GIT_COMMITTER_NAME": "rollingkv",
    "GIT_COMMITTER_EMAIL": "dev@rollingkv.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}
REGENERATE_HINT = (
    "regenerate the series against the pin: `rollingkv patches checkout DIR`, fix the failing commit there, "
    "then `rollingkv patches export DIR`"
)


@dataclass(frozen=True)
class Series:
    patches: tuple[Path, ...]
    native_files: tuple[str, ...]  # paths relative to the tree (and to native/)
    patches_dir: Path
    native_dir: Path

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for p in self.patches:
            h.update(b"P" + p.name.encode() + b"\0" + p.read_bytes())
        for rel in self.native_files:
            h.update(b"N" + rel.encode() + b"\0" + (self.native_dir / rel).read_bytes())
        return h.hexdigest()

    def patch_hashes(self) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in self.patches}


def load_series(patches_dir: Path | None = None, native_dir: Path | None = None) -> Series:
    patches_dir = patches_dir or paths.data_dir("patches")
    native_dir = native_dir or paths.data_dir("native")
    patches = tuple(sorted(patches_dir.glob("*.patch"))) if patches_dir.is_dir() else ()
    native: list[str] = []
    if native_dir.is_dir():
        for root, _dirs, files in os.walk(native_dir):
            for f in files:
                native.append(str((Path(root) / f).relative_to(native_dir)))
    return Series(patches, tuple(sorted(native)), patches_dir, native_dir)


def _git(args: list[str], cwd: Path, check: bool = True, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(_GIT_ENV)
    # Never let git discover a repository above the tree (the tree may live inside a checkout of ours).
    env["GIT_CEILING_DIRECTORIES"] = str(cwd.resolve().parent)
    if env_extra:
        env.update(env_extra)
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    except FileNotFoundError:
        abort("git is not installed", "install git (it applies and exports the patch series)")
    if check and proc.returncode != 0:
        abort(f"git {' '.join(args[:3])} failed in {cwd}: {_first_line(proc.stderr or proc.stdout)}")
    return proc


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return "(no output)"


def apply_series(tree: Path, series: Series | None = None, log=print) -> list[str]:
    """Copy native files and apply hook patches to `tree`. Returns what was done; a second call does nothing."""
    series = series or load_series()
    done: list[str] = []
    for rel in series.native_files:
        src, dst = series.native_dir / rel, tree / rel
        if dst.exists():
            if filecmp.cmp(src, dst, shallow=False):
                continue
            abort(
                f"{rel} in {tree} differs from native/{rel}: the tree has foreign changes",
                "start from a pristine tree at the pin (rollingkv build does) or " + REGENERATE_HINT,
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        done.append(f"native {rel}")
    if not series.patches:
        return done
    if _series_applies(tree, series, reverse=True) is None:
        return done  # the whole series is in already
    failing = _series_applies(tree, series, reverse=False)
    if failing is not None:
        patch, err = failing
        abort(f"patch {patch.name} does not apply to {tree}: {err}", REGENERATE_HINT)
    for patch in series.patches:
        _git(["apply", "--whitespace=nowarn", str(patch)], tree)
        done.append(f"patch {patch.name}")
        log(f"applied {patch.name}")
    return done


def _series_applies(tree: Path, series: Series, reverse: bool) -> tuple[Path, str] | None:
    """Dry run of the whole series (or its reversal, last patch first) on a scratch copy of the files it
    touches. Patches that touch the same file only apply in order, so they are checked in order.
    Returns None when every step applies, else (the first failing patch, git's reason)."""
    import tempfile

    touched = sorted({f for p in series.patches for f in describe_patch(p)[2]})
    with tempfile.TemporaryDirectory(prefix="rkv-apply-") as tmp:
        scratch = Path(tmp) / "tree"
        for rel in touched:
            if (tree / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / rel, scratch / rel)
        scratch.mkdir(exist_ok=True)
        order = list(reversed(series.patches)) if reverse else list(series.patches)
        for patch in order:
            args = ["apply", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + [str(patch)]
            proc = _git(args, scratch, check=False)
            if proc.returncode != 0:
                return patch, _first_line(proc.stderr)
    return None


def checkout(dest: Path, pristine: Path, series: Series | None = None) -> None:
    """A git work tree at the pin: base commit, native commit, then one commit per patch."""
    series = series or load_series()
    if dest.exists() and any(dest.iterdir()):
        abort(f"{dest} exists and is not empty", "choose a new directory")
    shutil.copytree(pristine, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".rollingkv-*"))
    _git(["init", "-q", "-b", "rollingkv"], dest)
    _git(["config", "core.autocrlf", "false"], dest)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "-m", f"llama.cpp {PIN.llama_cpp_commit}\n\nVendored in {PIN.bindings_package} {PIN.bindings_version}."], dest)
    _git(["tag", BASE_TAG], dest)
    for rel in series.native_files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(series.native_dir / rel, dest / rel)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "--allow-empty", "-m", "rollingkv native sources\n\nWhole new files; exported to native/, never to patches/."], dest)
    _git(["tag", NATIVE_TAG], dest)
    _write_sync_stamp(dest, series.native_dir)
    for patch in series.patches:
        proc = _git(["am", "-q", "--keep-cr", "--committer-date-is-author-date", str(patch)], dest, check=False)
        if proc.returncode != 0:
            _git(["am", "--abort"], dest, check=False)
            abort(f"patch {patch.name} does not apply at the pin: {_first_line(proc.stderr or proc.stdout)}", REGENERATE_HINT)


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _native_hashes(native_dir: Path) -> dict[str, str]:
    if not native_dir.is_dir():
        return {}
    return {str(f.relative_to(native_dir)): _file_hash(f) for f in native_dir.rglob("*") if f.is_file()}


def _write_sync_stamp(checkout_dir: Path, native_dir: Path) -> None:
    import json

    (checkout_dir / ".git" / SYNC_STAMP).write_text(json.dumps(_native_hashes(native_dir), indent=0, sort_keys=True) + "\n")


def native_conflicts(src: Path, native_dir: Path) -> list[str]:
    """Files of native_dir changed since the checkout src last synced with it (checkout or export) that the
    checkout does not hold as they are: exporting would overwrite or delete them (someone edited native/
    directly, in parallel with the checkout)."""
    import json

    stamp = src / ".git" / SYNC_STAMP
    if not stamp.is_file():
        return []  # a checkout from before the stamp: nothing to compare with
    try:
        synced = json.loads(stamp.read_text())
    except json.JSONDecodeError:
        return []
    conflicts = []
    for rel, h in sorted(_native_hashes(native_dir).items()):
        if synced.get(rel) == h:
            continue  # unchanged since the last sync: the checkout's version wins
        if (src / rel).is_file() and _file_hash(src / rel) == h:
            continue  # the checkout already has it
        conflicts.append(rel)
    return conflicts


def export(src: Path, series_dirs: tuple[Path, Path] | None = None, force: bool = False) -> list[Path]:
    """Regenerate patches/ (and native/) from a checkout made by `checkout`."""
    patches_dir, native_dir = series_dirs or (paths.data_dir("patches"), paths.data_dir("native"))
    for tag in (BASE_TAG, NATIVE_TAG):
        if _git(["rev-parse", "-q", "--verify", f"refs/tags/{tag}"], src, check=False).returncode != 0:
            abort(f"{src} is not a rollingkv patch checkout (tag {tag} missing)", "make one with `rollingkv patches checkout DIR`")
    if _git(["status", "--porcelain"], src).stdout.strip():
        abort(f"{src} has uncommitted changes", "commit them (one commit per hook, message saying why) and export again")
    conflicts = [] if force else native_conflicts(src, native_dir)
    if conflicts:
        shown = ", ".join(f"native/{c}" for c in conflicts[:6]) + (f" and {len(conflicts) - 6} more" if len(conflicts) > 6 else "")
        abort(f"{shown} changed since {src} last synced with native/; exporting would overwrite it",
              f"copy those files into {src} and commit them there (or export with --force to discard them)")
    added = _git(["diff", "--name-only", "--diff-filter=A", BASE_TAG, "HEAD"], src).stdout.split()
    modified = _git(["diff", "--name-only", "--diff-filter=MDR", BASE_TAG, "HEAD"], src).stdout.split()
    # native/: exactly the files that do not exist upstream
    if native_dir.exists():
        shutil.rmtree(native_dir)
    for rel in added:
        (native_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, native_dir / rel)
    for old in patches_dir.glob("*.patch"):
        old.unlink()
    patches_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if modified:
        out = _git(
            ["format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index",
             "-o", str(patches_dir), f"{NATIVE_TAG}..HEAD", "--", *modified],
            src,
        ).stdout
        written = [Path(line) for line in out.split() if line.endswith(".patch")]
    write_index(load_series(patches_dir, native_dir))
    _write_sync_stamp(src, native_dir)
    return sorted(written)


_SUBJECT = re.compile(r"^Subject: \[PATCH\] (.*)$", re.M)


def describe_patch(patch: Path) -> tuple[str, str, list[str]]:
    """(subject, why: first body paragraph, files touched)"""
    text = patch.read_text()
    head, _, rest = text.partition("\n---\n")
    m = _SUBJECT.search(head)
    subject = m.group(1).strip() if m else patch.stem
    body = head[m.end():].strip() if m else ""
    why = " ".join(body.split("\n\n")[0].split()) if body else ""
    files = re.findall(r"^diff --git a/(\S+) b/", rest, re.M)
    return subject, why, files


def write_index(series: Series) -> Path:
    lines = [
        "# The patch series",
        "",
        f"Against llama.cpp `{PIN.llama_cpp_commit}` (vendored in {PIN.bindings_package} {PIN.bindings_version}; the pin lives in `rollingkv_cli/upstream.py`).",
        "Generated by `rollingkv patches export`: do not edit this file or the patches by hand.",
        "",
        "Whole new source files live under `native/` at their tree paths and are copied in before the patches apply;",
        "the patches below only add hooks to upstream files.",
        "",
        "| patch | purpose | files touched |",
        "| --- | --- | --- |",
    ]
    for p in series.patches:
        subject, why, files = describe_patch(p)
        purpose = subject + (f": {why}" if why else "")
        lines.append(f"| `{p.name}` | {purpose.replace('|', '/')} | {', '.join(f'`{f}`' for f in files)} |")
    lines += ["", "## Native files", ""]
    lines += [f"- `native/{rel}`" for rel in series.native_files] or ["(none)"]
    index = series.patches_dir / "README.md"
    index.write_text("\n".join(lines) + "\n")
    return index
