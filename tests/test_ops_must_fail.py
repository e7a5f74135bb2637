"""The op test both ways (test-rolling-kv-ops on the CPU): unperturbed, every case passes bit-identically or within its
bound; with the op's test hook ROLLINGKV_DEBUG_PERTURB_TAIL (every tail score x (1 + x)), exactly the cases whose
tail holds a key some query row reads fail. Which cases those are is computed here from each case line (n_kv, n_q,
split, mask) with the op test's own mask rules (tests/optest.py), not taken from the binary. The number of cases is
the op test's own (its case lines, numbered from 0 without a gap, all run, none skipped), so a changed matrix needs
no edit here.

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

import optest
from optest import dropped_run_keys, live_tail_keys, mixed as _mixed

pytestmark = pytest.mark.build


def _run(binary, x: str | None) -> tuple[dict[int, tuple[str, bool]], str]:
    """The full CPU matrix, unperturbed or perturbed by x: {case index: (case_str, passed)} and the output. Every case
    from 0 to the last printed (none missing), the summary's counts the case lines' (optest.check_complete)."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    if x is not None:
        env["ROLLINGKV_DEBUG_PERTURB_TAIL"] = x
    proc = subprocess.run([str(binary), "-b", "CPU", "-t", "2"], capture_output=True, text=True, timeout=900, env=env)
    run = optest.parse(proc.stdout)
    optest.check_complete(run)
    return {i: (c.desc, bool(c.ok)) for i, c in run.cases.items() if not c.skipped}, proc.stdout


def test_live_tail_keys_follow_the_mask_rules():
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 511 K=f16/f16 V=f16/f16 mask=causal cache") == 0
    assert live_tail_keys("D= 64 hkv=2 gqa=2 n_kv= 512 n_q=  1 split= 511 K=f16/f16 V=f16/f16 mask=none") == 1
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  7 split= 512 K=f16/f16 V=f16/f16 mask=causal") == 0
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 255 K=f16/f16 V=f16/f16 mask=causal cache") == 507 - 255
    # rows: only rows 0 mod 4 read the tail; holes cut split +- 3
    assert live_tail_keys("D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 256 K=f16/f16 V=f16/f16 mask=rows") == 507 - 259


OUT = """test-rolling-kv-ops: backend CPU, 2 threads, full, same-type cases must be bit-identical
[   0] D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split=   0 K=f16/f16 V=f16/f16 mask=causal: NMSE=0.000e+00 (thr 5e-07) bitexact     1.0 ms OK
[   1] D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split= 255 K=f16/f16 V=f16/f16 mask=causal cache: NMSE=1.0e-03 (thr 5e-07) DIFF 3/3     1.0 ms FAIL
[   2] D=128 hkv=2 gqa=2 n_kv= 512 n_q=  7 split= 256 K=f32/f32 V=f32/f32 mask=holes sinks cache: not supported, skipped
[   3] D= 72 hkv=2 gqa=2 n_kv= 512 n_q=  1 split= 256 K=f16/f16 V=f16/f16 mask=causal cache: NMSE=0.000e+00 (thr 5e-07) refused (TILE kernel: no LSE)     0.1 ms OK (no live tail)
1 skipped, 0.1 s
2 passed, 1 failed
"""


def test_block_map_visibility_follows_the_mask_rules():
    """optest.key_visible and map_swap_visible (--map, --map-wrong): an odd split of a masked mapped case hides logical
    block 1 from every row; mixed types and unmapped cases never see the swap."""
    d = "D= 64 hkv=2 gqa=1 n_kv= 512 n_q=  1 split=   0 K=f16/f16 V=f16/f16 mask=causal"
    assert optest.mapped(d) and optest.key_visible(d, 0, 300) and not optest.key_visible(d, 0, 508)
    assert optest.map_swap_visible(d)
    odd = d.replace("split=   0", "split= 255")
    assert not optest.key_visible(odd, 0, 300, True) and optest.key_visible(odd, 0, 300)
    assert not optest.map_swap_visible(odd)
    assert optest.map_swap_visible(odd.replace("mask=causal", "mask=none"))  # no mask to hide it with
    assert not optest.map_swap_visible(d.replace("K=f16/f16", "K=f16/q8_0"))
    assert not optest.mapped(d.replace("n_kv= 512", "n_kv=1025"))
    assert not optest.mapped(d.replace("n_kv= 512", "n_kv= 256"))
    # rows: row 2 (window [0, split) masked) sees neither block below the split
    rows = "D= 64 hkv=2 gqa=2 n_kv=1536 n_q=  7 split= 768 K=f16/f16 V=f16/f16 mask=rows"
    assert not optest.key_visible(rows, 2, 100) and optest.key_visible(rows, 2, 1000)
    assert not optest.key_visible(rows, 1, 1000)  # a fully masked row


