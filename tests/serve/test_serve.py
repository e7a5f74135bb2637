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
    # the address first (a value-less flag after `--` must not take --host as its value), the arguments after `--` last
    assert argv[1:5] == ["--host", "127.0.0.1", "--port", "9999"] and argv[-2:] == ["--threads", "2"]


def test_slot_save_is_off_unless_asked_for(tmp_path, capsys, demo_model, monkeypatch, cpu_build):
    """Slot save/restore lets any client write files into the cache: serve passes --slot-save-path only with --slot-save
    (or `slot_save: true`), and never turns on more than -fa and --metrics beyond llama-server's defaults."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))

    def argv(*args):
        code, out, err = run_main(["serve", "--print-args", *args], capsys)
        assert code == 0, err
        return shlex.split(out.strip().splitlines()[-1])

    plain = argv("demo")
    assert "--slot-save-path" not in plain and "--slots" not in plain and "--props" not in plain
    assert plain[1:] == ["--host", "127.0.0.1", "--port", "8080", "-m", str(demo_model), "-fa", "on", "--metrics", "--alias",
                         demo_model.name.removesuffix(".gguf")]
    mine = argv("demo", "--", "--alias", "mine")
    assert mine.count("--alias") == 1 and mine[mine.index("--alias") + 1] == "mine"  # the user's own alias after `--` alone
    on = argv("demo", "--slot-save")
    assert on[on.index("--slot-save-path") + 1].endswith("/slots")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: demo\nslot_save: true\n")
    assert "--slot-save-path" in argv("--config", str(cfg))


def test_a_tail_type_the_build_does_not_take_is_refused_before_start(capsys, demo_model, cpu_build, monkeypatch):
    """serve asks the active build for its tail types (kvtypes.library_tail_types): one it lacks is one line, before
    llama-server starts and refuses it (issue 27: 10)."""
    from rollingkv_cli import kvtypes

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setattr(kvtypes, "library_tail_types", lambda lib_dir: ("f16",))
    code, _, err = run_main(["serve", "demo", "-ctkt", "q8_0", "--print-args"], capsys)
    assert code == 1 and "-ctkt q8_0: the active build" in err and "takes the tail types f16" in err
    code, _, err = run_main(["serve", "demo", "-ctkt", "f16", "--print-args"], capsys)
    assert code == 0, err


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


def test_a_flag_wins_over_the_config_files_key_unread(tmp_path, capsys, demo_model, monkeypatch, cpu_build):
    """The file's values are only defaults (click's default_map): a key a flag overrides is never used, so never refused,
    and a cross-setting error names where each value came from (the flag, or the file's key)."""
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: demo\nctx_size: lots\nparallel: 2\n")
    code, out, err = run_main(["serve", "--config", str(cfg), "-c", "2048", "--print-args"], capsys)
    assert code == 0, err
    argv = shlex.split(out.strip().splitlines()[-1])
    assert argv[argv.index("-c") + 1] == "2048" and argv[argv.index("-np") + 1] == "2"
    code, _, err = run_main(["serve", "--config", str(cfg), "--print-args"], capsys)
    assert code == 2 and f"config file {cfg}: ctx_size must be an integer, not 'lots'" in err
    cfg.write_text("model: demo\nparallel: 300\n")
    code, _, err = run_main(["serve", "--config", str(cfg), "-c", "100", "-np", "200", "--print-args"], capsys)
    assert code == 2 and "--ctx-size 100 has fewer cells than --parallel 200 has slots" in err
    cfg.write_text("model: demo\nctx_size: 100\nparallel: 200\n")
    code, _, err = run_main(["serve", "--config", str(cfg), "-np", "150", "--print-args"], capsys)
    assert code == 2 and f"config file {cfg}: ctx_size 100 has fewer cells than --parallel 150 has slots" in err


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
    assert code == 2 and "no MODEL" in err  # a usage error
    code, _, err = run_main(["serve", "demo", "-c", "1024", "--kv-window-cells", "4096"], capsys)
    assert code == 2 and "larger than the context" in err  # flags that contradict: a usage error


def test_vram_target_below_weights(capsys, demo_model, cpu_build, monkeypatch):
    from rollingkv_cli.serve import launch

    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    monkeypatch.setattr(launch, "build_has_rolling_kv", lambda lib: True)
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
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_stops_everything_and_exits_with_its_status(cpu_build, demo_model, sig):
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP stop llama-server and exit 128 + the signal's number (130, 143, 129), the
    shell's convention, saying which signal. Seen failing before the fix: each exited 0, as after a clean stop."""
    from rollingkv_cli.serve.server import free_port

    signum = getattr(signal, sig)
    port = free_port()
    proc = _spawn_serve(cpu_build, port)
    head = _wait_serving(proc)
    _wait_health(port, proc)
    assert _server_pids(port)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    out = head + out
    assert proc.returncode == 128 + signum, out
    assert f"llama-server stopped ({sig})" in out and "log: " in out and "Traceback" not in out
    assert _server_pids(port) == [], "no orphaned llama-server"


@pytest.mark.build
def test_killed_server_is_reported(cpu_build, demo_model):
    from rollingkv_cli.serve.server import free_port

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
    from rollingkv_cli.serve.settings import ServeSettings

    return ServeSettings(model=tmp_path / "m.gguf", extra_args=kw.pop("extra_args", []), **kw)


def test_gpu_layers_all_when_the_weights_fit(tmp_path):
    from rollingkv_cli.serve.launch import GPU_LAYERS_HEADROOM_MIB, gpu_layers

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
    from rollingkv_cli.serve.launch import gpu_layers

    s = _settings(tmp_path, kv_residency_mode="off" if case == "off" else None,
                  extra_args={"ngl": ["-ngl", "20"], "ngl=": ["--n-gpu-layers=20"], "fit": ["-fit", "on"],
                              "long": ["--gpu-layers", "all"]}.get(case, []))
    assert gpu_layers(s, case != "cpu", free_vram_mib=lambda: 80000, weights_mib=100) == ([], None)


def test_print_args_cpu_build_has_no_gpu_layers(capsys, demo_model, cpu_build, monkeypatch):
    monkeypatch.setenv("ROLLINGKV_BUILD", str(cpu_build.dir))
    code, out, _ = run_main(["serve", str(demo_model), "--print-args"], capsys)
    assert code == 0 and "-ngl" not in out.split()


# ---------------------------------------------------------------- the hybrid tail: --kv-tail-cpu-frac, --cpu-attn-gbps

@pytest.mark.parametrize("text,want", [("auto", "auto"), (" AUTO ", "auto"), ("0", 0.0), ("0.25", 0.25), ("1", 1.0)])
def test_tail_cpu_frac_setting(text, want):
    from rollingkv_cli.serve.settings import check_setting

    assert check_setting("kv_tail_cpu_frac", text, from_text=True) == want


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, "0.5", [0.5], float("nan")])
def test_tail_cpu_frac_setting_from_the_config_refused(value):
    from rollingkv_cli.serve.settings import SettingError, check_setting

    with pytest.raises(SettingError, match="must be auto or a fraction from 0 to 1"):
        check_setting("kv_tail_cpu_frac", value)
    assert check_setting("kv_tail_cpu_frac", 0.5) == 0.5 and check_setting("kv_tail_cpu_frac", 1) == 1.0
    assert check_setting("kv_tail_cpu_frac", "auto") == "auto"


