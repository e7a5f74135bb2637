"""A supervised llama-server process: free port, poll /health, terminate then kill, never orphaned.

Used by `rollingkv serve` and by the tests (vLLM's RemoteOpenAIServer habits).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from rollingkv_cli.console import RollingKVError

_HOST_HINT = "give an address of this machine with --host, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"


def resolve_host(host: str, port: int = 0) -> tuple[int, tuple]:
    """(address family, socket address) to bind host:port; a one-line error for a name that does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
        raise RollingKVError(f"cannot resolve host {host!r}: {why}", _HOST_HINT) from None
    if not infos:
        raise RollingKVError(f"cannot resolve host {host!r}: no address", _HOST_HINT)
    family, _, _, _, addr = infos[0]
    return family, addr


def _probe_socket(host: str, port: int) -> socket.socket:
    family, addr = resolve_host(host, port)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise
        if e.errno == errno.EADDRNOTAVAIL:
            raise RollingKVError(f"cannot listen on {host}: it is not an address of this machine", _HOST_HINT) from None
        if e.errno == errno.EACCES:
            raise RollingKVError(f"cannot listen on {host} port {port}: permission denied",
                                 "ports below 1024 need privileges: pick another with --port (0 = any free port)") from None
        raise RollingKVError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return s


def free_port(host: str = "127.0.0.1") -> int:
    with _probe_socket(host, 0) as s:
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port; RollingKVError when the host does not resolve or is not ours."""
    try:
        _probe_socket(host, port).close()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return True
        raise
    return False


def arg_error_in_log(lines: list[str]) -> str | None:
    """llama-server's refusal of its arguments, as common/arg.cpp prints it before anything loads ('error: invalid
    argument: --bogus', 'error while handling argument "-b": stoi', 'error while handling environment variable
    "LLAMA_ARG_N_PARALLEL": stoi'): the first such line, without a leading 'error: ' (None when there is none)."""
    for line in lines:
        line = line.strip()
        if line.startswith("error while handling "):
            return line[:300]
        if line.startswith("error: "):
            return line[len("error: "):][:300]
    return None


def bind_error_in_log(lines: list[str]) -> str | None:
    """llama-server's failure to listen ('couldn't bind HTTP server socket, hostname: H, port: P'): another process took
    the port between serve's check and llama-server's bind (two serves on one port at once); None when the log has none."""
    import re

    for line in lines:
        m = re.search(r"couldn't bind HTTP server socket, hostname: (\S+), port: (\d+)", line)
        if m:
            return f"port {m.group(2)} on {m.group(1)} is already in use (taken while llama-server started)"
    return None


def memory_error_in_log(lines: list[str]) -> str | None:
    """llama.cpp's failure to allocate (a context or model too large for the memory): 'could not allocate the KV cache
    (87890.62 MB)' from ggml's 'insufficient memory (attempted to allocate 87890.62 MB)' and llama's 'failed to allocate
    buffer for kv cache'; None when the log says neither."""
    import re

    size = None
    kv = False
    for line in lines:
        m = re.search(r"insufficient memory \(attempted to allocate ([0-9.]+ [KMGT]?B)\)", line)
        if m and size is None:
            size = m.group(1)
        if "failed to allocate buffer for kv cache" in line:
            kv = True
    if kv:
        return "llama.cpp could not allocate the KV cache" + (f" ({size})" if size else "")
    if size:
        return f"llama.cpp could not allocate {size} of memory"
    return None


def model_error_in_log(lines: list[str]) -> str | None:
    """llama.cpp's reason for not loading the model ('llama_model_load: error loading model: unknown model architecture:
    'foo''): 'llama.cpp could not load the model: unknown model architecture: 'foo''; None when the log has none."""
    marker = "error loading model: "
    for line in lines:
        at = line.find(marker)
        if at >= 0:
            return "llama.cpp could not load the model: " + line[at + len(marker):].strip()[:300]
    return None


def template_error_in_log(lines: list[str]) -> str | None:
    """llama-server's refusal of the model's chat template ('common_chat_templates_init: error: parser: Parser Error:
    Unexpected EOF'): 'llama-server could not parse the model's chat template: ...'; None when the log has none."""
    said = "llama-server could not use the model's chat template (tokenizer.chat_template): "
    for marker in ("common_chat_templates_init: error: ", "chat template parsing error: "):
        for i, line in enumerate(lines):
            at = line.find(marker)
            if at >= 0:
                why = line[at + len(marker):].strip()
                # a Jinja exception's own words follow on a line of their own ("Error: Jinja Exception: ...")
                why += next((" " + n.strip() for n in lines[i + 1:i + 8] if n.startswith("Error: ")), "")
                return said + why[:200]
    return None


