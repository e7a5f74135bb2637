"""A real llama-server from our build, on a free port, answering /completion; stopped without leftovers."""

from __future__ import annotations

import os

import pytest

from rollingkv_cli.serve.server import ServerProcess, port_in_use
from rollingkv_cli.console import RollingKVError

pytestmark = pytest.mark.build


def _server(cpu_build, demo_model, tmp_path, **kw) -> ServerProcess:
    return ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(demo_model), "-c", "2048", "-fa", "on", "-np", "1", "-t", "2"],
                         log_path=tmp_path / "server.log", **kw)


def test_server_answers_completion(cpu_build, demo_model, tmp_path):
    with _server(cpu_build, demo_model, tmp_path) as srv:
        r = srv.request("/completion", {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0, "seed": 0})
        assert "Paris" in r["content"]
        props = srv.request("/props")
        assert "default_generation_settings" in props
        pid = srv.proc.pid
    assert srv.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not port_in_use(srv.host, srv.port)


def test_occupied_port_is_refused(cpu_build, demo_model, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        srv = _server(cpu_build, demo_model, tmp_path, port=port)
        with pytest.raises(RollingKVError, match="already in use"):
            srv.start()
        assert srv.proc is None


def test_server_that_dies_is_reported(cpu_build, tmp_path):
    srv = ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(tmp_path / "missing.gguf")], log_path=tmp_path / "s.log")
    srv.start()
    with pytest.raises(RollingKVError, match="exited during start-up"):
        srv.wait_healthy(timeout=60)
    srv.stop()
    assert (tmp_path / "s.log").read_text().strip()
