"""The patch series: checkout -> export round trip, idempotent apply, refusal of foreign changes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rollingkv_cli.lib import patchset, upstream
from rollingkv_cli.console import RollingKVError

REPO = Path(__file__).resolve().parents[2]


def _dir_files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_series_is_real():
    series = patchset.load_series()
    assert series.patches, "the series must hold at least one patch"
    for p in series.patches:
        subject, why, files = patchset.describe_patch(p)
        assert subject and why, f"{p.name}: every patch says why it exists"
        assert files, f"{p.name} touches no file"
    assert (series.patches_dir / "README.md").read_text() == _index_text(series)


def _index_text(series) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "patches"
        shutil.copytree(series.patches_dir, copy)
        patchset.write_index(patchset.Series(tuple(copy / p.name for p in series.patches), series.native_files, copy, series.native_dir,
                                             tuple(copy / patchset.FIXES_SUBDIR / p.name for p in series.fixes)))
        return (copy / "README.md").read_text()


def test_checkout_export_round_trip_is_byte_identical(tmp_path, pristine_tree):
    series = patchset.load_series()
    co = tmp_path / "co"
    patchset.checkout(co, pristine_tree, series)
    log = subprocess.run(["git", "-C", str(co), "log", "--format=%s"], capture_output=True, text=True, check=True).stdout
    assert len(log.splitlines()) == 2 + len(series.fixes) + len(series.patches)
    out_patches, out_native = tmp_path / "patches", tmp_path / "native"
    out_patches.mkdir()
    # the lab series is not in a product checkout: its export leaves patches/lab/ and native-lab/ as they are
    shutil.copytree(series.patches_dir / patchset.LAB_SUBDIR, out_patches / patchset.LAB_SUBDIR)
    shutil.copytree(series.lab_native_dir, tmp_path / patchset.LAB_NATIVE)
    patchset.export(co, (out_patches, out_native))
    assert _dir_files(out_patches) == _dir_files(series.patches_dir)  # upstream-fixes/ and lab/ included
    assert _dir_files(out_native) == _dir_files(series.native_dir)


def test_upstream_fixes_are_a_series_of_their_own():
    series = patchset.load_series()
    assert series.fixes, "the AMX fix is carried as an upstream fix"
    for p in series.fixes:
        subject, why, files = patchset.describe_patch(p)
        body = p.read_text().partition("\n---\n")[0]
        # either the upstream PR it carries, or that upstream has no fix at the pin and when to drop the patch
        names_pr = "ggml-org/llama.cpp#" in body
        names_no_pr = "not fixed upstream at the pin" in body and "drop this patch" in body
        assert "Upstream bug fix" in why and (names_pr or names_no_pr), f"{p.name} says where upstream stands"
    ref = series.fixes_only()
    assert ref.fixes == series.fixes and not ref.patches and not ref.native_files
    assert ref.hash != series.hash and ref.hash != patchset.Series((), (), series.patches_dir, series.native_dir).hash
    index = (series.patches_dir / "README.md").read_text()
    assert "## Upstream fixes" in index and all(f"upstream-fixes/{p.name}" in index for p in series.fixes)


def test_reference_tree_gets_the_fixes_only_and_then_the_full_series(tmp_path, pristine_tree):
    """The --unpatched reference applies the upstream fixes alone; the full series applies on top of that tree."""
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    series = patchset.load_series()
    done = patchset.apply_series(tree, series.fixes_only(), log=lambda m: None)
    assert done == [f"upstream fix {p.name}" for p in series.fixes]
    assert "ggml_tile_config_make" in (tree / "ggml/src/ggml-cpu/amx/mmq.cpp").read_text()
    assert not (tree / series.native_files[0]).exists()
    assert patchset.apply_series(tree, series.fixes_only(), log=lambda m: None) == []
    rest = patchset.apply_series(tree, series, log=lambda m: None)
    assert len(rest) == len(series.native_files) + len(series.patches)
    assert patchset.apply_series(tree, series, log=lambda m: None) == []


def test_lab_series_applies_on_top_and_twice_is_a_no_op(tmp_path, pristine_tree):
    """`build --lab`: the lab's whole files and hooks after the product series, on a pristine tree or on a product tree."""
    lab = patchset.load_series(lab=True)
    assert lab.lab and lab.lab_patches and lab.lab_native_files
    fresh = tmp_path / "fresh"
    shutil.copytree(pristine_tree, fresh)
    done = patchset.apply_series(fresh, lab, log=lambda m: None)
    assert len(done) == len(lab.fixes) + len(lab.native_files) + len(lab.patches) + len(lab.lab_native_files) + len(lab.lab_patches)
    assert done[-len(lab.lab_patches):] == [f"lab patch {p.name}" for p in lab.lab_patches]
    for rel in lab.lab_native_files:
        assert (fresh / rel).read_bytes() == (lab.lab_native_dir / rel).read_bytes()
    snapshot = _dir_files(fresh / "ggml" / "src")
    assert patchset.apply_series(fresh, lab, log=lambda m: None) == []
    assert _dir_files(fresh / "ggml" / "src") == snapshot
    # on a tree that has the product series: the lab's part only, and the same tree as applying both at once
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    patchset.apply_series(tree, patchset.load_series(), log=lambda m: None)
    rest = patchset.apply_series(tree, lab, log=lambda m: None)
    assert rest == [f"lab native {r}" for r in lab.lab_native_files] + [f"lab patch {p.name}" for p in lab.lab_patches]
    assert patchset.apply_series(tree, lab, log=lambda m: None) == []
    assert _dir_files(tree / "ggml" / "src") == snapshot


