"""Names each rollout by its input row's content, not its position: (row hash, occurrence, repeat), and the agent."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from nemo_gym_tok.collect.collect_errors import InputError
from nemo_gym_tok.common.jsonl import scan_jsonl

ROW_HASH_HEX_DIGITS = 16
"""64 bits of SHA-256: a collision between two different rows of a data set is not a practical concern."""


class RolloutKey(NamedTuple):
    """What resuming matches on: the row's content hash, which occurrence of that content, and the repeat."""

    row_hash: str
    occurrence: int
    repeat: int


def row_hash(row: dict[str, Any]) -> str:
    """Hash of the row's canonical JSON (keys sorted, no spaces), so reformatting the input keeps the identity."""
    canonical = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:ROW_HASH_HEX_DIGITS]


@dataclass(frozen=True)
class RolloutId:
    """A record's `rollout_id`: its key, the row's index in the input when written (for people), and the agent."""

    key: RolloutKey
    row: int
    agent: str | None

    def to_json(self) -> dict[str, Any]:
        """The `rollout_id` object written into records and failure entries."""
        return {
            "row": self.row,
            "repeat": self.key.repeat,
            "row_hash": self.key.row_hash,
            "occurrence": self.key.occurrence,
            "agent": self.agent,
        }

    @classmethod
    def from_json(cls, value: Any) -> RolloutId:
        """Parse a `rollout_id`; ValueError says what is wrong (an index-only id is from an older `ngt collect`)."""
        if not isinstance(value, dict):
            raise ValueError(f"rollout_id is not an object: {value!r}")
        if "row_hash" not in value or "occurrence" not in value:
            raise ValueError(
                f"rollout_id {value!r} has no row_hash/occurrence (written by an older ngt collect, "
                "which identified rows by index only); collect into a new --output"
            )
        row, repeat, occurrence, digest = value.get("row"), value.get("repeat"), value["occurrence"], value["row_hash"]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (row, repeat, occurrence)):
            raise ValueError(f"rollout_id {value!r}: row, repeat and occurrence must be integers")
        agent = value.get("agent")
        if not isinstance(digest, str) or not (agent is None or isinstance(agent, str)):
            raise ValueError(f"rollout_id {value!r}: row_hash must be a string and agent a string or null")
        return cls(RolloutKey(digest, occurrence, repeat), row, agent)


@dataclass(frozen=True)
class InputRow:
    """One input row and its identity."""

    index: int
    """Among the input's non-empty lines, 0-based."""
    fields: dict[str, Any]
    row_hash: str
    occurrence: int
    """How many earlier rows of the input have the same content: repeated prompts stay distinct rollouts."""

    def key(self, repeat: int) -> RolloutKey:
        """The key of this row's `repeat`-th rollout."""
        return RolloutKey(self.row_hash, self.occurrence, repeat)

    def rollout_id(self, repeat: int, agent: str | None) -> RolloutId:
        """The id written with this row's `repeat`-th rollout."""
        return RolloutId(self.key(repeat), self.index, agent)


@dataclass(frozen=True)
class InputRows:
    """The rows in scope (the first `limit`), and the identity of every row of the file, for resume checks."""

    path: Path
    rows: list[InputRow]
    every_row: frozenset[tuple[str, int]]
    """(row hash, occurrence) of each readable row of the whole file, past --limit too: an output collected
    without --limit is still this input's when resumed with one."""


def read_input(input_path: str | os.PathLike[str], limit: int | None = None) -> InputRows:
    """The input's rows with their identities; a line in scope that is not a JSON object is an InputError, a torn
    last line included: a row that does not read is refused, never skipped (the input is the user's, not a file a
    killed writer left behind).

    Lines past `limit` are neither run nor validated: an unreadable one only has no identity.
    """
    path = Path(input_path)
    rows: list[InputRow] = []
    seen: Counter[str] = Counter()
    try:
        lines = scan_jsonl(path)
    except FileNotFoundError:
        raise InputError(f"input file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    index = 0
    for line in lines:
        in_scope = limit is None or index < limit
        if in_scope:
            if line.problem is not None:
                raise InputError(str(line.error()))
        if line.value is None:  # past the limit: no identity
            index += 1
            continue
        digest = row_hash(line.value)
        if in_scope:
            rows.append(InputRow(index, line.value, digest, seen[digest]))
        seen[digest] += 1
        index += 1
    every_row = frozenset((digest, occurrence) for digest, count in seen.items() for occurrence in range(count))
    return InputRows(path, rows, every_row)


def read_rows(input_path: str | os.PathLike[str], limit: int | None = None) -> list[dict[str, Any]]:
    """The input's non-empty lines as JSON objects (the first `limit` of them); any other line is an InputError."""
    return [row.fields for row in read_input(input_path, limit).rows]
