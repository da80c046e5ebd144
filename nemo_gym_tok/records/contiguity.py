"""Token contiguity of a rollout record: each model call's prompt starts with every id seen before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jsonl import TORN, scan_jsonl
from nemo_gym_tok.contract.token_sources import PrefixMismatchError, check_prefix
from nemo_gym_tok.records.image_runs import image_runs_problem, images_in
from nemo_gym_tok.records.rollout_record import MalformedRecordError, UnknownSchemaVersionError, full_output
from nemo_gym_tok.types.tokens import (
    IMAGE_RUNS_KEY,
    NEW_SEGMENT_REASON_KEY,
    SEGMENT_ASKED,
    SEGMENT_HISTORY_WITHOUT_IDS,
    WEIGHT_VERSION_KEY,
    WEIGHT_VERSION_SPANS_KEY,
    weight_versions_problem,
)

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class BundledTurn:
    """One model call of an episode, from the output item that carries its bundle."""

    item_index: int
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    prefix_splice: dict[str, Any] | None
    weight_version: str | None = None
    """The vLLM weight version that sampled the call's first generated id; None: unknown (an older record, a server
    that could not say)."""
    weight_version_spans: list[dict[str, Any]] | None = None
    """[{version, start, end}] over generation_token_ids, present only when the call's ids span several versions."""
    image_runs: list[dict[str, Any]] | None = None
    """A vision model's call: [{position, length, digest}] per image of its prompt; None on a text model."""

    @property
    def weight_versions(self) -> list[str]:
        """The versions that sampled this call's ids, in order ([] when unknown)."""
        if self.weight_version_spans:
            return [span["version"] for span in self.weight_version_spans]
        return [self.weight_version] if self.weight_version is not None else []

    @property
    def repaired(self) -> bool:
        """The hook replaced template ids that differed from the model's."""
        return bool(self.prefix_splice and self.prefix_splice.get("template_differed"))

    @property
    def starts_segment(self) -> bool:
        """The caller asked for the template's ids from this call on (`start_token_segment`): a new sequence."""
        return bool(self.prefix_splice and self.prefix_splice.get("new_segment"))

    @property
    def unasked_segment(self) -> str | None:
        """Why this call started a new token segment nobody asked for (None when it started none, or the caller asked:
        `new_segment_reason` "asked"). Records from before the reason was written say none: unasked too."""
        if not self.starts_segment:
            return None
        reason = (self.prefix_splice or {}).get(NEW_SEGMENT_REASON_KEY)
        if reason == SEGMENT_ASKED:
            return None
        if reason == SEGMENT_HISTORY_WITHOUT_IDS:
            return "its history carried no token ids, so the adapter started a new segment crossing vllm-router"
        return f"prefix_splice.{NEW_SEGMENT_REASON_KEY} says {reason!r}, not {SEGMENT_ASKED!r}"

    @property
    def end_token_replaced(self) -> bool:
        """The previous call's final end token gave way to the template's closing (GPT-OSS <|return|> -> <|end|>)."""
        return bool(self.prefix_splice and self.prefix_splice.get("end_token_replaced"))


class NotContiguousError(ValueError):
    """A model call's prompt does not start with the ids before it; says where, with decoded context."""

    def __init__(self, turn: int, position: int, expected: int | None, found: int | None, context: str = "") -> None:
        self.turn = turn
        self.position = position
        self.expected = expected
        self.found = found
        found_text = "end of prompt" if found is None else str(found)
        super().__init__(
            f"model call {turn} is not token-contiguous: its prompt differs from the ids before it at position "
            f"{position} (expected {expected}, found {found_text}){context}"
        )


def bundled_turns(record: dict[str, Any]) -> list[BundledTurn]:
    """The bundled items of `record["response"]["output"]`, in order, with full prompt ids (schema version 1 or 2).

    Raises UnknownSchemaVersionError for a record of a version this nemo_gym_tok does not read, and
    MalformedRecordError for a version 2 record whose prompts cannot be rebuilt (nemo_gym_tok.records.rollout_record)
    or an item whose weight version fields are malformed. An item without them (written before they existed) reads as
    unknown.
    """
    output = full_output(record)
    turns = []
    for index, item in enumerate(output):
        if item.get("prompt_token_ids") is None:
            continue
        version, spans = item.get(WEIGHT_VERSION_KEY), item.get(WEIGHT_VERSION_SPANS_KEY)
        generation = item.get("generation_token_ids")
        problem = weight_versions_problem(version, spans, len(generation) if isinstance(generation, list) else None)
        if problem is not None:
            raise MalformedRecordError(f"output item {index}: {problem}")
        turns.append(
            BundledTurn(
                item_index=index,
                prompt_token_ids=list(item["prompt_token_ids"]),
                generation_token_ids=list(item["generation_token_ids"]),
                generation_log_probs=list(item["generation_log_probs"]),
                prefix_splice=item.get("prefix_splice"),
                weight_version=version,
                weight_version_spans=[dict(span) for span in spans] if spans is not None else None,
                image_runs=item.get(IMAGE_RUNS_KEY) if isinstance(item.get(IMAGE_RUNS_KEY), list) else None,
            )
        )
    return turns


