"""The gate's metrics (rollingkv_cli/gate/metrics.py) against distributions whose TV and KL are known in closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rollingkv_cli.gate import metrics as gm


def logits_of(probs) -> np.ndarray:
    """Logits whose softmax is probs (log p, shifted by a constant that softmax ignores)."""
    return (np.log(np.asarray(probs, dtype=np.float64)) + 3.0).astype(np.float64)


def two_point(a: float, v: int = 2, eps: float = 0.0) -> np.ndarray:
    """[a, 1-a] padded with entries of probability eps (renormalised when eps > 0)."""
    p = np.full(v, eps)
    p[0], p[1] = a, 1 - a
    return p / p.sum()


@pytest.mark.parametrize("a,b", [(0.7, 0.4), (0.9, 0.5), (0.5, 0.5), (0.99, 0.01), (0.3, 0.6)])
def test_two_point_tv_and_kl_are_analytic(a, b):
    m = gm.compare_rows(logits_of(two_point(a)), logits_of(two_point(b)))
    assert m.tv[0] == pytest.approx(abs(a - b), abs=1e-12)
    kl = a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))
    assert m.kl[0] == pytest.approx(kl, rel=1e-9, abs=1e-15)


def test_tv_and_kl_on_a_large_vocabulary():
    """Mass moved between two of many entries: TV = moved mass, KL analytic, in float64 even from f32 logits."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(4096))
    q = p.copy()
    d = 0.5 * min(p[7], p[9])
    q[7] -= d
    q[9] += d
    m = gm.compare_rows(np.log(p), np.log(q))
    assert m.tv[0] == pytest.approx(d, rel=1e-9)
    kl = p[7] * math.log(p[7] / q[7]) + p[9] * math.log(p[9] / q[9])
    assert m.kl[0] == pytest.approx(kl, rel=1e-6)


def test_identical_rows_are_zero_and_agree():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 1000)).astype(np.float32)
    m = gm.compare_rows(x, x.copy())
    assert (m.tv == 0).all() and (m.kl == 0).all()
    assert m.top1_agree.all() and m.topk_agree.all() and not m.real().any()


def test_shift_invariance():
    x = np.random.default_rng(2).normal(size=(3, 500))
    m = gm.compare_rows(x, x + 17.25)
    assert m.tv.max() < 1e-12 and m.kl.max() < 1e-12 and m.top1_agree.all()


def test_swapped_top1_with_a_big_margin_is_real():
    ref = logits_of(two_point(0.9, v=10, eps=0.001))
    cand = ref.copy()
    cand[[0, 1]] = cand[[1, 0]]
    m = gm.compare_rows(ref, cand)
    assert not m.top1_agree[0]
    assert m.margin[0] == pytest.approx(math.log(0.9 / 0.1), rel=1e-9)
    assert m.real(0.5)[0]


def test_near_tie_swap_is_not_real():
    p = two_point(0.5, v=10, eps=0.01)
    p[0] += 0.001  # top-1 beats the runner-up by ~0.004 nats
    p /= p.sum()
    ref = logits_of(p)
    cand = ref.copy()
    cand[[0, 1]] = cand[[1, 0]]
    m = gm.compare_rows(ref, cand)
    assert not m.top1_agree[0]
    assert 0 < m.margin[0] < 0.01
    assert not m.real(0.5)[0]
    assert m.real(0.001)[0]  # with a tighter margin it would count


def test_topk_order_agreement():
    ref = np.array([[10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 0.0, 0.0]])
    swap45 = ref.copy()
    swap45[0, [3, 4]] = swap45[0, [4, 3]]  # 4th and 5th swapped: top-1 same, top-5 order differs
    swap67 = ref.copy()
    swap67[0, [5, 6]] = swap67[0, [6, 5]]  # only beyond the top-5
    assert gm.compare_rows(ref, swap45).top1_agree[0] and not gm.compare_rows(ref, swap45).topk_agree[0]
    assert gm.compare_rows(ref, swap67, topk=5).topk_agree[0]


