"""Reading test-rolling-kv-ops' output (native/tests/test-rolling-kv-ops.cpp), shared by tests/test_ops_must_fail.py (the
CPU) and tests/test_gpu.py (CUDA0): the case lines, which cases hold a live tail (computed from each case line with
the op test's own mask rules, not taken from the binary), and why CUDA refuses a case.

What the op test prints, per case i (main() there):
    [   i] <case_str>: NMSE=... (thr ...)<extra> <ms> ms OK|FAIL
    [   i] <case_str>: NMSE=... ... OK (fails: perturbed tail) | OK (no live tail)
                                    | FAIL (perturbed tail not detected) | FAIL (no live tail, yet failed)   (--expect-perturbed)
    [   i] <case_str>: not supported, skipped         (the backend's supports_op refused the op or the reference)
and at the end "N skipped, T s" and "P passed, F failed". A skipped case counts in neither P nor F; a case that
does as --expect-perturbed expects counts as passed. Head size 72 (case_str "D= 72") on a backend other than the
CPU is not run: it passes when the backend refuses it (" refused (TILE kernel: no LSE)") and its tail counts as
not live.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CASE = re.compile(r"^\[\s*(\d+)\] ((?:heads )?D=[^:]*): (.*)$")  # "heads D=...": the head split's cases (--heads)
VERDICT = re.compile(r"\s(OK|FAIL)( \([^)]*\))?$")
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.M)
SKIPPED = re.compile(r"^(\d+) skipped, ", re.M)
NOT_SUPPORTED = "not supported, skipped"
CAUGHT = "OK (fails: perturbed tail)"  # --expect-perturbed: a case with a live tail failed, as it must
CLEAN = "OK (no live tail)"            # --expect-perturbed: a case without one passed, as it must


@dataclass
class Case:
    index: int
    desc: str            # case_str: "D=128 hkv=2 gqa=4 n_kv= 512 n_q=  7 split= 256 K=f16/f16 V=f16/f16 mask=rows sinks cache"
    skipped: bool
    ok: bool | None      # None when skipped
    verdict: str | None  # "OK", "FAIL", "OK (fails: perturbed tail)", ...; None when skipped
    line: str


@dataclass
class Run:
    cases: dict[int, Case]
    passed: int | None
    failed: int | None
    n_skipped: int | None
    stdout: str


def parse(stdout: str) -> Run:
    cases: dict[int, Case] = {}
    for line in stdout.splitlines():
        m = CASE.match(line.rstrip())
        if not m:
            continue
        i, desc, rest = int(m.group(1)), m.group(2), m.group(3)
        if rest == NOT_SUPPORTED:
            cases[i] = Case(i, desc, True, None, None, line)
            continue
        v = VERDICT.search(rest)
        assert v, f"a case line without a verdict: {line!r}"
        cases[i] = Case(i, desc, False, v.group(1) == "OK", (v.group(1) + (v.group(2) or "")), line)
    s = SUMMARY.findall(stdout)
    k = SKIPPED.findall(stdout)
    return Run(cases, int(s[-1][0]) if s else None, int(s[-1][1]) if s else None, int(k[-1]) if k else None, stdout)


def check_complete(run: Run) -> None:
    """Every case from 0 to the last printed one (none missing: a crash mid-run leaves no summary), and the summary's
    counts are the case lines': passed + failed = the cases run, skipped = the 'not supported' lines."""
    tail = run.stdout[-3000:]
    assert run.cases, tail
    assert sorted(run.cases) == list(range(len(run.cases))), ("cases missing", sorted(set(range(max(run.cases) + 1)) - set(run.cases))[:10])
    assert run.passed is not None and run.n_skipped is not None, tail
    n_skip = sum(c.skipped for c in run.cases.values())
    assert run.n_skipped == n_skip, (run.n_skipped, n_skip)
    assert run.passed + run.failed == len(run.cases) - n_skip, (run.passed, run.failed, len(run.cases), n_skip)
    assert run.passed == sum(bool(c.ok) for c in run.cases.values()), tail


def field(desc: str, name: str) -> int:
    return int(re.search(name + r"=\s*(\d+)", desc).group(1))


def flags(desc: str) -> set[str]:
    """The words after mask=...: sinks, alibi, softcap, cache, ne3=2, q-perm."""
    return set(desc.split("mask=", 1)[1].split()[1:])