@pytest.mark.parametrize("args,yaml_text,message", [
    (["--kv-tail-cpu-frac", "1.5"], None, "must be auto or a fraction from 0 to 1 (0: no CPU part, 1: the whole tail on the CPU), not 1.5"),
    (["--kv-tail-cpu-frac", "most"], None, "must be auto or a fraction from 0 to 1, not most"),
    ([], "model: demo\nkv_tail_cpu_frac: 2\n", "kv_tail_cpu_frac must be auto or a fraction from 0 to 1"),
    ([], "model: demo\nkv-tail-cpu-frac: lots\n", "kv_tail_cpu_frac must be auto or a fraction from 0 to 1, not 'lots'"),
])
def test_bad_tail_cpu_frac_exits_2(tmp_path, capsys, isolated_cache, args, yaml_text, message):
    argv = ["serve", "demo", *args, "--print-args"]
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        argv = ["serve", "--config", str(tmp_path / "c.yaml"), "--print-args"]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.fixture
def hybrid_build(tmp_path, monkeypatch, isolated_cache):
    """A stand-in active build (llama-server and libllama.so files) whose library has the rolling KV and the hybrid
    tail; .cuda / .tail_cpu switch what it is. A tiny model to serve."""
    from rollingkv_cli.lib import builder
    from rollingkv_cli import models
    from rollingkv_cli.serve import launch

    bdir = tmp_path / "hb0123"
    (bdir / "build" / "bin").mkdir(parents=True)
    for name in ("llama-server", "libllama.so"):
        (bdir / "build" / "bin" / name).write_text("")
    (bdir / "build" / "bin" / "llama-server").chmod(0o755)
    state = type("State", (), {"cuda": True, "tail_cpu": True, "dir": bdir})()
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"options": {"cuda": state.cuda}}))
    monkeypatch.setattr(launch, "build_has_rolling_kv", lambda lib: True)
    monkeypatch.setattr(launch, "build_has_tail_cpu", lambda lib: state.tail_cpu)
    monkeypatch.delenv("LLAMA_ARG_CPU_ATTN_GBPS", raising=False)
    monkeypatch.delenv("LLAMA_ARG_KV_TAIL_CPU_FRAC", raising=False)
    state.model = models.write_synthetic(tmp_path / "tiny.gguf", models.SynthSpec(layers=2, embd=128, heads=2, kv_heads=1, ff=256,
                                                                                  vocab=300, ctx=4096))
    return state


def _argv(capsys, *args):
    args = list(args)
    at = args.index("--") if "--" in args else len(args)
    code, out, err = run_main(["serve", *args[:at], "--print-args", *args[at:]], capsys)
    assert code == 0, err
    return shlex.split(out.strip().splitlines()[-1]), out + err