def test_a_product_tree_has_no_lab_file_nor_probe_and_the_hashes_differ(tmp_path, pristine_tree):
    product, lab = patchset.load_series(), patchset.load_series(lab=True)
    assert not product.lab and not product.lab_patches and not product.lab_native_files
    assert product.hash != lab.hash
    assert set(product.patch_hashes()) < set(lab.patch_hashes())
    assert all(k.startswith("lab/") for k in set(lab.patch_hashes()) - set(product.patch_hashes()))
    # a lab series whose lab part is empty still hashes apart from the product (never one build directory for both)
    assert product.hash != patchset.Series(product.patches, product.native_files, product.patches_dir, product.native_dir,
                                           product.fixes, lab=True).hash
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    patchset.apply_series(tree, product, log=lambda m: None)
    for rel in lab.lab_native_files:
        assert not (tree / rel).exists(), f"{rel} is a lab file"
    cuda = {p.name: p.read_text() for p in (tree / "ggml" / "src" / "ggml-cuda").glob("*.cu*")}
    for name, text in cuda.items():
        for probe in ("rolling-kv-profile", "ggml_cuda_rkv_prof_", "ggml_cuda_rkv_lab", "ROLLINGKV_DEBUG_SKIP", "ROLLINGKV_DEBUG_NO_",
                      "ROLLINGKV_DEBUG_PROFILE"):
            assert probe not in text, f"{name} holds {probe}: lab code in the product"
    assert "ROLLINGKV_DEBUG" not in (tree / "ggml" / "CMakeLists.txt").read_text()
    # libllama's lab switch (issue 36, item 10: it turned elastic windows off in the product) and the forced chunks
    for p in [*(tree / "src").glob("*.cpp"), *(tree / "src").glob("*.h"), *(tree / "ggml" / "src").rglob("*rolling-kv*")]:
        text = p.read_text()
        for probe in ("ROLLINGKV_DEBUG_ONE_OP_STREAMS", "llama_rkv_one_op_streams", "ROLLINGKV_DEBUG_CHUNK_CELLS"):
            assert probe not in text, f"{p.name} holds {probe}: lab code in the product"


def test_lab_checkout_export_round_trip_is_byte_identical(tmp_path, pristine_tree):
    lab = patchset.load_series(lab=True)
    co = tmp_path / "co"
    patchset.checkout(co, pristine_tree, lab)
    tags = subprocess.run(["git", "-C", str(co), "tag"], capture_output=True, text=True, check=True).stdout.split()
    assert patchset.LAB_TAG in tags
    out_patches, out_native = tmp_path / "patches", tmp_path / "native"
    out_patches.mkdir()
    patchset.export(co, (out_patches, out_native))
    assert _dir_files(out_patches) == _dir_files(lab.patches_dir)  # upstream-fixes/ and lab/ included
    assert _dir_files(out_native) == _dir_files(lab.native_dir)  # as the product has them, not as the lab edits them
    assert _dir_files(tmp_path / patchset.LAB_NATIVE) == _dir_files(lab.lab_native_dir)
    # a product checkout's export leaves the lab series alone
    co2 = tmp_path / "co2"
    patchset.checkout(co2, pristine_tree)
    patchset.export(co2, (out_patches, out_native))
    assert _dir_files(out_patches / patchset.LAB_SUBDIR) == _dir_files(lab.patches_dir / patchset.LAB_SUBDIR)
    assert _dir_files(tmp_path / patchset.LAB_NATIVE) == _dir_files(lab.lab_native_dir)


