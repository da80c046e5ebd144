"""bench/p8_headerless.py's pure parts: where a case's conversations went, their contiguity and ceiling, its table."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from benchkit.figures import Figure  # noqa: E402
from p8_headerless import CASES, add_table, summary  # noqa: E402


def call(replica: str, prompt: int = 300, generated: int = 20, contiguous: bool = True) -> dict[str, object]:
    return {"replica": replica, "prompt": prompt, "generated": generated, "contiguous": contiguous}


def test_summary_counts_first_calls_calls_one_replica_and_contiguity() -> None:
    conversations = [
        [call("A"), call("A", 330)],
        [call("B"), call("A", 330, contiguous=False)],
        [call("B"), call("B", 330)],
    ]
    found = summary(conversations, 128)
    assert found["sessions"] == {"A": 1, "B": 2}
    assert found["turns"] == {"A": 3, "B": 3}
    assert found["one_replica"] == 2
    assert found["contiguous"] == 2
    # Each second call may find its first call's 2 full blocks (319 ids through the model, the 330th its own).
    assert found["ceiling"] == 3 * 256
    assert math.isnan(summary(conversations, 0)["ceiling"])


def test_the_reference_case_sends_the_header_and_every_policy_is_tried_without_it() -> None:
    assert CASES[0] == ("consistent_hash", True)
    without = {policy for policy, header in CASES if not header}
    assert without == {"consistent_hash", "sticky_least_loaded", "cache_aware", "round_robin", "power_of_two"}


def test_table_has_a_row_per_case_naming_the_header() -> None:
    figure = Figure("P8", "t", "c")
    case = {
        **summary([[call("A"), call("A", 330)]], 128),
        "cache_queries": 660.0,
        "cache_hits": 256.0,
        "cache_hit": 256 / 660,
        "ceiling_rate": 256 / 660,
        "seconds": 2.0,
    }
    results = [
        {**case, "policy": "consistent_hash", "header": True},
        {**case, "policy": "round_robin", "header": False},
    ]
    args = argparse.Namespace(conversations=1, turns=2, concurrency=1, max_tokens=8, opening_ids=10)
    add_table(figure, results, ["A", "B"], args, {"A": "0", "B": "1"})
    rows = figure.tables[0].rows
    assert [row[:2] for row in rows] == [["consistent_hash", "sent"], ["round_robin", "none"]]
    assert rows[0][6] == "38.8%" and rows[0][8] == "1 / 0" and rows[0][11] == "1/1"