def test_cpu_attn_from_the_profile(capsys, hybrid_build, monkeypatch):
    """The figure of the CPU part's thread count ($ROLLINGKV_CPU_PART_THREADS here: 6), whatever llama-server's -t says."""
    from rollingkv_cli.hw import cpu_attn, profile

    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "6")
    monkeypatch.setattr(cpu_attn.os, "sched_getaffinity", lambda pid: set(range(16)))  # 6 threads: at most the process's CPUs
    m = str(hybrid_build.model)
    profile.save_cpu_attn(6, "hb0123", {"gbps": {"f16": 40.5, "q8_0": 30.0, "q4_0": None}, "errors": {"q4_0": "not supported"}})
    argv, text = _argv(capsys, m, "--kv-tail-cpu-frac", "auto", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
    assert argv[argv.index("--kv-tail-cpu-frac") + 1] == "auto" and argv[argv.index("--cpu-attn-gbps") + 1] == "40.5"
    assert argv[argv.index("--pcie-bw-gbps") + 1] == "25" and argv[-4:] == ["-ngl", "99", "-t", "6"]
    # the tail's K type picks the figure; the window's type when the tail has none of its own
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "0.5", "-ctkt", "q8_0", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
    assert argv[argv.index("--kv-tail-cpu-frac") + 1] == "0.5" and argv[argv.index("--cpu-attn-gbps") + 1] == "30"
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "auto", "-ctk", "q8_0", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
    assert argv[argv.index("--cpu-attn-gbps") + 1] == "30"
    # asked for after `--` (llama-server's own flag) or through its variable: the same
    argv, _ = _argv(capsys, m, "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6", "--kv-tail-cpu-frac", "auto")
    assert argv[argv.index("--cpu-attn-gbps") + 1] == "40.5" and argv.count("--kv-tail-cpu-frac") == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLAMA_ARG_KV_TAIL_CPU_FRAC", "auto")
        argv, _ = _argv(capsys, m, "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
        assert argv[argv.index("--cpu-attn-gbps") + 1] == "40.5" and "--kv-tail-cpu-frac" not in argv
    # llama-server's default is auto: the figure is passed, the flag is not
    argv, _ = _argv(capsys, m, "-ctk", "q8_0", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "2")
    assert argv[argv.index("--cpu-attn-gbps") + 1] == "30" and "--kv-tail-cpu-frac" not in argv
    # turned off: nothing to plan with, nothing passed
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "0", "--pcie-bw-gbps", "25", "--", "-ngl", "99")
    assert "--cpu-attn-gbps" not in argv
    # no figure for this type, or for this thread count: nothing passed, and llama-server measures
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "auto", "-ctkt", "q4_0", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
    assert "--cpu-attn-gbps" not in argv
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "3")
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "auto", "--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6")
    assert "--cpu-attn-gbps" not in argv
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "6")
    # the notes serve prints (not with --print-args, which prints the command line only)
    from rollingkv_cli.serve.launch import resolve_cpu_attn
    from rollingkv_cli.serve.settings import ServeSettings

    def note(**kw):
        kw.setdefault("kv_tail_cpu_frac", "auto")
        s = ServeSettings(model=hybrid_build.model, extra_args=kw.pop("extra", ["-t", "6"]), **kw)
        return resolve_cpu_attn(s, True, "hb0123", True)

    assert note() == (40.5, note()[1]) and note()[1].startswith("CPU attention for planning: 40.5 GB/s — f16 tail, 6 threads, measured ")
    gbps, text = note(cache_type_k_tail="q4_0")
    assert gbps is None and "not supported" in text and "llama-server measures it" in text
    gbps, text = note(cache_type_k_tail="q4_0", kv_tail_cpu_frac=0.5)  # a fixed share: nothing measured (auto only)
    assert gbps is None and "not supported" in text and "goes without it" in text and "measures" not in text
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "3")
    gbps, text = note()
    assert gbps is None and "3 threads" in text and "probe pcie" in text
    monkeypatch.setenv("ROLLINGKV_CPU_PART_THREADS", "6")
    gbps, text = note(cache_type_k_tail="q5_0")
    assert gbps is None and "not q5_0" in text
    assert note(kv_tail_cpu_frac=None)[0] == 40.5 and note(kv_tail_cpu_frac=0.0) == (None, None)  # the default is auto; off: nothing
    assert note(kv_tail_cpu_frac=None, extra=["-t", "6", "--kv-tail-cpu-frac=0.25"])[0] == 40.5
    assert note(extra=["-t", "6", "--kv-tail-cpu-frac", "0"]) == (None, None)  # after `--` it comes last: it wins