TEMPLATE_HINT = "give llama-server a built-in template after `--`: -- --chat-template chatml (or fix the GGUF's tokenizer.chat_template)"


def abort_in_log(lines: list[str]) -> str | None:
    """The assertion llama.cpp aborted on ('.../llama-model.cpp:1362: GGML_ASSERT(...) failed'): 'llama.cpp aborted:
    GGML_ASSERT(...) failed'; None when the log has none."""
    for line in lines:
        at = line.find("GGML_ASSERT(")
        if at >= 0:
            return "llama.cpp aborted: " + line[at:].strip()[:200]
    return None


# How long a slot file being written may stand still before a stop gives up on its save (a disk that hangs)
SAVE_STALL = 15.0


class ServerProcess:
    def __init__(self, binary: Path, args: list[str], host: str = "127.0.0.1", port: int | None = None,
                 log_path: Path | None = None, env: dict | None = None, api_key: str | None = None, stop_grace: float = 15.0):
        self.binary = Path(binary)
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_start = 0  # where this start's lines begin in the log (it is appended to)
        self.failure_reason: str | None = None  # why it exited during start-up, when its log said
        self.api_key = api_key  # sent with our own requests when llama-server requires one
        # how long stop() waits after SIGTERM before SIGKILL: llama-server finishes the batch it is decoding first (a
        # long prefill: seconds to minutes on a CPU)
        self.stop_grace = stop_grace
        self.killed = False  # stop() had to SIGKILL it: it had not ended stop_grace seconds after SIGTERM
        self.killed_after = 0.0  # seconds from the SIGTERM to the SIGKILL
        self.kill_reason = ""  # why: "grace" (not ended in time), "signal" (a second stop signal), "stalled save"
        # where llama-server writes slot files (--slot-save-path), None without: a stop waits past the grace while it
        # writes one (a save of a long context takes seconds; a SIGKILL left it half-written), as long as the file grows
        self.slot_dir: Path | None = None
        self.on_save_wait = None  # called with a slot file's path when a stop begins to wait for its save
        self.saves_waited: list[str] = []  # the slot files a stop waited for
        self.saves_cut: list[str] = []  # half-written slot files a SIGKILL cut short, removed
        self.stopped_after = 0.0  # seconds from the SIGTERM to the end
        self._save_moved: dict[str, tuple[int, float]] = {}  # each slot file's position, and when it last moved

    @property
    def command(self) -> list[str]:
        # the address first: a user's argument that lacks its value (`-- --api-key`) must not take --host as its value
        return [str(self.binary), "--host", self.host, "--port", str(self.port), *self.args]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        if port_in_use(self.host, self.port):
            raise RollingKVError(f"port {self.port} on {self.host} is already in use", "pick another with --port, or stop what holds it")
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
            self._log_start = self._log_file.tell()
            self._log_file.write(("$ " + " ".join(self.command) + "\n").encode())
            self._log_file.flush()
        out = self._log_file if self._log_file else subprocess.DEVNULL
        from rollingkv_cli.lib.procs import popen_tied

        # own process group: a signal to us never half-kills it, and we can take the group down; tied: it
        # dies with us even when we are SIGKILLed or lose the terminal. Its death signal is SIGKILL, not SIGTERM:
        # llama-server takes SIGTERM as a graceful stop that waits for the batch it is decoding (a long prefill:
        # tens of seconds, its client stalled), and once we are gone nobody is left to wait for or to clean up after
        try:
            self.proc = popen_tied(self.command, death_signal=signal.SIGKILL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                   stdin=subprocess.DEVNULL)
        except OSError as e:
            self._close_log()
            raise RollingKVError(f"cannot start {self.binary}: {e.strerror or e}", "run `rollingkv build`") from None
        return self

    def wait_healthy(self, timeout: float = 120.0, on_poll=None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                from rollingkv_cli.lib.procs import exit_parts

                what, advice = exit_parts(None if self.proc is None else self.proc.returncode, self.log_path)
                reason = self._refusal_in_log()
                if reason is None:  # llama-server's own word on an argument or a LLAMA_ARG_* variable it refused
                    reason = arg_error_in_log(self._log_lines())
                    if reason:
                        advice = "llama-server --help lists what it takes: check the flags, the arguments after `--` and the " \
                            "LLAMA_ARG_* variables" + \
                            (f"; {advice}" if advice else "")
                if reason is None:  # the port, taken after our check (two serves started at once)
                    reason = bind_error_in_log(self._log_lines())
                    if reason:
                        advice = "pick another with --port (0 = any free port), or stop what holds it" + (f"; {advice}" if advice else "")
                if reason is None:  # memory it could not get: a context too large for the host
                    reason = memory_error_in_log(self._log_lines())
                    if reason:
                        advice = "lower -c/--ctx-size (the KV cache grows with it)" + (f"; {advice}" if advice else "")
                if reason is None:  # a model it would not load (`run` said why; serve said only "exit status 1")
                    reason = model_error_in_log(self._log_lines())
                    if reason:
                        advice = "the file is corrupt or not a model this build runs" + (f"; {advice}" if advice else "")
                if reason is None:  # a chat template it cannot parse: "exit status 1" and a log box before
                    reason = template_error_in_log(self._log_lines())
                    if reason:
                        advice = TEMPLATE_HINT + (f"; {advice}" if advice else "")
                if reason is None:  # an assertion: "killed by SIGABRT" and a log box before
                    reason = abort_in_log(self._log_lines())
                self.failure_reason = reason  # said in the error's one line: the caller need not show the log
                raise RollingKVError(f"llama-server exited during start-up ({what})" + (f": {reason}" if reason else ""), advice)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RollingKVError(f"llama-server did not become healthy within {timeout:g} s", self._log_hint())
            if on_poll:
                on_poll()
            time.sleep(0.5)

    def _log_lines(self) -> list[str]:
        """This start's lines of the log (not an earlier run's in the same file)."""
        if not self.log_path:
            return []
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read(4 << 20).decode(errors="replace").splitlines()
        except OSError:
            return []

    def _refusal_in_log(self) -> str | None:
        """The library's reason when it refused the context (a window or head split it cannot make, ...)."""
        from rollingkv_cli.lib.llama_ext import refusal_in_log

        return refusal_in_log(self._log_lines())

    def _log_hint(self) -> str | None:
        return f"see its log: {self.log_path}" if self.log_path else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float | None = None) -> int | None:
        """SIGTERM, wait (grace, else stop_grace, longer while a slot file is being written), then SIGKILL the whole
        group (self.killed says it came to that; a slot file it was writing is removed, in self.saves_cut)."""
        from rollingkv_cli.lib.procs import files_written, stop_group

        if self.proc is None:
            return None

        began = time.monotonic()
        cut: dict[str, int] = {}

        def killing(interrupted: bool) -> None:
            self.killed = True
            self.killed_after = time.monotonic() - began
            if self.slot_dir is not None:
                cut.update(files_written(self.proc.pid, self.slot_dir))
            self.kill_reason = "signal" if interrupted else "stalled save" if cut else "grace"

        try:
            stop_group(self.proc, self.stop_grace if grace is None else grace, on_kill=killing,
                       busy=self._saving if self.slot_dir is not None else None)
        finally:
            self.stopped_after = time.monotonic() - began
            self._close_log()
            for path in cut:  # llama-server closes a slot file once all of it is written: this one never will be
                try:
                    os.unlink(path)
                    self.saves_cut.append(path)
                except OSError:
                    pass
        return self.proc.returncode

    def _saving(self) -> bool:
        """Whether llama-server is writing a slot file that moved within SAVE_STALL seconds (stop_group's busy)."""
        from rollingkv_cli.lib.procs import files_written

        now = time.monotonic()
        files = files_written(self.proc.pid, self.slot_dir)
        for path, pos in files.items():
            if self._save_moved.get(path, (None,))[0] != pos:
                self._save_moved[path] = (pos, now)
            if path not in self.saves_waited:
                self.saves_waited.append(path)
                if self.on_save_wait:
                    self.on_save_wait(path)
        return any(now - self._save_moved[path][1] < SAVE_STALL for path in files)

    def _close_log(self) -> None:
        if self._log_file:
            self._log_file.close()
            self._log_file = None

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
    def http_request(self, path: str, data: bytes | None = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.url + path, data=data, headers=headers)

    def request(self, path: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        with urllib.request.urlopen(self.http_request(path, data), timeout=timeout) as r:
            return json.loads(r.read().decode())
