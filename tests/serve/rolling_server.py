"""`rollingkv serve` as a user runs it, for the tests of tests/serve: a real llama-server (CPU build, demo model) in its
own process group, its own cache folder, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from rollingkv_cli.serve.server import free_port


class Serve:
    """`rollingkv serve` as a user runs it, in its own process group."""

    def __init__(self, cpu_build, tmp_path, name, *flags, env_extra=None, server_args=("-t", "2")):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
        env.update({"ROLLINGKV_BUILD": str(cpu_build.dir), "ROLLINGKV_CACHE_DIR": str(tmp_path / f"cache-{name}"), "PYTHONUNBUFFERED": "1",
                    **(env_extra or {})})
        # the demo model comes from the shared cache: point the isolated cache's models/ at it
        models = tmp_path / f"cache-{name}" / "models"
        models.parent.mkdir(parents=True, exist_ok=True)
        from rollingkv_cli import models as m

        models.symlink_to(m.demo_path().parent, target_is_directory=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "rollingkv_cli", "serve", "demo", "--port", str(self.port), "-q", *flags, "--", *server_args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError("rollingkv serve did not come up")

    def post(self, path, payload, timeout=600):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 128 + signal.SIGTERM and "llama-server stopped (SIGTERM)" in out, out  # the status of a stop by SIGTERM
        self.output = out