def live_tail_keys(desc: str, lo: int | None = None, hi: int | None = None) -> int:
    """Tail cells [split, n_kv) (or only those in [lo, hi)) that some query row attends, by the op test's mask
    (run_case): padded columns (the last min(5, n_kv/4)), causal, holes (40 cells from n_kv/3, and split +- 3), rows
    (i % 4 == 1 fully masked, == 2 window masked, == 3 tail masked)."""
    n_kv, n_q, s = field(desc, "n_kv"), field(desc, "n_q"), field(desc, "split")
    mask = re.search(r"mask=(\w+)", desc).group(1)
    j0, j1 = max(s, lo if lo is not None else s), min(n_kv, hi if hi is not None else n_kv)
    if j0 >= j1:
        return 0
    if mask == "none":
        return j1 - j0
    n_valid = min(j1, n_kv - min(5, n_kv // 4))
    keys = set()
    for i in range(n_q):
        if mask == "rows" and i % 4 in (1, 3):
            continue
        for j in range(j0, n_valid):
            if j > n_valid - n_q + i:
                break
            if mask in ("holes", "rows") and (n_kv // 3 <= j < n_kv // 3 + 40 or s - 3 <= j < s + 3):
                continue
            keys.add(j)
    return len(keys)


def dropped_run_keys(desc: str) -> int:
    """--runs-wrong: the keys some query row attends in the run the op test leaves out of a case's tail runs (block 1 of
    the tail, cells [split + 256, split + 512)). Only a tail of five blocks or more has a run left after it (blocks 0, 2
    and 3 are hidden, block 4 on is the other run): a shorter one keeps its whole tail."""
    n_kv, s = field(desc, "n_kv"), field(desc, "split")
    if n_kv - s <= 4 * 256:
        return 0
    return live_tail_keys(desc, s + 256, s + 512)


def mapped(desc: str) -> bool:
    """--map, --map-wrong: the cases of two or more whole 256-cell blocks attend through a block map."""
    n_kv = field(desc, "n_kv")
    return n_kv % 256 == 0 and n_kv >= 512


def key_visible(desc: str, i: int, j: int, with_map: bool = False) -> bool:
    """Whether query row i (< n_q) sees logical key j, by the op test's mask rules (run_case; live_tail_keys): padded
    columns, causal, holes, rows; with_map: a mapped case with a mask and an odd split also masks logical block 1."""
    n_kv, n_q, s = field(desc, "n_kv"), field(desc, "n_q"), field(desc, "split")
    mask = re.search(r"mask=(\w+)", desc).group(1)
    if mask == "none":
        return True
    if with_map and mapped(desc) and s % 2 == 1 and 256 <= j < 512:
        return False
    n_valid = n_kv - min(5, n_kv // 4)
    if j >= n_valid or j > n_valid - n_q + i:
        return False
    if mask in ("holes", "rows") and (n_kv // 3 <= j < n_kv // 3 + 40 or s - 3 <= j < s + 3):
        return False
    if mask == "rows" and (i % 4 == 1 or (i % 4 == 2 and j < s) or (i % 4 == 3 and j >= s)):
        return False
    return True


def map_swap_visible(desc: str) -> bool:
    """--map-wrong on the CPU: the op's map swaps logical blocks 0 and 1, a permutation of the keys that only the
    bit-identity of same-type cases can see, where a query row sees keys of both blocks (their order then changes)."""
    if not mapped(desc) or mixed(desc):
        return False
    def sees(i: int, j0: int, j1: int) -> bool:
        return any(key_visible(desc, i, j, True) for j in range(j0, j1))

    return any(sees(i, 0, 256) and sees(i, 256, 512) for i in range(field(desc, "n_q")))


def mixed(desc: str) -> bool:
    k, v = re.search(r"K=(\w+)/(\w+)", desc), re.search(r"V=(\w+)/(\w+)", desc)
    return k.group(1) != k.group(2) or v.group(1) != v.group(2)


def tile_only(desc: str) -> bool:
    """Head size 72: only the stock TILE kernel (no LSE) runs it on CUDA/HIP, so those backends must refuse it."""
    return field(desc, "D") == 72


def cuda_skip_reason(desc: str, tail_host: bool) -> str | None:
    """Why CUDA0 reports a case 'not supported' (None: it must run). Measured on the H200 (docs/perf: every skipped case
    of the full matrix, 9 with a device tail, 289 with a pinned-host tail, fits exactly these reasons):
    - F32 K/V: the stock CUDA FlashAttention takes no F32 K/V, so neither the op nor its reference runs;
    - --tail-host, a tail in the non-cache layout: its cell rows are not contiguous, CUDA does not stream them (the
      scheduler gives the op to the CPU, and the test skips the case)."""
    if re.search(r"K=f32/|K=\w+/f32|V=f32/|V=\w+/f32", desc):
        return "F32 K/V: no CUDA FlashAttention kernel for them"
    if tail_host and "cache" not in flags(desc) and field(desc, "split") < field(desc, "n_kv") and not tile_only(desc):
        return "non-cache layout tail: rows not contiguous, not streamed from the host"
    return None