def test_cpu_attn_left_out(capsys, hybrid_build, monkeypatch):
    from rollingkv_cli.hw import profile

    m = str(hybrid_build.model)
    profile.save_cpu_attn(6, "hb0123", {"gbps": {"f16": 40.5}, "errors": {}})
    base = ["--pcie-bw-gbps", "25", "--", "-ngl", "99", "-t", "6"]
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "0", *base)  # no CPU part: nothing to plan it with
    assert argv[argv.index("--kv-tail-cpu-frac") + 1] == "0" and "--cpu-attn-gbps" not in argv
    argv, _ = _argv(capsys, m, *base)  # nor by default (llama-server's default: 0)
    assert "--cpu-attn-gbps" not in argv and "--kv-tail-cpu-frac" not in argv
    auto = ["--kv-tail-cpu-frac", "auto"]
    argv, _ = _argv(capsys, m, "--kv-residency-mode", "off", *auto, *base)
    assert "--cpu-attn-gbps" not in argv
    argv, _ = _argv(capsys, m, *auto, *base, "--cpu-attn-gbps", "12")  # the user's own wins
    assert argv.count("--cpu-attn-gbps") == 1 and argv[argv.index("--cpu-attn-gbps") + 1] == "12"
    monkeypatch.setenv("LLAMA_ARG_CPU_ATTN_GBPS", "11")
    argv, _ = _argv(capsys, m, *auto, *base)
    assert "--cpu-attn-gbps" not in argv
    monkeypatch.delenv("LLAMA_ARG_CPU_ATTN_GBPS")
    hybrid_build.cuda = False  # a CPU build attends the whole cache on the CPU: no split to plan
    argv, _ = _argv(capsys, m, "--kv-tail-cpu-frac", "0.5", *base)
    assert "--cpu-attn-gbps" not in argv and argv[argv.index("--kv-tail-cpu-frac") + 1] == "0.5"


def test_a_build_before_the_hybrid_tail_refuses_the_flag(capsys, hybrid_build):
    hybrid_build.tail_cpu = False
    code, _, err = run_main(["serve", str(hybrid_build.model), "--kv-tail-cpu-frac", "0.5", "--print-args"], capsys)
    assert code == 1 and "predates the hybrid tail" in err and "--kv-tail-cpu-frac" in err and "rollingkv build" in err
    argv, _ = _argv(capsys, str(hybrid_build.model), "--pcie-bw-gbps", "25", "--", "-ngl", "99")  # without it: served as before
    assert "--kv-tail-cpu-frac" not in argv and "--cpu-attn-gbps" not in argv


def test_the_plan_shows_the_chosen_split():
    from rollingkv_cli.serve.status import describe_plan_details, describe_tail_cpu

    assert describe_tail_cpu({"mode_chosen": "window"}) is None
    plan = {"split": True, "link": {"link_bw_gbps": 6.5, "mem_bw_gbps": 3000, "t_token_hybrid_ms": 12.345},
            "tail_cpu": {"requested": "auto", "frac": 0.86, "cpu_attn_gbps": 40.0, "cpu_attn_source": "measured", "n_threads": 15,
                         "reason": "cpu_bw / (cpu_bw + link_bw)"}}
    line = describe_tail_cpu(plan)
    assert line.startswith("CPU part of the tail: 86% of each split layer's host tail attended on the CPU")
    assert "requested auto" in line and "CPU attention 40 GB/s," in line and "15 threads" in line and "12.35 ms/token" in line
    assert line.endswith(": cpu_bw / (cpu_bw + link_bw); CPU attention measured") and line in describe_plan_details(plan)
    off = describe_tail_cpu({"tail_cpu": {"requested": 0, "frac": 0, "cpu_attn_gbps": None, "cpu_attn_source": "none",
                                          "reason": "disabled"}})
    assert off == "CPU part of the tail: none (requested 0): disabled"


@pytest.mark.parametrize("plan, gpu, want, unwanted", [
    ({"mode_requested": "auto", "mode_chosen": "resident", "reason": "no GPU and no vram_target: resident (the whole KV fits)",
      "device_bytes": 180 << 20, "host_bytes": 0, "split": False, "window_cells": 0},
     False, "residency: resident — no GPU and no vram_target: the whole KV fits; 180.0 MiB in host memory (CPU build)", ["on device", "(("]),
    ({"mode_requested": "window", "mode_chosen": "window", "reason": "window: explicit window of 256 cells", "split": True,
      "window_cells": 256, "tail_cells": 768, "device_bytes": 1 << 20, "host_bytes": 3 << 20},
     True, "residency: window — explicit window of 256 cells; window 256 / tail 768 cells; 1.0 MiB on device; 3.0 MiB on host", ["window,"]),
    # the library's reason of an explicit head split (llama-kv-residency-decide.cpp): the summary in brackets at its end
    ({"mode_requested": "auto", "mode_chosen": "head", "split": True,
      "reason": "head: explicit 1 device KV heads per layer (1 of 3 KV heads on the device, 30 of 30 layers split)",
      "heads": {"summary": "1 of 3 KV heads on the device, 30 of 30 layers split", "per_layer": [1, 1]}},
     True, "residency: head — explicit 1 device KV head per layer; 1 of 3 KV heads on the device, 30 of 30 layers split (per layer 1,1)",
     ["head: ", "heads per"]),
], ids=["cpu-resident", "window", "head"])
def test_the_residency_line_says_each_thing_once(plan, gpu, want, unwanted):
    """Issue 27 (17): the mode once, its reason without the mode again, no nested brackets, singulars, and no "on device"
    on a CPU build."""
    from rollingkv_cli.serve.status import describe_plan, describe_tail_cpu

    line = describe_plan(plan, gpu=gpu)
    assert line == want
    assert not any(u in line for u in unwanted)
    assert _bracket_depth(line) <= 1
    assert "(1 thread)" in describe_tail_cpu({"tail_cpu": {"frac": 0, "n_threads": 1}})


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        deepest = max(deepest, depth)
    return deepest


