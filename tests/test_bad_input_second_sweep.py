"""Issue 39's second sweep: what a new user's bad inputs still got wrong after the sixteen rows were fixed (the sweep
and its classes: docs/testing.md, "The second sweep"). Each test was seen failing on the code before its fix, as its
docstring says; in-process where no child is needed, a subprocess on the CPU build where llama.cpp runs."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollingkv_cli.console import RollingKVError
from test_cli import run_main


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _cli(cpu_build, *args, timeout: float = 120, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "rollingkv_cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return errors[0]


# ------------------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("args", [["run", "", "-p", "hi"], ["bench", "tail", "", "--dry-run"], ["bench", "load", "", "--dry-run"]],
                         ids=["run", "bench tail", "bench load"])
def test_an_empty_model_is_a_usage_error(args, capsys, isolated_cache):
    """An empty MODEL ('' from an unset shell variable) was "error: model  is not a file" (Path('') is the current
    directory), exit 1; serve and the gates said "no MODEL given" with exit 2. Now every command says so."""
    code, _, err = run_main(args, capsys)
    assert code == 2 and _errors(err) == ["error: no MODEL given (an empty string)"], err


@pytest.mark.parametrize("seed", ["-5", "4294967295", "4294967296", str(2**70)])
def test_run_refuses_a_seed_llama_cpp_would_wrap(seed, capsys, isolated_cache):
    """llama.cpp's seed is 32 bits: `run --seed 4294967296` answered exactly as --seed 0 (wrapped), -5 as 4294967291,
    and 4294967295 means a random seed there. Refused now (exit 2), before anything loads."""
    code, _, err = run_main(["run", "demo", "-p", "hi", "--seed", seed, "--temperature", "0.8"], capsys)
    assert code == 2 and "--seed" in err and "0<=x<=4294967294" in err, err


@pytest.mark.parametrize("args", [
    ["gate", "equiv", "{m}", "--threads", "100000"],
    ["gate", "needle", "{m}", "--threads", "513"],
    ["bench", "tail", "{m}", "-t", "1000", "--dry-run"],
    ["serve", "{m}", "--print-args", "--", "-t", "100000"],
    ["serve", "{m}", "--print-args", "--", "--threads-batch=600"],
    ["bench", "load", "{m}", "--dry-run", "--", "-t", "9999"],
], ids=["gate equiv", "gate needle", "bench tail", "serve -t", "serve --threads-batch", "bench load -t"])
def test_thread_counts_past_ggmls_most_are_refused(args, capsys, isolated_cache, fake_gguf):
    """`gate equiv --threads 100000` ended in "the reference run failed (killed by SIGSEGV ...)" with advice to rebuild;
    `serve -- -t 100000` in llama-server's SIGSEGV at start-up. Every thread count stops at ggml's GGML_MAX_N_THREADS
    (512), exit 2, before anything starts."""
    code, _, err = run_main([a.replace("{m}", str(fake_gguf)) for a in args], capsys)
    assert code == 2 and "512" in err and "GGML_MAX_N_THREADS" in err, err


def test_serve_refuses_a_bandwidth_past_a_float(capsys, isolated_cache, fake_gguf):
    """`serve --pcie-bw-gbps 1e308` was passed on: llama-server read it as a float (inf) and refused it after loading the
    model, and serve's hint pointed at the arguments after `--`. Refused at once now, exit 2."""
    code, _, err = run_main(["serve", str(fake_gguf), "--pcie-bw-gbps", "1e308", "--print-args"], capsys)
    assert code == 2 and "--pcie-bw-gbps" in err and "at most 3.40282e+38" in err, err


