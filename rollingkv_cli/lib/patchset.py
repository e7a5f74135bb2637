"""The patch series: whole new files under native/, small hook patches under patches/.

Rules (ollama's llama/ workflow, adapted):
- a file that does not exist upstream is *native*: it lives whole under native/ at its tree path;
- a change to an upstream file is a *hook*: it lives in a numbered git patch under patches/;
- a fix of an upstream bug is an *upstream fix*: a numbered git patch under patches/upstream-fixes/, applied
  first, by our build and by the `--unpatched` reference build alike (the reference is "upstream as it should
  behave", not "upstream crashing"); each names the upstream PR (or says upstream has none at the pin)
  so a pin bump can drop it;
- a lab instrument (the GPU timeline profile, speed probes that make outputs wrong, A/B switches of finished
  experiments) is the *lab series*: whole files under native-lab/ and hook patches under patches/lab/, applied after
  the hooks by `rollingkv build --lab` only (a lab patch may edit our native files too); the product build never sees it;
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
import textwrap
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
LAB_SUBDIR = "lab"  # under patches/: the lab series' hooks
LAB_NATIVE = "native-lab"  # next to native/: the lab series' whole files
LAB_TAG = "rollingkv-lab-native"  # in a lab checkout: the commit of the lab's whole files, on top of the product hooks
SYNC_STAMP = "rollingkv-native-synced.json"  # in the checkout's .git: native/ as of the last checkout or export
INDEX_WIDTH = 100  # patches/README.md wraps each patch's purpose at this many columns
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
    lab: bool = False  # the lab series on top (rollingkv build --lab); False: the product series, no lab file
    lab_patches: tuple[Path, ...] = ()  # patches/lab/: applied after the hooks (and the lab's native files)
    lab_native_files: tuple[str, ...] = ()  # paths relative to the tree (and to native-lab/)

    @property
    def lab_native_dir(self) -> Path:
        return self.native_dir.parent / LAB_NATIVE

    @cached_property
    def hash(self) -> str:
        """The series' content hash, computed once per Series: a build keys its directory and writes its manifest with
        the same value even when patches/ or native/ change while it runs. A lab series never hashes as a product one."""
        h = hashlib.sha256()
        for p in self.fixes:
            h.update(b"F" + p.name.encode() + b"\0" + p.read_bytes())
        for p in self.patches:
            h.update(b"P" + p.name.encode() + b"\0" + p.read_bytes())
        for rel in self.native_files:
            h.update(b"N" + rel.encode() + b"\0" + (self.native_dir / rel).read_bytes())
        if self.lab:
            h.update(b"LAB\0")
            for rel in self.lab_native_files:
                h.update(b"M" + rel.encode() + b"\0" + (self.lab_native_dir / rel).read_bytes())
            for p in self.lab_patches:
                h.update(b"L" + p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()

    def patch_hashes(self) -> dict[str, str]:
        return {_patch_label(self, p): hashlib.sha256(p.read_bytes()).hexdigest() for p in (*self.fixes, *self.patches, *self.lab_patches)}

    def fixes_only(self) -> "Series":
        """The upstream fixes alone: what the `--unpatched` reference build applies."""
        return Series((), (), self.patches_dir, self.native_dir, self.fixes)

    def with_lab(self) -> "Series":
        """This series with the lab series on top (read from patches/lab/ and native-lab/ next to its dirs)."""
        if self.lab:
            return self
        lab_dir = self.patches_dir / LAB_SUBDIR
        return Series(self.patches, self.native_files, self.patches_dir, self.native_dir, self.fixes, True,
                      tuple(sorted(lab_dir.glob("*.patch"))) if lab_dir.is_dir() else (), tuple(_walk(self.lab_native_dir)))


def _patch_label(series: Series, p: Path) -> str:
    """A patch's path under patches/: upstream-fixes/NAME, lab/NAME or NAME."""
    return (f"{FIXES_SUBDIR}/" if p in series.fixes else f"{LAB_SUBDIR}/" if p in series.lab_patches else "") + p.name


