"""`rollingkv serve` with auto tail types (-ctkt/-ctvt auto, `cache_type_k_tail: auto`): passed through, and refused before
llama-server starts where it cannot mean anything (mode off, a window that leaves no tail, a head split whose heads cannot
take the compressed types), one line each, exit 2."""

from __future__ import annotations

import shlex

import pytest

from test_cli import run_main


@pytest.fixture
def build_env(monkeypatch, cpu_build):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))


def _argv(capsys, *args) -> list[str]:
    code, out, err = run_main(["serve", *args, "--print-args"], capsys)
    assert code == 0, err
    return shlex.split(out.strip().splitlines()[-1])


def test_auto_is_passed_through(capsys, build_env, tmp_path):
    argv = _argv(capsys, "demo", "-ctkt", "auto", "-ctvt", "auto", "--kv-window-cells", "256")
    assert argv[argv.index("-ctkt") + 1] == "auto" and argv[argv.index("-ctvt") + 1] == "auto"
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: demo\ncache_type_k_tail: auto\ncache_type_v_tail: q8_0\n")
    argv = _argv(capsys, "--config", str(cfg))
    assert argv[argv.index("-ctkt") + 1] == "auto" and argv[argv.index("-ctvt") + 1] == "q8_0"


@pytest.mark.parametrize("args,yaml_text,message", [
    (["--kv-residency-mode", "off", "-ctkt", "auto"], None, "--cache-type-k-tail auto chooses the type of a split's tail, and --kv-residency-mode off never splits"),
    (["-ctvt", "auto"], "kv_residency_mode: 'off'\n", "kv_residency_mode off never splits"),
    (["-c", "4096", "--kv-window-cells", "4096", "-ctkt", "auto"], None, "--kv-window-cells 4096 holds each slot's whole context (4096 cells)"),
    (["-c", "4096", "-np", "2", "--kv-window-cells", "2048", "-ctvt", "auto"], None, "holds each slot's whole context (2048 cells)"),
    (["-ctkt", "automatic"], None, "automatic"),
    ([], "cache_type_k_tail: automatic\n", "cache_type_k_tail"),
])
def test_refused_with_one_line_exit_2(capsys, isolated_cache, tmp_path, args, yaml_text, message):
    extra = []
    if yaml_text is not None:
        cfg = tmp_path / "s.yaml"
        cfg.write_text("model: demo\n" + yaml_text)
        extra = ["--config", str(cfg)]
    code, _, err = run_main(["serve", *(["demo"] if yaml_text is None else []), *args, *extra, "--print-args"], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.lower().startswith("error:")]) == 1


def test_a_window_that_spills_is_fine(capsys, build_env):
    argv = _argv(capsys, "demo", "-c", "4096", "-np", "2", "--kv-window-cells", "1024", "-ctkt", "auto")
    assert argv[argv.index("--kv-window-cells") + 1] == "1024"


def test_a_head_split_whose_heads_cannot_take_the_type(capsys, build_env, tmp_path):
    from rollingkv_cli import models

    m40 = models.write_synthetic(tmp_path / "h40.gguf", models.SynthSpec(layers=2, embd=160, heads=4, kv_heads=4, ff=256, vocab=300, ctx=512))
    code, _, err = run_main(["serve", str(m40), "--kv-residency-mode", "head", "-ctkt", "auto", "--print-args"], capsys)
    assert code == 2 and "host heads (K head size 40) cannot take the q8_0/q4_0 tail that -ctkt auto chooses" in err
    # explicit types that divide the heads, or a window split of the same model: fine
    _argv(capsys, str(m40), "--kv-residency-mode", "head", "-ctkt", "f16")
    _argv(capsys, str(m40), "-ctkt", "auto")
    m64 = models.write_synthetic(tmp_path / "h64.gguf", models.SynthSpec(layers=2, embd=256, heads=4, kv_heads=2, ff=256, vocab=300, ctx=512))
    _argv(capsys, str(m64), "--kv-device-heads", "1", "-ctkt", "auto", "-ctvt", "auto")


def test_a_build_before_auto_is_refused(capsys, build_env, monkeypatch):
    from rollingkv_cli.serve import launch

    monkeypatch.setattr(launch, "build_has_tail_auto", lambda lib: False)
    code, _, err = run_main(["serve", "demo", "-ctvt", "auto", "--print-args"], capsys)
    assert code == 1 and "-ctvt auto: the active build" in err and "API 7" in err


def test_the_cpu_attention_figure_is_left_to_the_plan(demo_model):
    """The CPU part's figure depends on the tail's K type, which auto chooses only when it plans: llama-server measures it."""
    from rollingkv_cli.serve.launch import resolve_cpu_attn
    from rollingkv_cli.serve.settings import ServeSettings

    s = ServeSettings(model=demo_model, cache_type_k_tail="auto", kv_tail_cpu_frac="auto")
    gbps, text = resolve_cpu_attn(s, True, "key", True)
    assert gbps is None and "llama-server measures it for the type it chooses" in text
