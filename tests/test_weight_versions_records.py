"""Weight versions in rollout records (hand-written): the bundle's validation, both schema versions, training
sequences, `ngt check`'s report of episodes spanning versions, `ngt export-nemo-gym` and `ngt inspect`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import ExportError, RolloutId, RolloutKey, nemo_gym_export, row_hash
from nemo_gym_tok.contract.conversion import chat_message_to_items
from nemo_gym_tok.records.contiguity import bundled_turns, check_file
from nemo_gym_tok.records.inspect_html import page_data
from nemo_gym_tok.records.rollout_record import MalformedRecordError, full_output, packed_record
from nemo_gym_tok.records.training import rollout_to_training_sequence, rollout_to_training_sequences
from nemo_gym_tok.types import ChatMessage
from nemo_gym_tok.types.responses import ResponseItem
from nemo_gym_tok.types.tokens import TELEMETRY_FIELDS, bundle_of

SPLIT = [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 3}]


def item(prompt: list[int], generation: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
        **extra,
    }


def episode(*versions: dict[str, Any], row: int = 0) -> dict[str, Any]:
    """A contiguous three-call version 1 record; `versions[k]` is added to call k's bundled item."""
    prompts = [[1, 2], [1, 2, 10, 11, 12, 3], [1, 2, 10, 11, 12, 3, 20, 21, 22, 4]]
    generations = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    output = [
        item(p, g, **(versions[k] if k < len(versions) else {})) for k, (p, g) in enumerate(zip(prompts, generations))
    ]
    fields = {"question": f"q{row}"}
    return {
        **fields,
        "response": {"output": output},
        "reward": 1.0,
        "rollout_id": RolloutId(RolloutKey(row_hash(fields), 0, 0), row, "a").to_json(),
    }


ONE_VERSION = episode({"weight_version": "v1"}, {"weight_version": "v1"}, {"weight_version": "v1"})
TWO_VERSIONS = episode({"weight_version": "v1"}, {"weight_version": "v1"}, {"weight_version": "v2"}, row=1)
SPLIT_TURN = episode({"weight_version": "v1"}, {"weight_version": "v1", "weight_version_spans": SPLIT}, row=2)
OLD = episode(row=3)  # written before the fields existed


# --- the bundle -------------------------------------------------------------------------------------------------------


def bundle(**fields: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1], "generation_token_ids": [5, 6, 7], "generation_log_probs": [0.0] * 3, **fields}


def test_the_fields_travel_with_the_bundle() -> None:
    assert {"weight_version", "weight_version_spans"} <= set(TELEMETRY_FIELDS)
    message = {"role": "assistant", "content": "x", **bundle(weight_version="v1", weight_version_spans=SPLIT)}
    last = chat_message_to_items(message)[-1].model_dump(exclude_none=True)
    assert last["weight_version"] == "v1" and last["weight_version_spans"] == SPLIT  # kept on the output item
    assert bundle_of(last)["weight_version_spans"] == SPLIT


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"weight_version": 3}, "string"),
        ({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 0, "end": 3.0}]}, "integer"),
        ({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 0, "end": 2}]}, "cover"),
        ({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 0, "end": 4}]}, "<= 3"),
        ({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 1, "end": 1}]}, "start < end"),
        (
            {
                "weight_version": "v1",
                "weight_version_spans": [
                    {"version": "v1", "start": 0, "end": 1},
                    {"version": "v2", "start": 2, "end": 3},
                ],
            },
            "contiguous",
        ),
        ({"weight_version": "v2", "weight_version_spans": SPLIT}, "first span's version"),
        ({"weight_version": "v1", "weight_version_spans": []}, "non-empty"),
        ({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 0, "end": 3, "x": 1}]}, "extra"),
    ],
)
def test_malformed_versions_are_a_clear_validation_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChatMessage.model_validate({"role": "assistant", "content": "x", **bundle(**fields)})
    with pytest.raises(ValidationError):
        ResponseItem.model_validate({"type": "message", "role": "assistant", **bundle(**fields)})


def test_spans_need_generated_ids() -> None:
    with pytest.raises(ValidationError, match="without generation_token_ids"):
        ChatMessage.model_validate({"role": "assistant", "content": "x", "weight_version_spans": SPLIT})


# --- records and training sequences ----------------------------------------------------------------------------------


def test_both_schema_versions_keep_them_per_bundled_item() -> None:
    packed = packed_record(SPLIT_TURN)
    assert packed["schema_version"] == 2
    stored = [entry for entry in packed["response"]["output"] if "prompt_suffix_token_ids" in entry]
    assert [entry.get("weight_version") for entry in stored] == ["v1", "v1", None]
    assert stored[1]["weight_version_spans"] == SPLIT
    assert full_output(packed) == SPLIT_TURN["response"]["output"]
    for record in (SPLIT_TURN, packed):
        turns = bundled_turns(record)
        assert [turn.weight_version for turn in turns] == ["v1", "v1", None]
        assert [turn.weight_versions for turn in turns] == [["v1"], ["v1", "v2"], []]