def test_apply_to_a_directory_that_is_not_llama_cpp_writes_nothing(tmp_path, runner):
    from rollingkv_cli.cli import rollingkv

    junk = tmp_path / "not-llama"
    junk.mkdir()
    (junk / "CMakeLists.txt").write_text("project(other)\n")
    r = runner.invoke(rollingkv, ["patches", "apply", str(junk)])
    assert r.exit_code == 1
    assert "is not a llama.cpp source tree" in str(r.exception or r.output)
    assert sorted(p.name for p in junk.rglob("*")) == ["CMakeLists.txt"]


def test_apply_to_llama_cpp_at_another_commit_writes_nothing_and_says_so(tmp_path, pristine_tree):
    tree = tmp_path / "other"
    shutil.copytree(pristine_tree, tree)
    series = patchset.load_series()
    rel = "src/llama-graph.cpp"  # a file hooks touch and the pin's fingerprint covers
    assert rel in upstream.FINGERPRINT_FILES
    first = next(p for p in series.patches if rel in patchset.describe_patch(p)[2])
    (tree / rel).write_text((tree / rel).read_text().replace("\n", "\n// moved on upstream\n", 4000))
    before = _dir_files(tree)
    with pytest.raises(RollingKVError) as e:
        patchset.apply_series(tree, series, log=lambda m: None)
    assert f"patch {first.name} does not apply" in e.value.message and "nothing was written" in e.value.message
    assert "does not match llama.cpp" in e.value.hint
    assert _dir_files(tree) == before  # no native file, no upstream fix, no earlier hook


def test_export_picks_up_a_new_hook_and_a_new_native_file(tmp_path, pristine_tree):
    co = tmp_path / "co"
    patchset.checkout(co, pristine_tree)
    (co / "README.md").write_text((co / "README.md").read_text() + "\nrollingkv was here\n")
    (co / "src" / "llama-rolling-kv-extra.cpp").write_text("// new\n")
    subprocess.run(["git", "-C", str(co), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(co), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "docs: say hello\n\nBecause a test needs a hook."], check=True)
    out_patches, out_native = tmp_path / "patches", tmp_path / "native"
    out_patches.mkdir()
    written = patchset.export(co, (out_patches, out_native))
    assert written[-1].name.endswith("-docs-say-hello.patch")
    assert "src/llama-rolling-kv-extra.cpp" not in written[-1].read_text()
    assert (out_native / "src" / "llama-rolling-kv-extra.cpp").read_text() == "// new\n"
    assert "docs-say-hello" in (out_patches / "README.md").read_text()


def test_export_refuses_to_overwrite_native_edits_made_outside_the_checkout(tmp_path, pristine_tree):
    co = tmp_path / "co"
    patchset.checkout(co, pristine_tree)
    out_patches, out_native = tmp_path / "patches", tmp_path / "native"
    out_patches.mkdir()
    patchset.export(co, (out_patches, out_native))  # the first export syncs native/ with the checkout
    rel = "src/llama-kv-residency.cpp"
    # someone edits native/ directly while the checkout moves on: exporting would lose the edit
    (out_native / rel).write_text((out_native / rel).read_text() + "\n// edited in native/\n")
    (co / "src" / "llama-kv-cache-split.cpp").write_text((co / "src" / "llama-kv-cache-split.cpp").read_text() + "\n// edited in the checkout\n")
    subprocess.run(["git", "-C", str(co), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "edit"], check=True)
    with pytest.raises(RollingKVError) as e:
        patchset.export(co, (out_patches, out_native))
    assert f"native/{rel}" in e.value.message and "--force" in e.value.hint
    assert (out_native / rel).read_text().endswith("// edited in native/\n")  # nothing was touched
    # once the checkout holds the edit, the export goes through and keeps it
    shutil.copy2(out_native / rel, co / rel)
    subprocess.run(["git", "-C", str(co), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "take the edit"], check=True)
    patchset.export(co, (out_patches, out_native))
    assert (out_native / rel).read_text().endswith("// edited in native/\n")
    assert (out_native / "src" / "llama-kv-cache-split.cpp").read_text().endswith("// edited in the checkout\n")
    # --force discards a direct edit
    (out_native / rel).write_text("// scratch\n")
    patchset.export(co, (out_patches, out_native), force=True)
    assert (out_native / rel).read_text().endswith("// edited in native/\n")


def test_apply_twice_is_a_no_op(tmp_path, pristine_tree):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    series = patchset.load_series()
    first = patchset.apply_series(tree, series, log=lambda m: None)
    assert len(first) == len(series.fixes) + len(series.patches) + len(series.native_files)
    snapshot = _dir_files(tree / "src")
    assert patchset.apply_series(tree, series, log=lambda m: None) == []
    assert _dir_files(tree / "src") == snapshot


