"""Turns `ngt collect`'s rollout records and failure entries into NeMo Gym's rollout rows and failures-sidecar rows.

Pure (no files): `nemo_gym_export(records, failures)` returns the rows NeMo Gym's rollout collection would have
written for the same rollouts, and what NeMo RL reads:

- each bundled output item carries its whole `prompt_token_ids` (version 2 records store it as prefix length +
  suffix, which NeMo RL's contiguity check cannot read), with `generation_token_ids` and `generation_log_probs`, and
  the bundle's telemetry as recorded (`weight_version`, and `weight_version_spans` where a call spanned versions,
  included: a trainer reads which weights sampled each call from the row);
- `_ng_task_index` (one per distinct input row, numbered in input order, or the row's own if it has one),
  `_ng_rollout_index` (the rollout's number within its task: row occurrence x repeats + repeat) and `agent_ref`
  (the row's own, else `{"type": "responses_api_agents", "name": <agent>}`);
- the `response` filled with the fields NeMo Gym's `NeMoGymResponse` requires and older records lack (`tools`,
  `tool_choice`, `parallel_tool_calls` as the row's `responses_create_params` sent them, else the Responses API
  defaults; unknown usage details as null, NeMo Gym's "not reported");
- no `schema_version`: a row is a version 1 record (full prompts), which `ngt check` and the training readers read.

A failure entry becomes a sidecar row like the one NeMo Gym writes for a `/run` that gave no result: the indices,
`agent_ref`, `_ng_failure_class` (`agent_run_error` when the agent answered and broke, `agent_request_failed` when
no answer came, or a gateway's 429/502/503/504), `_ng_failure_type`, `_ng_failure_message` and
`_ng_failure_http_status`; no reward and no response, and not terminal (a rerun retries it, as `ngt collect` does).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.collect.identity import RolloutId, RolloutKey
from nemo_gym_tok.records.rollout_record import (
    SCHEMA_VERSION_KEY,
    MalformedRecordError,
    UnknownSchemaVersionError,
    full_output,
)
from nemo_gym_tok.types.tokens import (
    BUNDLE_FIELDS,
    WEIGHT_VERSION_KEY,
    WEIGHT_VERSION_SPANS_KEY,
    weight_versions_problem,
)

TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
AGENT_REF_KEY = "agent_ref"
AGENT_REF_TYPE = "responses_api_agents"
"""The server kind NeMo Gym's configs name agents by in `{type, name}` references."""
FAILURE_CLASS_KEY = "_ng_failure_class"
AGENT_RUN_ERROR = "agent_run_error"
AGENT_REQUEST_FAILED = "agent_request_failed"
GATEWAY_STATUSES = frozenset({429, 502, 503, 504})
"""Statuses something in front of the agent answers with: NeMo Gym then counts the rollout as never run."""
_STATUS_IN_REASON = re.compile(r"agent answered HTTP (\d{3})\b")


class ExportError(ValueError):
    """A record or failure entry that cannot become a NeMo Gym row; the message names it and says what to fix."""


@dataclass(frozen=True)
class NemoGymExport:
    """The converted rows, in (task, rollout) order, as NeMo Gym sorts its collected rows."""

    rows: list[dict[str, Any]]
    failure_rows: list[dict[str, Any]]


def nemo_gym_export(
    records: Iterable[dict[str, Any]],
    failures: Iterable[dict[str, Any]] = (),
    *,
    agent: str | None = None,
    repeats: int | None = None,
    record_labels: Sequence[str] | None = None,
    failure_labels: Sequence[str] | None = None,
) -> NemoGymExport:
    """NeMo Gym's rows for `ngt collect`'s records (versions 1 and 2) and its failure entries.

    `agent` names the agent for rollouts whose `rollout_id` has none (and must match where it has one); `repeats` is
    the collection's `--repeats`, needed only to number the rollouts of rows that occur more than once in the input
    the way NeMo Gym does (default: one more than the highest repeat seen). Raises ExportError on anything that is
    not a rollout record or failure entry, naming it by its label (`record_labels` / `failure_labels`, e.g. a file
    and line; default: its index); a failure entry for a rollout that has a record is left out.
    """
    if repeats is not None and repeats < 1:
        raise ExportError(f"repeats must be >= 1, got {repeats}")
    done: list[tuple[RolloutId, dict[str, Any]]] = []
    labels: list[str] = []
    for index, record in enumerate(records):
        labels.append(record_labels[index] if record_labels is not None else f"record {index}")
        done.append((_rollout_id_of(record, labels[-1], agent), record))
    failed: list[tuple[RolloutId, dict[str, Any]]] = []
    for index, entry in enumerate(failures):
        label = failure_labels[index] if failure_labels is not None else f"failure entry {index}"
        failed.append((_rollout_id_of(entry, label, agent), entry))
    seen: dict[RolloutKey, int] = {}
    for position, (rollout, _) in enumerate(done):
        if rollout.key in seen:
            raise ExportError(
                f"{labels[position]} is the same rollout as {labels[seen[rollout.key]]} (row "
                f"{rollout.row}, repeat {rollout.key.repeat}): an output of `ngt collect` holds each "
                "rollout once; remove the duplicate"
            )
        seen[rollout.key] = position
    failed = [(rollout, entry) for rollout, entry in failed if rollout.key not in seen]
    row_fields = [record for _, record in done] + [_entry_row(entry) for _, entry in failed]
    numbering = _Numbering([rollout for rollout, _ in done + failed], row_fields, repeats)
    rows = [_row(record, rollout, numbering, labels[i]) for i, (rollout, record) in enumerate(done)]
    failure_rows = [_failure_row(entry, rollout, numbering) for rollout, entry in failed]
    return NemoGymExport(sorted(rows, key=_index_order), sorted(failure_rows, key=_index_order))


