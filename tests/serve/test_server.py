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


def _post(srv: ServerProcess, path: str, payload: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(srv.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_integers_that_do_not_fit_are_refused_not_wrapped(cpu_build, demo_model, tmp_path):
    """The upstream fix patches/upstream-fixes/0003 (issue 39): llama-server read a request's integers with a cast, so
    id_slot 2^32 + 1 was slot 1 (and any id past the slots wrapped around: another client's slot by overflow), a
    prompt token id of 2^63 was token 0 and n_predict 2^63 a valid-looking count. Each is a 400 now, naming the value;
    the ids in range still work, and so does seed's documented -1 (random). Seen failing before the fix (the build of the series without it): every one of the
    four was answered 200."""
    srv = ServerProcess(cpu_build.artifact("llama-server"), ["-m", str(demo_model), "-c", "1024", "-fa", "on", "-np", "2", "-t", "2"],
                        log_path=tmp_path / "server.log")
    with srv:
        for payload, what in (({"prompt": "Hello", "n_predict": 4, "id_slot": 2**32 + 1}, "id_slot"),
                              ({"prompt": "Hello", "n_predict": 4, "id_slot": 2}, "id_slot"),  # 2 slots: 0 and 1
                              ({"prompt": [1, 2**63], "n_predict": 4}, "token id"),
                              ({"prompt": "Hello", "n_predict": 2**63}, "n_predict")):
            code, body = _post(srv, "/completion", payload)
            assert code == 400, (payload, code, body)
            assert what in body["error"]["message"], body
        code, body = _post(srv, "/completion", {"prompt": "Hello", "n_predict": 4, "id_slot": 1})
        assert code == 200 and body["id_slot"] == 1, body
        code, body = _post(srv, "/completion", {"prompt": [1, 2, 3], "n_predict": 4, "id_slot": -1, "seed": -1})
        assert code == 200 and body["tokens_predicted"] == 4, body  # seed's documented -1 (random) keeps its meaning
        code, body = _post(srv, "/completion", {"prompt": "Hello", "n_predict": 4, "seed": -2})
        assert code == 400 and "seed" in body["error"]["message"], body
        code, body = _post(srv, "/detokenize", {"tokens": [1, 2**63]})
        assert code == 400 and "token id" in body["error"]["message"], body
