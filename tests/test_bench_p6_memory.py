"""bench/p6_collect_load.py: what the memory target judges (growth after the peak run), rollouts per run, a run's
rounds and how they add up."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from benchkit.server import BenchError  # noqa: E402
from p6_collect_load import (  # noqa: E402
    AGENT,
    concurrency_order,
    memory_table,
    merged_run,
    readings,
    rollouts_per_run,
    round_sizes,
)

MIB = 1024


def result(start: int, after: dict[int, int], end: int, adapter: int = 700) -> dict[str, object]:
    """One setup's RSS readings (KiB): the agent's as given, the adapter flat at `adapter` MiB."""
    flat = {"policy_model": adapter * MIB}
    return {
        "runs": {},
        "rss_start_kib": {AGENT: start * MIB, **flat},
        "rss_after_kib": {c: {AGENT: rss * MIB, **flat} for c, rss in after.items()},
        "rss_end_kib": {AGENT: end * MIB, **flat},
    }


def test_growth_is_judged_from_after_the_highest_concurrency_run_not_from_the_warm_up() -> None:
    # The agent triples from the warm-up to the peak run (in-flight memory), then grows 5% with the runs after it.
    found = readings({"none": result(100, {64: 400, 32: 410, 8: 420}, 420)})
    assert found["P6.rss_growth.max"].value == pytest.approx(0.05)
    assert found["P6.rss_growth.max"].where == f"none {AGENT}, after c64 -> end"


def test_growth_after_the_peak_still_fails_the_target_when_it_is_large() -> None:
    found = readings({"hook": result(100, {64: 300, 8: 360}, 390), "none": result(100, {64: 300, 8: 300}, 300)})
    assert found["P6.rss_growth.max"].value == pytest.approx(0.30)
    assert found["P6.rss_growth.max"].where.startswith("hook ")


def test_the_adapter_is_judged_too_and_the_other_processes_are_not() -> None:
    setup = result(100, {64: 400, 8: 400}, 400, adapter=700)
    setup["rss_end_kib"]["policy_model"] = 840 * MIB  # +20% after the peak run
    setup["rss_end_kib"]["head"] = 10_000 * MIB  # not judged
    setup["rss_after_kib"][64]["head"] = 60 * MIB
    found = readings({"adapter": setup})
    assert found["P6.rss_growth.max"].value == pytest.approx(0.20)
    assert "policy_model" in found["P6.rss_growth.max"].where


def test_one_concurrency_has_no_run_after_the_peak_so_the_growth_is_not_measured() -> None:
    found = readings({"none": result(100, {32: 400}, 400)})
    assert math.isnan(found["P6.rss_growth.max"].value)


def test_the_table_prints_start_every_run_and_end_with_both_growths() -> None:
    table = memory_table({"none": result(100, {64: 400, 32: 410, 8: 420}, 420)})
    assert table.headers == [
        "setup",
        "process",
        "start",
        "after c64",
        "after c32",
        "after c8",
        "end",
        "start -> end",
        "after c64 -> end",
    ]
    agent = next(row for row in table.rows if row[1] == AGENT)
    assert agent[2] == "100.0" and agent[6] == "420.0"
    assert agent[7] == "+320.0%" and agent[8] == "+5.0%"


def test_runs_time_at_least_the_minimum_and_three_waves_at_8() -> None:
    assert [rollouts_per_run(c, 1.0, 24) for c in (8, 32, 64)] == [24, 32, 64]
    assert rollouts_per_run(32, 2.0, 24) == 64
    assert rollouts_per_run(1, 1.0, 0) == 1


def test_the_highest_concurrency_runs_first_and_repeats_collapse() -> None:
    assert concurrency_order([8, 32, 64, 32]) == [64, 32, 8]
    with pytest.raises(BenchError, match="at least 1"):
        concurrency_order([8, 0])


def test_a_run_of_several_waves_is_collected_a_wave_a_round() -> None:
    assert round_sizes(24, 8) == [8, 8, 8]
    assert round_sizes(64, 64) == [64]
    assert round_sizes(32, 32) == [32]
    assert round_sizes(25, 8) == [9, 8, 8]  # the rollouts left over go to the first rounds: none is lost
    assert round_sizes(5, 8) == [5]  # less than a wave: one round
    assert sum(round_sizes(101, 7)) == 101


def test_rounds_add_up_to_one_run() -> None:
    def part(seconds: float, rollouts: int, ends: list[int], hits: int, queries: int) -> dict[str, object]:
        return {
            "seconds": seconds,
            "rollouts": rollouts,
            "calls": rollouts * 20,
            "ends": ends,
            "cache_hit": hits / queries,
            "cache_hits": hits,
            "cache_queries": queries,
            "requests /v1/chat/completions": rollouts * 20,
        }

    merged = merged_run([part(10.0, 8, [100, 300], 90, 100), part(14.0, 8, [200], 10, 100)])
    assert merged["seconds"] == 24.0 and merged["rollouts"] == 16 and merged["calls"] == 320
    assert merged["requests /v1/chat/completions"] == 320
    assert merged["end_ids"] == 200  # the median over every rollout, not of the rounds' medians
    assert merged["cache_hit"] == pytest.approx(0.5)  # over all the queries, not the mean of the rounds' shares
    assert merged["rounds"] == 2
