"""serve/status.py: the live status's residency line from rolling_kv_stats, for llama-server's default layout (one
unified cache: every slot's sequence in one stream)."""

from __future__ import annotations

from rollingkv_cli.serve.status import residency_from_stats


def test_a_unified_cache_shows_each_slots_sequence_and_the_runs():
    """One stream holds every slot: the line gives each slot's sequence (seqs) instead of the stream's total, the runs
    the last step read, and, on a GPU build, what the copy plan itself issued (plan_streamed). Seen failing before: the
    line said "0: 256+1344" (the stream) and nothing of the runs."""
    mib = 1 << 20
    stats = {"split": True, "slots": [{"stream": 0, "device_cells": 256, "tail_cells": 1344, "window_cells": 256}],
             "seqs": [{"seq": 0, "device_cells": 256, "tail_cells": 453}, {"seq": 2, "device_cells": 0, "tail_cells": 310}],
             "last": {"tail_bytes": 24 * mib, "tail_runs": 2, "occupied_bytes": 30 * mib, "streamed_bytes": 24 * mib},
             "plan_streamed": {"bytes": 900 * mib, "last_bytes": 24 * mib, "plans": 40}}
    line = residency_from_stats(stats)
    assert "slot cells device+tail 0: 256+453, 2: 0+310;" in line, line
    assert "last step attended 24 MiB of tail in 2 runs of its sequences' blocks (30 MiB occupied, 24 MiB streamed, " \
           "24 MiB issued by the copy plan)" in line, line
    # the whole tail read (no runs), a CPU build (no plan_streamed): neither said
    stats["last"]["tail_runs"] = 0
    del stats["plan_streamed"]
    line = residency_from_stats(stats)
    assert " run" not in line and "issued" not in line and "0: 256+453" in line, line


def test_several_streams_keep_their_per_slot_cells():
    """-np N (a stream per slot): the streams are the slots; a seqs list does not replace them."""
    stats = {"split": True, "slots": [{"stream": 0, "device_cells": 100, "tail_cells": 0, "window_cells": 256},
                                      {"stream": 1, "device_cells": 256, "tail_cells": 700, "window_cells": 256}],
             "seqs": [], "last": {}}
    assert "slot cells device+tail 0: 100+0, 1: 256+700;" in residency_from_stats(stats)


def test_block_moves_of_a_unified_cache_are_counted_in_blocks():
    """Block residency (windows "blocks"): the moves are whole 256-cell blocks, said as blocks both ways; elastic
    windows keep their cell counts."""
    stats = {"split": True, "windows": "blocks", "slots": [{"stream": 0, "device_cells": 512, "tail_cells": 300}],
             "seqs": [{"seq": 1, "device_cells": 512, "tail_cells": 300}], "last": {},
             "moves": {"promoted_cells": 3 * 256, "demoted_cells": 2 * 256}}
    line = residency_from_stats(stats)
    assert line.endswith("; blocks moved 3 to the device, 2 to the tail"), line
    stats["windows"] = "elastic"
    assert residency_from_stats(stats).endswith("; windows moved 768 cells to the device, 512 to the tail")


def test_the_steps_row_says_where_the_time_went():
    """rolling_kv_stats.evals (API 10): each kind of batch as a count and a mean, with the tail each read; kinds not run
    yet are left out, and a library without the counters shows no row."""
    from rollingkv_cli.serve.status import describe_steps

    ev = {"decode": {"evals": 4, "ms": 100.0, "tail_bytes": 8e9}, "mixed": {"evals": 1, "ms": 210.0, "tail_bytes": 0},
          "prefill": {"evals": 0, "ms": 0.0}, "decode_by_seqs": []}
    assert describe_steps({"evals": ev}) == "decode 4 x 25.0 ms (2.00 GB of tail each), prompt beside decode 1 x 210.0 ms"
    assert describe_steps({"split": True}) is None
    assert describe_steps({"evals": {"decode": {"evals": 0}}}) is None
