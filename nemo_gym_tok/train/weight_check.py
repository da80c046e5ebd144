"""Every collected turn was sampled by the weights just pushed: exact, or the step is refused."""

from __future__ import annotations

from collections.abc import Sequence

from nemo_gym_tok.records.training import TrainingSequence
from nemo_gym_tok.train.staleness import StaleWeightsError

__all__ = ["StaleWeightsError", "check_weight_versions", "version_problems"]


def version_problems(sequence: TrainingSequence, expected: str) -> list[str]:
    """What is wrong with one episode's weight versions (empty when every turn says `expected` and no turn spans
    several versions). An unknown version (None) is a problem: not knowing is not being sure."""
    problems = []
    for index, version in enumerate(sequence.weight_versions):
        if version != expected:
            problems.append(f"turn {index} was sampled by version {version!r}")
    for index, spans in enumerate(sequence.weight_version_spans):
        if spans:
            versions = ", ".join(f"{span['version']!r} [{span['start']}, {span['end']})" for span in spans)
            problems.append(f"turn {index} spans versions {versions}")
    if len(sequence.weight_versions) != len(sequence.turns):
        problems.append(f"{len(sequence.turns)} turns but {len(sequence.weight_versions)} weight versions")
    return problems


def check_weight_versions(sequences: Sequence[tuple[str, TrainingSequence]], expected: str) -> None:
    """Raise StaleWeightsError naming every (name, sequence) with a turn not sampled by `expected` alone."""
    found = [
        f"{name}: {'; '.join(problems)}"
        for name, sequence in sequences
        if (problems := version_problems(sequence, expected))
    ]
    if found:
        raise StaleWeightsError(
            f"{len(found)} of {len(sequences)} episodes were not sampled by the pushed weights (version "
            f"{expected!r}): " + " | ".join(found[:5]) + (" ..." if len(found) > 5 else "")
        )