def spans_weight_versions(turns: Sequence[BundledTurn]) -> bool:
    """The episode's ids were sampled by more than one weight version: its turns name different versions, or a turn's
    ids span several (unknown turns are not counted here: see has_unknown_weight_version)."""
    return any(turn.weight_version_spans for turn in turns) or len({v for t in turns for v in t.weight_versions}) > 1


def has_unknown_weight_version(turns: Sequence[BundledTurn]) -> bool:
    """A bundled turn of the episode does not say which weight version sampled it."""
    return any(turn.weight_version is None for turn in turns)


def describe_weight_versions(turns: Sequence[BundledTurn]) -> str:
    """The versions of an episode's turns for a report line, runs of turns with the same versions joined:
    `turns 0-1 v1, turn 2 v1 -> v2, turn 3 unknown`."""
    runs: list[tuple[int, int, str]] = []
    for number, turn in enumerate(turns):
        versions = " -> ".join(turn.weight_versions) or "unknown"
        if runs and runs[-1][2] == versions and not turn.weight_version_spans:
            runs[-1] = (runs[-1][0], number, versions)
        else:
            runs.append((number, number, versions))
    return ", ".join(
        f"turn {first} {versions}" if first == last else f"turns {first}-{last} {versions}"
        for first, last, versions in runs
    )


def segments(turns: Sequence[BundledTurn]) -> list[list[BundledTurn]]:
    """The turns cut where a call started a new token segment (each segment trains as its own sequence)."""
    cut: list[list[BundledTurn]] = []
    for turn in turns:
        if not cut or turn.starts_segment:
            cut.append([])
        cut[-1].append(turn)
    return cut


def check_contiguous(turns: Sequence[BundledTurn], decode: Decode | None = None) -> None:
    """Raise NotContiguousError at the first model call whose prompt does not extend the ids before it.

    A call that starts a new token segment starts afresh; a call whose splice replaced the previous call's final end
    token with the template's closing must extend all ids before it but that one.
    """
    seen: list[int] = []
    for number, turn in enumerate(turns):
        if turn.starts_segment:
            seen = []
        expected = seen[:-1] if turn.end_token_replaced and seen else seen
        try:
            check_prefix(turn.prompt_token_ids, expected)
        except PrefixMismatchError as exc:
            context = _context(seen, turn.prompt_token_ids, exc.position, decode)
            raise NotContiguousError(number, exc.position, exc.expected, exc.found, context) from None
        seen = turn.prompt_token_ids + turn.generation_token_ids


def _context(seen: list[int], prompt: list[int], position: int, decode: Decode | None) -> str:
    if decode is None:
        return ""
    start = max(0, position - 8)
    return f"; before: {decode(seen[start : position + 8])!r}, this prompt: {decode(prompt[start : position + 8])!r}"


