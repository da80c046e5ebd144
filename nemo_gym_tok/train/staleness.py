"""Which weights drew each token, and how many pushes behind the trainer they were: exact, from the bundles' labels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nemo_gym_tok.records.training import TrainingSequence


class StaleWeightsError(RuntimeError):
    """A collected token was not sampled by weights the step may train on: a version unknown, not pushed by this
    run, newer than the trainer's, failed its proof, or more pushes behind than the staleness bound allows."""


def token_versions(sequence: TrainingSequence) -> list[str | None]:
    """The weight version that sampled each id of `sequence` (as long as `sequence.token_ids`): a turn's version, or
    where a push landed during the turn its spans' versions; None at ids the model did not sample and wherever the
    record does not say (an older record, a span that does not cover the position)."""
    versions: list[str | None] = [None] * len(sequence.token_ids)
    for index, (start, end) in enumerate(sequence.turns):
        spans = sequence.weight_version_spans[index] if index < len(sequence.weight_version_spans) else None
        if spans:
            for span in spans:
                low, high = max(0, int(span["start"])), min(end - start, int(span["end"]))
                versions[start + low : start + high] = [span["version"]] * max(0, high - low)
        elif index < len(sequence.weight_versions):
            versions[start:end] = [sequence.weight_versions[index]] * (end - start)
    return versions


@dataclass
class PushLog:
    """The labels this run pushed, in order: a token's lag is the number of pushes between its label and the
    trainer's, counted here, never estimated from step numbers. Labels pushed but refused by their probe are kept
    apart: a token under one of them was drawn by weights nobody proved."""

    labels: list[str] = field(default_factory=list)
    unproven: set[str] = field(default_factory=set)

    def pushed(self, label: str) -> None:
        if label in self.labels or label in self.unproven:
            raise ValueError(f"version {label!r} was pushed before: each push needs a new label")
        self.labels.append(label)

    def failed(self, label: str) -> None:
        """`label` was served, then refused by its proof (the push rolled back)."""
        self.unproven.add(label)
        if label in self.labels:
            self.labels.remove(label)

    def lag(self, token_version: str | None, trainer_version: str) -> int:
        """Pushes between `token_version` and `trainer_version`; StaleWeightsError when it cannot be known."""
        if token_version is None:
            raise StaleWeightsError("a sampled token has no weight version (the server could not say)")
        if token_version in self.unproven:
            raise StaleWeightsError(f"a token was sampled by version {token_version!r}, which failed its probe")
        if token_version not in self.labels:
            raise StaleWeightsError(
                f"a token was sampled by version {token_version!r}, which this run never pushed (start-up weights, or "
                "another trainer's)"
            )
        lag = self.labels.index(trainer_version) - self.labels.index(token_version)
        if lag < 0:
            raise StaleWeightsError(
                f"a token of version {token_version!r} is newer than the trainer's {trainer_version!r}"
            )
        return lag


def token_lags(sequence: TrainingSequence, log: PushLog, trainer_version: str, max_staleness: int) -> list[int | None]:
    """Per id of `sequence`: None where the model did not sample it, else how many pushes its weights were behind
    `trainer_version`. StaleWeightsError, naming the position, for a sampled id whose lag is unknown or above
    `max_staleness`."""
    lags: list[int | None] = []
    for position, (version, sampled) in enumerate(zip(token_versions(sequence), sequence.loss_mask)):
        if not sampled:
            lags.append(None)
            continue
        try:
            lag = log.lag(version, trainer_version)
        except StaleWeightsError as exc:
            raise StaleWeightsError(f"position {position}: {exc}") from None
        if lag > max_staleness:
            raise StaleWeightsError(
                f"position {position} was sampled by version {version!r}, {lag} pushes behind the trainer's "
                f"{trainer_version!r}: over the staleness bound {max_staleness}"
            )
        lags.append(lag)
    return lags


def lag_counts(lags: Sequence[Sequence[int | None]]) -> dict[int, int]:
    """How many sampled tokens sit at each lag, over several sequences."""
    counts: dict[int, int] = {}
    for row in lags:
        for lag in row:
            if lag is not None:
                counts[lag] = counts.get(lag, 0) + 1
    return dict(sorted(counts.items()))
