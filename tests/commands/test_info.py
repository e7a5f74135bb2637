"""`rollingkv info`'s report (commands/info.py: info_report), called without click on the CPU build.

Seen failing: with info_report's stale comparison inverted (== for !=), both tests.
"""

from __future__ import annotations

import copy

import pytest

from rollingkv_cli.commands.info import info_report


@pytest.mark.build
def test_a_build_of_this_series_is_not_stale(cpu_build):
    r = info_report(cpu_build)
    assert r["dir"] == str(cpu_build.dir) and r["stale"] is False
    assert r["series_hash"] == cpu_build.manifest["series_hash"] and "llama-server" in " ".join(r["artifacts"])
    host = r["host"]
    assert host["error"] is None and host["cpu_model"] and isinstance(host["ggml_features"], list)


@pytest.mark.build
def test_a_build_of_another_series_is_stale(cpu_build):
    other = copy.copy(cpu_build)
    object.__setattr__(other, "manifest", {**cpu_build.manifest, "series_hash": "0" * 16})
    assert info_report(other)["stale"] is True