@dataclass
class ContiguityReport:
    """Contiguity over a rollouts file (what `ngt check` prints)."""

    rollouts: int = 0
    multi_turn: int = 0
    turns: int = 0
    contiguous: int = 0
    repaired_turns: int = 0
    new_segments: int = 0
    """Calls that started a new token segment the caller asked for (`start_token_segment`): one training sequence
    each, not a contiguity failure."""
    unasked_segments: int = 0
    """Calls that started a new token segment nobody asked for: each fails its rollout."""
    without_bundles: int = 0
    unreadable_lines: int = 0
    unreadable_records: int = 0
    """Records of a schema_version this nemo_gym_tok does not read, or whose packed prompts cannot be rebuilt."""
    failures: list[str] = field(default_factory=list)
    spanning_versions: int = 0
    """Rollouts whose ids were sampled by more than one weight version (a report, not a failure)."""
    spanning_examples: list[str] = field(default_factory=list)
    """The first of them, each with its turns' versions."""
    unknown_versions: int = 0
    """Rollouts with a bundled turn of unknown weight version (older records, servers that could not say)."""
    image_rollouts: int = 0
    """Rollouts whose calls record images (a vision model's `image_runs`)."""
    images: int = 0
    """The images those rollouts hold, each counted once (its last call's record)."""

    @property
    def ok(self) -> bool:
        return self.rollouts > 0 and self.contiguous == self.rollouts and self.unreadable_lines == 0

    def format(self) -> str:
        lines = [
            f"rollouts: {self.rollouts} ({self.multi_turn} with several model calls)",
            f"model calls (bundled turns): {self.turns}",
            f"token-contiguous rollouts: {self.contiguous}/{self.rollouts}",
            f"turns repaired by the prefix splice: {self.repaired_turns}",
        ]
        lines.append(
            f"new token segments the caller asked for (start_token_segment; one training sequence each): "
            f"{self.new_segments}; started without the caller asking (failures): {self.unasked_segments}"
        )
        if self.without_bundles:
            lines.append(f"rollouts without token bundles: {self.without_bundles}")
        if self.unreadable_lines:
            lines.append(f"unreadable lines: {self.unreadable_lines}")
        if self.unreadable_records:
            lines.append(f"records of an unknown schema_version or malformed: {self.unreadable_records}")
        lines += [f"  {failure}" for failure in self.failures]
        if self.turns:
            lines.append(
                f"rollouts spanning several weight versions: {self.spanning_versions} (off-policy turns, not a "
                f"contiguity failure); with a turn of unknown weight version: {self.unknown_versions}"
            )
            lines += [f"  {example}" for example in self.spanning_examples]
        if self.image_rollouts:
            lines.append(
                f"rollouts with images: {self.image_rollouts}, holding {self.images} image(s); each image's run in "
                "place in every call's prompt ids, and kept (position, length, digest) from call to call"
            )
        return "\n".join(lines)


def check_file(path: str | Path, decode: Decode | None = None, max_failures: int = 5) -> ContiguityReport:
    """Walk every rollout record (one JSON object per line) of `path`; a line that is not one, a torn last line too,
    is counted unreadable and named among the failures (nemo_gym_tok.common.jsonl's scan)."""
    report = ContiguityReport()
    for line in scan_jsonl(path):
        number, record = line.number, line.value
        if record is None:  # a torn last line too: the rollout it held is not in the file
            report.unreadable_lines += 1
            if len(report.failures) < max_failures:
                report.failures.append(f"line {number}: {TORN if line.torn else line.problem}")
            continue
        report.rollouts += 1
        label = f"line {number}" + (f" (rollout {record['rollout_id']})" if "rollout_id" in record else "")
        try:
            turns = bundled_turns(record)
        except (UnknownSchemaVersionError, MalformedRecordError) as exc:
            report.unreadable_records += 1
            if len(report.failures) < max_failures:
                report.failures.append(f"{label}: {exc}")
            continue
        report.turns += len(turns)
        report.multi_turn += len(turns) > 1
        report.repaired_turns += sum(turn.repaired for turn in turns)
        unasked = [(index, turn.unasked_segment) for index, turn in enumerate(turns) if turn.unasked_segment]
        report.unasked_segments += len(unasked)
        report.new_segments += sum(turn.starts_segment for turn in turns) - len(unasked)
        report.unknown_versions += bool(turns) and has_unknown_weight_version(turns)
        if spans_weight_versions(turns):
            report.spanning_versions += 1
            if len(report.spanning_examples) < max_failures:
                report.spanning_examples.append(f"{label}: {describe_weight_versions(turns)}")
        images = [(turn.prompt_token_ids, turn.image_runs) for turn in turns]
        report.image_rollouts += images_in(images) > 0
        report.images += images_in(images)
        problem = None
        if not turns:
            report.without_bundles += 1
            problem = "no token bundles"
        else:
            try:
                check_contiguous(turns, decode)
                if unasked:
                    index, why = unasked[0]
                    problem = f"model call {index + 1} started a new token segment nobody asked for: {why}"
                elif (image_problem := image_runs_problem(images)) is not None:
                    problem = image_problem
                else:
                    report.contiguous += 1
            except NotContiguousError as exc:
                problem = str(exc)
        if problem and len(report.failures) < max_failures:
            report.failures.append(f"{label}: {problem}")
    return report
