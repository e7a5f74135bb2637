"""End to end on the CPU build: llama_cpp's ctypes bindings load OUR libllama, the ABI matches, the demo model answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_python

pytestmark = pytest.mark.build


def test_import_llama_cpp_loads_our_library(cpu_build):
    r = run_python(
        """
        import json, os
        from pathlib import Path
        from rollingkv_cli.lib import llama_ext
        llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
        print(json.dumps({"loaded": str(llama_ext.loaded_library_path(llama_cpp)), "info": ext.build_info(),
                          "api": ext.api_version(), "abi": ext.abi_mismatches(llama_cpp)}))
        """,
        cpu_build.lib_dir,
    )
    assert r["loaded"] == str(cpu_build.lib_dir / "libllama.so")
    assert f"pin={cpu_build.manifest['pin']}" in r["info"]
    assert f"series={cpu_build.manifest['series_hash'][:16]}" in r["info"]
    assert r["api"] >= 1
    assert r["abi"] == [], "llama_context_params / llama_model_params layouts must match llama-cpp-python 0.3.36"


def _load(lib_dir) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    code = f"from rollingkv_cli.lib import llama_ext; llama_ext.load(__import__('pathlib').Path({str(lib_dir)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_unpatched_library_is_refused(unpatched_build):
    """The pin's own libllama (`rollingkv build --unpatched`): llama_cpp binds it (same API), but it lacks our
    build-info symbol, so llama_ext refuses it by its own check. Fails when that check is dropped (the load succeeds)."""
    proc = _load(unpatched_build.lib_dir)
    assert proc.returncode != 0
    assert "is not a rollingkv build (no llama_rolling_kv_build_info)" in proc.stderr, proc.stderr[-2000:]
    assert "could not load" not in proc.stderr


def test_a_library_llama_cpp_cannot_bind_is_refused(tmp_path, cpu_build):
    """A real shared library that is not a libllama at all (libggml-base renamed): llama_cpp fails to bind its
    functions, which llama_ext says in one line."""
    import shutil

    fake = tmp_path / "lib"
    fake.mkdir()
    shutil.copy(cpu_build.lib_dir / "libggml-base.so", fake / "libllama.so")
    proc = _load(fake)
    assert proc.returncode != 0 and "llama_cpp could not load" in proc.stderr, proc.stderr[-2000:]


def test_demo_model_gives_finite_logits(cpu_build, demo_model):
    r = run_python(
        f"""
        import json, os, math
        from pathlib import Path
        from rollingkv_cli.lib import llama_ext
        llama_cpp, ext = llama_ext.load(Path(os.environ["RKV_TEST_LIB_DIR"]))
        llm = llama_cpp.Llama(model_path={str(demo_model)!r}, n_ctx=512, logits_all=True, verbose=False, flash_attn=True)
        toks = llm.tokenize(b"The capital of France is")
        llm.eval(toks)
        row = llm.scores[len(toks) - 1]
        top = int(row.argmax())
        print(json.dumps({{"finite": bool(all(math.isfinite(float(x)) for x in row)), "n_vocab": len(row),
                          "top": llm.detokenize([top]).decode(errors="replace")}}))
        """,
        cpu_build.lib_dir,
    )
    assert r["finite"]
    assert r["n_vocab"] == 49152
    assert r["top"].strip() == "Paris"


def test_rollingkv_run_answers(cpu_build, demo_model, monkeypatch):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "rollingkv_cli", "run", "demo", "-p", "What is the capital of France? Answer in one word.", "-n", "16"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.build
def test_the_tail_types_are_the_librarys(cpu_build):
    """kvtypes.TAIL_TYPES (serve's -ctkt/-ctvt, the gates', bench tail's, the docs') is the list the library accepts
    (ggml_rkv_tail_type_names), and every one of them is a type the library can name (issue 27: 10)."""
    from rollingkv_cli import kvtypes
    from rollingkv_cli.bench import arithmetic
    from rollingkv_cli.gate import common as gate_common
    from rollingkv_cli.serve.settings import SETTINGS

    assert kvtypes.library_tail_types(cpu_build.lib_dir) == kvtypes.TAIL_TYPES
    assert "iq4_nl" not in kvtypes.TAIL_TYPES and "iq4_nl" in kvtypes.WINDOW_TYPES
    # every option that takes a tail type takes the library's list and auto (the planner's choice), nothing else
    assert kvtypes.TAIL_TYPE_CHOICES == kvtypes.TAIL_TYPES + ("auto",)
    assert SETTINGS["cache_type_k_tail"].choices == SETTINGS["cache_type_v_tail"].choices == kvtypes.TAIL_TYPE_CHOICES
    assert tuple(gate_common.CACHE_TYPES) == kvtypes.TAIL_TYPES and set(arithmetic.CACHE_TYPES) == set(kvtypes.TAIL_TYPES)
    assert tuple(gate_common.TAIL_CHOICES) == kvtypes.TAIL_TYPE_CHOICES
    cli_md = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md").read_text()
    assert f"T, a cache type: {', '.join(kvtypes.TAIL_TYPES)}" in cli_md


def test_library_tail_types_without_a_library(tmp_path):
    from rollingkv_cli import kvtypes

    assert kvtypes.library_tail_types(tmp_path) is None
