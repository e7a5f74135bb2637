"""Build directories: keyed, manifest written last, no-op rebuilds, interrupted builds never used."""

from __future__ import annotations

import json

import pytest

from rollingkv_cli.lib import builder, patchset



@pytest.mark.build
def test_rebuild_with_nothing_changed_is_a_fast_no_op(cpu_build, monkeypatch):
    """Structural, not a wall-clock bound (5 s on a loaded 2-core CI was the check): with nothing changed the build takes
    no lock and runs no configure, patch or compile step. Seen failing with the series' hash changed (a monkeypatched
    patchset.load_series): the build then goes past the no-op into the locked build, which fails here at once."""
    def never(*a, **k):
        raise AssertionError("a rebuild with nothing changed went into the build")

    monkeypatch.setattr(builder, "_build_lock", never)
    monkeypatch.setattr(builder, "_build_locked", never)
    again = builder.build(builder.BuildOptions(cuda=False), quiet=True, activate=False)
    assert again.dir == cpu_build.dir
    assert again.manifest["built_at"] == cpu_build.manifest["built_at"]


@pytest.mark.build
def test_manifest_records_what_went_in(cpu_build):
    m = cpu_build.manifest
    series = patchset.load_series()
    assert m["pin"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert m["series_hash"] == series.hash
    assert m["patches"] == series.patch_hashes()
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in m["cmake_flags"] and "-DLLAMA_BUILD_UI=OFF" in m["cmake_flags"]
    for a in ("libllama.so", "llama-server", "llama-bench", "test-rolling-kv-ops"):
        assert a in m["artifacts"] and (cpu_build.bin_dir / a).exists()


def test_keys_differ_by_options_and_series():
    s = patchset.load_series().hash
    a = builder.BuildOptions(cuda=False).key(s)
    assert a != builder.BuildOptions(cuda=True, cuda_arch="90").key(s)
    assert a != builder.BuildOptions(cuda=False, backend_dl=True).key(s)
    assert a != builder.BuildOptions(cuda=False).key("0" * 64)
    # a lab build: its own key even before its series hash differs, and no old key moves
    assert a != builder.BuildOptions(cuda=False, lab=True).key(s)
    import hashlib
    from dataclasses import asdict

    from rollingkv_cli.lib import upstream

    before_lab = {k: v for k, v in asdict(builder.BuildOptions(cuda=False)).items() if k not in ("unpatched", "lab")}
    assert a == hashlib.sha256(json.dumps({"pin": upstream.PIN.llama_cpp_commit, "series": s, "options": before_lab},
                                          sort_keys=True).encode()).hexdigest()[:16]
    assert builder.series_for(builder.BuildOptions(lab=True)).hash == patchset.load_series(lab=True).hash != s


def test_lab_and_unpatched_are_refused_together():
    from rollingkv_cli.console import RollingKVError

    with pytest.raises(RollingKVError, match="exclude each other"):
        builder.validate_options(builder.BuildOptions(unpatched=True, lab=True))


@pytest.mark.build
def test_half_written_build_is_never_used(tmp_path, cpu_build):
    """A build directory without a manifest (an interrupted build) or with an artifact missing is not a build."""
    fake = tmp_path / "b"
    (fake / "build" / "bin").mkdir(parents=True)
    assert builder.Build.load(fake) is None
    manifest = dict(cpu_build.manifest)
    (fake / "manifest.json").write_text(json.dumps(manifest))
    assert builder.Build.load(fake) is None  # artifacts missing
    (fake / "manifest.json").write_text("{ truncated")
    assert builder.Build.load(fake) is None


@pytest.mark.build
def test_info_json_shows_the_active_build(cpu_build, monkeypatch, capsys):
    from test_cli import run_main

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, out, _ = run_main(["info", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["dir"] == str(cpu_build.dir) and data["stale"] is False
    code, out, _ = run_main(["build", "--no-cuda", "--print-dir"], capsys)
    assert code == 0 and out.strip() == str(cpu_build.dir)


@pytest.mark.parametrize(
    "opts, present, absent",
    [
        (builder.BuildOptions(), ["-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=ON"], ["-DGGML_CUDA=ON", "-DGGML_BACKEND_DL=ON"]),
        (builder.BuildOptions(cuda=True, cuda_arch="90"), ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"], ["-DGGML_BACKEND_DL=ON"]),
        (builder.BuildOptions(cuda=True, cuda_arch="90", backend_dl=True), ["-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON"], []),
        (builder.BuildOptions(toolchain="cosmocc"), ["-DCMAKE_C_COMPILER=cosmocc", "-DCMAKE_CXX_COMPILER=cosmoc++"], []),
    ],
)
def test_cmake_flags(tmp_path, opts, present, absent):
    flags = builder.cmake_flags(opts, tmp_path, "ab" * 32)
    for f in present:
        assert f in flags
    for f in absent:
        assert f not in flags
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in flags and "-DLLAMA_BUILD_UI=OFF" in flags
    if opts.backend_dl:
        assert f"-DGGML_BACKEND_DIR={tmp_path / 'build' / 'bin'}" in flags



def _fake_build(d: Path) -> Path:
    (d / "build" / "bin").mkdir(parents=True)
    (d / "manifest.json").write_text('{"artifacts": []}')
    return d


def test_a_copied_cache_uses_its_own_copy_of_the_active_build(tmp_path, monkeypatch):
    """Issue 39: `cp -a` of the cache with ROLLINGKV_CACHE_DIR at the copy still used the original's build (the pointer
    is absolute). The pointer into a cache's builds/ resolves relative to this cache's root now, where the copy has the
    build; the file keeps its absolute form (older versions sharing a cache read it); a relative one is read from the
    root; a build outside the cache stays as written. Seen failing before the fix: the copy's active build was
    <orig>/builds/abc."""
    import shutil

    from rollingkv_cli.lib import builder, paths

    monkeypatch.delenv("ROLLINGKV_BUILD", raising=False)
    orig = tmp_path / "orig"
    bdir = _fake_build(orig / "builds" / "abc")
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(orig))
    builder.set_active(bdir)
    assert (orig / "active-build").read_text().strip() == str(bdir)
    assert builder.active_build().dir == bdir
    shutil.copytree(orig, tmp_path / "copy", symlinks=True)
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path / "copy"))
    assert builder.active_build().dir == tmp_path / "copy" / "builds" / "abc"
    shutil.move(str(orig), str(tmp_path / "gone"))  # the original moved away: the copy does not care
    assert builder.active_build().dir == tmp_path / "copy" / "builds" / "abc"
    (tmp_path / "copy" / "active-build").write_text("builds/abc\n")
    assert builder.active_build().dir == tmp_path / "copy" / "builds" / "abc"
    shutil.move(str(tmp_path / "gone"), str(orig))
    (tmp_path / "copy" / "active-build").write_text(f"{bdir}\n")
    shutil.rmtree(tmp_path / "copy" / "builds" / "abc")  # the copy lacks it: the original's, as written
    assert builder.active_build().dir == bdir

    outside = _fake_build(tmp_path / "elsewhere" / "mybuild")
    builder.set_active(outside)
    assert paths.active_build_file().read_text().strip() == str(outside)
    assert builder.active_build().dir == outside