def test_the_plan_details_nest_no_brackets():
    """Issue 27 (17): the library's sources have brackets of their own ("host memory bandwidth (the tail is in the same
    memory)", "measured: 256 MiB f16 tail, 15 threads"): the lines put them last, outside the figures' brackets."""
    from rollingkv_cli.serve.status import describe_plan_details

    plan = {"split": True, "estimate": {"ms_per_token": 8.85, "t_resident_ms": 7.55, "t_tail_ms": 1.3},
            "link": {"mem_bw_gbps": 14, "link_bw_gbps": 13.6, "link_bw_source": "host memory bandwidth (the tail is in the same memory)"},
            "tail_cpu": {"requested": "auto", "frac": 0.5, "cpu_attn_gbps": 40.0, "n_threads": 15,
                         "cpu_attn_source": "measured: 256 MiB f16 tail, 15 threads"}}
    lines = describe_plan_details(plan)
    assert lines[0] == ("expected 8.85 ms/token at full context: 7.55 ms resident (14 GB/s measured) + 1.30 ms tail at 13.6 GB/s — "
                        "host memory bandwidth (the tail is in the same memory)")
    assert lines[1].endswith("; CPU attention measured: 256 MiB f16 tail, 15 threads")
    assert all(_bracket_depth(line) <= 1 for line in lines), lines
    no_estimate = describe_plan_details({"split": True, "estimate": {}, "link": plan["link"]})
    assert all(_bracket_depth(line) <= 1 for line in no_estimate), no_estimate


@pytest.mark.parametrize("meminfo, want", [
    ("MemTotal:       24683520 kB\nMemFree:         1000000 kB\nMemAvailable:   22453248 kB\n", "MemAvailable 21927 MiB"),
    ("MemTotal:       24683520 kB\n", "MemTotal 24105 MiB (MemAvailable unknown)"),
], ids=["available", "no-MemAvailable"])
def test_the_host_memory_budget_says_memavailable(tmp_path, monkeypatch, meminfo, want):
    """Issue 39 (14): a CPU build's budget line said "free 24105 MiB", which is MemTotal (ggml's CPU device reports it as
    free); it says the kernel's MemAvailable, named as such (MemTotal, named, where the kernel gives no MemAvailable). Seen
    failing before the fix: the line read "budget on host memory: free 24105 MiB - reserve 1024 MiB"."""
    from rollingkv_cli.hw import hostinfo
    from rollingkv_cli.serve.status import describe_plan_details

    (tmp_path / "meminfo").write_text(meminfo)
    monkeypatch.setattr(hostinfo, "MEMINFO", tmp_path / "meminfo")
    dev = {"name": "host memory", "host_memory": True, "free_bytes": 24683520 * 1024, "weights_bytes": 92 << 20}
    plan = {"split": True, "budget": {"vram_target_mib": 0, "reserve_bytes": 1 << 30, "devices": [dev]}}
    line = describe_plan_details(plan)[0]
    assert line.startswith(f"budget on host memory: {want} - reserve 1024 MiB;"), line
    assert "free 24105" not in line
    gpu = {**dev, "name": "CUDA0", "host_memory": False}  # a GPU's free memory is the driver's own figure: unchanged
    assert describe_plan_details({**plan, "budget": {**plan["budget"], "devices": [gpu]}})[0].startswith("budget on CUDA0: free 24105 MiB")