def _walk(root: Path) -> list[str]:
    """Every file under root, relative to it, sorted (none when root does not exist)."""
    found: list[str] = []
    if root.is_dir():
        for d, _dirs, files in os.walk(root):
            found += [str((Path(d) / f).relative_to(root)) for f in files]
    return sorted(found)


def load_series(patches_dir: Path | None = None, native_dir: Path | None = None, lab: bool = False) -> Series:
    """The product series (lab: with the lab series on top) from patches/ and native/ (native-lab/ next to it)."""
    patches_dir = patches_dir or paths.data_dir("patches")
    native_dir = native_dir or paths.data_dir("native")
    patches = tuple(sorted(patches_dir.glob("*.patch"))) if patches_dir.is_dir() else ()
    fixes_dir = patches_dir / FIXES_SUBDIR
    fixes = tuple(sorted(fixes_dir.glob("*.patch"))) if fixes_dir.is_dir() else ()
    series = Series(patches, tuple(_walk(native_dir)), patches_dir, native_dir, fixes)
    return series.with_lab() if lab else series


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
    """Apply the upstream fixes, copy the native files, apply the hook patches (a lab series: then copy the lab's native
    files and apply the lab patches). Returns what was done; a second call does nothing. Everything is checked before
    anything is written: a refused tree is untouched."""
    series = series or load_series()
    _require_llama_tree(tree)
    # a lab series already in: its patches may have edited native files, which then differ from native/ on purpose
    lab_in = bool(series.lab_patches) and _lab_applied(tree, series)
    lab_edited = {f for p in series.lab_patches for f in describe_patch(p)[2]} if lab_in else set()
    native_todo = _native_pending(tree, series.native_dir, [r for r in series.native_files if r not in lab_edited], "native")
    lab_native_todo = _native_pending(tree, series.lab_native_dir, list(series.lab_native_files), LAB_NATIVE) if series.lab else []
    overlay = {rel: series.native_dir / rel for rel in native_todo} | {rel: series.lab_native_dir / rel for rel in lab_native_todo}
    fixes_todo = _pending(tree, series.fixes, [], "upstream fix")
    hooks_todo = _pending(tree, series.patches, list(series.fixes) if fixes_todo else [], "patch",
                          applied_after=list(series.lab_patches) if lab_in else [])
    lab_todo = [] if lab_in else _pending(tree, series.lab_patches, [*(series.fixes if fixes_todo else ()), *hooks_todo], "lab patch",
                                          overlay=overlay, may_be_in=False)
    done: list[str] = []

    def apply(patches: list[Path], what: str, shown: str) -> None:
        for patch in patches:
            _git(["apply", "--whitespace=nowarn", str(patch)], tree)
            done.append(f"{what} {patch.name}")
            log(f"applied {shown}{patch.name}")

    def copy(src_dir: Path, rels: list[str], what: str) -> None:
        for rel in rels:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src_dir / rel, tree / rel)
            done.append(f"{what} {rel}")

    apply(fixes_todo, "upstream fix", "upstream fix ")
    copy(series.native_dir, native_todo, "native")
    apply(hooks_todo, "patch", "")
    copy(series.lab_native_dir, lab_native_todo, "lab native")
    apply(lab_todo, "lab patch", "lab/")
    return done


def _native_pending(tree: Path, native_dir: Path, rels: list[str], where: str) -> list[str]:
    """The whole files not yet in the tree; refuses a tree where one of them differs."""
    todo: list[str] = []
    for rel in rels:
        src, dst = native_dir / rel, tree / rel
        if not dst.exists():
            todo.append(rel)
        elif not filecmp.cmp(src, dst, shallow=False):
            abort(
                f"{rel} in {tree} differs from {where}/{rel}: the tree has foreign changes",
                "start from a pristine tree at the pin (rollingkv build does) or " + REGENERATE_HINT,
            )
    return todo


def _lab_applied(tree: Path, series: Series) -> bool:
    """The lab patches are in the tree: their reversal applies, and leaves the native files they edit as native/ has them."""
    def native_as_exported(scratch: Path) -> bool:
        edited = {f for p in series.lab_patches for f in describe_patch(p)[2]}
        return all(filecmp.cmp(scratch / rel, series.native_dir / rel, shallow=False)
                   for rel in series.native_files if rel in edited and (scratch / rel).is_file())

    return _dry_run(tree, [(p, True) for p in reversed(series.lab_patches)], check=native_as_exported) is None


