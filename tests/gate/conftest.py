"""Fixtures of the gate tests: a fake llama-server (a small HTTP server that speaks the endpoints the gates use)
as the active build's."""

from __future__ import annotations

import sys

import pytest

# ---------------------------------------------------------------- a fake llama-server

FAKE_SERVER = r'''
import json, os, re, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
def opt(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
mode = opt("--kv-residency-mode", "auto")
ctx = int(opt("-c", "4096"))
window = int(opt("--kv-window-cells", "0") or 0)
if mode != "off" and not window and opt("--vram-target"):
    window = 1024
behaviour = os.environ.get("FAKE_NEEDLE", "retrieve")
log = os.environ.get("FAKE_ARGV_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps(argv) + "\n")
heads = int(opt("--kv-device-heads", "0") or 0)
head = mode in ("head", "auto") and heads > 0 and not os.environ.get("FAKE_NO_SPLIT")
split = head or (mode != "off" and 0 < window < ctx and not os.environ.get("FAKE_NO_SPLIT"))
plan = {"mode_requested": mode, "mode_chosen": "head" if head else "window" if split else "off", "split": split,
        "reason": "fake: explicit heads" if head else "fake: explicit window" if split else "fake: resident", "kv_size": ctx,
        "window_cells": window if split and not head else 0, "tail_cells": ctx if head else ctx - window if split else 0,
        "vram_target_mib": int(opt("--vram-target", "0") or 0),
        "heads": {"split": head, "summary": f"{heads} of 4 KV heads on the device, 2 of 2 layers split" if head else "",
                  "per_layer": [heads, heads] if head else []}}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            return self.send({"status": "ok"})
        if self.path == "/props":
            return self.send({"rolling_kv": plan})
        self.send({"error": "not found"}, 404)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize":  # one token per character
            return self.send({"tokens": [ord(c) for c in body["content"]]})
        if self.path == "/apply-template":
            return self.send({"prompt": "<|user|>" + body["messages"][0]["content"] + "<|assistant|>"})
        if self.path == "/completion":
            prompt = body["prompt"]
            text = "".join(chr(t) for t in prompt) if isinstance(prompt, list) else prompt
            m = re.search(r"secret number is (\d+)", text)
            number = m.group(1) if m else "0"
            answer = " %s." % number
            if behaviour == "forget":
                answer = " 11111."
            elif behaviour == "differ" and mode != "off":
                answer = " %s, or so." % number
            t0 = time.time()
            time.sleep(float(os.environ.get("FAKE_COMPLETION_S", "0")))
            if os.environ.get("FAKE_COMPLETION_LOG"):  # when each completion ran: the test sees whether they overlapped
                with open(os.environ["FAKE_COMPLETION_LOG"], "a") as f:
                    f.write(json.dumps({"start": t0, "end": time.time(), "n_prompt": len(prompt)}) + "\n")
            toks = [ord(c) for c in answer][: body.get("n_predict", 16)]
            return self.send({"content": "".join(chr(t) for t in toks), "tokens": toks, "tokens_evaluated": len(prompt),
                              "tokens_predicted": len(toks),
                              "timings": {"prompt_ms": 10.0, "prompt_per_second": 1000.0, "predicted_ms": 5.0, "predicted_per_second": 200.0}})
        self.send({"error": "not found"}, 404)

ThreadingHTTPServer((opt("--host", "127.0.0.1"), int(opt("--port"))), H).serve_forever()
'''


@pytest.fixture
def fake_server_build(monkeypatch, isolated_cache, tmp_path):
    """The active build: an empty libllama.so and the fake llama-server; `cuda` as the test sets it."""
    from rollingkv_cli.lib import builder

    bdir = tmp_path / "build"
    bin_dir = bdir / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "libllama.so").write_bytes(b"")
    server = bin_dir / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    server.chmod(0o755)
    state = {"options": {"cuda": False}, "argv_log": tmp_path / "argv.jsonl"}
    monkeypatch.setattr(builder, "active_build", lambda required=True: builder.Build(bdir, {"pin": "x", "series_hash": "y", "options": state["options"]}))
    monkeypatch.setenv("FAKE_ARGV_LOG", str(state["argv_log"]))
    return state