def test_ties_rank_by_token_id():
    ref = np.zeros((1, 50))
    m = gm.compare_rows(ref, ref.copy())
    assert m.top1_ref[0] == 0 and m.topk_agree[0] and m.margin[0] == 0


def test_nonfinite_rows_fail():
    ref = np.random.default_rng(3).normal(size=(2, 100))
    cand = ref.copy()
    cand[1, 5] = np.nan
    acc = gm.GateAccumulator()
    acc.add(ref, cand)
    s = acc.summary()
    assert s["nonfinite"] == 1 and s["n_real"] == 1 and s["max_tv"] == 1.0 and s["max_kl"] is None
    v = gm.verdict(s, gm.default_thresholds("quantized"))
    assert not v.passed and "max_nonfinite" in [c.name for c in v.failed]
    json.dumps(s, allow_nan=False)  # the summary stays strict JSON


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        gm.compare_rows(np.zeros((2, 10)), np.zeros((2, 11)))


def test_accumulator_over_batches_equals_one_shot():
    rng = np.random.default_rng(4)
    ref = rng.normal(size=(203, 777)).astype(np.float32)
    cand = (ref + rng.normal(scale=0.3, size=ref.shape)).astype(np.float32)
    one = gm.GateAccumulator()
    one.add(ref, cand)
    many = gm.GateAccumulator()
    for s in range(0, 203, 64):  # uneven last batch, and more rows than ROW_CHUNK per batch
        many.add(ref[s:s + 64], cand[s:s + 64])
    a, b = one.summary(), many.summary()
    assert a == b
    assert a["n"] == 203 and 0 < a["mean_tv"] < 1 and a["n_top1_disagree"] > 0
    assert [w["pos"] for w in a["worst"]] == sorted([w["pos"] for w in a["worst"]], key=lambda p: -float(one.metrics()[1].tv[p]))
    assert a["real_frac"] == pytest.approx(float(one.metrics()[1].real(0.5).mean()))


def test_summary_of_nothing_fails_the_verdict():
    s = gm.GateAccumulator().summary()
    assert s["n"] == 0
    assert not gm.verdict(s, gm.default_thresholds("same_type")).passed


def test_profile_choice():
    assert gm.profile_for(("f16", "f16"), (None, None)) == "same_type"
    assert gm.profile_for(("f16", "f16"), ("f16", "f16")) == "same_type"
    assert gm.profile_for(("q8_0", "q8_0"), (None, None)) == "same_type"  # the reference holds q8_0 too
    assert gm.profile_for(("f16", "f16"), ("q8_0", None)) == "quantized"
    assert gm.profile_for(("f16", "f16"), (None, "q4_0")) == "quantized"
    assert gm.profile_for(("f16", "f16"), ("bf16", "bf16")) == "quantized"
    assert gm.profile_for(("f32", "f32"), ("f16", "f16")) == "same_type"


def test_default_bounds():
    s = gm.default_thresholds("same_type")
    assert s["max_mean_tv"] == 1e-4 and s["min_top1_agreement"] == 0.999 and s["max_real_frac"] == 0
    q = gm.default_thresholds("quantized")
    assert q["max_mean_tv"] == 0.02 and q["max_real_frac"] == 0.01


def _summary(**kw):
    base = {"n": 2048, "mean_tv": 0.0, "max_tv": 0.0, "mean_kl": 0.0, "max_kl": 0.0, "top1_agreement": 1.0,
            "real_frac": 0.0, "frac_full_agree": 1.0, "nonfinite": 0}
    base.update(kw)
    return base


