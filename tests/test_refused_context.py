"""When the library refuses a context, its own reason (llama_rolling_kv_last_error) reaches the user's one line: gate
equiv's runner, a llama-server started by serve, the gates or bench load, and a bench tail cell.

The refusal used: head mode on the demo model (3 KV heads per layer) with 5 device heads and auto tail types: nothing
spills, so auto has no tail to choose a type for, and the library says so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollingkv_cli.lib.llama_ext import refusal_in_log, refusal_reason

REFUSAL = "device_heads 5 keeps every KV head on the device"
HEAD_FLAGS = ["--kv-residency-mode", "head", "--kv-device-heads", "5", "-ctkt", "auto", "-ctvt", "auto"]


def test_refusal_reason_drops_the_generic_text():
    """last_error's text without a reason of its own (llama.cpp refused, not the planner) is no reason."""
    assert refusal_reason("llama_init_from_model failed (see the log)") is None
    assert refusal_reason("") is None and refusal_reason(None) is None
    assert refusal_reason("rolling KV: vram_target 10 MiB is below the minimum") == "vram_target 10 MiB is below the minimum"


def test_refusal_in_log_finds_the_library_line():
    lines = ["0.00.845 I load", f"0.00.845.397 E llama_init_from_model_rolling_kv: rolling KV: {REFUSAL} (3 per layer)",
             "0.00.845.401 E cmn  common_init_: failed to create context with model 'm.gguf'"]
    assert refusal_in_log(lines) == f"{REFUSAL} (3 per layer)"
    assert refusal_in_log(lines[::2]) is None
    # since API 8 the plain function calls llama_init_from_model_rolling_kv_test, whose name the log line carries
    # (seen failing: the server harness and bench tail's second ask found no reason in the log)
    api8 = [line.replace("rolling_kv: ", "rolling_kv_test: ") for line in lines]
    assert refusal_in_log(api8) == f"{REFUSAL} (3 per layer)"


@pytest.mark.build
def test_gate_equiv_shows_the_library_reason(cpu_build, demo_model):
    """Seen failing before the runner asked last_error(): "could not create the context with these residency
    parameters", the reason only in the candidate's log."""
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir)}
    proc = subprocess.run([sys.executable, "-m", "rollingkv_cli", "gate", "equiv", "--model", str(demo_model),
                           "--synthetic-tokens", "64", "--ctx", "256", *HEAD_FLAGS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error_lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and REFUSAL in error_lines[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.build
def test_llama_server_start_up_names_the_library_reason(cpu_build, demo_model, tmp_path):
    """The server harness (serve, the gates, bench load) reads the reason from the server's log. Seen failing before:
    "llama-server exited during start-up (exit status 1)" and the log's path."""
    from rollingkv_cli.console import RollingKVError
    from rollingkv_cli.serve.server import ServerProcess

    srv = ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(demo_model), "-c", "512", *HEAD_FLAGS],
                        log_path=tmp_path / "server.log")
    with pytest.raises(RollingKVError) as refused:
        with srv:  # starts it and waits for /health
            pass
    assert "exited during start-up" in refused.value.message and REFUSAL in refused.value.message


@pytest.mark.build
def test_bench_tail_cell_names_the_library_reason(cpu_build, demo_model):
    """llama-bench keeps the library's log to itself unless -v: the failed cell is asked again. Seen failing before:
    the cell's error was llama-bench's "failed to create context with model ..."."""
    from rollingkv_cli.bench.tail import CellRunner, context_refusal_reason

    args = [str(cpu_build.artifact("llama-bench")), "-m", str(demo_model), "-fa", "1", "-p", "0", "-n", "1", "-r", "1",
            "-o", "json", *HEAD_FLAGS]
    rc, _, err_tail, _, _ = CellRunner().run(args, timeout=120)
    assert rc != 0 and not any(REFUSAL in line for line in err_tail)  # why the second ask is needed
    assert REFUSAL in (context_refusal_reason(args, err_tail) or "")