def test_live_status_decode_rate_counts_the_running_requests():
    """Issue 27 (16): two requests decoding read as their tokens per second over the last seconds, and the tokens so far.
    Issue 39 (9): without /metrics: the running requests from /slots, the ended ones from llama-server's log (a slot clears
    its counts when its request ends), or, where the log never says, what a sample saw."""
    from rollingkv_cli.serve.status import LiveStatus

    class Srv:
        url = "http://127.0.0.1:1"
        log_path = None

        def http_request(self, path):  # a server that does not answer what the test does not give (/props)
            raise OSError("no server")

    def slots(*tasks):  # (task id, generated, prompt processed) per slot; None: an idle slot (cleared)
        return [{"id": i, "is_processing": True, "id_task": t[0], "n_prompt_tokens_processed": t[2], "next_token": [{"n_decoded": t[1]}]}
                if t else {"id": i, "is_processing": False} for i, t in enumerate(tasks)]

    st = LiveStatus(Srv(), started=0.0, plan=None, gpu=False, vram=lambda: [])
    st.sample(now=0.0, slots=slots(None, None))
    assert st.tokens_generated() == 0 and st.prompt_tokens() == 0 and st.decode_rate() is None
    st.sample(now=1.0, slots=slots((1, 10, 100), (2, 20, 200)))
    assert st.tokens_generated() == 30 and st.prompt_tokens() == 300
    st.sample(now=3.0, slots=slots((1, 30, 100), (2, 40, 200)))
    assert st.decode_rate() == 70 / 3 and st.tokens_generated() == 70
    rows = dict(st.rows())
    assert rows["decode"] == "23.3 tok/s over the last 5 s, 70 tokens generated" and rows["requests"] == "2 in flight of 2 slots"
    assert rows["prompt"] == "100.0 tok/s over the last 5 s, 300 tokens read"
    # the first request ends with 35 tokens: its slot is cleared, the log says 35 (the sample saw 30), counted once
    st.sample(now=4.0, slots=slots(None, (2, 50, 200)), ended={1: [100, 35]})
    assert st.tokens_generated() == 85 and st.in_flight() == 1
    # a new one on the freed slot; the second one ends and the log does not say (a quieter log level): after GRACE_S
    # seconds it counts with the 60 tokens a sample saw, and once only when the log says after all
    st.sample(now=5.0, slots=slots((3, 5, 64), (2, 60, 200)))
    assert st.tokens_generated() == 35 + 5 + 60 and st.prompt_tokens() == 100 + 64 + 200
    st.sample(now=6.0, slots=None)  # /slots did not answer (a long prefill holds its queue): nothing ends
    st.sample(now=12.0, slots=None)
    assert st.tokens_generated() == 100
    st.sample(now=13.0, slots=slots((3, 9, 64), None))
    assert st.tokens_generated() == 35 + 9 + 60
    st.sample(now=14.0, slots=slots(None, None), ended={2: [200, 64], 3: [64, 9]})
    assert st.tokens_generated() == 35 + 9 + 64 and st.prompt_tokens() == 100 + 64 + 200
    # idle for longer than the window: the rate falls to 0
    for t in (15.0, 17.0, 20.0):
        st.sample(now=t, slots=slots(None, None), ended={})
    assert st.decode_rate() == 0.0 and "generated 108 tokens" in st.line()
    assert "VRAM" not in rows and rows["KV"] == "residency plan: not reported by this build"


def test_the_task_log_reads_each_ended_request_once(tmp_path):
    """TaskLog: llama-server's print_timing lines, read on from where it stopped, a half-written line at the next read."""
    from rollingkv_cli.serve.status import TaskLog

    log = tmp_path / "serve.log"
    log.write_text("main: server is listening\n"
                   "0.10.582.658 I slot print_timing: id  3 | task 2 | prompt eval time =     197.01 ms /     4 tokens (   49.25 ms per token)\n"
                   "0.10.582.689 I slot print_timing: id  3 | task 2 |        eval time =    2978.74 ms /    24 tokens (  129.51 ms per token)\n"
                   "0.10.582.689 I slot print_timing: id  3 | task 2 |       total time =    3175.75 ms /    28 tokens\n"
                   "0.11.000.000 I slot print_timing: id  0 | task 7 | prompt eval time =     10.00 ms /   512 tokens")
    tl = TaskLog(log)
    assert tl.read() == {2: [4, 24]}
    with open(log, "a") as f:
        f.write(" (   1.00 ms per token)\n0.11.000.001 I slot print_timing: id  0 | task 7 |        eval time =  5.00 ms /     1 tokens\n")
    assert tl.read() == {7: [512, 1]} and tl.read() == {}
    assert TaskLog(None).read() == {} and TaskLog(tmp_path / "missing").read() == {}


def test_live_status_reads_the_split_from_props_stats():
    """The KV now row from /props' rolling_kv_stats, as residency_line says it from the /metrics lines of the same figures."""
    from rollingkv_cli.serve.status import LiveStatus, residency_from_stats, residency_line

    stats = {"split": True, "slots": [{"stream": 0, "device_cells": 256, "tail_cells": 700, "window_cells": 768},
                                      {"stream": 1, "device_cells": 0, "tail_cells": 0, "window_cells": 256}],
             "last": {"tail_bytes": 20 << 20, "occupied_bytes": 10 << 20, "streamed_bytes": 0},
             "moves": {"promoted_cells": 512, "demoted_cells": 256}}
    text = "\n".join(["llamacpp:rolling_kv_last_tail_bytes 20971520", "llamacpp:rolling_kv_last_occupied_bytes 10485760",
                      "llamacpp:rolling_kv_last_streamed_bytes 0", "llamacpp:rolling_kv_promoted_cells_total 512",
                      "llamacpp:rolling_kv_demoted_cells_total 256"]
                     + [f'llamacpp:rolling_kv_slot_{k}_cells{{slot="{d["stream"]}"}} {d[k + "_cells"]}'
                        for d in stats["slots"] for k in ("device", "tail", "window")])
    line = residency_from_stats(stats)
    assert line == residency_line(text)
    assert "0: 256+700 (window 768)" in line and "moved 512 cells to the device, 256 to the tail" in line
    assert residency_from_stats({"split": False}) is None and residency_from_stats(None) is None

    class Srv:
        url = "http://127.0.0.1:1"

    st = LiveStatus(Srv(), started=0.0, plan={"split": True, "mode_chosen": "window"}, gpu=False, vram=lambda: [])
    st.sample(now=0.0, slots=[], stats=stats, sharing=None)
    assert dict(st.rows())["KV now"] == line and "shared" not in dict(st.rows())


