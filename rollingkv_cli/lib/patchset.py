"""The patch series: whole new files under native/, small hook patches under patches/.

Rules (ollama's llama/ workflow, adapted):
- a file that does not exist upstream is *native*: it lives whole under native/ at its tree path;
- a change to an upstream file is a *hook*: it lives in a numbered git patch under patches/;
- a fix of an upstream bug is an *upstream fix*: a numbered git patch under patches/upstream-fixes/, applied
  first, by our build and by the `--unpatched` reference build alike (the reference is "upstream as it should
  behave", not "upstream crashing"); each names the upstream PR (or says upstream has none at the pin)
  so a pin bump can drop it;
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
from functools import cached_property
from pathlib import Path

from rollingkv_cli.lib import paths
from rollingkv_cli.console import abort
from rollingkv_cli.lib.upstream import PIN, identify_tree

BASE_TAG = "rollingkv-base"
FIXES_TAG = "rollingkv-upstream-fixes"  # the last upstream-fix commit (= BASE_TAG when there is none)
NATIVE_TAG = "rollingkv-native"
FIXES_SUBDIR = "upstream-fixes"  # under patches/
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
    patches: tuple[Path, ...]  # hooks, applied after the native files
    native_files: tuple[str, ...]  # paths relative to the tree (and to native/)
    patches_dir: Path
    native_dir: Path
    fixes: tuple[Path, ...] = ()  # upstream fixes (patches/upstream-fixes/), applied first

    @cached_property
    def hash(self) -> str:
        """The series' content hash, computed once per Series: a build keys its directory and writes its manifest with
        the same value even when patches/ or native/ change while it runs."""
        h = hashlib.sha256()
        for p in self.fixes:
            h.update(b"F" + p.name.encode() + b"\0" + p.read_bytes())
        for p in self.patches:
            h.update(b"P" + p.name.encode() + b"\0" + p.read_bytes())
        for rel in self.native_files:
            h.update(b"N" + rel.encode() + b"\0" + (self.native_dir / rel).read_bytes())
        return h.hexdigest()

    def patch_hashes(self) -> dict[str, str]:
        return {(f"{FIXES_SUBDIR}/" if p in self.fixes else "") + p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in (*self.fixes, *self.patches)}

    def fixes_only(self) -> "Series":
        """The upstream fixes alone: what the `--unpatched` reference build applies."""
        return Series((), (), self.patches_dir, self.native_dir, self.fixes)


def load_series(patches_dir: Path | None = None, native_dir: Path | None = None) -> Series:
    patches_dir = patches_dir or paths.data_dir("patches")
    native_dir = native_dir or paths.data_dir("native")
    patches = tuple(sorted(patches_dir.glob("*.patch"))) if patches_dir.is_dir() else ()
    fixes_dir = patches_dir / FIXES_SUBDIR
    fixes = tuple(sorted(fixes_dir.glob("*.patch"))) if fixes_dir.is_dir() else ()
    native: list[str] = []
    if native_dir.is_dir():
        for root, _dirs, files in os.walk(native_dir):
            for f in files:
                native.append(str((Path(root) / f).relative_to(native_dir)))
    return Series(patches, tuple(sorted(native)), patches_dir, native_dir, fixes)


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
    """Apply the upstream fixes, copy the native files, apply the hook patches. Returns what was done; a
    second call does nothing. Everything is checked before anything is written: a refused tree is untouched."""
    series = series or load_series()
    _require_llama_tree(tree)
    native_todo: list[str] = []
    for rel in series.native_files:
        src, dst = series.native_dir / rel, tree / rel
        if not dst.exists():
            native_todo.append(rel)
        elif not filecmp.cmp(src, dst, shallow=False):
            abort(
                f"{rel} in {tree} differs from native/{rel}: the tree has foreign changes",
                "start from a pristine tree at the pin (rollingkv build does) or " + REGENERATE_HINT,
            )
    fixes_todo = _pending(tree, series.fixes, [], "upstream fix")
    hooks_todo = _pending(tree, series.patches, list(series.fixes) if fixes_todo else [], "patch")
    done: list[str] = []
    for patch in fixes_todo:
        _git(["apply", "--whitespace=nowarn", str(patch)], tree)
        done.append(f"upstream fix {patch.name}")
        log(f"applied upstream fix {patch.name}")
    for rel in native_todo:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(series.native_dir / rel, tree / rel)
        done.append(f"native {rel}")
    for patch in hooks_todo:
        _git(["apply", "--whitespace=nowarn", str(patch)], tree)
        done.append(f"patch {patch.name}")
        log(f"applied {patch.name}")
    return done


def _require_llama_tree(tree: Path) -> None:
    marks = ("CMakeLists.txt", "include/llama.h", "ggml/include/ggml.h")
    if not tree.is_dir() or not all((tree / m).is_file() for m in marks):
        abort(f"{tree} is not a llama.cpp source tree (no {', '.join(marks)})",
              f"pass the root of a llama.cpp tree at the pin {PIN.short} (`rollingkv patches checkout DIR` makes one)")


def _pending(tree: Path, patches: tuple[Path, ...], before: list[Path], kind: str) -> list[Path]:
    """The patches of one segment still to apply: none when the whole segment is in (its reversal applies),
    all of them when they apply on top of `before` (the earlier segment, not yet in the tree). Refuses a
    tree where neither holds, before anything is written."""
    if not patches:
        return []
    if not before and _dry_run(tree, [(p, True) for p in reversed(patches)]) is None:
        return []
    failing = _dry_run(tree, [(p, False) for p in (*before, *patches)])
    if failing is None:
        return list(patches)
    patch, err = failing
    pinned, why = identify_tree(tree)
    hint = REGENERATE_HINT if pinned else f"{why}: start from a tree at the pin {PIN.short}, or " + REGENERATE_HINT
    abort(f"{kind} {patch.name} does not apply to {tree}: {err}; nothing was written", hint)


def _dry_run(tree: Path, steps: list[tuple[Path, bool]]) -> tuple[Path, str] | None:
    """Apply (patch, reverse) steps in order on a scratch copy of the files they touch: patches that touch
    the same file only apply in order. None when every step applies, else (the first failing patch, git's reason)."""
    import tempfile

    touched = sorted({f for p, _ in steps for f in describe_patch(p)[2]})
    with tempfile.TemporaryDirectory(prefix="rkv-apply-") as tmp:
        scratch = Path(tmp) / "tree"
        for rel in touched:
            if (tree / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / rel, scratch / rel)
        scratch.mkdir(exist_ok=True)
        for patch, reverse in steps:
            args = ["apply", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + [str(patch)]
            proc = _git(args, scratch, check=False)
            if proc.returncode != 0:
                return patch, _first_line(proc.stderr)
    return None


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def _check_room_for_checkout(dest: Path, pristine: Path) -> None:
    """Before writing: the nearest existing folder of dest is writable, not on a read-only filesystem, with room for the
    tree and its git objects (about twice the tree)."""
    from rollingkv_cli.models import human_bytes

    where = dest if dest.exists() else dest.parent
    while not where.exists():
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError as e:
        abort(f"cannot use {where}: {e.strerror or e}")
    if st.f_flag & os.ST_RDONLY:
        abort(f"{where} is on a read-only filesystem: cannot check out into {dest}", "choose a directory on a writable filesystem")
    if not os.access(where, os.W_OK | os.X_OK):
        abort(f"{where} is not writable: cannot check out into {dest}", "choose a directory you can write")
    need = 2 * _tree_bytes(pristine) + (64 << 20)
    free = st.f_bavail * st.f_frsize
    if free < need:
        abort(f"{where} has {human_bytes(free)} free; the checkout (the tree and its git history) needs about {human_bytes(need)}",
              "free some space, or choose a directory on another filesystem")


def _os_error_line(e: BaseException) -> str:
    """One line for an OSError or a shutil.Error (which lists every file that failed: a megabyte on a full disk)."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        first = e.args[0][0]
        why = first[2] if len(first) > 2 else first
        return f"{why} (and {len(e.args[0]) - 1} more)" if len(e.args[0]) > 1 else str(why)
    return getattr(e, "strerror", None) or _first_line(str(e))


def checkout(dest: Path, pristine: Path, series: Series | None = None) -> None:
    """A git work tree at the pin: base commit, native commit, then one commit per patch. Checked for room first; on any
    failure what was written is removed (dest itself when this made it), and the error is one line."""
    series = series or load_series()
    if dest.exists() and any(dest.iterdir()):
        abort(f"{dest} exists and is not empty", "choose a new directory")
    _check_room_for_checkout(dest, pristine)
    made = [d for d in (dest, *dest.parents) if not d.exists()]
    try:
        _checkout(dest, pristine, series)
    except BaseException as e:
        if dest.exists():
            if dest in made:
                shutil.rmtree(dest, ignore_errors=True)
            else:  # it was an empty folder of the user's: empty it again
                for p in dest.iterdir():
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        for d in made[1:]:  # the parents made for it, innermost first, while empty
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError):  # shutil.Error is one too
            abort(f"could not check out into {dest}: {_os_error_line(e)}; nothing was left behind",
                  "check the directory's permissions and free space")
        raise


def _checkout(dest: Path, pristine: Path, series: Series) -> None:
    shutil.copytree(pristine, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".rollingkv-*"))
    _git(["init", "-q", "-b", "rollingkv"], dest)
    _git(["config", "core.autocrlf", "false"], dest)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "-m", f"llama.cpp {PIN.llama_cpp_commit}\n\nVendored in {PIN.bindings_package} {PIN.bindings_version}."], dest)
    _git(["tag", BASE_TAG], dest)
    for patch in series.fixes:
        _am(dest, patch)
    _git(["tag", FIXES_TAG], dest)
    for rel in series.native_files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(series.native_dir / rel, dest / rel)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "--allow-empty", "-m", "rollingkv native sources\n\nWhole new files; exported to native/, never to patches/."], dest)
    _git(["tag", NATIVE_TAG], dest)
    _write_sync_stamp(dest, series.native_dir)
    for patch in series.patches:
        _am(dest, patch)


def _am(dest: Path, patch: Path) -> None:
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
    for tag in (BASE_TAG, FIXES_TAG, NATIVE_TAG):
        if _git(["rev-parse", "-q", "--verify", f"refs/tags/{tag}"], src, check=False).returncode != 0:
            abort(f"{src} is not a rollingkv patch checkout (tag {tag} missing)", "make one with `rollingkv patches checkout DIR`")
    # the base, then the upstream fixes up to FIXES_TAG (the base itself when there is none), the native commit, the hooks
    commit = {t: _git(["rev-parse", f"{t}^{{commit}}"], src).stdout.strip() for t in (BASE_TAG, FIXES_TAG, NATIVE_TAG)}
    order = [commit[BASE_TAG], *_git(["rev-list", "--reverse", "--first-parent", f"{BASE_TAG}..HEAD"], src).stdout.split()]
    pos = {t: order.index(c) if c in order else -1 for t, c in commit.items()}
    if not 0 <= pos[FIXES_TAG] < pos[NATIVE_TAG]:
        abort(f"{src}: the tags {BASE_TAG}, {FIXES_TAG}, {NATIVE_TAG} are not in that order below HEAD",
              "after a rebase, move the tags to the last upstream-fix commit and the native commit (`git tag -f TAG COMMIT`)")
    has_fixes = pos[FIXES_TAG] > 0
    if _git(["status", "--porcelain"], src).stdout.strip():
        abort(f"{src} has uncommitted changes", "commit them (one commit per hook, message saying why) and export again")
    conflicts = [] if force else native_conflicts(src, native_dir)
    if conflicts:
        shown = ", ".join(f"native/{c}" for c in conflicts[:6]) + (f" and {len(conflicts) - 6} more" if len(conflicts) > 6 else "")
        abort(f"{shown} changed since {src} last synced with native/; exporting would overwrite it",
              f"copy those files into {src} and commit them there (or export with --force to discard them)")
    added = _git(["diff", "--name-only", "--diff-filter=A", FIXES_TAG, "HEAD"], src).stdout.split()
    modified = _git(["diff", "--name-only", "--diff-filter=MDR", FIXES_TAG, "HEAD"], src).stdout.split()
    # native/: exactly the files that do not exist upstream
    if native_dir.exists():
        shutil.rmtree(native_dir)
    for rel in added:
        (native_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, native_dir / rel)
    fixes_dir = patches_dir / FIXES_SUBDIR
    for old in (*patches_dir.glob("*.patch"), *fixes_dir.glob("*.patch")):
        old.unlink()
    patches_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []  # the upstream fixes, then the hooks
    if has_fixes:
        fixes_dir.mkdir(exist_ok=True)
        out = _git(["format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index",
                    "-o", str(fixes_dir), f"{BASE_TAG}..{FIXES_TAG}"], src).stdout
        written += sorted(Path(line) for line in out.split() if line.endswith(".patch"))
    elif fixes_dir.is_dir() and not any(fixes_dir.iterdir()):
        fixes_dir.rmdir()
    if modified:
        out = _git(
            ["format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index",
             "-o", str(patches_dir), f"{NATIVE_TAG}..HEAD", "--", *modified],
            src,
        ).stdout
        written += sorted(Path(line) for line in out.split() if line.endswith(".patch"))
    write_index(load_series(patches_dir, native_dir))
    _write_sync_stamp(src, native_dir)
    return written


_SUBJECT = re.compile(r"^Subject: \[PATCH\] (.*(?:\n[ \t].*)*)$", re.M)  # a long subject is folded over lines


def describe_patch(patch: Path) -> tuple[str, str, list[str]]:
    """(subject, why: first body paragraph, files touched)"""
    text = patch.read_text()
    head, _, rest = text.partition("\n---\n")
    m = _SUBJECT.search(head)
    subject = " ".join(m.group(1).split()) if m else patch.stem
    body = head[m.end():].strip() if m else ""
    why = " ".join(body.split("\n\n")[0].split()) if body else ""
    files = re.findall(r"^diff --git a/(\S+) b/", rest, re.M)
    return subject, why, files


def _patch_table(patches: tuple[Path, ...], prefix: str, title: str) -> list[str]:
    lines = [title, "", "| patch | purpose | files touched |", "| --- | --- | --- |"]
    for p in patches:
        subject, why, files = describe_patch(p)
        purpose = subject + (f": {why}" if why else "")
        lines.append(f"| `{prefix}{p.name}` | {purpose.replace('|', '/')} | {', '.join(f'`{f}`' for f in files)} |")
    return lines + [""]


def write_index(series: Series) -> Path:
    lines = [
        "# The patch series",
        "",
        f"Against llama.cpp `{PIN.llama_cpp_commit}` (vendored in {PIN.bindings_package} {PIN.bindings_version}; the pin lives in `rollingkv_cli/lib/upstream.py`).",
        "Generated by `rollingkv patches export`: do not edit this file or the patches by hand.",
        "",
        "The series has three parts, applied in this order:",
        "",
        f"1. **Upstream fixes** (`{FIXES_SUBDIR}/`): bugs of the pinned llama.cpp itself, fixed as upstream fixes them (each names",
        "   its upstream PR, or says upstream has none at the pin; drop it when a pin bump fixes the bug). Both our build and the `--unpatched` reference build apply them,",
        "   so the reference stays \"upstream as it should behave\".",
        "2. **Native files** (`native/`): whole new source files, copied in at their tree paths.",
        "3. **Hooks** (the numbered patches here): small changes to upstream files that call into the native files.",
        "",
        f"In a checkout (`rollingkv patches checkout DIR`) the tags `{BASE_TAG}`, `{FIXES_TAG}` and `{NATIVE_TAG}` mark the",
        "boundaries. A new hook is a commit on top. A new upstream fix goes below the native commit: `git rebase -i "
        f"{FIXES_TAG}`, add the fix as the first commit (`edit` the native commit, commit the fix before it, `git rebase",
        f"--continue`), then `git tag -f {FIXES_TAG} <the fix>` and `git tag -f {NATIVE_TAG} <the native commit>`, and export.",
        "",
    ]
    lines += _patch_table(series.fixes, f"{FIXES_SUBDIR}/", "## Upstream fixes") if series.fixes else []
    lines += _patch_table(series.patches, "", "## Hooks")
    lines += ["## Native files", ""]
    lines += [f"- `native/{rel}`" for rel in series.native_files] or ["(none)"]
    index = series.patches_dir / "README.md"
    index.write_text("\n".join(lines) + "\n")
    return index