@pytest.mark.build
def test_bench_tail_refuses_depths_and_links_it_cannot_run(capsys, cpu_build, demo_model, monkeypatch, tmp_path):
    """`bench tail -d 1099511627776` printed llama-bench's usage for every cell (its -d is an int); `-d 2000000000` on a
    CPU build failed every cell's context one after another (41.9 TiB of KV); `--pcie-bw-gbps inf` wrote Infinity into
    the JSON report (not JSON). Each is one line before any cell now."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, _, err = run_main(["bench", "tail", str(demo_model), "-d", str(2**40), "--dry-run"], capsys)
    assert code == 2 and "more than llama-bench's int holds" in err, err
    code, _, err = run_main(["bench", "tail", str(demo_model), "-d", "2000000000", "--dry-run"], capsys)
    assert code == 1 and "the KV cache of 2000000256 cells (f16/f16)" in _errors(err)[0] and "MemAvailable" in err, err
    code, _, err = run_main(["bench", "tail", str(demo_model), "--pcie-bw-gbps", "inf", "--dry-run"], capsys)
    assert code == 2 and "positive finite number" in err, err
    code, _, err = run_main(["bench", "load", str(demo_model), "--ctx-per-slot", "50000000", "--dry-run"], capsys)
    assert code == 1 and "the KV cache of 200000000 cells (f16/f16)" in _errors(err)[0], err
    # the cache type given after `--` is the one counted
    code, _, err = run_main(["bench", "load", str(demo_model), "--ctx-per-slot", "50000000", "--dry-run", "--", "-ctk", "q4_0",
                             "-ctv", "q4_0"], capsys)
    assert code == 1 and "(q4_0/q4_0)" in _errors(err)[0], err


# -------------------------------------------------------------------------------------------- config values


def test_a_key_given_twice_in_a_config_file_is_refused(capsys, isolated_cache, tmp_path):
    """YAML keeps the last of two equal keys silently: `model: demo` then `model: other` served other (here: "model
    other not found"). Now one line naming the key and both lines."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: demo\nctx_size: 4096\nparallel: 2\nctx_size: 2048\n")
    code, _, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == 1 and "the key 'ctx_size' is given twice (first on line 2) (line 4, column 1)" in _errors(err)[0], err
    from rollingkv_cli.userinput import read_yaml

    ok = tmp_path / "ok.yaml"
    ok.write_text("a: {x: 1, y: 2}\nb: [{x: 1}, {x: 2}]\n")  # the same key in different mappings is fine
    assert read_yaml(ok, "f") == {"a": {"x": 1, "y": 2}, "b": [{"x": 1}, {"x": 2}]}
    nested = tmp_path / "n.yaml"
    nested.write_text("a:\n  x: 1\n  x: 2\n")
    with pytest.raises(RollingKVError, match="the key 'x' is given twice"):
        read_yaml(nested, "f")


# ---------------------------------------------------------------------------------------- environment variables


@pytest.mark.build
def test_serve_on_a_cpu_build_checks_the_link_variable(capsys, cpu_build, demo_model, monkeypatch):
    """`ROLLINGKV_PCIE_BW_GBPS=abc rollingkv serve` on a CPU build started (the variable was read only on a GPU), while
    `gate equiv` and `probe pcie` refused it: the same setup failed once it met a GPU. serve refuses it everywhere now."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setenv("ROLLINGKV_PCIE_BW_GBPS", "abc")
    code, _, err = run_main(["serve", str(demo_model), "--print-args"], capsys)
    assert code == 1 and "$ROLLINGKV_PCIE_BW_GBPS='abc' is not a number of GB/s" in _errors(err)[0], err


# ---------------------------------------------------------------------------------------------- output paths


def test_an_output_file_on_a_pseudo_filesystem_is_refused_before_the_run():
    """`gate needle --json /proc/x.json` ran the whole gate, then "cannot write /proc/x.json: No such file or
    directory"; `bench load --json /proc/x.json` failed its first cell's log. The output file's check refuses a pseudo
    filesystem now, as the output directory's check did."""
    from rollingkv_cli.userinput import check_output_file

    for path in ("/proc/x.json", "/sys/x.png"):
        with pytest.raises(RollingKVError, match="is not on a disk"):
            check_output_file(path, "report")


def test_bench_plot_refuses_a_device(capsys, monkeypatch, tmp_path):
    """`bench plot REPORT -o /dev/full` said "✓ plot: /dev/full". Refused now, before drawing, as --json is."""
    from rollingkv_cli.bench import cli as bench_cli
    from rollingkv_cli.bench import plot as plotting

    drawn = []
    monkeypatch.setattr(bench_cli, "_load_report", lambda path: {"cells": []})
    monkeypatch.setattr(plotting, "have_matplotlib", lambda: True)
    monkeypatch.setattr(plotting, "render", lambda doc, out: drawn.append(out))
    code, _, err = run_main(["bench", "plot", str(tmp_path / "r.json"), "-o", "/dev/full"], capsys)
    assert code == 1 and "cannot write plot /dev/full: it is a device" in _errors(err)[0] and drawn == [], err
    code, out, err = run_main(["bench", "plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "p.png")], capsys)
    assert code == 0 and drawn == [tmp_path / "p.png"], err


# -------------------------------------------------------------- llama-server's own refusals, said in the line


def test_llama_servers_refusals_are_read_from_its_log():
    from rollingkv_cli.serve.server import arg_error_in_log, memory_error_in_log, model_error_in_log

    assert arg_error_in_log(["$ llama-server ...", "error: invalid argument: --bogus"]) == "invalid argument: --bogus"
    assert arg_error_in_log(['error while handling argument "-b": stoi', "", "usage:"]) == 'error while handling argument "-b": stoi'
    assert arg_error_in_log(['error while handling environment variable "LLAMA_ARG_N_PARALLEL": stoi']).endswith("stoi")
    assert arg_error_in_log(["0.00.1 I main: loading", "0.01 E srv  load_model: failed"]) is None
    log = ["0.00.413086 E ggml_aligned_malloc: insufficient memory (attempted to allocate 87890.62 MB)",
           "0.00.420309 E llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache"]
    assert memory_error_in_log(log) == "llama.cpp could not allocate the KV cache (87890.62 MB)"
    assert memory_error_in_log(log[:1]) == "llama.cpp could not allocate 87890.62 MB of memory"
    assert memory_error_in_log(["all is well"]) is None
    assert model_error_in_log(["0.00.01 E llama_model_load: error loading model: unknown model architecture: 'foo'"]) == \
        "llama.cpp could not load the model: unknown model architecture: 'foo'"


def test_the_servers_address_comes_before_the_users_arguments():
    """serve put its --host/--port after the arguments given after `--`: `serve demo -- --api-key` (its value forgotten)
    made --host the API key, and llama-server said "invalid argument: 127.0.0.1"."""
    from rollingkv_cli.serve.server import ServerProcess

    srv = ServerProcess(Path("/bin/llama-server"), ["-m", "m.gguf", "--api-key"], port=8123)
    assert srv.command == ["/bin/llama-server", "--host", "127.0.0.1", "--port", "8123", "-m", "m.gguf", "--api-key"]


@pytest.mark.build
@pytest.mark.parametrize("extra,expect", [
    (["--bogus-flag"], "invalid argument: --bogus-flag"),
    (["--api-key"], 'error while handling argument "--api-key": expected value for argument'),
    (["-b", "abc"], 'error while handling argument "-b"'),
], ids=["unknown flag", "a flag without its value", "a value it cannot read"])
def test_serve_says_what_llama_server_refused(cpu_build, demo_model, extra, expect):
    """An argument llama-server refuses after `--` was "llama-server exited during start-up (exit status 1)" after a box
    of its log; now the one line says what it refused (and no box)."""
    proc = _cli(cpu_build, "serve", str(demo_model), "--port", "0", "--", *extra)
    assert proc.returncode == 1
    line = _one_error(proc)
    assert line.startswith("error: llama-server exited during start-up (exit status 1): ") and expect in line, line
    assert "llama-server --help" in proc.stderr and "last lines of" not in proc.stdout + proc.stderr


@pytest.mark.build
def test_a_cache_the_host_cannot_hold_is_refused_before_the_server_starts(capsys, cpu_build, demo_model, monkeypatch):
    """On a CPU build the whole KV cache is in host memory. `serve demo -c 2000000000` had llama-server killed by the
    kernel's out-of-memory killer (which may pick another process); -c 4000000 failed its allocation after a 15-line
    log box; `gate needle --filler-tokens 10000000` said only "exited during start-up (exit status 1)". Both now refuse
    a cache larger than MemAvailable, before any server starts (counted at the smallest type pair it may use)."""
    from rollingkv_cli.hw import hostinfo

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setattr(hostinfo, "mem_available_bytes", lambda: 1 << 30)  # 1 GiB available: the same on every host
    cases = [(["serve", str(demo_model), "-c", "2000000000", "--print-args"], "a context of 2000000000 cells: the KV cache of 2000000000 cells (f16/f16)"),
             (["serve", str(demo_model), "--print-args", "--", "-c", "100000"], "the KV cache of 100000 cells (f16/f16)"),
             (["serve", str(demo_model), "-c", "400000", "-ctk", "q4_0", "-ctv", "q4_0", "--print-args"], "(q4_0/q4_0)"),
             (["gate", "needle", str(demo_model), "--filler-tokens", "100000"], "the KV cache of 105472 cells (f16/f16)")]
    for args, expect in cases:
        code, _, err = run_main(args, capsys)
        assert code == 1 and expect in _errors(err)[0] and "1.00 GiB available (MemAvailable)" in err, (args, err)
    code, out, err = run_main(["serve", str(demo_model), "-c", "4096", "--print-args"], capsys)  # 94 MiB: fits
    assert code == 0, err


def test_llama_servers_memory_failure_is_named(monkeypatch, tmp_path):
    """What the pre-check does not see (a GPU build's host memory, another process's use): the start-up failure's line
    says the cache could not be allocated, from llama-server's log, and what to lower (before: "exit status 1")."""
    from rollingkv_cli.serve.server import ServerProcess

    log = tmp_path / "srv.log"
    script = tmp_path / "fake-server"
    script.write_text("#!/bin/sh\necho '0.00.41 E ggml_aligned_malloc: insufficient memory (attempted to allocate 87890.62 MB)'\n"
                      "echo '0.00.42 E llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache'\n"
                      "exit 1\n")
    script.chmod(0o755)
    srv = ServerProcess(script, [], log_path=log)
    srv.start()
    with pytest.raises(RollingKVError) as e:
        srv.wait_healthy(timeout=30)
    srv.stop()
    assert e.value.message == ("llama-server exited during start-up (exit status 1): llama.cpp could not allocate the KV "
                               "cache (87890.62 MB)")
    assert e.value.hint.startswith("lower -c/--ctx-size") and srv.failure_reason


def _unknown_architecture(path: Path) -> Path:
    key, value = b"general.architecture", b"foo"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IQ", 8, len(value)) + value)
    return path


@pytest.mark.build
def test_a_model_llama_cpp_will_not_load_is_named(cpu_build, tmp_path):
    """A GGUF of an architecture llama.cpp does not know: `run` said "unknown model architecture: 'foo'", serve and
    gate needle only "exited during start-up (exit status 1)", gate equiv "llama.cpp says why in its log". Each says
    llama.cpp's reason now."""
    m = _unknown_architecture(tmp_path / "foo.gguf")
    for args in (["serve", str(m), "--port", "0"], ["gate", "needle", str(m)], ["gate", "equiv", str(m), "--synthetic-tokens", "64"]):
        proc = _cli(cpu_build, *args)
        assert proc.returncode == 1, (args, proc.stderr)
        line = _one_error(proc)
        assert "could not load the model" in line and "unknown model architecture: 'foo'" in line, (args, line)


@pytest.mark.build
def test_bench_load_says_why_a_cell_failed(cpu_build, demo_model, tmp_path):
    """A cell whose server does not start was a "failed" in the table and nothing else on screen (the reason only in
    the report, as "RollingKVError: ..."). Now a warning line per failed cell says why, and the report keeps the
    message and its hint."""
    out = tmp_path / "bench-load.json"
    proc = _cli(cpu_build, "bench", "load", str(demo_model), "--long", "300", "4", "--short", "64", "4", "--shorts", "1", "-np", "2",
                "--cells", "split", "--json", str(out), "--", "--bogus")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: cell split failed: ")]
    assert len(warnings) == 1 and "invalid argument: --bogus" in warnings[0], proc.stderr
    cell = json.loads(out.read_text())["cells"][0]
    assert cell["status"] == "failed" and cell["error"].startswith("llama-server exited during start-up") and "hint" in cell


# ----------------------------------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", ["SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU"])
def test_every_signal_that_ends_a_process_unwinds(sig):
    """SIGQUIT (Ctrl-\\), SIGUSR1/2, SIGALRM and SIGXCPU ended the CLI on the spot: `gate equiv` left its work folder of
    reference logits (1.5 GB here) and `rollingkv run` its child answering on the terminal. Inside stop_signals_raise
    (cli.main runs every command in it) each raises Terminated, as SIGTERM does; its `finally` blocks run. In a child
    process: before the fix the signal ended the process that received it."""
    code = f"""
import os, signal, sys, time
from rollingkv_cli.lib.procs import Terminated, stop_signals_raise, stop_signum
try:
    with stop_signals_raise():
        try:
            os.kill(os.getpid(), signal.{sig})
            time.sleep(5)
        finally:
            print("cleaned up", flush=True)
except Terminated as e:
    print("Terminated", stop_signum(e) == signal.{sig}, flush=True)
print("restored", signal.getsignal(signal.{sig}) in (signal.SIG_DFL, signal.SIG_IGN), flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split("\n")[:3] == ["cleaned up", "Terminated True", "restored True"], \
        (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.build
def test_a_sigkilled_run_takes_its_child_along(tmp_path, cpu_build, demo_model):
    """`rollingkv run` answers in a forked child (llama.cpp's aborts end only it); SIGKILL of the command left that child
    answering on the terminal, re-parented, until its 3000 tokens were done. Now it dies with the command."""
    from proctree import descendant_running, killed_outright, wait_for

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Write a very long story about a dragon and a lighthouse.")
    proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "run", str(demo_model), "--prompt-file", str(prompt), "-n", "3000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)})
    with killed_outright(proc, "run"):
        wait_for(lambda: descendant_running(proc.pid, str(prompt)), 60, "run's child")
        time.sleep(2)  # inside llama.cpp's decode


def _slot_busy(srv_pid: int) -> bool:
    """Whether the llama-server of pid is processing a request (its port from its command line, then /slots)."""
    import urllib.request

    from proctree import cmdline

    args = cmdline(srv_pid)
    if "--port" not in args:
        return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{args[args.index('--port') + 1]}/slots", timeout=2) as r:
            return any(s.get("is_processing") for s in json.loads(r.read().decode()))
    except OSError:
        return False


@pytest.mark.build
def test_a_stopped_gate_needle_does_not_wait_for_the_prefill(cpu_build, demo_model, tmp_path):
    """SIGTERM (or Ctrl-C) while gate needle's server prefills: llama-server finishes the batch it is on before it stops,
    and the gate waited the 15 s grace before its SIGKILL (exit 15 s after the signal). A gate's server holds nothing to
    wait for: 2 s, then SIGKILL."""
    from proctree import descendant_running, descendants, kill_all, wait_for, wait_gone

    proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "gate", "needle", str(demo_model), "--filler-tokens", "6000",
                             "--threads", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)})
    kids: set[int] = set()
    try:
        srv = wait_for(lambda: descendant_running(proc.pid, "--no-warmup"), 120, "the reference's llama-server")
        wait_for(lambda: _slot_busy(srv), 120, "the first prompt's prefill")
        time.sleep(1)
        kids = descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        assert proc.returncode == 143 and "stopped by SIGTERM" in err, err
        assert took < 8, f"gate needle took {took:.1f} s to stop"
        assert not wait_gone(kids, 2.0)
    finally:
        kill_all(kids)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# =============================================================================================================
# The sweep of 2026-12-06 (a new user again, after the second sweep's fixes): docs/testing.md, "the third sweep".
# Each test was seen failing on main ae98576, as its docstring says.


def test_a_settings_file_past_64_kib_is_refused_before_parsing(capsys, isolated_cache, tmp_path):
    """A configuration bomb without an alias: a 6 MB `x: [1,1,1,...]` in --config or --thresholds was parsed by
    PyYAML for more than 60 s, 1.9 GB resident, before any check saw it (the reads stopped only at 256 MiB, the cap for
    prompts). Settings files are a few dozen lines: more than 64 KiB is refused before parsing, with one line. Seen
    failing before the fix: the 100 KiB file below was parsed, then "unknown key(s) x"."""
    big = tmp_path / "c.yaml"
    big.write_text("x: [" + ",".join(["1"] * 50000) + "]\n")
    code, _, err = run_main(["serve", "demo", "--config", str(big), "--print-args"], capsys)
    assert code == 1 and "it holds more than 64 KiB, the most rollingkv reads from a config file" in _errors(err)[0], err
    from rollingkv_cli.gate.metrics import ThresholdsError, load_thresholds

    for suffix in (".yaml", ".json"):
        th = tmp_path / f"t{suffix}"
        th.write_text('{"x": [' + ",".join(["1"] * 50000) + "]}")
        with pytest.raises(ThresholdsError, match="more than 64 KiB"):
            load_thresholds(th, "same_type")


@pytest.mark.parametrize("key", ["pcie_bw_gbps", "kv_tail_cpu_frac", "threshold"])
def test_an_integer_past_a_float_is_a_bad_value_not_a_crash(key, capsys, isolated_cache, tmp_path):
    """`pcie_bw_gbps: 1000...0` (400 digits) in a config file, or `max_mean_tv: 1000...0` in a thresholds file, ended in
    "internal error: OverflowError: int too large to convert to float". Now the value's own line (exit 2 / the
    thresholds error), the number cut short."""
    huge = "1" + "0" * 400
    if key == "threshold":
        from rollingkv_cli.gate.metrics import ThresholdsError, load_thresholds

        th = tmp_path / "t.yaml"
        th.write_text(f"max_mean_tv: {huge}\n")
        with pytest.raises(ThresholdsError, match=r"max_mean_tv must be a finite number or null, not 1000.*\.\.\.") as e:
            load_thresholds(th, "same_type")
        assert len(str(e.value)) < 200
        return
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: demo\n{key}: {huge}\n")
    code, _, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == 2 and f"{key} must be" in _errors(err)[0] and "internal error" not in err, err


def test_one_setting_spelled_twice_in_a_config_file_is_refused(capsys, isolated_cache, tmp_path):
    """`ctx-size: 4096` and `ctx_size: 8192` in one config file are the same setting (serve reads `-` as `_`): the last
    one won silently (the second sweep refused only a key repeated letter for letter). Now one line naming both."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: demo\nctx_size: 2048\nctx-size: 8192\n")
    code, _, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == 2 and "ctx_size and ctx-size are the same setting, given twice" in _errors(err)[0], err


def test_a_key_given_twice_in_a_json_thresholds_file_is_refused(tmp_path):
    """A thresholds file in JSON (`{"max_mean_tv": 0.1, "max_mean_tv": 0.5}`) kept the last value silently, while the
    same file in YAML was refused since the second sweep. JSON files refuse it too now."""
    from rollingkv_cli.gate.metrics import ThresholdsError, load_thresholds

    th = tmp_path / "t.json"
    th.write_text('{"max_mean_tv": 0.1, "min_top1_agreement": 0.9, "max_mean_tv": 0.5}')
    with pytest.raises(ThresholdsError, match="the key 'max_mean_tv' is given twice"):
        load_thresholds(th, "same_type")
    ok = tmp_path / "ok.json"
    ok.write_text('{"same_type": {"max_mean_tv": 0.1}, "quantized": {"max_mean_tv": 0.2}}')  # one key per mapping: fine
    assert load_thresholds(ok, "quantized")["max_mean_tv"] == 0.2


# a header llama.cpp's load_hparams GGML_ASSERTs on (llama-model.cpp), and the line that says so
ABORTING_HEADERS = {
    "experts used, none given": ({"llama.expert_used_count": 2}, "routes each token to 2 experts of 0 (it has no expert_count)"),
    "2000 experts": ({"llama.expert_count": 2000, "llama.expert_used_count": 2}, "has 2000 experts; llama.cpp loads at most 1024"),
    "experts, none used": ({"llama.expert_count": 8}, "has 8 experts but routes a token to none"),
    "expert groups without experts": ({"llama.expert_group_count": 2}, "has 2 expert groups (0 used) for 0 experts"),
    "unknown RoPE scaling": ({"llama.rope.scaling.type": "bogus"}, "has the RoPE scaling type 'bogus'"),
    "more nextn layers than layers": ({"llama.nextn_predict_layers": 40}, "has 40 next-token prediction layers but 30 layers"),
}


@pytest.mark.parametrize("bad", list(ABORTING_HEADERS))
@pytest.mark.parametrize("command", ["serve", "gate equiv", "gate needle", "bench tail", "bench load"])
def test_headers_llama_cpp_aborts_on_are_refused_before_a_child_starts(command, bad, tmp_path, capsys, isolated_cache):
    """Past the 600-layer check (issue 39 row 2), load_hparams has more GGML_ASSERTs on header values: `expert_used_count`
    without `expert_count`, more than 1024 experts, an unknown `rope.scaling.type`, more next-token layers than layers,
    expert groups without experts. serve and gate needle said "llama-server exited during start-up (killed by SIGABRT
    ...)" and a log box, `run` the assertion after loading the weights. Now one line before anything starts. Seen
    failing before the fix: every command here went on (without a build: "no rollingkv build yet"; bench tail
    --dry-run printed its cells)."""
    from test_models import COMMANDS, _header

    kvs, expect = ABORTING_HEADERS[bad]
    m = tmp_path / "m.gguf"
    m.write_bytes(_header({"general.architecture": "llama", "llama.block_count": 30, **kvs}))
    code, out, err = run_main([a.replace("{m}", str(m)).replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]], capsys)
    assert code == 1 and len(_errors(err)) == 1 and expect in _errors(err)[0], out + err
    assert "llama.cpp would abort on it" in err


def test_a_real_moe_layout_passes_the_checks():
    """The checks above refuse only what llama.cpp aborts on: a plain mixture of experts, per-layer counts, grouped
    experts and the known RoPE scalings pass."""
    from rollingkv_cli.models import _check_hparams

    base = {"general.architecture": "llama", "llama.block_count": 4}
    for extra in ({"llama.expert_count": 8, "llama.expert_used_count": 2},
                  {"llama.expert_count": 8, "llama.expert_used_count": [2, 2, 1, 2]},
                  {"llama.expert_count": 256, "llama.expert_used_count": 8, "llama.expert_group_count": 8,
                   "llama.expert_group_used_count": 4},
                  {"llama.rope.scaling.type": "yarn"}, {"llama.rope.scaling.type": "none"},
                  {"llama.nextn_predict_layers": 1}):
        _check_hparams({**base, **extra}, "m.gguf")


def _with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the GGUF src whose tokenizer.chat_template is `template` (the other keys, the tensor infos and the data
    byte for byte; the header re-padded to the 32-byte alignment)."""
    data = src.read_bytes()
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(vtype: int, pos: int) -> int:
        if vtype in scalar:
            return pos + scalar[vtype]
        if vtype == 8:
            return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
        itype, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        for _ in range(count):
            pos = skip(itype, pos)
        return pos

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos, kvs = 24, []
    for _ in range(n_kv):
        start = pos
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        key = data[start + 8:pos].decode()
        pos = skip(struct.unpack_from("<I", data, pos)[0], pos + 4)
        if key != "tokenizer.chat_template":
            kvs.append(data[start:pos])
    infos = pos
    for _ in range(n_tensors):
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        pos += 4 + 8 * struct.unpack_from("<I", data, pos)[0] + 12
    key, value = b"tokenizer.chat_template", template.encode()
    kvs.append(struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value)
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + data[infos:pos]
    dst.write_bytes(head + b"\0" * (-len(head) % 32) + data[-(-pos // 32) * 32:])
    return dst


@pytest.mark.build
@pytest.mark.parametrize("template,expect", [
    ("{% for", "is not a valid Jinja template: unexpected 'end of template'"),
    ("{{ raise_exception('System role not supported') }}", "fails on this message: System role not supported"),
    ("{{ messages[5]['content'] }}", "fails on this message: list object has no element 5"),
], ids=["does not parse", "raises", "fails on the message"])
def test_run_says_the_chat_template_is_broken(cpu_build, demo_model, tmp_path, template, expect):
    """A GGUF whose chat template does not parse, or raises on the one user message (many real templates call
    raise_exception()), ended `run` in "internal error: RuntimeError: unexpected 'end of template'" (or ValueError)
    with the "this is a bug in rollingkv" hint. Now one line naming the template and what to do."""
    m = _with_chat_template(demo_model, tmp_path / "t.gguf", template)
    proc = _cli(cpu_build, "run", str(m), "-p", "hi", "-n", "2")
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    line = _one_error(proc)
    assert "the chat template of" in line and "(tokenizer.chat_template)" in line and expect in line, line


def test_llama_servers_template_and_assert_failures_are_read_from_its_log():
    """serve with a chat template llama-server cannot use: "llama-server exited during start-up (exit status 1)" and a
    25-line log box whose last lines did not say why (the reason was 10 lines up); a GGML_ASSERT: "killed by SIGABRT"
    and the box. Both are read from the log into the one line now (and the box is left out)."""
    from rollingkv_cli.serve.server import TEMPLATE_HINT, abort_in_log, template_error_in_log

    log = ["0.04.74 E common_chat_templates_init: error: parser: Parser Error: Unexpected EOF",
           "0.04.74 E srv          init: init: chat template parsing error: std::exception"]
    assert template_error_in_log(log).endswith("(tokenizer.chat_template): parser: Parser Error: Unexpected EOF")
    log = ["0.04.745 E srv   init: init: chat template parsing error: Unable to generate parser for this template. "
           "Automatic parser generation failed: ", "------------", "While executing CallExpression at line 1", "   ^",
           "Error: Jinja Exception: System role not supported", "0.04.745 E srv  init: init: please consider ..."]
    assert template_error_in_log(log).endswith("failed: Error: Jinja Exception: System role not supported")
    assert template_error_in_log(["all is well"]) is None and "--chat-template chatml" in TEMPLATE_HINT
    assert abort_in_log(["/src/llama-model.cpp:1362: GGML_ASSERT(n_expert_used_max <= hparams.n_expert) failed"]) == \
        "llama.cpp aborted: GGML_ASSERT(n_expert_used_max <= hparams.n_expert) failed"


@pytest.mark.build
def test_serve_says_the_chat_template_is_broken(cpu_build, demo_model, tmp_path):
    """End to end: one line with llama-server's reason and the built-in template to use, no log box."""
    m = _with_chat_template(demo_model, tmp_path / "t.gguf", "{% for")
    proc = _cli(cpu_build, "serve", str(m), "--port", "0", "-q")
    assert proc.returncode == 1
    line = _one_error(proc)
    assert "could not use the model's chat template (tokenizer.chat_template): parser: Parser Error" in line, line
    assert "--chat-template chatml" in proc.stderr and "last lines of" not in proc.stdout + proc.stderr