def _index_order(row: dict[str, Any]) -> tuple[Any, ...]:
    task = row[TASK_INDEX_KEY]
    task_order = (0, task, "") if isinstance(task, int) and not isinstance(task, bool) else (1, 0, repr(task))
    return task_order, row[ROLLOUT_INDEX_KEY]


def _rollout_id_of(obj: Any, what: str, agent: str | None) -> RolloutId:
    if not isinstance(obj, dict):
        raise ExportError(f"{what} is a JSON {type(obj).__name__}, not an object")
    if "rollout_id" not in obj:
        raise ExportError(
            f"{what} has no rollout_id: not written by `ngt collect` (its records and failure entries carry one)"
        )
    try:
        rollout = RolloutId.from_json(obj["rollout_id"])
    except ValueError as exc:
        raise ExportError(f"{what}: {exc}") from None
    if rollout.agent is None and agent is None:
        raise ExportError(f"{what}: its rollout_id names no agent; pass the agent's name (--agent) for agent_ref")
    if rollout.agent is not None and agent is not None and rollout.agent != agent:
        raise ExportError(f"{what} was collected with agent {rollout.agent!r}, not {agent!r}")
    return RolloutId(rollout.key, rollout.row, rollout.agent or agent)


class _Numbering:
    """NeMo Gym's task and rollout indices for every rollout of the collection (records and failures together)."""

    def __init__(self, rollouts: list[RolloutId], row_fields: list[dict[str, Any]], repeats: int | None) -> None:
        highest = max((rollout.key.repeat for rollout in rollouts), default=0)
        if repeats is not None and highest >= repeats:
            raise ExportError(
                f"a rollout has repeat {highest}, so the collection had more than {repeats} repeats "
                "per row: pass its --repeats"
            )
        self.repeats = repeats if repeats is not None else highest + 1
        # A row's first line in the input (rollout_id.row) orders the tasks, as NeMo Gym numbers them in input order.
        first_line: dict[tuple[str, int], int] = {}
        own_task: dict[tuple[str, int], Any] = {}
        for rollout, fields in zip(rollouts, row_fields):
            row = (rollout.key.row_hash, rollout.key.occurrence)
            first_line[row] = min(rollout.row, first_line.get(row, rollout.row))
            if TASK_INDEX_KEY in fields:  # a data set that numbers its tasks itself (NeMo Gym keeps theirs)
                own_task[row] = fields[TASK_INDEX_KEY]
        # Identical rows are one task to NeMo Gym: their rollouts are numbered on after each other.
        in_input_order = sorted(first_line, key=lambda r: (first_line[r], r))
        by_content: dict[str, int] = {}
        for row in in_input_order:
            if row not in own_task:
                by_content.setdefault(row[0], len(by_content))
        self.task: dict[tuple[str, int], Any] = {}
        members: dict[Any, list[tuple[str, int]]] = {}
        for row in in_input_order:
            task = own_task[row] if row in own_task else by_content[row[0]]
            self.task[row] = task
            members.setdefault(_hashable(task), []).append(row)
        self.slot = {row: slot for rows in members.values() for slot, row in enumerate(rows)}

    def indices(self, rollout: RolloutId) -> tuple[Any, int]:
        row = (rollout.key.row_hash, rollout.key.occurrence)
        return self.task[row], self.slot[row] * self.repeats + rollout.key.repeat


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, str, float, bool)) or value is None else repr(value)


