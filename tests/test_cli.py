"""Every command's help, and bad input that must end in one clear line (no traceback)."""

from __future__ import annotations

import pytest

from rollingkv_cli.cli import rollingkv

COMMANDS = [
    [], ["build"], ["info"], ["run"], ["patches"], ["patches", "checkout"], ["patches", "export"],
    ["patches", "apply"], ["patches", "list"], ["model"], ["model", "demo"], ["model", "synth"],
    ["probe"], ["probe", "pcie"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "root")
def test_help(runner, cmd):
    for flag in ("-h", "--help"):
        result = runner.invoke(rollingkv, [*cmd, flag], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "Usage:" in result.output


def test_version(runner):
    from rollingkv_cli import __version__

    result = runner.invoke(rollingkv, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def run_main(args, capsys):
    """Through main(), as a user would: exit code + stderr, and no traceback."""
    import sys
    from unittest import mock

    from rollingkv_cli.cli import main

    code = 0
    with mock.patch.object(sys, "argv", ["rollingkv", *args]):
        try:
            main()
        except SystemExit as exc:
            code = exc.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return code, out.out, out.err


def test_unknown_option_value(capsys):
    code, _, err = run_main(["build", "--toolchain", "msvc"], capsys)
    assert code == 2 and "msvc" in err


def test_cuda_without_nvcc(capsys, monkeypatch, isolated_cache):
    from rollingkv_cli.lib import builder

    monkeypatch.setattr(builder, "nvcc_path", lambda: None)
    code, _, err = run_main(["build", "--cuda"], capsys)
    assert code == 1 and "nvcc" in err and "hint:" in err


def test_cosmocc_missing(capsys, monkeypatch, isolated_cache, tmp_path):
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name.startswith("cosmo") else real_which(name, *a, **k))
    code, _, err = run_main(["build", "--no-cuda", "--toolchain", "cosmocc"], capsys)
    assert code == 1 and "cosmocc" in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_no_compiler(capsys, monkeypatch, isolated_cache):
    import shutil

    real_which = shutil.which
    compilers = {"cc", "gcc", "clang", "c++", "g++", "clang++"}
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name in compilers else real_which(name, *a, **k))
    code, _, err = run_main(["build", "--no-cuda"], capsys)
    assert code == 1 and "compiler" in err


def test_offline_without_cached_sdist(capsys, isolated_cache):
    code, _, err = run_main(["build", "--no-cuda"], capsys)
    assert code == 1 and "not cached" in err and "ROLLINGKV_OFFLINE" in err


def test_source_not_llama_cpp(capsys, isolated_cache, tmp_path):
    code, _, err = run_main(["build", "--no-cuda", "--source", str(tmp_path)], capsys)
    assert code == 1 and "not a llama.cpp source tree" in err


def test_print_dir_not_built(capsys, isolated_cache):
    code, _, err = run_main(["build", "--no-cuda", "--print-dir"], capsys)
    assert code == 1 and "not built yet" in err


def test_info_without_build(capsys, isolated_cache):
    code, _, err = run_main(["info"], capsys)
    assert code == 1 and "no rollingkv build" in err and "rollingkv build" in err


def test_cuda_arch_garbage(capsys, monkeypatch, isolated_cache):
    from rollingkv_cli.lib import builder

    monkeypatch.setattr(builder, "nvcc_path", lambda: "/usr/bin/true")
    code, _, err = run_main(["build", "--cuda", "--cuda-arch", "sm90; rm -rf /"], capsys)
    assert code == 1 and "not a CUDA architecture" in err


def test_run_missing_model(capsys, isolated_cache):
    code, _, err = run_main(["run", "/nonexistent/model.gguf", "-p", "hi"], capsys)
    assert code == 1 and "not found" in err


def test_run_not_gguf(capsys, isolated_cache, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    code, _, err = run_main(["run", str(bad), "-p", "hi"], capsys)
    assert code == 1 and "not a GGUF" in err


def test_demo_offline_not_cached(capsys, isolated_cache):
    code, _, err = run_main(["model", "demo"], capsys)
    assert code == 1 and "not cached" in err


def test_synth_refuses_overwrite_and_bad_shapes(capsys, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    code, _, err = run_main(["model", "synth", str(out)], capsys)
    assert code == 1 and "--force" in err and out.read_bytes() == b"keep me"
    code, _, err = run_main(["model", "synth", str(tmp_path / "x.gguf"), "--embd", "100", "--heads", "3"], capsys)
    assert code == 2 and "multiple" in err  # a shape llama.cpp cannot run: a usage error
    assert not (tmp_path / "x.gguf").exists()


def test_patches_export_not_a_checkout(capsys, tmp_path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    code, _, err = run_main(["patches", "export", str(tmp_path)], capsys)
    assert code == 1 and "not a rollingkv patch checkout" in err


def test_assert_reference_resident_can_fail():
    """The check the bit-identity tests make of their reference (issue 27: 22) refuses a reference wired to a split."""
    import copy

    from conftest import assert_reference_resident

    plan = {"mode_chosen": "off", "split": False, "heads": {"split": False},
            "layers": [{"il": 0, "split": False, "tail_cells": 0, "host_heads": 0}]}
    good = {"reference": {"spec": "resident", "residency": {"mode": "off"}, "plan": plan, "context_via": "llama_init_from_model_rolling_kv"}}
    assert_reference_resident(good)
    for mutate in (lambda r: r["reference"].update(residency={"mode": "window", "window_cells": 256}),
                   lambda r: r["reference"]["plan"].update(mode_chosen="window", split=True),
                   lambda r: r["reference"]["plan"]["layers"][0].update(split=True, tail_cells=512),
                   lambda r: r["reference"]["plan"]["heads"].update(split=True),
                   lambda r: r["reference"].update(plan=None)):
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(AssertionError):
            assert_reference_resident(bad)


def test_gpu_tests_asked_for():
    """tests/test_gpu.py fails (not skips) on a GPU with a CPU build when `-m gpu` asked for its tests."""
    from test_gpu import gpu_tests_asked_for

    assert gpu_tests_asked_for("gpu") and gpu_tests_asked_for("gpu and not slow")
    assert not gpu_tests_asked_for("") and not gpu_tests_asked_for("not gpu") and not gpu_tests_asked_for("slow and not gpu")


def test_help_fits_80_columns(monkeypatch):
    """Issue 27 (18): every command's --help at 80 columns has no line over 80 (unwrappable blocks were up to 144)."""
    from click.testing import CliRunner

    from rollingkv_cli.cli import rollingkv
    from test_docs import _commands

    monkeypatch.setenv("COLUMNS", "80")
    long = []
    for path, _ in _commands(rollingkv):
        out = CliRunner().invoke(rollingkv, [*path, "--help"], terminal_width=80).output
        long += [f"{' '.join(path)}: {line}" for line in out.splitlines() if len(line) > 80]
    assert not long, "\n".join(long)


def _helps(monkeypatch, width: int = 80):
    from click.testing import CliRunner

    from test_docs import _commands

    monkeypatch.setenv("COLUMNS", str(width))
    for path, _ in _commands(rollingkv):
        yield " ".join(path) or "rollingkv", CliRunner().invoke(rollingkv, [*path, "--help"], terminal_width=width).output


def test_command_lists_give_whole_phrases(monkeypatch):
    """issue 39: `rollingkv --help` cut every description ("... against its PCIe..."): each command has a short_help
    that fits. Seen failing before the fix: 9 of the root's 9 commands and most subcommands ended in "..."."""
    cut = []
    for name, out in _helps(monkeypatch):
        listing = out.split("Commands:", 1)[1] if "Commands:" in out else ""
        cut += [f"{name}: {line}" for line in listing.splitlines() if line.rstrip().endswith("...")]
    assert not cut, "\n".join(cut)


def test_help_never_breaks_inside_a_word(monkeypatch):
    """issue 39: help text broke option names at their hyphens (`--kv-` / `window-cells`). Seen failing before the fix:
    gate equiv's help alone had 4 lines ending in a word and a hyphen ("floating-", "llama-", ...)."""
    import re

    broken = []
    for name, out in _helps(monkeypatch):
        broken += [f"{name}: {line}" for line in out.splitlines() if re.search(r"\w-$", line)]
    assert not broken, "\n".join(broken)


def test_help_cuts_a_word_longer_than_a_line_only_after_a_comma_or_a_slash(monkeypatch):
    """The sweep of 2026-12-06: a default longer than the help column was cut anywhere, `bench load --help` showed
    "[default: d" / "efault,split,resident,default-resident,vanilla]" and "docs/perf/<date>-bench-l" / "oad-<model>/...".
    Such a word now starts a line of its own and is cut after a comma or a slash. Each word of the 80-column help is a
    word of the 100-column one, or a piece of one that ends (or starts) at such a cut. Seen failing before the fix:
    bench load ("d", "efault,split,..."), bench tail ("docs/perf/<date>-bench-tail-<model", ">/bench-tail.json")."""
    wide = {name: set(out.split()) for name, out in _helps(monkeypatch, 100)}

    def a_clean_piece(tok: str, words: set[str]) -> bool:
        for w in words:
            i = w.find(tok)
            while i >= 0:
                if (i == 0 or w[i - 1] in ",/") and (i + len(tok) == len(w) or tok[-1] in ",/"):
                    return True
                i = w.find(tok, i + 1)
        return False

    cut = [f"{name}: {tok!r}" for name, out in _helps(monkeypatch) for tok in set(out.split()) - wide[name]
           if not a_clean_piece(tok, wide[name])]
    assert not cut, "\n".join(sorted(cut))