def test_verdict_passes_and_fails_on_each_bound():
    th = gm.default_thresholds("same_type")
    assert gm.verdict(_summary(), th).passed
    assert gm.verdict(_summary(mean_tv=1e-4), th).passed  # bounds are inclusive
    for kw, name in ((dict(mean_tv=2e-4), "max_mean_tv"), (dict(top1_agreement=0.998), "min_top1_agreement"),
                     (dict(real_frac=1 / 2048), "max_real_frac"), (dict(mean_tv=float("nan")), "max_mean_tv")):
        v = gm.verdict(_summary(**kw), th)
        assert not v.passed and [c.name for c in v.failed] == [name], kw
        assert "must be" in v.failed[0].describe()
    q = gm.default_thresholds("quantized")
    assert gm.verdict(_summary(mean_tv=0.015, top1_agreement=0.95, real_frac=0.005), q).passed
    assert not gm.verdict(_summary(mean_tv=0.015, real_frac=0.02), q).passed


def test_thresholds_file_flat_override_yaml(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("max_mean_tv: 1.0e-6\nmax_max_tv: 0.001\nmin_top1_agreement: null\nreal_margin_nats: 0.25\n")
    th = gm.load_thresholds(f, "same_type")
    assert th["max_mean_tv"] == 1e-6 and th["max_max_tv"] == 0.001 and th["min_top1_agreement"] is None
    assert th["real_margin_nats"] == 0.25 and th["max_real_frac"] == 0.0  # untouched keys keep the default
    v = gm.verdict(_summary(mean_tv=5e-6, top1_agreement=0.5), th)
    assert [c.name for c in v.failed] == ["max_mean_tv"]  # top-1 no longer checked
    assert not gm.verdict(_summary(max_tv=0.01), th).passed


def test_thresholds_file_per_profile_json(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"quantized": {"max_mean_tv": 0.05}, "same_type": {"max_mean_tv": 0}}))
    assert gm.load_thresholds(f, "quantized")["max_mean_tv"] == 0.05
    assert gm.load_thresholds(f, "same_type")["max_mean_tv"] == 0.0
    assert gm.load_thresholds(None, "quantized") == gm.default_thresholds("quantized")


@pytest.mark.parametrize("text,match", [
    ("max_mean_tvv: 1\n", "unknown key"),
    ("max_mean_tv: -1\n", ">= 0"),
    ("max_mean_tv: yes\n", "finite number"),
    ("min_top1_agreement: 1.5\n", "fraction"),
    ("- 1\n- 2\n", "mapping"),
    ("same_type: {max_mean_tv: 1}\nmax_real_frac: 0\n", "mixes"),
    ("max_mean_tv: [1\n", "not valid YAML"),
])
def test_thresholds_file_errors(tmp_path, text, match):
    f = tmp_path / "t.yaml"
    f.write_text(text)
    with pytest.raises(gm.ThresholdsError, match=match):
        gm.load_thresholds(f, "same_type")


def test_thresholds_file_missing(tmp_path):
    with pytest.raises(gm.ThresholdsError, match="cannot read"):
        gm.load_thresholds(tmp_path / "nope.yaml", "same_type")


def test_relative_thresholds_follow_the_baseline_over_the_tail_positions():
    """--tail-baseline: factor x the baseline's TV at the same positions, no absolute floor (0.0025 is far below the
    quantized profile's 0.02), evaluated on summary["tail"]; real flips dropped. Fails when a floor or the
    all-positions summary comes back."""
    q = gm.default_thresholds("quantized")
    th, how = gm.relative_thresholds(q, {"mean_tv": 0.001, "real_frac": 0.001, "mean_kl": 0.5, "max_tv": 0.9}, "q4_0")
    assert th["baseline_factor"] == gm.default_baseline_factor("q4_0") == 2.5 and th["positions"] == "tail"
    assert th["max_mean_tv"] == pytest.approx(0.0025) and how["max_mean_tv"]["bound"] == pytest.approx(0.0025)
    assert th["max_real_frac"] is None and how["max_real_frac"]["bound"] is None and how["max_real_frac"]["dropped"]
    assert th["max_mean_kl"] is None and th["max_max_tv"] is None and "max_mean_kl" not in how  # disabled stays disabled
    assert q["max_mean_tv"] == 0.02  # the input is not modified
    s = {"n": 512, "nonfinite": 0, "mean_tv": 0.001, "real_frac": 0.0, "tail": {"n": 256, "mean_tv": 0.002, "real_frac": 0.05}}
    assert gm.verdict(s, th).passed
    v = gm.verdict(dict(s, tail=dict(s["tail"], mean_tv=0.003)), th)  # the all-positions mean would still pass
    assert [c.name for c in v.failed] == ["max_mean_tv"] and "over the positions that read the tail" in v.failed[0].describe()
    assert not gm.verdict({k: x for k, x in s.items() if k != "tail"}, th).passed  # no tail summary: fails


