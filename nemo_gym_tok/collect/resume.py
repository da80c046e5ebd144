"""Resuming: the rollouts an output holds, matched by row identity; another input's or agent's output is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_gym_tok.collect.collect_errors import ResumeError
from nemo_gym_tok.collect.identity import InputRows, RolloutId, RolloutKey


def done_keys(output: Path, inputs: InputRows, agent: str | None, written: list[RolloutId]) -> set[RolloutKey]:
    """The keys of the rollouts already in `output`, after checking every one belongs to this input and agent.

    Rows may have been added or reordered since, and --limit may differ: keys name content, so the rest is found.
    A record of another agent, or of a row the input no longer has (another input, or an edited row), is a
    ResumeError: appending to that file would mix two collections.
    """
    others = sorted({repr(rid.agent) for rid in written if rid.agent != agent})
    if others:
        raise ResumeError(
            f"{output} holds rollouts of agent {', '.join(others)}, not {agent!r}: collect into another --output "
            "(resuming would mix two agents' rollouts)"
        )
    foreign = [rid for rid in written if (rid.key.row_hash, rid.key.occurrence) not in inputs.every_row]
    if foreign:
        raise ResumeError(
            f"{output} holds {len(foreign)} rollout(s) of rows that are not in {inputs.path} (the first: row "
            f"{foreign[0].row} of the input it was collected from, row_hash {foreign[0].key.row_hash}); it was "
            "collected from another or an edited input: collect into another --output, or restore that input"
        )
    return {rid.key for rid in written}


def belongs(entry: dict[str, Any], inputs: InputRows, agent: str | None) -> bool:
    """A failures-file entry of this input and agent (others are stale, from a collection the output no longer has)."""
    rid = RolloutId.from_json(entry["rollout_id"])
    return rid.agent == agent and (rid.key.row_hash, rid.key.occurrence) in inputs.every_row
