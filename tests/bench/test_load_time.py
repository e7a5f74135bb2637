"""bench load's account of where a cell's time went (rollingkv_cli/bench/load_time.py): the evaluations of a run from
the first and last samples of the server's counters, and a split cell's decode evaluation against its floor."""

from __future__ import annotations

import pytest

from rollingkv_cli.bench import load_time as lt


def _kind(evals, ms, prompt=0, decode=0, tail=0, streamed=0):
    return {"evals": evals, "prompt_tokens": prompt, "decode_tokens": decode, "ms": ms, "steps": evals,
            "tail_bytes": tail, "streamed_bytes": streamed, "move_ms": 0.0}


def _sample(dec, pre, mix):
    return {"split": True, "evals": {"decode": dec, "prefill": pre, "mixed": mix}}


def test_the_run_is_the_last_sample_less_the_first():
    first = _sample(_kind(2, 10.0, decode=2), _kind(1, 50.0, prompt=100), _kind(0, 0.0))  # the warm-up before requests
    last = _sample(_kind(12, 210.0, decode=40, tail=30e9, streamed=10e9), _kind(3, 250.0, prompt=2100),
                   _kind(2, 100.0, prompt=1000, decode=6))
    t = lt.summarize_time([first, {"t": 1}, last], wall_s=1.0)
    dec, pre, mix = (t["kinds"][k] for k in ("decode", "prefill", "mixed"))
    assert dec["evals"] == 10 and dec["ms_mean"] == pytest.approx(20.0) and dec["decode_tokens"] == 38
    assert dec["streamed_gb_mean"] == pytest.approx(1.0) and dec["tail_gb_mean"] == pytest.approx(3.0)
    assert pre["prompt_tokens"] == 2000 and pre["prompt_tps"] == pytest.approx(2000 / 0.2)
    assert mix["evals"] == 2 and mix["ms_mean"] == pytest.approx(50.0)
    assert t["busy_s"] == pytest.approx(0.5) and t["idle_s"] == pytest.approx(0.5)


def test_a_server_without_the_counters_has_no_account():
    assert lt.summarize_time([{"split": True, "steps": 3}], 1.0) is None
    assert lt.summarize_time([], 1.0) is None


def test_the_decode_floor_is_the_resident_step_plus_the_larger_of_link_and_cpu():
    cell = {"stats": {"split": True}, "plan": {"link": {"link_bw_gbps": 50.0}, "tail_cpu": {"cpu_attn_gbps": 100.0}},
            "time": {"kinds": {"decode": {**_kind(10, 400.0, tail=30e9, streamed=10e9), "ms_mean": 40.0}}}}
    resident = {"time": {"kinds": {"decode": {**_kind(10, 100.0), "ms_mean": 10.0}}}}
    fl = lt.decode_floor(cell, resident)
    # per evaluation 1 GB over the link (20 ms) beside 2 GB on the CPU (20 ms): 10 + 20
    assert fl["link_ms"] == pytest.approx(20.0) and fl["cpu_ms"] == pytest.approx(20.0)
    assert fl["floor_ms"] == pytest.approx(30.0) and fl["over_floor"] == pytest.approx(40.0 / 30.0)
    # every tail byte (3 GB) over link and CPU together (150 GB/s): 10 + 20
    assert fl["best_share_floor_ms"] == pytest.approx(30.0)
    # a CPU part without its bandwidth, or no resident cell: no floor rather than a wrong one
    assert lt.decode_floor({**cell, "plan": {"link": {"link_bw_gbps": 50.0}}}, resident) is None
    assert lt.decode_floor(cell, None) is None
    doc = {"cells": [{**cell, "name": "default"}, {**resident, "name": "default-resident", "stats": {"split": False}}]}
    lt.add_floors(doc)
    assert doc["cells"][0]["time"]["decode_floor"]["floor_ms"] == pytest.approx(30.0)
    assert "decode_floor" not in doc["cells"][1]["time"]


def test_decode_evaluations_by_sequences_each_against_the_resident_ones():
    one, four = _kind(10, 150.0, decode=10, tail=10e9, streamed=5e9), _kind(10, 300.0, decode=40, tail=20e9, streamed=10e9)
    zero = [_kind(0, 0.0)] * 8
    cell_last = {"evals": {"decode": _kind(20, 450.0, decode=50, tail=30e9, streamed=15e9), "prefill": _kind(0, 0.0),
                           "mixed": _kind(0, 0.0), "decode_by_seqs": [one, _kind(0, 0.0), _kind(0, 0.0), four] + zero[4:]}}
    res_last = {"evals": {"decode": _kind(20, 100.0, decode=50), "prefill": _kind(0, 0.0), "mixed": _kind(0, 0.0),
                          "decode_by_seqs": [_kind(10, 40.0, decode=10), _kind(0, 0.0), _kind(0, 0.0),
                                             _kind(10, 60.0, decode=40)] + zero[4:]}}
    first = {"evals": {"decode": _kind(0, 0.0), "prefill": _kind(0, 0.0), "mixed": _kind(0, 0.0), "decode_by_seqs": zero}}
    cell = {"name": "default", "stats": {"split": True}, "plan": {"link": {"link_bw_gbps": 50.0}, "tail_cpu": {"cpu_attn_gbps": 50.0}},
            "time": lt.summarize_time([first, cell_last], 2.0)}
    resident = {"name": "default-resident", "stats": {"split": False}, "time": lt.summarize_time([first, res_last], 2.0)}
    by = cell["time"]["decode_by_seqs"]
    assert [b["evals"] for b in by] == [10, 0, 0, 10, 0, 0, 0, 0] and by[3]["ms_mean"] == pytest.approx(30.0)
    lt.add_floors({"cells": [cell, resident]})
    fl = cell["time"]["decode_floor"]["by_seqs"]
    # four sequences: 2 GB each over 100 GB/s (20 ms) beside the resident cell's four-sequence step (6 ms)
    assert fl[3]["best_share_floor_ms"] == pytest.approx(26.0) and fl[3]["over_best_share_floor"] == pytest.approx(30 / 26)
    assert fl[0]["best_share_floor_ms"] == pytest.approx(4.0 + 10.0) and fl[1] is None
