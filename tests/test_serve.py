"""`rollingkv serve`: settings, pre-flight refusals, and a real supervised server (CPU build, demo model)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from test_cli import run_main


def test_print_args_merges_config_and_flags(tmp_path, capsys, demo_model, monkeypatch, cpu_build):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: demo\nctx_size: 4096\nparallel: 2\ncache_type_k: q8_0\nport: 9999\nextra_args: ['--threads', '2']\n")
    code, out, err = run_main(["serve", "--config", str(cfg), "-c", "2048", "--print-args"], capsys)
    assert code == 0, err
    argv = shlex.split(out.strip().splitlines()[-1])
    assert argv[0].endswith("llama-server")
    assert argv[argv.index("-c") + 1] == "2048"  # the flag wins over the file
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-ctk") + 1] == "q8_0"
    assert argv[argv.index("--port") + 1] == "9999" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("-m") + 1] == str(demo_model)
    assert argv[-2:] == ["--port", "9999"] and "--threads" in argv


@pytest.mark.parametrize(
    "yaml_text, message, exit_code",
    [
        # a bad setting exits 2, as the same bad flag does; a file that does not parse exits 1
        ("model: demo\nwindow: 3\n", "unknown key", 2),
        ("model: demo\ncache_type_k: q3_k\n", "cache_type_k", 2),
        ("model: demo\nparallel: -1\n", "parallel must be an integer from 1 to 256, not -1", 2),
        ("- just\n- a list\n", "mapping", 1),
        ("model: [unclosed\n", "not valid YAML", 1),
    ],
)
def test_bad_config_is_refused(tmp_path, capsys, yaml_text, message, exit_code):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    code, _, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == exit_code and message in err


def test_bad_input(tmp_path, capsys, demo_model, cpu_build, monkeypatch):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, _, err = run_main(["serve", str(tmp_path / "nope.gguf")], capsys)
    assert code == 1 and "not found" in err
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    code, _, err = run_main(["serve", str(notgguf)], capsys)
    assert code == 1 and "not a GGUF" in err
    code, _, err = run_main(["serve", "demo", "-ctk", "q3_k"], capsys)
    assert code == 2 and "q3_k" in err
    code, _, err = run_main(["serve"], capsys)
    assert code == 1 and "no MODEL" in err
    code, _, err = run_main(["serve", "demo", "-c", "1024", "--kv-window-cells", "4096"], capsys)
    assert code == 2 and "larger than the context" in err  # flags that contradict: a usage error


def test_vram_target_below_weights(capsys, demo_model, cpu_build, monkeypatch):
    from rollingkv_cli import serving

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setattr(serving, "build_has_rolling_kv", lambda lib: True)
    code, _, err = run_main(["serve", "demo", "--vram-target", "10"], capsys)
    assert code == 1 and "below the model's weights" in err and "minimum" in err


def test_occupied_port(capsys, demo_model, cpu_build, monkeypatch):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run_main(["serve", "demo", "--port", str(port), "-q"], capsys)
    assert code == 1 and "already in use" in err


def _spawn_serve(cpu_build, port, *extra):
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", "demo", "-c", "2048", "--port", str(port), *extra, "--", "-t", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _wait_health(port, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("server did not come up")


def _wait_serving(proc, timeout=180) -> str:
    """Read `rollingkv serve`'s output until it says it is serving (it has seen /health itself)."""
    seen = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("serve exited before serving:\n" + "".join(seen))
        seen.append(line)
        if "serving " in line:
            return "".join(seen)
    raise AssertionError("serve did not report serving")


def _server_pids(port) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"llama-server.*--port {port}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.build
def test_sigterm_stops_everything(cpu_build, demo_model):
    from rollingkv_cli.server import free_port

    port = free_port()
    proc = _spawn_serve(cpu_build, port)
    head = _wait_serving(proc)
    _wait_health(port, proc)
    assert _server_pids(port)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    out = head + out
    assert proc.returncode == 0, out
    assert "llama-server stopped" in out and "log: " in out
    assert _server_pids(port) == [], "no orphaned llama-server"


@pytest.mark.build
def test_killed_server_is_reported(cpu_build, demo_model):
    from rollingkv_cli.server import free_port

    port = free_port()
    proc = _spawn_serve(cpu_build, port)
    _wait_serving(proc)
    for pid in _server_pids(port):
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "exited unexpectedly" in out and "full log" in out
    assert _server_pids(port) == []


# ---------------------------------------------------------------- GPU layers: the rolling KV, not --fit, makes room

def _settings(tmp_path, **kw):
    from rollingkv_cli.serving import ServeSettings

    return ServeSettings(model=tmp_path / "m.gguf", extra_args=kw.pop("extra_args", []), **kw)


def test_gpu_layers_all_when_the_weights_fit(tmp_path):
    from rollingkv_cli.serving import GPU_LAYERS_HEADROOM_MIB, gpu_layers

    free = lambda: 80000  # noqa: E731
    args, note = gpu_layers(_settings(tmp_path), True, free_vram_mib=free, weights_mib=5564)
    assert args == ["-ngl", "all"] and "all" in note and "80000 MiB free VRAM" in note
    # the explicit target is the budget, not free VRAM
    args, note = gpu_layers(_settings(tmp_path, vram_target=7500), True, free_vram_mib=free, weights_mib=5564)
    assert args == ["-ngl", "all"] and "--vram-target" in note
    # weights + headroom beyond the budget: llama-server's --fit decides, and the note says so
    tight = 5564 + GPU_LAYERS_HEADROOM_MIB - 1
    args, note = gpu_layers(_settings(tmp_path, vram_target=tight), True, free_vram_mib=free, weights_mib=5564)
    assert args == [] and "--fit moves layers to the CPU" in note
    args, note = gpu_layers(_settings(tmp_path), True, free_vram_mib=lambda: None, weights_mib=5564)
    assert args == [] and "NVML" in note


@pytest.mark.parametrize("case", ["cpu", "off", "ngl", "ngl=", "fit", "long"])
def test_gpu_layers_left_alone(tmp_path, case):
    from rollingkv_cli.serving import gpu_layers

    s = _settings(tmp_path, kv_residency_mode="off" if case == "off" else None,
                  extra_args={"ngl": ["-ngl", "20"], "ngl=": ["--n-gpu-layers=20"], "fit": ["-fit", "on"],
                              "long": ["--gpu-layers", "all"]}.get(case, []))
    assert gpu_layers(s, case != "cpu", free_vram_mib=lambda: 80000, weights_mib=100) == ([], None)


def test_print_args_cpu_build_has_no_gpu_layers(capsys, demo_model, cpu_build, monkeypatch):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, out, _ = run_main(["serve", str(demo_model), "--print-args"], capsys)
    assert code == 0 and "-ngl" not in out.split()