def _require_llama_tree(tree: Path) -> None:
    marks = ("CMakeLists.txt", "include/llama.h", "ggml/include/ggml.h")
    if not tree.is_dir() or not all((tree / m).is_file() for m in marks):
        abort(f"{tree} is not a llama.cpp source tree (no {', '.join(marks)})",
              f"pass the root of a llama.cpp tree at the pin {PIN.short} (`rollingkv patches checkout DIR` makes one)")


def _pending(tree: Path, patches: tuple[Path, ...], before: list[Path], kind: str, applied_after: list[Path] | None = None,
             overlay: dict[str, Path] | None = None, may_be_in: bool = True) -> list[Path]:
    """The patches of one segment still to apply: none when the whole segment is in (its reversal applies, after that of
    applied_after: a later segment known to be in, which may touch the same lines), all of them when they apply on top of
    `before` (the earlier segment, not yet in the tree; overlay: files to be copied in before them). Refuses a tree where
    neither holds, before anything is written."""
    if not patches:
        return []
    if may_be_in and not before:
        undo = [(p, True) for p in reversed(applied_after or [])] + [(p, True) for p in reversed(patches)]
        if _dry_run(tree, undo) is None:
            return []
    failing = _dry_run(tree, [(p, False) for p in (*before, *patches)], overlay=overlay)
    if failing is None:
        return list(patches)
    patch, err = failing
    pinned, why = identify_tree(tree)
    hint = REGENERATE_HINT if pinned else f"{why}: start from a tree at the pin {PIN.short}, or " + REGENERATE_HINT
    abort(f"{kind} {patch.name} does not apply to {tree}: {err}; nothing was written", hint)


