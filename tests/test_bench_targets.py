"""bench/targets.py: the met / NOT met verdicts of the performance report, misses first."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from targets import MET, MISSED, TARGETS, UNMEASURED, Reading, Target, judge, text, verdicts, worst  # noqa: E402

AT_MOST = Target("share", "P1", "p1.share", "<=", 1.10, "adapter / bare hop")
AT_LEAST = Target("speed", "P6", "p6.speed", ">=", 0.95, "rollouts/s over stock")


def test_just_over_an_upper_bound_is_not_met_and_just_under_is() -> None:
    assert judge(AT_MOST, Reading(1.1001)).verdict == MISSED
    assert judge(AT_MOST, Reading(1.0999)).verdict == MET
    assert judge(AT_MOST, Reading(1.10)).verdict == MET


def test_just_under_a_lower_bound_is_not_met_and_just_over_is() -> None:
    assert judge(AT_LEAST, Reading(0.9499)).verdict == MISSED
    assert judge(AT_LEAST, Reading(0.9501)).verdict == MET


def test_no_reading_or_nan_is_not_measured_never_met() -> None:
    assert judge(AT_MOST, None).verdict == UNMEASURED
    assert judge(AT_MOST, Reading(math.nan)).verdict == UNMEASURED


def test_an_unknown_comparison_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown comparison"):
        judge(Target("x", "P1", "x", "==", 1.0, "x"), Reading(1.0))


def test_misses_come_first_then_unmeasured_then_met_in_table_order() -> None:
    targets = [
        Target("a", "P1", "a", "<=", 1.0, "a"),
        Target("b", "P2", "b", "<=", 1.0, "b"),
        Target("c", "P2", "c", "<=", 1.0, "c"),
        Target("d", "P3", "d", ">=", 1.0, "d"),
        Target("e", "P3", "e", "<=", 1.0, "e"),
    ]
    readings = {"a": Reading(0.5), "b": Reading(1.2), "d": Reading(0.9), "e": Reading(1.0)}
    judged = verdicts(readings, targets)
    assert [(v.target.key, v.verdict) for v in judged] == [
        ("b", MISSED),
        ("d", MISSED),
        ("c", UNMEASURED),
        ("a", MET),
        ("e", MET),
    ]
    report = text(judged)
    assert report.splitlines()[0] == "targets: 2 NOT met, 2 met of 5"
    assert "1.200" in report and "target <= 1: NOT met" in report


def test_the_table_holds_the_issues_thresholds_with_unique_keys() -> None:
    by_key = {target.key: target for target in TARGETS}
    assert len(by_key) == len(TARGETS)
    assert all(target.comparison in ("<=", ">=") for target in TARGETS)
    assert by_key["P1.own_share.p50@7k"].threshold == 1.10 and by_key["P1.own_share.p95@7k"].threshold == 1.10
    assert by_key["P1a.adapter/stock.p50@7k.worst"].threshold == 0.8
    assert by_key["P1a-P2.adapter-hook.worst"].threshold == 0.05  # issue 40
    assert by_key["P1b-P2.adapter-hook.worst"].threshold == 0.05  # issue 40, the agent's way
    assert by_key["P2.hook/token-in.paired@7k.worst"].threshold == 1.10
    assert by_key["P2.hook/token-in.paired@32k.worst"].threshold == 1.10
    assert by_key["P9.hook-token-in.ms@32k-1k"].threshold == 1.0
    assert by_key["P2.hook/stock.paired@7k.worst"].threshold == 0.8
    assert by_key["P3.adapter.per_spliced_turn"].threshold == 1.05


def test_the_cell_names_where_the_value_was_measured() -> None:
    verdict = judge(AT_MOST, Reading(1.234, "7122 ids, history random-1"))
    assert verdict.cell() == "1.234 (7122 ids, history random-1); target <= 1.1: NOT met"
    assert judge(AT_MOST, None).cell() == "not measured (target <= 1.1)"


def test_the_worst_history_is_the_highest_reading_nan_left_out() -> None:
    assert worst([(0.7, "words-0"), (math.nan, "tools-2"), (0.86, "random-1"), (0.78, "mixed-4")]) == Reading(
        0.86, "random-1"
    )
    assert math.isnan(worst([(math.nan, "a")]).value)
    assert judge(AT_MOST, worst([])).verdict == UNMEASURED


def test_the_adapter_is_judged_beside_the_hook_at_each_size() -> None:
    from targets import ADAPTER_OVER_HOOK, CHAINED_OVER_HOOK, derived

    readings = {
        "P1a.adapter/token-in.p50@1k.worst": Reading(1.12),
        "P2.hook/token-in.paired@1k.worst": Reading(1.09),
        "P1a.adapter/token-in.p50@32k.worst": Reading(1.20),
        "P2.hook/token-in.paired@32k.worst": Reading(1.08),
        "P1a.adapter/token-in.p50@7k.worst": Reading(1.30),  # no hook reading at 7k: not compared
    }
    gap = derived(readings)[ADAPTER_OVER_HOOK]
    assert round(gap.value, 6) == 0.12 and gap.where.startswith("32k")
    assert CHAINED_OVER_HOOK not in derived(readings)  # no continued-call reading: not derived
    assert derived({"P1a.adapter/token-in.p50@1k.worst": Reading(1.1)}) == {}
    chained = derived({**readings, "P1b.adapter/token-in.p50@1k.worst": Reading(1.16)})[CHAINED_OVER_HOOK]
    assert round(chained.value, 6) == 0.07 and chained.where.startswith("1k")