def _entry_row(entry: dict[str, Any]) -> dict[str, Any]:
    """The input row a failure entry keeps (`row`), or nothing."""
    return entry["row"] if isinstance(entry.get("row"), dict) else {}


def _agent_ref(fields: dict[str, Any], agent: str | None) -> Any:
    own = fields.get(AGENT_REF_KEY)
    if isinstance(own, dict) and own.get("name"):
        return own  # NeMo Gym keeps a row's agent_ref as it is when nothing re-routes it
    return {"type": AGENT_REF_TYPE, "name": agent}


def _row(record: dict[str, Any], rollout: RolloutId, numbering: _Numbering, what: str) -> dict[str, Any]:
    response = record.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise ExportError(f"{what} (row {rollout.row}, repeat {rollout.key.repeat}) has no response.output list")
    if "reward" not in record:
        raise ExportError(
            f"{what} (row {rollout.row}, repeat {rollout.key.repeat}) has no reward: NeMo Gym's rows "
            "carry the verifier's reward"
        )
    try:
        output = full_output(record)
    except (UnknownSchemaVersionError, MalformedRecordError) as exc:
        raise ExportError(f"{what} (row {rollout.row}, repeat {rollout.key.repeat}): {exc}") from None
    for position, item in enumerate(output):
        if isinstance(item, dict) and item.get("prompt_token_ids") is not None:
            missing = [key for key in BUNDLE_FIELDS if not isinstance(item.get(key), list)]
            if missing:
                raise ExportError(
                    f"{what} (row {rollout.row}, repeat {rollout.key.repeat}): output item {position} "
                    f"has a prompt but no {' / '.join(missing)}: NeMo RL needs all three"
                )
            generation = item["generation_token_ids"]
            problem = weight_versions_problem(
                item.get(WEIGHT_VERSION_KEY), item.get(WEIGHT_VERSION_SPANS_KEY), len(generation)
            )
            if problem is not None:
                raise ExportError(
                    f"{what} (row {rollout.row}, repeat {rollout.key.repeat}): output item {position}: {problem}"
                )
    params = record.get("responses_create_params")
    task, rollout_index = numbering.indices(rollout)
    row = {key: value for key, value in record.items() if key != SCHEMA_VERSION_KEY}
    row["response"] = _nemo_gym_response(response, output, params if isinstance(params, dict) else {})
    row[TASK_INDEX_KEY] = task
    row[ROLLOUT_INDEX_KEY] = rollout_index
    row[AGENT_REF_KEY] = _agent_ref(record, rollout.agent)
    return row


def _nemo_gym_response(response: dict[str, Any], output: list[Any], params: dict[str, Any]) -> dict[str, Any]:
    converted = {**response, "output": output}
    # What the model server echoes on each answer: the request's, else the Responses API's defaults.
    converted.setdefault("tools", params.get("tools") or [])
    converted.setdefault("tool_choice", params.get("tool_choice") or "auto")
    converted.setdefault("parallel_tool_calls", params.get("parallel_tool_calls", True))
    usage = converted.get("usage")
    if isinstance(usage, dict):
        usage = dict(usage)
        usage.setdefault("input_tokens_details", {"cached_tokens": None})
        usage.setdefault("output_tokens_details", {"reasoning_tokens": None})
        converted["usage"] = usage
    return converted


def _failure_row(entry: dict[str, Any], rollout: RolloutId, numbering: _Numbering) -> dict[str, Any]:
    reason = entry.get("reason")
    if not isinstance(reason, str):
        raise ExportError(
            f"failure entry of row {rollout.row}, repeat {rollout.key.repeat} has no reason: not an "
            "`ngt collect` failures file"
        )
    status = entry.get("http_status")
    if not isinstance(status, int) or isinstance(status, bool):
        found = _STATUS_IN_REASON.search(reason)  # entries written before http_status was recorded
        status = int(found.group(1)) if found else None
    ran = status is not None and status not in GATEWAY_STATUSES
    task, rollout_index = numbering.indices(rollout)
    return {
        TASK_INDEX_KEY: task,
        ROLLOUT_INDEX_KEY: rollout_index,
        AGENT_REF_KEY: _agent_ref(_entry_row(entry), rollout.agent),
        FAILURE_CLASS_KEY: AGENT_RUN_ERROR if ran else AGENT_REQUEST_FAILED,
        "_ng_failure_type": entry.get("kind") or ("http_status" if status is not None else "no_answer"),
        "_ng_failure_message": reason,
        "_ng_failure_http_status": status,
        "_ng_failure_response_body": None,
        "rollout_id": entry["rollout_id"],
    }
