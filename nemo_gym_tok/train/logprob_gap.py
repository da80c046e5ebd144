"""The sampler-versus-learner log-prob gap per token, and the share of tokens a GRPO ratio would clip."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nemo_gym_tok.records.training import TrainingSequence

CLIP_EPSILON = 0.2
"""GRPO's (and PPO's) clip range: a ratio exp(learner - sampler) outside [1 - 0.2, 1 + 0.2] is clipped."""
KINDS = ("free", "constrained", "unknown")


@dataclass(frozen=True)
class GapFigures:
    """|learner - sampler| over `tokens` positions: their sum and max, and how many ratios fall outside the clip."""

    tokens: int = 0
    total: float = 0.0
    max: float = math.nan
    clipped: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else math.nan

    @property
    def clip_share(self) -> float:
        return self.clipped / self.tokens if self.tokens else math.nan

    def __add__(self, other: GapFigures) -> GapFigures:
        top = [value for value in (self.max, other.max) if not math.isnan(value)]
        return GapFigures(
            self.tokens + other.tokens,
            self.total + other.total,
            max(top, default=math.nan),
            self.clipped + other.clipped,
        )


def gap_figures(sampler: Sequence[float], learner: Sequence[float], epsilon: float = CLIP_EPSILON) -> GapFigures:
    """The figures of paired per-token log probs (same length: position i of one is position i of the other)."""
    if len(sampler) != len(learner):
        raise ValueError(f"{len(sampler)} sampler log probs against {len(learner)} learner log probs")
    gaps = [abs(b - a) for a, b in zip(sampler, learner)]
    clipped = sum(1 for a, b in zip(sampler, learner) if not (1 - epsilon <= _ratio(b - a) <= 1 + epsilon))
    return GapFigures(len(gaps), sum(gaps), max(gaps, default=math.nan), clipped)


def total(figures: Iterable[GapFigures]) -> GapFigures:
    """Figures over the union of the positions."""
    result = GapFigures()
    for figure in figures:
        result = result + figure
    return result


def turn_kind(sequence: TrainingSequence, index: int) -> str:
    """`free`, `constrained` or `unknown` (a record that does not say) for turn `index`."""
    labels = sequence.constrained_by[index] if index < len(sequence.constrained_by) else None
    if labels is None:
        return "unknown"
    return "constrained" if labels else "free"


def sampled_positions(sequence: TrainingSequence) -> list[int]:
    """The positions of `sequence.token_ids` the model sampled (where `exact_gap` reads the learner's log probs)."""
    return [index for index, sampled in enumerate(sequence.loss_mask) if sampled and index > 0]


def exact_gap(
    sequence: TrainingSequence, learner: Sequence[float], epsilon: float = CLIP_EPSILON
) -> dict[str, GapFigures]:
    """Per turn kind: the sampler's log probs of the generated ids against the learner's along the same ids
    (`learner[i]` = log p(token_ids[i] | token_ids[:i]), as long as `sequence.token_ids`)."""
    if len(learner) != len(sequence.token_ids):
        raise ValueError(f"{len(learner)} learner log probs for a sequence of {len(sequence.token_ids)} ids")
    by_kind = {kind: GapFigures() for kind in KINDS}
    for index, (start, end) in enumerate(sequence.turns):
        kind = turn_kind(sequence, index)
        by_kind[kind] = by_kind[kind] + gap_figures(sequence.log_probs[start:end], learner[start:end], epsilon)
    return by_kind


def _ratio(difference: float) -> float:
    return math.exp(min(difference, 700.0))  # a huge gap is a huge ratio, not an OverflowError
