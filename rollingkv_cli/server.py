"""A supervised llama-server process: free port, poll /health, terminate then kill, never orphaned.

Used by `rollingkv serve` and by the tests (vLLM's RemoteOpenAIServer habits).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from rollingkv_cli.console import RollingKVError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class ServerProcess:
    def __init__(self, binary: Path, args: list[str], host: str = "127.0.0.1", port: int | None = None,
                 log_path: Path | None = None, env: dict | None = None):
        self.binary = Path(binary)
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *self.args, "--host", self.host, "--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        if port_in_use(self.host, self.port):
            raise RollingKVError(f"port {self.port} on {self.host} is already in use", "pick another with --port, or stop what holds it")
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
            self._log_file.write(("$ " + " ".join(self.command) + "\n").encode())
            self._log_file.flush()
        out = self._log_file if self._log_file else subprocess.DEVNULL
        # own process group: a signal to us never half-kills it, and we can take the group down
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 120.0, on_poll=None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RollingKVError(f"llama-server exited during start-up (exit code {code})", self._log_hint())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RollingKVError(f"llama-server did not become healthy within {timeout:.0f} s", self._log_hint())
            if on_poll:
                on_poll()
            time.sleep(0.5)

    def _log_hint(self) -> str | None:
        return f"see its log: {self.log_path}" if self.log_path else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group."""
        from rollingkv_cli.procs import stop_group

        if self.proc is None:
            return None
        stop_group(self.proc, grace)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ requests
    def request(self, path: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
