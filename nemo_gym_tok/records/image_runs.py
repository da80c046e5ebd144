"""What `ngt check` holds a vision rollout's image records to: each run where its bundle says, each image kept."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def image_runs_problem(turns: Sequence[tuple[list[int], list[dict[str, Any]] | None]]) -> str | None:
    """Per model call (its prompt ids, its bundle's `image_runs`), in order: each run must be a whole run of one
    placeholder id in the call's prompt ids, and every image of a call must still be there in the next call, at the
    same position, with the same length and digest. None when all holds (or the calls record no images)."""
    previous: list[dict[str, Any]] | None = None
    for call, (prompt, runs) in enumerate(turns, start=1):
        if runs is None:
            previous = None
            continue
        for index, run in enumerate(runs):
            position, length = run.get("position"), run.get("length")
            if not isinstance(position, int) or not isinstance(length, int) or length < 1:
                return f"model call {call}: image {index}'s record is malformed: {run!r}"
            pads = prompt[position : position + length]
            whole = (
                len(pads) == length
                and len(set(pads)) == 1
                and (position == 0 or prompt[position - 1] != pads[0])
                and (position + length == len(prompt) or prompt[position + length] != pads[0])
            )
            if not whole:
                return (
                    f"model call {call}: image {index} is recorded as {length} ids at {position}, which its prompt "
                    "ids do not hold"
                )
        if previous is not None:
            kept = [(run["position"], run["length"], run.get("digest")) for run in runs[: len(previous)]]
            before = [(run["position"], run["length"], run.get("digest")) for run in previous]
            if kept != before:
                changed = next((k for k, (a, b) in enumerate(zip(kept, before)) if a != b), len(kept))
                return (
                    f"model call {call}: image {changed} of the call before is not where it was, or not the same image"
                )
        previous = runs
    return None


def images_in(turns: Sequence[tuple[list[int], list[dict[str, Any]] | None]]) -> int:
    """How many images a rollout's last call that records them holds (0 for a rollout without any)."""
    recorded = [runs for _, runs in turns if runs]
    return len(recorded[-1]) if recorded else 0