def test_foreign_change_is_refused_naming_the_patch(tmp_path, pristine_tree):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    series = patchset.load_series()
    _, _, files = patchset.describe_patch(series.patches[0])
    target = tree / files[0]
    target.write_text(target.read_text().replace("llama-vocab.cpp", "llama-vocab-forked.cpp").replace("target_link_libraries", "# foreign\ntarget_link_libraries", 1))
    with pytest.raises(RollingKVError) as exc:
        patchset.apply_series(tree, series, log=lambda m: None)
    assert series.patches[0].name in exc.value.message
    assert "patches checkout" in exc.value.hint


def test_foreign_native_file_is_refused(tmp_path, pristine_tree):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree)
    series = patchset.load_series()
    rel = series.native_files[0]
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text("// someone else's file\n")
    with pytest.raises(RollingKVError, match="foreign changes"):
        patchset.apply_series(tree, series, log=lambda m: None)


def test_pin_identification(tmp_path, pristine_tree):
    assert upstream.identify_tree(pristine_tree) == (True, "content fingerprint matches the pin")
    other = tmp_path / "other"
    shutil.copytree(pristine_tree, other)
    (other / "include" / "llama.h").write_text((other / "include" / "llama.h").read_text() + "\n// newer\n")
    ok, why = upstream.identify_tree(other)
    assert not ok and "does not match" in why
    with pytest.raises(RollingKVError, match="refusing"):
        upstream.resolve_source(other, allow_unpinned=False)
    assert upstream.resolve_source(other, allow_unpinned=True) == (other.resolve(), False)


def test_git_tree_at_another_commit_is_refused(tmp_path, pristine_tree):
    tree = tmp_path / "g"
    shutil.copytree(pristine_tree, tree)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True)
    ok, why = upstream.identify_tree(tree)
    assert not ok and "git HEAD" in why


def test_corrupt_cached_sdist_is_replaced_or_refused(isolated_cache):
    sd = upstream.cached_sdist()
    sd.parent.mkdir(parents=True)
    sd.write_bytes(b"truncated")
    with pytest.raises(RollingKVError, match="not cached"):
        upstream.fetch_sdist(log=lambda m: None)
    assert not sd.exists()


def test_a_series_hash_is_fixed_when_it_is_first_read(tmp_path):
    """A build keys its directory and writes its manifest with one hash: a native file committed while it runs must not
    make the manifest claim a series the build was not made from (a later load sees the change)."""
    import shutil

    from rollingkv_cli.lib import paths

    patches, native = tmp_path / "patches", tmp_path / "native"
    shutil.copytree(paths.data_dir("patches"), patches)
    shutil.copytree(paths.data_dir("native"), native)
    series = patchset.load_series(patches, native)
    before = series.hash
    victim = native / series.native_files[0]
    victim.write_bytes(victim.read_bytes() + b"\n// changed while a build runs\n")
    assert series.hash == before
    assert patchset.load_series(patches, native).hash != before


def test_checkout_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, pristine_tree, monkeypatch):
    """Issue 27 (7): ENOSPC in the middle of the copy was an internal error (a 1.2 MB message listing every file) with a
    partial tree left behind."""
    import errno
    import shutil

    from rollingkv_cli.console import RollingKVError

    real = shutil.copytree

    def copytree(src, dst, **kw):
        real(Path(src) / "include", Path(dst) / "include")  # some of it written, then the disk is full
        raise shutil.Error([(f"{src}/f{i}", f"{dst}/f{i}", f"[Errno {errno.ENOSPC}] No space left on device") for i in range(5000)])

    monkeypatch.setattr(shutil, "copytree", copytree)
    dest = tmp_path / "new" / "co"
    with pytest.raises(RollingKVError) as e:
        patchset.checkout(dest, pristine_tree)
    assert "No space left on device (and 4999 more)" in e.value.message and "\n" not in e.value.message
    assert len(e.value.message) < 400
    assert not dest.exists() and not (tmp_path / "new").exists()
    empty = tmp_path / "empty"  # the user's own empty folder stays, emptied again
    empty.mkdir()
    with pytest.raises(RollingKVError):
        patchset.checkout(empty, pristine_tree)
    assert empty.is_dir() and not any(empty.iterdir())


def test_checkout_on_a_read_only_filesystem_is_refused_before_writing(tmp_path, pristine_tree, monkeypatch):
    import os

    from rollingkv_cli.console import RollingKVError

    real = os.statvfs

    class RO:
        def __init__(self, r):
            self._r = r

        def __getattr__(self, k):
            return getattr(self._r, k)

        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: RO(real(p)))
    with pytest.raises(RollingKVError) as e:
        patchset.checkout(tmp_path / "co", pristine_tree)
    assert "read-only filesystem" in e.value.message and not (tmp_path / "co").exists()