def test_relative_thresholds_factor_from_the_file(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("quantized:\n  baseline_factor: 1.5\n")
    th, _ = gm.relative_thresholds(gm.load_thresholds(f, "quantized"), {"mean_tv": 0.1, "real_frac": float("nan")})
    assert th["max_mean_tv"] == pytest.approx(0.15)
    th, _ = gm.relative_thresholds(gm.load_thresholds(f, "quantized"), {"mean_tv": float("nan")})
    assert th["max_mean_tv"] == 0.02  # a NaN baseline: the absolute bound stays
    f.write_text("baseline_factor: -1\n")
    with pytest.raises(gm.ThresholdsError, match=">= 0"):
        gm.load_thresholds(f, "quantized")


@pytest.mark.parametrize("n_rows,n_seq,n_batch,window,expect", [
    (8, 1, 4, 3, [0, 0, 0, 1, 1, 1, 1, 1]),               # one sequence: position p is cell p
    (8, 1, 4, None, [0] * 8),                             # not split: nothing reads a tail
    (8, 1, 4, 8, [0] * 8),                                # the window holds every token
    # two sequences of 4, 2 positions of each per batch: cells (seq 0: 0 1 4 5), (seq 1: 2 3 6 7)
    (8, 2, 4, 4, [0, 0, 1, 1, 0, 0, 1, 1]),
    (8, 2, 4, 3, [0, 0, 1, 1, 0, 1, 1, 1]),
    (6, 2, 4, 4, [0, 0, 1, 0, 0, 1]),                     # a last batch of one position per sequence: cells 4, 5
])
def test_tail_rows_follow_the_cells_the_tokens_went_to(n_rows, n_seq, n_batch, window, expect):
    assert gm.tail_rows(n_rows, n_seq, n_batch, window).astype(int).tolist() == expect


def test_subset_summary_and_the_gates_own_checks():
    rows = {"pos": np.arange(4), "tv": np.array([0.0, 0.0, 0.1, 0.3]), "kl": np.array([0.0, 0.0, 0.2, 0.4]),
            "top1_ref": np.array([1, 1, 1, 1]), "top1_cand": np.array([1, 1, 1, 2]), "margin": np.array([1.0, 1.0, 1.0, 1.0]),
            "topk_agree": np.array([True, True, True, False]), "nonfinite": np.zeros(4, dtype=bool),
            "bitwise": np.array([True, True, False, False])}
    mask = np.array([False, False, True, True])
    t = gm.subset_summary(rows, mask)
    assert t["n"] == 2 and t["mean_tv"] == pytest.approx(0.2) and t["real_frac"] == 0.5 and t["bitwise_equal_rows"] == 0
    w = gm.subset_summary(rows, ~mask)
    assert w["n"] == 2 and w["mean_tv"] == 0 and w["bitwise_equal_rows"] == 2
    s = _summary(n=4, bitwise_equal_rows=3, tail_positions=0)
    th = dict(gm.default_thresholds("same_type"), max_mean_tv=None, min_top1_agreement=None, max_real_frac=None)
    assert gm.verdict(s, th).passed  # the flags are off unless a gate sets them
    v = gm.verdict(s, dict(th, require_tail=True, require_bitwise=True))
    assert [c.name for c in v.failed] == ["min_tail_positions", "bitwise"]
    assert v.failed[0].describe().startswith(gm.TAIL_NEVER_USED)
    assert gm.verdict(dict(s, bitwise_equal_rows=4, tail_positions=2), dict(th, require_tail=True, require_bitwise=True)).passed


def test_default_baseline_factor_follows_the_k_types_rounding_step():
    f = gm.default_baseline_factor
    assert f("q8_0") == f("bf16") == f("f16") == f(None) == 1.5  # the noise floor of the slack
    assert f("q4_0") == 2.5 and f("q4_1") == pytest.approx(2.6) and f("q5_0") == pytest.approx(1.75)
    assert gm.relative_thresholds(gm.default_thresholds("quantized"), {"mean_tv": 0.01}, "q8_0")[0]["max_mean_tv"] == pytest.approx(0.015)


def test_bitwise_types():
    assert gm.bitwise_types(("f16", "f16"), (None, None)) and gm.bitwise_types(("q8_0", "q8_0"), ("q8_0", None))
    assert not gm.bitwise_types(("f16", "f16"), ("f32", "f32"))  # same_type bounds, other bits
    assert not gm.bitwise_types(("f16", "f16"), (None, "q4_0"))


def test_order_floor_thresholds_relax_upper_and_agreement_bounds():
    s = gm.default_thresholds("same_type")
    floor = {"mean_tv": 0.01, "top1_agreement": 0.98, "real_frac": 0.002, "mean_kl": 0.3, "frac_full_agree": 0.5}
    th, how = gm.order_floor_thresholds(s, floor)
    assert th["order_factor"] == gm.DEFAULT_ORDER_FACTOR == 2.0
    assert th["max_mean_tv"] == pytest.approx(0.02) and how["max_mean_tv"]["floor"] == 0.01
    assert th["min_top1_agreement"] == pytest.approx(0.96)  # 1 - 2 x 0.02
    assert th["max_real_frac"] == pytest.approx(0.004)
    assert th["max_mean_kl"] is None and "min_frac_full_agree" not in how  # disabled checks stay disabled
    assert s["max_mean_tv"] == 1e-4  # the input is not modified
    # a floor tighter than the absolute bounds changes nothing
    th2, _ = gm.order_floor_thresholds(s, {"mean_tv": 0.0, "top1_agreement": 1.0, "real_frac": 0.0})
    assert {k: th2[k] for k in ("max_mean_tv", "min_top1_agreement", "max_real_frac")} == \
        {k: s[k] for k in ("max_mean_tv", "min_top1_agreement", "max_real_frac")}
    # the split passes within 2 x floor and fails beyond it
    ok = {"n": 100, "nonfinite": 0, "mean_tv": 0.019, "top1_agreement": 0.97, "real_frac": 0.0,
          "over_floor": {"n": 50, "quantile": 0.99, "floor_tv": 0.03, "factor": 2.0, "bound_tv": 0.06, "n_over": 0, "frac_over": 0.0}}
    assert not gm.verdict(ok, s).passed and gm.verdict(ok, th).passed
    assert not gm.verdict(dict(ok, mean_tv=0.021), th).passed
    assert not gm.verdict(dict(ok, top1_agreement=0.95), th).passed


def test_order_factor_from_the_file(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("order_factor: 1.5\n")
    th, _ = gm.order_floor_thresholds(gm.load_thresholds(f, "same_type"), {"mean_tv": 0.01})
    assert th["max_mean_tv"] == pytest.approx(0.015)


# ---------------------------------------------------------------- the order floor's per-position bound

def _rows(tv) -> dict:
    """load_positions()-shaped rows with only what over_floor reads (positions out of order, as a runner may write)."""
    tv = np.asarray(tv, dtype=np.float64)
    pos = np.arange(tv.shape[0])[::-1].copy()
    return {"pos": pos, "tv": tv[pos]}


def test_over_floor_counts_the_tail_positions_above_factor_x_the_floors_p99():
    """101 tail positions whose floor TVs are evenly spaced in [0.001, 0.002]: the floor's 99th percentile (linear) is
    the 100th value, 0.00199, and the bound 2 x that, 0.00398. The candidate has 3 tail positions above it, one AT it
    (not over), and window positions far above both (not selected: they do not count, and the floor's own window
    positions do not move its quantile)."""
    n_win, n_tail = 50, 101
    sel = np.r_[np.zeros(n_win, bool), np.ones(n_tail, bool)]
    floor = np.r_[np.full(n_win, 0.9), np.linspace(0.001, 0.002, n_tail)]
    cand_tail = np.full(n_tail, 0.003)
    cand_tail[[0, 40, 100]] = [0.005, 0.0041, 1.0]  # 1.0: a non-finite row's TV (compare_rows)
    cand_tail[7] = 2 * 0.00199  # exactly the bound: not over
    cand = np.r_[np.full(n_win, 0.5), cand_tail]
    of = gm.over_floor(_rows(cand), _rows(floor), sel)
    assert of["n"] == 101 and of["quantile"] == 0.99 and of["factor"] == 2.0
    assert of["floor_tv"] == pytest.approx(0.00199, rel=1e-12) and of["bound_tv"] == pytest.approx(0.00398, rel=1e-12)
    assert of["n_over"] == 3 and of["frac_over"] == pytest.approx(3 / 101)
    of = gm.over_floor(_rows(cand), _rows(floor), sel, factor=1.0)  # every tail position of the candidate is above 0.00199
    assert of["bound_tv"] == pytest.approx(0.00199) and of["n_over"] == 101
    # nothing selected: no bound, no fraction (the check then fails, as does min_tail_positions)
    of = gm.over_floor(_rows(cand), _rows(floor), np.zeros(n_win + n_tail, bool))
    assert of["n"] == 0 and of["bound_tv"] is None and of["frac_over"] is None


def test_over_floor_a_bit_identical_floor_gives_a_bound_of_zero():
    """A floor run bit-identical at the tail positions (the CPU): bound 0, so any changed tail row is over."""
    sel = np.array([False, True, True, True, True])
    of = gm.over_floor(_rows([0.3, 0.0, 0.0, 1e-9, 0.0]), _rows([0.2, 0.0, 0.0, 0.0, 0.0]), sel)
    assert of["bound_tv"] == 0.0 and of["n_over"] == 1 and of["frac_over"] == 0.25


def test_over_floor_separates_order_noise_from_a_perturbed_tail():
    """The two cases the check is for, with the shape of the H200's synthetic-model runs (per-position TV narrow around
    its mean: floor 0.002 +- 0.0003). A correct split's TVs are draws like the floor's: ~1 % of the tail positions
    exceed the floor's p99, none exceed 2 x it, the check passes. A wrong merge adds to every tail position (here
    +0.005, with a window of 768 of 1024 positions): the mean over all positions, 0.00325, stays within 2 x the floor's
    mean (0.004), the window's share dilutes it; every tail position exceeds 2 x p99 (~0.0054), the check fails."""
    rng = np.random.default_rng(0)
    n, wc = 1024, 768
    sel = np.arange(n) >= wc
    floor = np.clip(rng.normal(0.002, 0.0003, n), 0, None)
    split = np.clip(rng.normal(0.002, 0.0003, n), 0, None)
    th, _ = gm.order_floor_thresholds(gm.default_thresholds("same_type"), {"mean_tv": 0.002, "top1_agreement": 0.98})
    assert th["max_frac_over_floor"] == 0.05 and th["order_floor"]
    of = gm.over_floor(_rows(split), _rows(floor), sel, th["order_factor"])
    above_p99 = int((split[sel] > np.quantile(floor[sel], 0.99)).sum())
    assert 0 < above_p99 < 0.03 * sel.sum() and of["n_over"] == 0
    bad = np.where(sel, split + 0.005, split)
    assert bad.mean() <= th["max_mean_tv"]  # the mean alone passes it
    of_bad = gm.over_floor(_rows(bad), _rows(floor), sel, th["order_factor"])
    assert of_bad["n_over"] > 0.95 * sel.sum()
    s = {"n": n, "nonfinite": 0, "mean_tv": float(bad.mean()), "top1_agreement": 0.98, "real_frac": 0.0}
    assert gm.verdict(dict(s, mean_tv=float(split.mean()), over_floor=of), th).passed
    v = gm.verdict(dict(s, over_floor=of_bad), th)
    assert [c.name for c in v.failed] == ["max_frac_over_floor"]
    assert v.failed[0].describe().startswith(f"{of_bad['n_over']} of 256 positions that read the tail exceed 2 x the order floor's 99th-percentile TV")


def test_max_frac_over_floor_check():
    """In force only with the order floor (the gates' flag), inclusive, fails without the counts, off with null, set by
    a thresholds file (a fraction), and not a default of the quantized profile."""
    th, _ = gm.order_floor_thresholds(gm.default_thresholds("same_type"), {"mean_tv": 0.01})
    s = {"n": 100, "nonfinite": 0, "mean_tv": 0.0, "top1_agreement": 1.0, "real_frac": 0.0}

    def of(n_over, n=80):
        return {"n": n, "quantile": 0.99, "floor_tv": 0.001, "factor": 2.0, "bound_tv": 0.002, "n_over": n_over, "frac_over": n_over / n if n else None}
    assert gm.verdict(dict(s, over_floor=of(4)), th).passed  # 4/80 = 0.05: inclusive
    v = gm.verdict(dict(s, over_floor=of(5)), th)
    assert [c.name for c in v.failed] == ["max_frac_over_floor"] and v.failed[0].over == "tail" and v.failed[0].value == 5 / 80
    assert [c.name for c in gm.verdict(s, th).failed] == ["max_frac_over_floor"]  # no counts: fails
    assert [c.name for c in gm.verdict(dict(s, over_floor=of(0, n=0)), th).failed] == ["max_frac_over_floor"]
    assert "max_frac_over_floor" not in [c.name for c in gm.verdict(s, gm.default_thresholds("same_type")).checks]  # no floor
    assert gm.default_thresholds("quantized")["max_frac_over_floor"] is None
    q, _ = gm.order_floor_thresholds(gm.default_thresholds("quantized"), {"mean_tv": 0.01})
    assert "max_frac_over_floor" not in [c.name for c in gm.verdict(s, q).checks]


def test_max_frac_over_floor_from_the_file(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("max_frac_over_floor: 0.2\n")
    th, _ = gm.order_floor_thresholds(gm.load_thresholds(f, "same_type"), {"mean_tv": 0.01})
    s = {"n": 100, "nonfinite": 0, "mean_tv": 0.0, "top1_agreement": 1.0, "real_frac": 0.0,
         "over_floor": {"n": 10, "quantile": 0.99, "floor_tv": 0.0, "factor": 2.0, "bound_tv": 0.0, "n_over": 2, "frac_over": 0.2}}
    assert th["max_frac_over_floor"] == 0.2 and gm.verdict(s, th).passed
    f.write_text("max_frac_over_floor: null\n")
    th, _ = gm.order_floor_thresholds(gm.load_thresholds(f, "same_type"), {"mean_tv": 0.01})
    assert gm.verdict(dict(s, over_floor=None), th).passed  # disabled: not checked
    f.write_text("max_frac_over_floor: 1.5\n")
    with pytest.raises(gm.ThresholdsError, match="fraction"):
        gm.load_thresholds(f, "same_type")
