"""The GPU machine's scripts reach what they claim to run: scripts/device/gpu-tests.sh (lib.sh's gpu_tests) collects every
gpu-marked test of the repo. A gpu test in a file the script's command does not name runs nowhere (tests/test_hybrid_tail.py's
was in that state while the command was `pytest -m gpu tests/test_gpu.py`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIB_SH = REPO / "scripts" / "device" / "lib.sh"
OPTS_WITH_VALUE = {"-p", "-k", "-m", "-c", "-o", "--rootdir", "--timeout", "--junitxml", "--basetemp"}


def _gpu_tests_command(text: str) -> list[str]:
    """The pytest arguments of lib.sh's gpu_tests function (the words after `python3 -m pytest`, up to a pipe, without
    redirections)."""
    body = re.search(r"^gpu_tests\(\)\s*\{\n(.*?)^\}", text, re.S | re.M)
    assert body, "scripts/device/lib.sh has no gpu_tests function"
    line = next((ln for ln in body.group(1).splitlines() if "-m pytest" in ln), None)
    assert line, "gpu_tests runs no pytest"
    words = shlex.split(line.split("|")[0].split("-m pytest", 1)[1])
    return [w for w in words if not re.match(r"^\d*[<>]", w)]  # redirections are the shell's


def _selection(args: list[str]) -> list[str]:
    """The arguments that decide which tests run: -m/-k with their values, and the paths; reporting options dropped."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-k"):
            out += [a, args[i + 1]]
            i += 2
            continue
        if a in OPTS_WITH_VALUE:
            i += 2
            continue
        if not a.startswith("-"):
            out.append(a)
        i += 1
    return out


def _collect(args: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: nothing selected
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def _missed(selection: list[str], every_gpu_test: set[str]) -> dict[str, int]:
    reached = _collect(selection)
    missed: dict[str, int] = {}
    for nodeid in every_gpu_test - reached:
        f = nodeid.split("::")[0]
        missed[f] = missed.get(f, 0) + 1
    return missed


def test_gpu_tests_sh_reaches_every_gpu_marked_test():
    """`pytest --collect-only -m gpu tests/` (every gpu-marked test of the repo) against what gpu_tests' own command collects:
    each gpu-marked file must be reached. Seen failing on the command before this change (`-m gpu tests/test_gpu.py`):
    tests/test_hybrid_tail.py's probe test missed; the same check against that command is part of this test, so it is
    shown to bite on every run."""
    every_gpu_test = _collect(["-m", "gpu", "tests"])
    files = {n.split("::")[0] for n in every_gpu_test}
    assert "tests/test_gpu.py" in files and "tests/test_hybrid_tail.py" in files, files  # the collection itself works
    selection = _selection(_gpu_tests_command(LIB_SH.read_text()))
    assert "-m" in selection and "gpu" in selection[selection.index("-m") + 1], selection
    assert _missed(selection, every_gpu_test) == {}, f"scripts/device/lib.sh gpu_tests ({shlex.join(selection)}) misses these gpu tests"
    # the check bites: the command as it was before (one file named) misses the other file's gpu test
    old = 'gpu_tests() {\n  timeout 400 python3 -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider 2>&1 | tail -15\n}\n'
    missed_by_old = _missed(_selection(_gpu_tests_command(old)), every_gpu_test)
    assert missed_by_old.get("tests/test_hybrid_tail.py") == 1 and "tests/test_gpu.py" not in missed_by_old, missed_by_old


def test_the_gpu_tests_command_is_read_as_the_shell_reads_it():
    text = LIB_SH.read_text()
    args = _gpu_tests_command(text)
    assert args[:4] == ["-q", "-m", "gpu", "tests/"] and any(a.startswith("--junitxml=") for a in args)
    assert _selection(args) == ["-m", "gpu", "tests/"]
    assert _selection(["-q", "-p", "no:cacheprovider", "-k", "x", "a.py", "--junitxml", "f.xml"]) == ["-k", "x", "a.py"]
