"""Token contiguity of a rollout record: each model call's prompt starts with every id seen before it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.contract.token_sources import PrefixMismatchError, check_prefix
from nemo_gym_tok.records.rollout_record import MalformedRecordError, UnknownSchemaVersionError, full_output

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class BundledTurn:
    """One model call of an episode, from the output item that carries its bundle."""

    item_index: int
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    prefix_splice: dict[str, Any] | None

    @property
    def repaired(self) -> bool:
        """The hook replaced template ids that differed from the model's."""
        return bool(self.prefix_splice and self.prefix_splice.get("template_differed"))

    @property
    def starts_segment(self) -> bool:
        """The caller asked for the template's ids from this call on (`start_token_segment`): a new sequence."""
        return bool(self.prefix_splice and self.prefix_splice.get("new_segment"))

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
    MalformedRecordError for a version 2 record whose prompts cannot be rebuilt (nemo_gym_tok.records.rollout_record).
    """
    output = full_output(record)
    turns = []
    for index, item in enumerate(output):
        if item.get("prompt_token_ids") is None:
            continue
        turns.append(
            BundledTurn(
                item_index=index,
                prompt_token_ids=list(item["prompt_token_ids"]),
                generation_token_ids=list(item["generation_token_ids"]),
                generation_log_probs=list(item["generation_log_probs"]),
                prefix_splice=item.get("prefix_splice"),
            )
        )
    return turns


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
    without_bundles: int = 0
    unreadable_lines: int = 0
    unreadable_records: int = 0
    """Records of a schema_version this nemo_gym_tok does not read, or whose packed prompts cannot be rebuilt."""
    failures: list[str] = field(default_factory=list)

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
        if self.new_segments:
            lines.append(f"new token segments (start_token_segment; one training sequence each): {self.new_segments}")
        if self.without_bundles:
            lines.append(f"rollouts without token bundles: {self.without_bundles}")
        if self.unreadable_lines:
            lines.append(f"unreadable lines: {self.unreadable_lines}")
        if self.unreadable_records:
            lines.append(f"records of an unknown schema_version or malformed: {self.unreadable_records}")
        lines += [f"  {failure}" for failure in self.failures]
        return "\n".join(lines)


def check_file(path: str | Path, decode: Decode | None = None, max_failures: int = 5) -> ContiguityReport:
    """Walk every rollout record (one JSON object per line) of `path`."""
    report = ContiguityReport()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                report.unreadable_lines += 1
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
            report.new_segments += sum(turn.starts_segment for turn in turns)
            problem = None
            if not turns:
                report.without_bundles += 1
                problem = "no token bundles"
            else:
                try:
                    check_contiguous(turns, decode)
                    report.contiguous += 1
                except NotContiguousError as exc:
                    problem = str(exc)
            if problem and len(report.failures) < max_failures:
                report.failures.append(f"{label}: {problem}")
    return report