def test_reading_the_op_tests_output():
    """optest: case lines, verdicts, skips and the summary; an output with a case missing (a gap), a count that is not
    the case lines' or no summary (a crash) is refused."""
    run = optest.parse(OUT)
    optest.check_complete(run)
    assert [c.ok for c in run.cases.values()] == [True, False, None, True] and run.cases[2].skipped
    assert run.cases[3].verdict == optest.CLEAN and optest.tile_only(run.cases[3].desc) and run.cases[1].desc.endswith("mask=causal cache")
    assert (run.passed, run.failed, run.n_skipped) == (2, 1, 1)
    assert optest.flags(run.cases[2].desc) == {"sinks", "cache"}
    assert optest.cuda_skip_reason(run.cases[2].desc, False).startswith("F32 K/V")
    assert optest.cuda_skip_reason(run.cases[0].desc, True).startswith("non-cache layout") and not optest.cuda_skip_reason(run.cases[0].desc, False)
    assert optest.cuda_skip_reason(run.cases[1].desc, True) is None  # the cache layout streams
    bad = [OUT.replace("[   1]", "[   5]"), OUT.replace("2 passed, 1 failed", "3 passed, 1 failed"), OUT.rsplit("1 skipped", 1)[0],
           OUT.replace("1 skipped", "0 skipped")]
    for text in bad:
        with pytest.raises(AssertionError):
            optest.check_complete(optest.parse(text))


