"""The op test both ways (test-rolling-kv-ops on the CPU): unperturbed, every case passes bit-identically or within its
bound; with the op's debug switch ROLLINGKV_DEBUG_PERTURB_TAIL (every tail score x (1 + x)), exactly the cases whose
tail holds a key some query row reads fail. Which cases those are is computed here from each case line (n_kv, n_q,
split, mask) with the op test's own mask rules, not taken from the binary.

Measured on the CPU build (876 cases): x = 1e-4 fails exactly the 553 same-type cases with a live tail; mixed-type
cases (f16 window + quantized tail) are held to NMSE <= 5e-5 against a dequantized reference, which a small x stays
under, and fail only at large x (x = 1: all 588 live-tail cases). At x = 1e-6, 1 of the 8 same-type cases whose tail
holds a single live key still comes out bit-identical (D=64, n_kv=512, split=511, no mask: one score in 512 moved by
1e-6 changes its weight by ~1e-9, lost in the f16 accumulation of V); every case with two or more live tail keys fails.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.build

N_CASES = 876  # the full CPU matrix; a change to the case list must change this number on purpose
CASE = re.compile(r"^\[\s*(\d+)\] (D=.*?): .*\s(OK|FAIL)$")
SUMMARY = re.compile(r"(\d+) passed, (\d+) failed")


def _run(binary, x: str | None) -> tuple[dict[int, tuple[str, bool]], str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    if x is not None:
        env["ROLLINGKV_DEBUG_PERTURB_TAIL"] = x
    proc = subprocess.run([str(binary), "-b", "CPU", "-t", "2"], capture_output=True, text=True, timeout=900, env=env)
    cases = {}
    for line in proc.stdout.splitlines():
        m = CASE.match(line.rstrip())
        if m:
            cases[int(m.group(1))] = (m.group(2), m.group(3) == "OK")
    assert cases, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cases, proc.stdout


def _field(desc: str, name: str) -> int:
    return int(re.search(name + r"=\s*(\d+)", desc).group(1))


def live_tail_keys(desc: str) -> int:
    """Tail cells [split, n_kv) that some query row attends, by the op test's mask (run_case): padded columns
    (the last min(5, n_kv/4)), causal, holes (40 cells from n_kv/3, and split +- 3), rows (i % 4 == 1 fully masked,
    == 2 window masked, == 3 tail masked)."""
    n_kv, n_q, s = _field(desc, "n_kv"), _field(desc, "n_q"), _field(desc, "split")
    mask = re.search(r"mask=(\w+)", desc).group(1)
    if s >= n_kv:
        return 0
    if mask == "none":
        return n_kv - s
    n_valid = n_kv - min(5, n_kv // 4)
    keys = set()
    for i in range(n_q):
        if mask == "rows" and i % 4 in (1, 3):
            continue
        for j in range(s, n_valid):
            if j > n_valid - n_q + i:
                break
            if mask in ("holes", "rows") and (n_kv // 3 <= j < n_kv // 3 + 40 or s - 3 <= j < s + 3):
                continue
            keys.add(j)
    return len(keys)


def _mixed(desc: str) -> bool:
    k, v = re.search(r"K=(\w+)/(\w+)", desc), re.search(r"V=(\w+)/(\w+)", desc)
    return k.group(1) != k.group(2) or v.group(1) != v.group(2)


def test_live_tail_keys_follow_the_mask_rules():
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 511 K=f16/f16 V=f16/f16 mask=causal cache") == 0
    assert live_tail_keys("D= 64 hkv=2 gqa=2 n_kv= 512 n_q=  1 split= 511 K=f16/f16 V=f16/f16 mask=none") == 1
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  7 split= 512 K=f16/f16 V=f16/f16 mask=causal") == 0
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 255 K=f16/f16 V=f16/f16 mask=causal cache") == 507 - 255
    # rows: only rows 0 mod 4 read the tail; holes cut split +- 3
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 256 K=f16/f16 V=f16/f16 mask=rows") == 507 - 259


@pytest.fixture(scope="module")
def runs(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    assert binary.exists(), "the op test binary is part of every build"
    return {x: _run(binary, x) for x in (None, "1e-6", "1e-4", "1")}


def test_unperturbed_every_case_passes_none_skipped(runs):
    cases, out = runs[None]
    assert len(cases) == N_CASES and all(ok for _, ok in cases.values()), out[-3000:]
    assert f"{N_CASES} passed, 0 failed" in out and re.search(r"^0 skipped", out, re.M), out[-500:]


@pytest.mark.parametrize("x", ["1e-4", "1"])
def test_perturbed_exactly_the_live_tail_cases_fail(runs, x):
    """x = 1e-4: every same-type case with a live tail fails (bit-identity), every other case passes; x = 1: every case
    with a live tail fails, mixed ones too. Fails when a case with a live tail passes perturbed (a check that cannot
    see the tail) or one without fails (a perturbation leaking into the window)."""
    base, _ = runs[None]
    cases, out = runs[x]
    assert cases.keys() == base.keys()
    must_fail = {i for i, (desc, _) in base.items() if live_tail_keys(desc) and (x == "1" or not _mixed(desc))}
    failed = {i for i, (_, ok) in cases.items() if not ok}
    assert failed == must_fail, (sorted(failed - must_fail)[:10], sorted(must_fail - failed)[:10])
    passed, n_failed = map(int, SUMMARY.findall(out)[-1])
    assert n_failed == len(must_fail) and passed == N_CASES - len(must_fail)
    assert len(must_fail) > N_CASES // 2 and N_CASES - len(must_fail) > 200  # both sides are well populated


def test_perturbed_by_one_ulp_scale_every_multi_key_tail_fails(runs):
    """x = 1e-6: no case without a live tail and no mixed case fails; every same-type case with two or more live tail
    keys fails; a single live key may survive (f16 rounding of V's accumulation)."""
    base, _ = runs[None]
    cases, _ = runs["1e-6"]
    failed = {i for i, (_, ok) in cases.items() if not ok}
    same = {i: live_tail_keys(d) for i, (d, _) in base.items() if not _mixed(d)}
    assert failed <= {i for i, k in same.items() if k}
    assert {i for i, k in same.items() if k >= 2} <= failed
