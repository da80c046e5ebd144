"""`ngt collect`'s records as NeMo Gym rollout rows: whole prompts for NeMo RL, NeMo Gym's indices, agent_ref and
failures sidecar, refusals that name the record, and files never half-written (no NeMo Gym needed here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import (
    CollectError,
    ExportError,
    RolloutId,
    RolloutKey,
    export_nemo_gym,
    failures_path_for,
    nemo_gym_export,
    nemo_gym_failures_path_for,
    row_hash,
)
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.records.rollout_record import full_output, packed_record
from nemo_gym_tok.servers.inprocess import serve_in_thread
from tests.fixtures.collect_agent import AgentBehaviour, create_head_app
from tests.nemo_gym.nemo_rl_rule import check_rollout

FIXTURE = Path(__file__).parent / "fixtures" / "demo_grid_navigation.jsonl"


def fixture_records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def rid(row: dict[str, Any], index: int, repeat: int = 0, occurrence: int = 0, agent: str | None = "a") -> dict:
    return RolloutId(RolloutKey(row_hash(row), occurrence, repeat), index, agent).to_json()


def record(row: dict[str, Any], index: int, repeat: int = 0, occurrence: int = 0, **extra: Any) -> dict[str, Any]:
    """A minimal schema-2 record of one model call (prompt [1, 2], generation [3])."""
    item = {
        "type": "message",
        "role": "assistant",
        "id": "m",
        "content": [],
        "prompt_prefix_length": 0,
        "prompt_suffix_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    return {
        "schema_version": 2,
        **row,
        "response": {"output": [item]},
        "reward": 1.0,
        "rollout_id": rid(row, index, repeat, occurrence),
        **extra,
    }


def test_every_bundled_item_gets_its_whole_prompt_and_nemo_rls_rule_passes_where_it_failed() -> None:
    records = fixture_records()
    for raw in records:
        with pytest.raises(KeyError, match="prompt_token_ids"):
            check_rollout(raw)  # what NeMo RL meets in a schema 2 record

    export = nemo_gym_export(records)

    assert len(export.rows) == 3 and export.failure_rows == []
    in_input_order = sorted(records, key=lambda r: r["rollout_id"]["row"])  # the file is in finishing order
    for raw, row in zip(in_input_order, export.rows):
        assert row["rollout_id"] == raw["rollout_id"]
        result = check_rollout(row)
        assert result.contiguous and result.model_calls == raw["response"]["model_calls"] == 4
        assert row["response"]["output"] == full_output(raw)  # the ids the record holds, unpacked, nothing else
        assert "schema_version" not in row
        assert not any("prompt_suffix_token_ids" in item for item in row["response"]["output"])
        assert packed_record(row) == {
            **raw,
            "response": {**raw["response"], **_filled(raw)},
            "_ng_task_index": row["_ng_task_index"],
            "_ng_rollout_index": 0,
            "agent_ref": row["agent_ref"],
        }
    assert [r["_ng_task_index"] for r in export.rows] == [0, 1, 2]
    assert all(r["agent_ref"] == {"type": "responses_api_agents", "name": "grid_navigation_agent"} for r in export.rows)


def _filled(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw["responses_create_params"]
    usage = {
        **raw["response"]["usage"],
        "input_tokens_details": {"cached_tokens": None},
        "output_tokens_details": {"reasoning_tokens": None},
    }
    return {
        "tools": params["tools"],
        "tool_choice": params["tool_choice"],
        "parallel_tool_calls": params["parallel_tool_calls"],
        "usage": usage,
    }


def test_response_fields_the_record_has_are_kept_and_missing_ones_take_the_responses_api_defaults() -> None:
    row = {"responses_create_params": {"input": "hi"}}
    given = record(row, 0)
    given["response"].update(
        tool_choice="none",
        usage={"input_tokens": 2, "output_tokens": 1, "total_tokens": 3, "input_tokens_details": {"cached_tokens": 0}},
    )
    [out] = nemo_gym_export([given]).rows
    response = out["response"]
    assert (response["tools"], response["tool_choice"], response["parallel_tool_calls"]) == ([], "none", True)
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": None}


def test_task_and_rollout_indices_are_numbered_as_nemo_gym_numbers_repeated_rows() -> None:
    a, b = {"q": "a"}, {"q": "b"}
    # Input lines: a, b, a (the same content again), each collected twice; one rollout of b failed.
    records = [
        record(a, 0, 0),
        record(a, 0, 1),
        record(b, 1, 0),
        record(a, 2, 0, occurrence=1),
        record(a, 2, 1, occurrence=1),
    ]
    failures = [{"rollout_id": rid(b, 1, 1), "reason": "agent answered HTTP 500 on POST x: boom", "row": b}]

    export = nemo_gym_export(reversed(records), failures)

    numbered = [(r["q"], r["_ng_task_index"], r["_ng_rollout_index"]) for r in export.rows]
    # NeMo Gym: identical rows are one task, whose rollouts are numbered on row after row (aabb...).
    assert numbered == [("a", 0, 0), ("a", 0, 1), ("a", 0, 2), ("a", 0, 3), ("b", 1, 0)]
    [failed] = export.failure_rows
    assert (failed["_ng_task_index"], failed["_ng_rollout_index"]) == (1, 1)
    with pytest.raises(ExportError, match="pass its --repeats"):
        nemo_gym_export(records, repeats=1)
    wider = nemo_gym_export(records, repeats=3).rows
    assert sorted(r["_ng_rollout_index"] for r in wider if r["q"] == "a") == [0, 1, 3, 4]


def test_a_rows_own_task_index_and_agent_ref_are_kept() -> None:
    row = {"q": "x", "_ng_task_index": 41, "agent_ref": {"type": "responses_api_agents", "name": "theirs"}}
    [out] = nemo_gym_export([record(row, 0)]).rows
    assert (out["_ng_task_index"], out["_ng_rollout_index"], out["agent_ref"]) == (41, 0, row["agent_ref"])


@pytest.mark.parametrize(
    ("entry", "failure_class", "status"),
    [
        (
            {"reason": "agent answered HTTP 500 on POST u: crashed", "kind": "http_status", "http_status": 500},
            "agent_run_error",
            500,
        ),
        (
            {"reason": "agent answered HTTP 503 on POST u: busy", "kind": "http_status", "http_status": 503},
            "agent_request_failed",
            503,
        ),
        (
            {"reason": "timed out after 3s waiting for POST u", "kind": "timeout", "http_status": None},
            "agent_request_failed",
            None,
        ),
        ({"reason": "agent answered HTTP 422 on POST u: bad row"}, "agent_run_error", 422),  # an older entry
    ],
)
def test_failure_entries_become_nemo_gym_sidecar_rows(entry: dict, failure_class: str, status: int | None) -> None:
    row = {"q": "x"}
    [side] = nemo_gym_export([], [{"rollout_id": rid(row, 0), "row": row, **entry}]).failure_rows
    assert side["_ng_failure_class"] == failure_class and side["_ng_failure_http_status"] == status
    assert side["_ng_failure_message"] == entry["reason"]
    assert (side["_ng_task_index"], side["_ng_rollout_index"], side["agent_ref"]["name"]) == (0, 0, "a")
    assert "reward" not in side and "response" not in side and "_ng_failure_terminal" not in side


def test_a_failure_entry_of_a_rollout_that_has_its_record_is_left_out() -> None:
    row = {"q": "x"}
    export = nemo_gym_export([record(row, 0)], [{"rollout_id": rid(row, 0), "reason": "old", "row": row}])
    assert len(export.rows) == 1 and export.failure_rows == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("rollout_id"), "record 0 has no rollout_id"),
        (lambda r: r.update(schema_version=3), "newer than this nemo_gym_tok reads"),
        (lambda r: r.pop("reward"), "has no reward"),
        (lambda r: r.update(response={}), "no response.output list"),
        (lambda r: r["response"]["output"][0].update(prompt_prefix_length=9), "prompt_prefix_length 9"),
        (lambda r: r["response"]["output"][0].pop("generation_log_probs"), "no generation_log_probs"),
        (lambda r: r["rollout_id"].update(agent="other"), "collected with agent 'other', not 'a'"),
    ],
)
def test_records_that_cannot_become_rows_are_refused_by_name(change: Any, message: str) -> None:
    bad = record({"q": "x"}, 0)
    change(bad)
    with pytest.raises(ExportError, match=message):
        nemo_gym_export([bad], agent="a")


def test_a_duplicate_rollout_and_a_missing_agent_are_refused() -> None:
    row = {"q": "x"}
    with pytest.raises(ExportError, match="record 1 is the same rollout as record 0"):
        nemo_gym_export([record(row, 0), record(row, 0)])
    anonymous = record(row, 0)
    anonymous["rollout_id"]["agent"] = None
    with pytest.raises(ExportError, match="names no agent; pass the agent's name"):
        nemo_gym_export([anonymous])
    assert nemo_gym_export([anonymous], agent="b").rows[0]["agent_ref"]["name"] == "b"


def write_jsonl(path: Path, objects: list[Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def test_export_writes_rows_and_sidecar_that_ngt_check_reads_and_replaces_both(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "out.jsonl", fixture_records())
    row = {"q": "lost"}
    write_jsonl(
        failures_path_for(source),
        [
            {
                "rollout_id": rid(row, 3, agent="grid_navigation_agent"),
                "reason": "timed out after 1s",
                "kind": "timeout",
                "row": row,
            }
        ],
    )
    target = tmp_path / "gym" / "rollouts.jsonl"

    summary = export_nemo_gym(source, target)

    sidecar = nemo_gym_failures_path_for(target)
    assert sidecar == tmp_path / "gym" / "rollouts_failures.jsonl"  # NeMo Gym's naming
    assert (summary.rows, summary.failures) == (3, 1)
    assert [json.loads(line)["_ng_task_index"] for line in sidecar.read_text().splitlines()] == [3]
    report = check_file(target)  # rows are version 1 records: our own readers take them too
    assert (report.rollouts, report.contiguous, report.turns) == (3, 3, 12)
    assert target.stat().st_mode & 0o044  # readable by others, unlike a temp file's 0600

    failures_path_for(source).unlink()
    assert export_nemo_gym(source, target).failures == 0
    assert not sidecar.exists()  # no failures now: a stale sidecar must not linger


def test_a_bad_line_names_file_and_line_and_writes_nothing(tmp_path: Path) -> None:
    good = fixture_records()
    target = tmp_path / "rollouts.jsonl"
    target.write_text("earlier export\n")
    bad = write_jsonl(tmp_path / "out.jsonl", [*good[:2], {**good[2], "schema_version": 7}])
    with pytest.raises(CollectError, match=rf"{bad}:3 .*schema_version 7"):
        export_nemo_gym(bad, target)
    bad.write_text(json.dumps(good[0]) + "\n" + '{"rollout_id": ')
    with pytest.raises(CollectError, match=rf"{bad}:2: the last line is incomplete"):
        export_nemo_gym(bad, target)
    assert target.read_text() == "earlier export\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left behind
    with pytest.raises(CollectError, match="would overwrite its input"):
        export_nemo_gym(bad, bad)


def test_cli_export_exit_status_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "out.jsonl", fixture_records())
    assert main(["export-nemo-gym", str(source), str(tmp_path / "rows.jsonl")]) == 0
    assert f"3 rollout rows -> {tmp_path / 'rows.jsonl'}" in capsys.readouterr().out
    assert main(["export-nemo-gym", str(tmp_path / "missing.jsonl"), str(tmp_path / "rows.jsonl")]) == 2
    assert "ngt export-nemo-gym: input file not found" in capsys.readouterr().err
    write_jsonl(source, [{"reward": 1}])
    assert main(["export-nemo-gym", str(source), str(tmp_path / "rows.jsonl")]) == 2
    assert f"{source}:1 has no rollout_id" in capsys.readouterr().err


def test_collect_with_nemo_gym_output_writes_the_rows_and_the_sidecar_of_its_failures(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path / "rows.jsonl", [{"id": i, "responses_create_params": {"input": f"q{i}"}} for i in range(3)])
    behaviour.fail_ids = {1}
    rows = tmp_path / "gym.jsonl"
    with serve_in_thread(create_head_app({"my_agent": agent_url})) as head:
        status = main(
            [
                "collect",
                "--input",
                str(tmp_path / "rows.jsonl"),
                "--output",
                str(tmp_path / "out.jsonl"),
                "--agent",
                "my_agent",
                "--head-url",
                head,
                "--repeats",
                "2",
                "--nemo-gym-output",
                str(rows),
            ]
        )
    assert status == 1  # a failed rollout: exported all the same, to the sidecar
    out = capsys.readouterr().out
    assert f"collect: NeMo Gym rows: 4 rollout rows -> {rows}; 2 failed rollouts" in out
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["id"], r["_ng_task_index"], r["_ng_rollout_index"]) for r in written] == [
        (0, 0, 0),
        (0, 0, 1),
        (2, 2, 0),
        (2, 2, 1),
    ]
    assert all(r["agent_ref"] == {"type": "responses_api_agents", "name": "my_agent"} for r in written)
    sidecar = [json.loads(line) for line in nemo_gym_failures_path_for(rows).read_text().splitlines()]
    assert [
        (s["_ng_task_index"], s["_ng_rollout_index"], s["_ng_failure_class"], s["_ng_failure_http_status"])
        for s in sidecar
    ] == [(1, 0, "agent_run_error", 500), (1, 1, "agent_run_error", 500)]
    entries = [json.loads(line) for line in failures_path_for(tmp_path / "out.jsonl").read_text().splitlines()]
    assert {(e["kind"], e["http_status"]) for e in entries} == {("http_status", 500)}