def test_old_records_read_as_unknown() -> None:
    sequence = rollout_to_training_sequence(OLD)
    assert sequence.weight_versions == [None, None, None]
    assert sequence.weight_version_spans == [None, None, None]
    assert not sequence.spans_weight_versions
    assert rollout_to_training_sequence(packed_record(OLD)).token_ids == sequence.token_ids


def test_training_sequences_carry_each_turns_version() -> None:
    sequence = rollout_to_training_sequence(TWO_VERSIONS)
    assert sequence.weight_versions == ["v1", "v1", "v2"] and sequence.spans_weight_versions
    assert not rollout_to_training_sequence(ONE_VERSION).spans_weight_versions
    split = rollout_to_training_sequence(SPLIT_TURN)
    assert split.weight_version_spans == [None, SPLIT, None] and split.spans_weight_versions
    start, end = split.turns[1]  # spans count in the turn's generated ids: add the turn's start for positions
    assert [split.token_ids[start + s["start"] : start + s["end"]] for s in SPLIT] == [[20], [21, 22]]


def test_a_new_segment_keeps_its_turns_versions() -> None:
    record = episode({"weight_version": "v1"}, {"weight_version": "v2", "prefix_splice": {"new_segment": True}})
    sequences = rollout_to_training_sequences(record)
    assert [s.weight_versions for s in sequences] == [["v1"], ["v2", None]]


def test_a_malformed_recorded_version_names_the_item() -> None:
    bad = episode({"weight_version": "v1", "weight_version_spans": [{"version": "v1", "start": 0, "end": 2}]})
    with pytest.raises(MalformedRecordError, match="output item 0: weight_version_spans end at 2, not at 3"):
        bundled_turns(bad)


# --- ngt check, export, inspect ---------------------------------------------------------------------------------------


def write(path: Path, *records: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_check_reports_episodes_spanning_versions_without_failing(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "rollouts.jsonl", ONE_VERSION, TWO_VERSIONS, SPLIT_TURN, OLD)
    report = check_file(path)
    assert report.ok and report.contiguous == 4  # spanning versions is no contiguity failure
    assert report.spanning_versions == 2 and report.unknown_versions == 2  # SPLIT_TURN's last turn and OLD
    assert [example.split(" ")[:2] for example in report.spanning_examples] == [["line", "2"], ["line", "3"]]
    assert report.spanning_examples[0].endswith("turns 0-1 v1, turn 2 v2")
    assert report.spanning_examples[1].endswith("turn 0 v1, turn 1 v1 -> v2, turn 2 unknown")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rollouts spanning several weight versions: 2" in out and "with a turn of unknown weight version: 2" in out


def test_check_counts_a_malformed_version_as_unreadable(tmp_path: Path) -> None:
    bad = episode({"weight_version": 7})
    report = check_file(write(tmp_path / "bad.jsonl", bad, ONE_VERSION))
    assert report.unreadable_records == 1 and not report.ok
    assert "weight_version must be a string" in report.failures[0]


def test_export_keeps_each_bundled_items_version() -> None:
    rows = nemo_gym_export([packed_record(SPLIT_TURN), OLD]).rows
    by_question = {row["question"]: row for row in rows}
    output = by_question["q2"]["response"]["output"]
    assert [entry.get("weight_version") for entry in output] == ["v1", "v1", None]
    assert output[1]["weight_version_spans"] == SPLIT and "prompt_token_ids" in output[1]
    assert all("weight_version" not in entry for entry in by_question["q3"]["response"]["output"])
    with pytest.raises(ExportError, match="output item 0: weight_version must be a string"):
        nemo_gym_export([episode({"weight_version": 1})])


def test_inspect_shows_each_turns_version_and_marks_spanning_episodes() -> None:
    data = page_data([ONE_VERSION, TWO_VERSIONS, SPLIT_TURN, OLD], None, "t")
    flags = [rollout["spans_weight_versions"] for rollout in data["rollouts"]]
    assert flags == [False, True, True, False]
    versions = [rollout["sequences"][0]["weight_versions"] for rollout in data["rollouts"]]
    assert versions == [["v1"] * 3, ["v1", "v1", "v2"], ["v1", "v1 \u2192 v2", None], [None] * 3]


def test_the_rendered_page_badges_every_turn(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (tests/test_inspect_html.py insists on it)")
    out = tmp_path / "page.html"
    assert main(["inspect", str(write(tmp_path / "r.jsonl", ONE_VERSION, SPLIT_TURN, OLD)), "--html", str(out)]) == 0
    dom = subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert 'data-rendered="1"' in dom
    assert re.findall(r'data-spans-versions="(\d)"', dom) == ["0", "1", "0"]
    badges = re.findall(r'<span class="wv( wv-unknown)?" data-turn="\d">([^<]*)</span>', dom)
    assert [text for _, text in badges] == [
        *(f"turn {k}: v1" for k in range(3)),
        "turn 0: v1",
        "turn 1: v1 \u2192 v2",
        "turn 2: weight version unknown",
        *(f"turn {k}: weight version unknown" for k in range(3)),
    ]
    assert "spans weight versions" in dom