def test_live_status_shows_the_prompt_tokens_shared_across_slots():
    """Issue 37: /props' rolling_kv_prefix_sharing as the live status's shared row; none where sharing is off."""
    from rollingkv_cli.serve.status import LiveStatus, describe_sharing

    class Srv:
        url = "http://127.0.0.1:1"

    st = LiveStatus(Srv(), started=0.0, plan=None, gpu=False, vram=lambda: [])
    st.sample(now=0.0, slots=[], stats=None, sharing={"min_tokens": 256, "tasks": 3, "tokens": 60000})
    assert dict(st.rows())["shared"] == "60000 prompt tokens taken from other slots by 3 requests (prefixes of at least 256 tokens)"
    st.sample(now=1.0, slots=[], stats=None, sharing={"min_tokens": 0, "tasks": 0, "tokens": 0})  # off (-np N, or 0)
    assert "shared" not in dict(st.rows()) and describe_sharing(None) is None
    assert describe_sharing({"min_tokens": 256, "tasks": 1, "tokens": 300}).startswith("300 prompt tokens taken from other slots by 1 request ")


@pytest.mark.parametrize("cuda, args, refused", [
    (True, [], True),  # auto on a GPU budgets free VRAM and may split
    (True, ["--kv-residency-mode", "off"], False),
    (True, ["--", "--kv-residency-mode", "off"], False),
    (False, [], False),  # auto on a CPU build without a budget stays resident
    (False, ["--vram-target", "300"], True),
    (False, ["--", "--kv-window-cells", "256"], True),
], ids=["gpu-auto", "gpu-off", "gpu-off-after-dashes", "cpu-auto", "cpu-budget", "cpu-window-after-dashes"])
def test_iq4_nl_only_where_the_cache_stays_whole(capsys, hybrid_build, monkeypatch, cuda, args, refused):
    """Issue 27 (10): -ctk iq4_nl, which llama.cpp takes for an unsplit cache, made llama-server abort (GGML_ASSERT in the
    scheduler) once the cache split (an explicit window, a budget, auto on a GPU): refused before it starts, exit 2."""
    from rollingkv_cli.serve import launch

    monkeypatch.setattr(launch, "_resolve_bandwidth", lambda s, cuda: (None, "test"))
    monkeypatch.setattr(launch, "gpu_layers", lambda s, cuda: ([], None))
    hybrid_build.cuda = cuda
    at = args.index("--") if "--" in args else len(args)
    code, out, err = run_main(["serve", str(hybrid_build.model), "-ctk", "iq4_nl", *args[:at], "--print-args", *args[at:]], capsys)
    if refused:
        assert code == 2 and "--cache-type-k iq4_nl: only an unsplit cache takes iq4_nl" in err and "--kv-residency-mode off" in err, err
    else:
        assert code == 0 and "-ctk iq4_nl" in out, err


# ---------------------------------------------------------------- children die with the CLI, even under SIGKILL