@pytest.fixture(scope="module")
def runs(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    assert binary.exists(), "the op test binary is part of every build"
    return {x: _run(binary, x) for x in (None, "1e-6", "1e-4", "1")}


def test_unperturbed_every_case_passes_none_skipped(runs):
    """The case count is the op test's own (its case lines, numbered from 0 without a gap): every one passes, the
    summary says so, none is skipped (a 'not supported, skipped' line, or a skipped count other than 0, fails), and
    it is the full matrix, not the quick one (the quick has 267)."""
    cases, out = runs[None]
    run = optest.parse(out)
    assert all(ok for _, ok in cases.values()), out[-3000:]
    assert len(cases) == len(run.cases) and run.n_skipped == 0 and optest.NOT_SUPPORTED not in out, out[-500:]
    assert f"{len(cases)} passed, 0 failed" in out and len(cases) > 800, out[-500:]


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
    run = optest.parse(out)
    n = len(base)
    assert run.failed == len(must_fail) and run.passed == n - len(must_fail)
    assert len(must_fail) > n // 2 and n - len(must_fail) > 200  # both sides are well populated


def test_perturbed_by_one_ulp_scale_every_multi_key_tail_fails(runs):
    """x = 1e-6: no case without a live tail and no mixed case fails; every same-type case with two or more live tail
    keys fails; a single live key may survive (f16 rounding of V's accumulation)."""
    base, _ = runs[None]
    cases, _ = runs["1e-6"]
    failed = {i for i, (_, ok) in cases.items() if not ok}
    same = {i: live_tail_keys(d) for i, (d, _) in base.items() if not _mixed(d)}
    assert failed <= {i for i, k in same.items() if k}
    assert {i for i, k in same.items() if k >= 2} <= failed


# ------------------------------------------------------------------------ the head split's cases (--heads)

HEAD_CASE = re.compile(r"^heads D=\s*(\d+) hkv=(\d+) gqa=(\d+) h_dev=(\d+) n_kv=\s*(\d+) n_q=\s*(\d+) K=(\S+)/(\S+) V=(\S+)/(\S+) mask=(\w+)")


def _run_heads(binary, x: str | None) -> tuple[dict[int, tuple[str, bool]], str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    if x is not None:
        env["ROLLINGKV_DEBUG_PERTURB_TAIL"] = x
    proc = subprocess.run([str(binary), "-b", "CPU", "-t", "2", "--heads"], capture_output=True, text=True, timeout=900, env=env)
    run = optest.parse(proc.stdout)
    optest.check_complete(run)
    return {i: (c.desc, bool(c.ok)) for i, c in run.cases.items() if not c.skipped}, proc.stdout


@pytest.fixture(scope="module")
def head_runs(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    return {x: _run_heads(binary, x) for x in (None, "1e-4")}


def test_head_split_op_cases_are_bit_identical(head_runs):
    """ggml_flash_attn_ext on the device heads' query view + the streaming op with an EMPTY window over the host heads,
    concatenated by head, against ggml_flash_attn_ext over every head: bit-identical on the CPU in every case (each head
    at its part's types: two types compare each head with the whole-heads reference at that head's types), none skipped;
    decode (one-chunk and split-KV), small batches and prefill (the tiled path), GQA 1 and 3, every cut of 2..4 KV heads."""
    cases, out = head_runs[None]
    run = optest.parse(out)
    assert all(ok for _, ok in cases.values()) and run.n_skipped == 0 and len(cases) >= 80, out[-3000:]
    assert all("bitexact" in c.line for c in run.cases.values()), out[-3000:]
    shapes = [HEAD_CASE.match(d).groups() for d, _ in cases.values()]
    assert all(0 < int(h) < int(hkv) for _, hkv, _, h, *_ in shapes)  # every case keeps heads in host memory
    n_q = {int(s[5]) for s in shapes}
    assert {1, 7, 128, 512} <= n_q and any(int(s[4]) > 512 and int(s[5]) == 1 for s in shapes)  # split-KV decode
    assert any(s[6] != s[7] for s in shapes)  # two types


def test_head_split_op_cases_fail_perturbed(head_runs):
    """Every case has host heads and unmasked keys (each mask leaves keys of row 0), so with every host head's score
    x (1 + 1e-4) every case fails: the check sees the streamed part in every path."""
    base, _ = head_runs[None]
    cases, out = head_runs["1e-4"]
    assert cases.keys() == base.keys()
    assert not any(ok for _, ok in cases.values()), out[-3000:]


# ------------------------------------------------------------------------ tail runs (--runs, --runs-wrong)


def _run_runs(binary, flag: str) -> tuple[dict[int, tuple[str, bool, str]], str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLINGKV_DEBUG_PERTURB_TAIL"}
    proc = subprocess.run([str(binary), "-b", "CPU", "-t", "2", flag], capture_output=True, text=True, timeout=900, env=env)
    run = optest.parse(proc.stdout)
    optest.check_complete(run)
    return {i: (c.desc, bool(c.ok), c.line) for i, c in run.cases.items() if not c.skipped}, proc.stdout


@pytest.fixture(scope="module")
def runs_runs(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    return {flag: _run_runs(binary, flag) for flag in ("--runs", "--runs-wrong")}


def test_tail_runs_are_bit_identical(runs_runs):
    """--runs: the mask hides tail blocks 0, 2 and 3 from every row and the op reads only the other blocks (its tail
    runs): every case passes against ggml_flash_attn_ext over the whole K/V, bit-identically for one type, none
    skipped; the run cases cover decode (split-KV), small batches and the tiled path, quantized and mixed types."""
    cases, out = runs_runs["--runs"]
    run = optest.parse(out)
    assert all(ok for _, ok, _ in cases.values()) and run.n_skipped == 0, out[-3000:]
    with_runs = {i: d for i, (d, _, line) in cases.items() if re.search(r" runs=[12] ", line)}
    assert len(with_runs) >= 60, len(with_runs)
    assert all("bitexact" in cases[i][2] for i, d in with_runs.items() if not _mixed(d)), out[-3000:]
    n_q = {optest.field(d, "n_q") for d in with_runs.values()}
    assert {1, 7, 64} <= n_q and any(_mixed(d) for d in with_runs.values())


def test_a_key_left_out_of_the_runs_is_caught(runs_runs):
    """--runs-wrong: the first run (tail block 1) is also left out of the runs while its keys stay visible; exactly the
    cases where some row sees one of those keys fail (computed here from the case line), every other case passes."""
    cases, out = runs_runs["--runs-wrong"]
    base, _ = runs_runs["--runs"]
    assert cases.keys() == base.keys()
    must_fail = {i for i, (d, _, _) in cases.items() if dropped_run_keys(d)}
    # the comparison failed where the op test's self-check says "caught"; a case that passed says "no live tail"
    caught = {i for i, (_, _, line) in cases.items() if line.endswith(optest.CAUGHT)}
    assert caught == must_fail, (sorted(caught - must_fail)[:10], sorted(must_fail - caught)[:10])
    assert all(ok for _, ok, _ in cases.values()), out[-3000:]  # and nothing else went the wrong way
    assert len(must_fail) >= 50


# ------------------------------------------------------------------------ block maps (--map, --map-wrong)


@pytest.fixture(scope="module")
def map_runs(cpu_build):
    binary = cpu_build.artifact("test-rolling-kv-ops")
    return {flag: _run_runs(binary, flag) for flag in ("--map", "--map-wrong")}


def test_block_map_is_bit_identical(map_runs):
    """--map: every case of two or more whole blocks attends through a block map (a unified cache whose blocks move
    between the window and the tail: resident blocks in shuffled window slots beside unused ones of garbage, the others
    in a tail whose resident cells are garbage, a physical mask) against ggml_flash_attn_ext over the logical K/V and
    mask: every case passes, bit-identically for one type, none skipped; decode (split-KV), small batches and the tiled
    path, every mask, sinks, softcap, ALiBi, GQA, quantized and mixed types, two streams, with and without tail runs."""
    cases, out = map_runs["--map"]
    run = optest.parse(out)
    assert all(ok for _, ok, _ in cases.values()) and run.n_skipped == 0, out[-3000:]
    with_map = {i: d for i, (d, _, line) in cases.items() if " map=" in line}
    assert with_map.keys() == {i for i, (d, _, _) in cases.items() if optest.mapped(d)}
    assert len(with_map) >= 900, len(with_map)
    assert all("bitexact" in cases[i][2] for i, d in with_map.items() if not _mixed(d)), out[-3000:]
    n_q = {optest.field(d, "n_q") for d in with_map.values()}
    assert {1, 7, 64, 512} <= n_q
    split_kv = [d for d in with_map.values() if optest.field(d, "n_q") == 1 and "K=f16/f16 V=f16/f16" in d]
    assert any(optest.field(d, "n_kv") >= 1024 for d in split_kv)  # split-KV decode, chunks of several blocks
    assert {re.search(r"mask=(\w+)", d).group(1) for d in with_map.values()} == {"none", "causal", "holes", "rows"}
    flags = set().union(*(optest.flags(d) for d in with_map.values()))
    assert {"sinks", "softcap", "alibi", "ne3=2", "q-perm"} <= flags
    assert any(_mixed(d) for d in with_map.values()) and any(optest.field(d, "gqa") > 1 for d in with_map.values())
    lines = [cases[i][2] for i in with_map]
    assert sum(bool(re.search(r" runs=[1-4] ", line)) for line in lines) >= 200  # with tail runs
    assert sum(" runs=0 " in line for line in lines) >= 200                        # and without
    # no block resident, and every block (no tail)
    assert any(" map=0/" in line for line in lines) and any(re.search(r" map=(\d+)/\1 ", line) for line in lines)


def test_a_swapped_block_map_is_caught(map_runs):
    """--map-wrong: the op's map swaps logical blocks 0 and 1 while K/V and mask stay those of the true map. Each key
    keeps its mask column, so that is a permutation of the keys, which the CPU's bit-identity sees where a row of a
    same-type case sees keys of both blocks: exactly those cases fail (computed here from the case line), every other
    case passes (mixed types, whose bound cannot see an order; cases whose mask hides block 1 from every row)."""
    cases, out = map_runs["--map-wrong"]
    base, _ = map_runs["--map"]
    assert cases.keys() == base.keys()
    must_fail = {i for i, (d, _, _) in cases.items() if optest.map_swap_visible(d)}
    caught = {i for i, (_, _, line) in cases.items() if line.endswith(optest.CAUGHT)}
    assert caught == must_fail, (sorted(caught - must_fail)[:10], sorted(must_fail - caught)[:10])
    assert all(ok for _, ok, _ in cases.values()), out[-3000:]
    # both sides well populated, same-type mapped cases among those that must pass
    same_clean = [i for i, (d, _, _) in cases.items() if optest.mapped(d) and not _mixed(d) and i not in must_fail]
    assert len(must_fail) >= 400 and len(same_clean) >= 200, (len(must_fail), len(same_clean))
