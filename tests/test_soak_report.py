"""The soak's counts can fail (nemo_gym_tok/testing/soak_report.py): over an output whose every rollout is whole and
contiguous, a planted lost rollout, a torn line mid-file, a doubled rollout and a new token segment nobody asked for
each fail the report, and say which count; the redo reasons, the segments and the calls per replica are counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.common.jsonl import scan_lines
from nemo_gym_tok.testing.soak_report import OutputCounts, SoakReport, calls_per_replica, redo_reason

ROLLOUTS = 8
REPLICAS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
TORN = '{"rollout_id": {"row_hash": "row-'  # a record cut off mid-write


def rollout(index: int) -> dict[str, Any]:
    """A whole two-call number_guess-like rollout on one replica, its ids contiguous."""
    replica = REPLICAS[index % 2]
    first = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]}
    second = {"prompt_token_ids": [1, 2, 3, 4, 5], "generation_token_ids": [6], "generation_log_probs": [-0.3]}
    splice = {"applied": True, "template_differed": False, "replaced_tokens": 0}
    items = [
        {"type": "message", "role": "assistant", **first, "replica": replica},
        {"type": "function_call_output", "call_id": "c", "output": "higher"},
        {"type": "message", "role": "assistant", **second, "replica": replica, "prefix_splice": splice},
    ]
    rollout_id = {"row_hash": f"row-{index // 2}", "occurrence": 0, "repeat": index % 2, "agent": "number_guess_agent"}
    return {"rollout_id": rollout_id, "response": {"output": items}, "reward": 1.0}


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in records))
    return path


def report_of(path: Path) -> SoakReport:
    return SoakReport(expected=ROLLOUTS, output=OutputCounts.read(path), collect_runs=1, seconds=1.0)


def test_a_whole_output_passes_and_is_counted(tmp_path: Path) -> None:
    report = report_of(write(tmp_path / "rollouts.jsonl", [rollout(i) for i in range(ROLLOUTS)]))
    assert report.ok, report.format()
    assert report.output.contiguous == ROLLOUTS and report.output.calls_per_replica == dict.fromkeys(REPLICAS, 8)
    assert "new token segments: asked for 0, nobody asked for 0" in report.format()


def unasked_segment(records: list[Any]) -> None:
    records[3]["response"]["output"][2]["prefix_splice"] = {
        "applied": False,
        "template_differed": False,
        "replaced_tokens": 0,
        "new_segment": True,
        "new_segment_reason": "history_without_ids",
    }
    records[3]["response"]["output"][2]["prompt_token_ids"] = [1, 2, 9, 9, 5]  # the template's ids, not the model's


@pytest.mark.parametrize(
    ("fault", "plant", "says"),
    [
        ("a lost rollout", lambda records: records.pop(5), "lost 1"),
        (
            "a torn line mid-file",
            lambda records: records.insert(4, '{"rollout_id": {"row_hash": "row-'),
            "torn lines 1",
        ),
        ("a doubled rollout", lambda records: records.append(records[0]), "duplicated 1"),
        ("a segment nobody asked for", unasked_segment, "nobody asked for 1"),
    ],
)
def test_each_planted_fault_fails_the_report(tmp_path: Path, fault: str, plant: Any, says: str) -> None:
    records: list[Any] = [rollout(i) for i in range(ROLLOUTS)]
    plant(records)
    report = report_of(write(tmp_path / "rollouts.jsonl", records))
    assert not report.ok, f"{fault} passed: {report.format()}"
    assert says in report.format() and report.format().endswith("soak: FAILED")


def test_an_asked_segment_is_counted_and_passes(tmp_path: Path) -> None:
    records = [rollout(i) for i in range(ROLLOUTS)]
    unasked_segment(records)
    records[3]["response"]["output"][2]["prefix_splice"]["new_segment_reason"] = "asked"
    report = report_of(write(tmp_path / "rollouts.jsonl", records))
    assert report.ok and report.output.new_segments == 1, report.format()


def test_redo_reasons_and_a_replica_that_never_served_after_its_readmission(tmp_path: Path) -> None:
    assert redo_reason({"kind": "http", "http_status": 502}) == "http (HTTP 502)"
    assert redo_reason({"kind": "transport", "http_status": None}) == "transport"
    lines = [json.dumps(rollout(i)) for i in range(ROLLOUTS)]
    assert calls_per_replica(scan_lines(lines[4:])) == dict.fromkeys(REPLICAS, 4)
    report = report_of(write(tmp_path / "rollouts.jsonl", [rollout(i) for i in range(ROLLOUTS)]))
    report.pushed_version, report.versions = "soak-1", {"soak-1": 32}
    killed = {
        "url": REPLICAS[1],
        "drop_seconds": 0.5,
        "dropped_because": "did not answer",
        "ready_to_routed_seconds": 5.0,
        "resync_seconds": 4.0,
        "readmitted": "proven against the push's probe",
        "collecting_after_readmission": 10.0,
        "share_after_readmission": 0.0,
    }
    report.replicas = [killed]
    assert not report.ok and "0% of the calls written after it" in report.format()  # back, but never served
    killed["share_after_readmission"] = 0.4
    assert report.ok, report.format()