def _dry_run(tree: Path, steps: list[tuple[Path, bool]], overlay: dict[str, Path] | None = None,
             check=None) -> tuple[Path, str] | None:
    """Apply (patch, reverse) steps in order on a scratch copy of the files they touch (overlay: files taken from
    elsewhere, not yet in the tree): patches that touch the same file only apply in order. None when every step applies
    (and check(scratch), when given, holds), else (the first failing patch, git's reason)."""
    import tempfile

    touched = sorted({f for p, _ in steps for f in describe_patch(p)[2]})
    with tempfile.TemporaryDirectory(prefix="rkv-apply-") as tmp:
        scratch = Path(tmp) / "tree"
        for rel in touched:
            origin = (overlay or {}).get(rel) or tree / rel
            if origin.is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, scratch / rel)
        scratch.mkdir(exist_ok=True)
        for patch, reverse in steps:
            args = ["apply", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + [str(patch)]
            proc = _git(args, scratch, check=False)
            if proc.returncode != 0:
                return patch, _first_line(proc.stderr)
        if check is not None and steps and not check(scratch):
            return steps[-1][0], "the files it leaves differ from the series'"
    return None


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def _check_room_for_checkout(dest: Path, pristine: Path) -> None:
    """Before writing: the nearest existing folder of dest is writable, not on a read-only filesystem, with room for the
    tree and its git objects (about twice the tree)."""
    from rollingkv_cli.lib.units import human_bytes

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
    from rollingkv_cli.userinput import check_output_dir

    check_output_dir(dest, "checkout directory")  # a device, a file, /proc: one line, not NotADirectoryError
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
    for patch in series.patches:
        _am(dest, patch)
    if series.lab:
        for rel in series.lab_native_files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(series.lab_native_dir / rel, dest / rel)
        _git(["add", "-A"], dest)
        _git(["commit", "-q", "--allow-empty", "-m", "rollingkv lab sources\n\nWhole new files of the lab series; exported to "
              f"{LAB_NATIVE}/, never to patches/."], dest)
        _git(["tag", LAB_TAG], dest)
        for patch in series.lab_patches:
            _am(dest, patch)
    _write_sync_stamp(dest, series)


def _am(dest: Path, patch: Path) -> None:
    proc = _git(["am", "-q", "--keep-cr", "--committer-date-is-author-date", str(patch)], dest, check=False)
    if proc.returncode != 0:
        _git(["am", "--abort"], dest, check=False)
        abort(f"patch {patch.name} does not apply at the pin: {_first_line(proc.stderr or proc.stdout)}", REGENERATE_HINT)


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _native_hashes(native_dir: Path, prefix: str = "") -> dict[str, str]:
    return {prefix + rel: _file_hash(native_dir / rel) for rel in _walk(native_dir)}


def _synced_hashes(series: Series) -> dict[str, str]:
    """native/ (and, for a lab series, native-lab/ as LAB_NATIVE/REL) as a checkout or export last saw it."""
    return _native_hashes(series.native_dir) | (_native_hashes(series.lab_native_dir, f"{LAB_NATIVE}/") if series.lab else {})


def _write_sync_stamp(checkout_dir: Path, series: Series) -> None:
    import json

    (checkout_dir / ".git" / SYNC_STAMP).write_text(json.dumps(_synced_hashes(series), indent=0, sort_keys=True) + "\n")


def native_conflicts(src: Path, series: Series) -> list[str]:
    """Files of native/ (native-lab/ for a lab series) changed since the checkout src last synced with them (checkout or
    export) that the checkout does not hold as they are: exporting would overwrite or delete them (someone edited native/
    directly, in parallel with the checkout)."""
    import json

    stamp = src / ".git" / SYNC_STAMP
    if not stamp.is_file():
        return []  # a checkout from before the stamp: nothing to compare with
    try:
        synced = json.loads(stamp.read_text())
    except ValueError:
        return []
    if not isinstance(synced, dict):
        return []
    conflicts = []
    for key, h in sorted(_synced_hashes(series).items()):
        if synced.get(key) == h:
            continue  # unchanged since the last sync: the checkout's version wins
        rel = key.removeprefix(f"{LAB_NATIVE}/")
        if (src / rel).is_file() and _file_hash(src / rel) == h:
            continue  # the checkout already has it
        conflicts.append(key if key.startswith(f"{LAB_NATIVE}/") else f"native/{key}")
    return conflicts


def export(src: Path, series_dirs: tuple[Path, Path] | None = None, force: bool = False) -> list[Path]:
    """Regenerate patches/ (and native/) from a checkout made by `checkout`; from a lab checkout (`checkout --lab`: the
    tag LAB_TAG) also patches/lab/ and native-lab/, else those stay as they are."""
    patches_dir, native_dir = series_dirs or (paths.data_dir("patches"), paths.data_dir("native"))
    for tag in (BASE_TAG, FIXES_TAG, NATIVE_TAG):
        if not _has_tag(src, tag):
            abort(f"{src} is not a rollingkv patch checkout (tag {tag} missing)", "make one with `rollingkv patches checkout DIR`")
    lab = _has_tag(src, LAB_TAG)
    tags = (BASE_TAG, FIXES_TAG, NATIVE_TAG, *((LAB_TAG,) if lab else ()))
    # the base, then the upstream fixes up to FIXES_TAG (the base itself when there is none), the native commit, the hooks
    # (and in a lab checkout the lab's native commit and its hooks)
    commit = {t: _git(["rev-parse", f"{t}^{{commit}}"], src).stdout.strip() for t in tags}
    order = [commit[BASE_TAG], *_git(["rev-list", "--reverse", "--first-parent", f"{BASE_TAG}..HEAD"], src).stdout.split()]
    pos = {t: order.index(c) if c in order else -1 for t, c in commit.items()}
    if not 0 <= pos[FIXES_TAG] < pos[NATIVE_TAG] or (lab and not pos[NATIVE_TAG] < pos[LAB_TAG]):
        abort(f"{src}: the tags {', '.join(tags)} are not in that order below HEAD",
              "after a rebase, move the tags to the last upstream-fix commit, the native commit"
              + (" and the lab's native commit" if lab else "") + " (`git tag -f TAG COMMIT`)")
    has_fixes = pos[FIXES_TAG] > 0
    if _git(["status", "--porcelain"], src).stdout.strip():
        abort(f"{src} has uncommitted changes", "commit them (one commit per hook, message saying why) and export again")
    series = load_series(patches_dir, native_dir, lab=lab)
    conflicts = [] if force else native_conflicts(src, series)
    if conflicts:
        shown = ", ".join(conflicts[:6]) + (f" and {len(conflicts) - 6} more" if len(conflicts) > 6 else "")
        abort(f"{shown} changed since {src} last synced with native/; exporting would overwrite it",
              f"copy those files into {src} and commit them there (or export with --force to discard them)")
    end = f"{LAB_TAG}^" if lab else "HEAD"  # the product series' last commit
    added = _git(["diff", "--name-only", "--diff-filter=A", FIXES_TAG, end], src).stdout.split()
    modified = _git(["diff", "--name-only", "--diff-filter=MDR", FIXES_TAG, end], src).stdout.split()
    # native/: exactly the files that do not exist upstream, as the product series leaves them
    if native_dir.exists():
        shutil.rmtree(native_dir)
    for rel in added:
        (native_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        if lab:  # the lab's patches may edit them further up
            (native_dir / rel).write_bytes(_blob(src, end, rel))
        else:
            shutil.copy2(src / rel, native_dir / rel)
    fixes_dir = patches_dir / FIXES_SUBDIR
    for old in (*patches_dir.glob("*.patch"), *fixes_dir.glob("*.patch")):
        old.unlink()
    patches_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []  # the upstream fixes, then the hooks, then the lab's hooks
    if has_fixes:
        fixes_dir.mkdir(exist_ok=True)
        written += _format_patches(src, fixes_dir, f"{BASE_TAG}..{FIXES_TAG}")
    elif fixes_dir.is_dir() and not any(fixes_dir.iterdir()):
        fixes_dir.rmdir()
    if modified:
        written += _format_patches(src, patches_dir, f"{NATIVE_TAG}..{end}", modified)
    if lab:
        written += _export_lab(src, patches_dir / LAB_SUBDIR, series.lab_native_dir)
    write_index(load_series(patches_dir, native_dir))
    _write_sync_stamp(src, load_series(patches_dir, native_dir, lab=lab))
    return written


def _export_lab(src: Path, lab_dir: Path, lab_native_dir: Path) -> list[Path]:
    """patches/lab/ and native-lab/ from a lab checkout: the files added above the product series, and a patch per lab
    commit for the files it changes (upstream files and our native ones alike)."""
    added = _git(["diff", "--name-only", "--diff-filter=A", f"{LAB_TAG}^", "HEAD"], src).stdout.split()
    modified = _git(["diff", "--name-only", "--diff-filter=MDR", f"{LAB_TAG}^", "HEAD"], src).stdout.split()
    if lab_native_dir.exists():
        shutil.rmtree(lab_native_dir)
    for rel in added:
        (lab_native_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, lab_native_dir / rel)
    for old in lab_dir.glob("*.patch"):
        old.unlink()
    if not modified:
        if lab_dir.is_dir() and not any(lab_dir.iterdir()):
            lab_dir.rmdir()
        return []
    lab_dir.mkdir(parents=True, exist_ok=True)
    return _format_patches(src, lab_dir, f"{LAB_TAG}..HEAD", modified)


def _format_patches(src: Path, out: Path, revs: str, only: list[str] | None = None) -> list[Path]:
    args = ["format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index", "-o", str(out), revs]
    text = _git(args + (["--", *only] if only else []), src).stdout
    return sorted(Path(line) for line in text.split() if line.endswith(".patch"))


def _has_tag(src: Path, tag: str) -> bool:
    return _git(["rev-parse", "-q", "--verify", f"refs/tags/{tag}"], src, check=False).returncode == 0


def _blob(src: Path, rev: str, rel: str) -> bytes:
    """A file's bytes at a revision of the checkout."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(src.resolve().parent))
    proc = subprocess.run(["git", "cat-file", "blob", f"{rev}:{rel}"], cwd=src, capture_output=True, env=env)
    if proc.returncode != 0:
        abort(f"git cat-file {rev}:{rel} failed in {src}: {_first_line(proc.stderr.decode(errors='replace'))}")
    return proc.stdout


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


def _wrap(text: str, indent: str = "", first: str | None = None) -> list[str]:
    return textwrap.wrap(text, INDEX_WIDTH, initial_indent=indent if first is None else first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def _patch_list(patches: tuple[Path, ...], prefix: str, title: str) -> list[str]:
    """One entry per patch: its file, its subject and first paragraph, and the files it touches, wrapped."""
    lines = [title, ""]
    for p in patches:
        subject, why, files = describe_patch(p)
        lines.append(f"- `{prefix}{p.name}`")
        lines += _wrap(subject + (f": {why}" if why else ""), "  ")
        lines += _wrap("Touches " + ", ".join(f"`{f}`" for f in files) + ".", "  ")
    return lines + [""]


def write_index(series: Series) -> Path:
    lines = ["# The patch series", ""]
    lines += _wrap(f"Against llama.cpp `{PIN.llama_cpp_commit}` (vendored in {PIN.bindings_package} "
                   f"{PIN.bindings_version}; the pin lives in `rollingkv_cli/lib/upstream.py`). Generated by "
                   "`rollingkv patches export`: do not edit this file or the patches by hand.")
    lines += ["", "The series has three parts, applied in this order:", ""]
    lines += _wrap(f"**Upstream fixes** (`{FIXES_SUBDIR}/`): bugs of the pinned llama.cpp itself, fixed as upstream "
                   "fixes them (each names its upstream PR, or says upstream has none at the pin; drop it when a pin "
                   "bump fixes the bug). Both our build and the `--unpatched` reference build apply them, so the "
                   "reference stays \"upstream as it should behave\".", "   ", "1. ")
    lines += _wrap("**Native files** (`native/`): whole new source files, copied in at their tree paths.", "   ", "2. ")
    lines += _wrap("**Hooks** (the numbered patches here): small changes to upstream files that call into the native "
                   "files.", "   ", "3. ")
    lines += [""]
    lines += _wrap(f"A lab build (`rollingkv build --lab`) then applies the **lab series**: its whole files "
                   f"(`{LAB_NATIVE}/`) and its hooks (`{LAB_SUBDIR}/`, which may edit our native files too): "
                   "instruments and probes that the product build never contains (its build directory and series "
                   "hash differ; its manifest says `\"lab\": true`).")
    lines += [""]
    lines += _wrap(f"In a checkout (`rollingkv patches checkout DIR`) the tags `{BASE_TAG}`, `{FIXES_TAG}` and "
                   f"`{NATIVE_TAG}` mark the boundaries. A new hook is a commit on top. A new upstream fix goes below "
                   f"the native commit: `git rebase -i {FIXES_TAG}`, add the fix as the first commit (`edit` the "
                   "native commit, commit the fix before it, `git rebase --continue`), then "
                   f"`git tag -f {FIXES_TAG} <the fix>` and `git tag -f {NATIVE_TAG} <the native commit>`, and "
                   f"export. `rollingkv patches checkout --lab DIR` adds the lab's native commit (tag `{LAB_TAG}`) "
                   "and a commit per lab hook on top; a new lab hook is a commit on top of it, a new product hook "
                   "goes below the tag (and the tag moves with the rebase).")
    lines += [""]
    lab = series.with_lab()
    lines += _patch_list(series.fixes, f"{FIXES_SUBDIR}/", "## Upstream fixes") if series.fixes else []
    lines += _patch_list(series.patches, "", "## Hooks")
    lines += _patch_list(lab.lab_patches, f"{LAB_SUBDIR}/", "## Lab hooks") if lab.lab_patches else []
    lines += ["## Native files", ""]
    lines += [f"- `native/{rel}`" for rel in series.native_files] or ["(none)"]
    if lab.lab_native_files:
        lines += ["", "## Lab native files", ""]
        lines += [f"- `{LAB_NATIVE}/{rel}`" for rel in lab.lab_native_files]
    index = series.patches_dir / "README.md"
    index.write_text("\n".join(lines) + "\n")
    return index