def _stream_request(port: int, n_words: int, n_predict: int = 64) -> socket.socket:
    """A streaming /completion sent on a socket that is never read: the client of a long prefill."""
    import json

    body = json.dumps({"prompt": "word " * n_words, "n_predict": n_predict, "stream": True, "cache_prompt": False}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _processing(port: int) -> bool:
    import json

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/slots", timeout=2) as r:
            return any(s.get("is_processing") for s in json.loads(r.read().decode()))
    except OSError:
        return False


@pytest.mark.build
def test_sigkill_of_serve_takes_llama_server_down_mid_prefill(cpu_build, demo_model):
    """SIGKILL of `rollingkv serve` while llama-server prefills a long streaming request: every process serve started is
    gone within 2 s. Seen failing before the fix (issue 39 row 3): the parent-death signal was SIGTERM, which llama-server
    takes as a graceful stop that waits for the running batch, so it lived on (re-parented) until its prefill ended."""
    from proctree import killed_outright, wait_for
    from rollingkv_cli.serve.server import free_port

    port = free_port()
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", "demo", "-q", "-c", "8192", "--port", str(port),
                             "--", "-t", "2", "-b", "8192", "-ub", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    with killed_outright(proc, "serve"):
        _wait_serving(proc)
        client = _stream_request(port, 7000)
        wait_for(lambda: _processing(port), 60, "the request to start")
    client.close()


@pytest.mark.build
@pytest.mark.parametrize("sig,twice", [("SIGTERM", False), ("SIGINT", False), ("SIGINT", True)],
                         ids=["SIGTERM", "SIGINT", "SIGINT twice"])
def test_a_stop_during_a_streaming_request_is_prompt_and_says_the_server_was_killed(cpu_build, demo_model, sig, twice):
    """SIGTERM or Ctrl-C (SIGINT) to `rollingkv serve` while llama-server prefills a long streaming request: llama-server
    does not end on SIGTERM then (its HTTP thread waits for the request its stopped task loop will never finish), and
    serve waited its 15 s grace before the SIGKILL, then said "✓ llama-server stopped (SIGTERM)" as after a clean stop.
    Seen failing before the fix: the stop took 15.1 s and the line said "stopped". Now: a few seconds, the line says
    the server was killed and why, the exit status is still 128 + the signal, and no process serve started is left.
    A second Ctrl-C 0.3 s after the first kills it at once; the line said "it had not ended 3 s after SIGTERM" then too
    (seen failing before that fix): it names the second signal now."""
    from proctree import descendants, kill_all, wait_for, wait_gone
    from rollingkv_cli.serve.server import free_port

    signum = getattr(signal, sig)
    port = free_port()
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", "demo", "-q", "-c", "8192", "--port", str(port),
                             "--", "-t", "2", "-b", "8192", "-ub", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    kids: set[int] = set()
    client = None
    try:
        head = _wait_serving(proc)
        client = _stream_request(port, 7000)
        wait_for(lambda: _processing(port), 60, "the request to start")
        time.sleep(1)  # inside the prefill
        kids = descendants(proc.pid)
        assert kids
        t0 = time.monotonic()
        proc.send_signal(signum)
        if twice:
            time.sleep(0.3)
            proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        out = head + out
        assert took < (2 if twice else 8), f"serve took {took:.1f} s to stop:\n{out}"
        assert proc.returncode == 128 + signum, out
        assert not wait_gone(kids, 1.0), "a process serve started outlived it"
        assert _server_pids(port) == []
        if twice:
            assert "llama-server killed (SIGKILL) at a second stop signal" in out and "had not ended" not in out, out
        else:
            assert "llama-server killed (SIGKILL): it had not ended 3 s after SIGTERM" in out, out
        assert f"(serve stopped by {sig})" in out and "llama-server stopped" not in out, out
        assert "Traceback" not in out
    finally:
        if client is not None:
            client.close()
        kill_all(kids)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.build
def test_serve_keeps_the_newest_logs_as_the_gates_do(cpu_build, demo_model, tmp_path):
    """Issue 39: serve's logs (<cache>/logs/serve-<time>-<port>-<pid>.log) were never pruned; now the newest
    KEEP_RUN_LOGS runs' stay, this one's included, as the gates' (one function, paths.prune_run_logs), and other files
    are left alone. Seen failing before the fix: all 25 old logs were still there."""
    from rollingkv_cli.lib import paths
    from rollingkv_cli.serve.server import free_port

    logs = tmp_path / "cache" / "logs"
    logs.mkdir(parents=True)
    old = [logs / f"serve-202601{d:02d}-120000-8080.log" for d in range(1, 26)]
    for f in old:
        f.write_text("old\n")
    (logs / "notes.txt").write_text("mine\n")
    port = free_port()
    env = {**os.environ, "ROLLINGKV_BUILD": str(cpu_build.dir), "ROLLINGKV_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", str(demo_model), "-q", "-c", "2048", "--port", str(port),
                             "--", "-t", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        _wait_serving(proc)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    kept = sorted(p.name for p in logs.iterdir())
    assert len([n for n in kept if n.startswith("serve-")]) == paths.KEEP_RUN_LOGS and "notes.txt" in kept, kept
    assert kept[-1].startswith("serve-2026") and f"-{port}-{proc.pid}.log" in kept[-1], kept  # this run's log, kept
    assert [f.exists() for f in old] == [False] * 6 + [True] * 19


@pytest.mark.build
def test_the_live_status_leaves_the_metrics_to_other_readers(cpu_build, demo_model):
    """Issue 39 (9): with the live status on (no -q), an outside scraper's first /metrics read after a request still has
    the request's rates: serve's status poll (once a second) reads /slots and /props, never /metrics, whose every read
    resets llama-server's per-interval gauges. Seen failing before the fix: the scraper read predicted_tokens_seconds 0
    and prompt_tokens_seconds 0, serve's poll having read (and reset) them first. (A first version of the new status,
    which lost a request's tokens when its slot cleared them, never showed the line waited for: the wait has a
    deadline.)"""
    import json

    from rollingkv_cli.serve.server import free_port
    from rollingkv_cli.serve.status import parse_metrics

    port = free_port()
    proc = _spawn_serve(cpu_build, port)  # stdout is a pipe: the plain status line, sampled every second
    try:
        _wait_serving(proc)
        body = json.dumps({"prompt": "Once upon a time", "n_predict": 24, "ignore_eos": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["tokens_predicted"] == 24
        import queue
        import threading

        lines: queue.Queue = queue.Queue()  # serve's lines, read by a thread: a wait for the next one has a deadline
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        seen = []
        deadline = time.monotonic() + 60
        while not any(line.startswith("in flight 0, generated 24 tokens") for line in seen):  # serve polled after its end
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError("serve's status never showed the request's tokens:\n" + "".join(seen)) from None
        # a second poll after that one, for good measure: the line changes each second while the rate's window moves on
        assert lines.get(timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            m = parse_metrics(r.read().decode())
        assert m["tokens_predicted_total"] == 24
        assert m["predicted_tokens_seconds"] > 0 and m["prompt_tokens_seconds"] > 0, m
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert _server_pids(port) == []
