"""Smoke test of a build on the GPU machine: llama-server with the demo model fully offloaded answers,
and llama_cpp (ctypes) on our libllama sees the GPU. Prints a JSON summary (also to --out); exit 0 when the
answer names Paris and llama_cpp reports GPU offload.

    python3 scripts/device/smoke.py --model PATH [--out FILE]     (`scripts/device/check.sh smoke` runs it)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollingkv_cli.lib import builder  # noqa: E402
from rollingkv_cli.serve.server import ServerProcess  # noqa: E402


def _nvml_used_mib() -> list[int]:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used // 2**20 for i in range(n)]
    except Exception as e:  # no NVML: say so rather than fail the smoke test
        return [f"nvml unavailable: {e}"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    b = builder.active_build()
    log = Path("/tmp/rkv-smoke-server.log")
    log.unlink(missing_ok=True)
    summary: dict = {"build": str(b.dir), "options": b.manifest["options"], "build_seconds": b.manifest["build_seconds"]}
    ldd = subprocess.run(["ldd", str(b.artifact("llama-server"))], capture_output=True, text=True).stdout
    summary["llama_server_links_libggml_cuda"] = "libggml-cuda" in ldd
    devs = subprocess.run([str(b.artifact("llama-server")), "--list-devices"], capture_output=True, text=True)
    summary["list_devices"] = (devs.stdout + devs.stderr).strip().splitlines()[-4:]
    t0 = time.time()
    srv = ServerProcess(b.artifact("llama-server"), ["-m", args.model, "-ngl", "99", "-c", "4096", "-fa", "on", "-np", "1"], log_path=log)
    with srv:
        summary["server_start_s"] = round(time.time() - t0, 2)
        prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        r = srv.request("/completion", {"prompt": prompt, "n_predict": 32, "temperature": 0, "seed": 0})
        summary["answer"] = r["content"]
        summary["timings"] = r.get("timings")
        summary["gpu_memory_used_mib_while_serving"] = _nvml_used_mib()
    text = log.read_text(errors="replace")
    summary["log_backend_lines"] = [line for line in text.splitlines() if re.search(r"load_backend|offloaded|CUDA0 model buffer|using device CUDA", line)][:12]
    code = (
        "import json; from pathlib import Path; from rollingkv_cli.lib import llama_ext;"
        f"m, ext = llama_ext.load(Path({str(b.lib_dir)!r}));"
        "print(json.dumps({'gpu_offload': bool(m.llama_supports_gpu_offload()), 'info': ext.build_info()}))"
    )
    py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    summary["python_ctypes"] = json.loads(py.stdout.strip().splitlines()[-1]) if py.returncode == 0 else {"error": py.stderr[-2000:]}
    out = json.dumps(summary, indent=2)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    ok = "Paris" in summary["answer"] and summary["python_ctypes"].get("gpu_offload") is True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
