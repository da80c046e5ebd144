"""Off-policy corrections from the exact data: per sampled token, the weight its loss term gets, from the sampler's
own log prob (the behaviour policy), the learner's, and the token's lag."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_gym_tok.train.logprob_gap import GapFigures, gap_figures

CorrectionMode = Literal["none", "tis", "mask"]
CORRECTION_MODES: tuple[CorrectionMode, ...] = ("none", "tis", "mask")
DEFAULT_TIS_CAP = 2.0
TOKEN_WEIGHT_KEY = "token_weight"
"""The rollout_func's extra key: per episode, one weight per completion id (0.0 where the model did not sample)."""


@dataclass(frozen=True)
class Correction:
    """How a step weighs tokens sampled by other weights than the trainer's.

    - `none`: every sampled token counts as it is (GRPO's ratio is 1 at the current weights);
    - `tis`: token-level truncated importance sampling: each token's loss term times
      min(exp(learner - sampler), `tis_cap`), the sampler's log prob as the behaviour policy;
    - `mask`: tokens more than `mask_lag` pushes behind the trainer leave the loss (0: learn only from tokens of
      the trainer's own weights, as slime's mask of off-policy tokens in partial rollouts does).
    """

    mode: CorrectionMode = "tis"
    tis_cap: float = DEFAULT_TIS_CAP
    mask_lag: int = 0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"correction must be one of {', '.join(CORRECTION_MODES)}, got {self.mode!r}")
        if not (self.tis_cap >= 1.0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"tis_cap must be a finite number >= 1, got {self.tis_cap}")
        if self.mask_lag < 0:
            raise ValueError(f"mask_lag must be >= 0, got {self.mask_lag}")

    def describe(self) -> str:
        if self.mode == "tis":
            return f"token TIS (cap {self.tis_cap:g})"
        if self.mode == "mask":
            return f"mask tokens more than {self.mask_lag} push(es) behind"
        return "none"


@dataclass
class CorrectionFigures:
    """What a correction did over some tokens: how many it capped or masked, and the sampler-versus-learner gap per
    lag (|learner - sampler| per token, the learner at the trainer's weights)."""

    tokens: int = 0
    capped: int = 0
    masked: int = 0
    by_lag: dict[int, GapFigures] = field(default_factory=dict)

    def add(self, other: CorrectionFigures) -> None:
        self.tokens += other.tokens
        self.capped += other.capped
        self.masked += other.masked
        for lag, figures in other.by_lag.items():
            self.by_lag[lag] = self.by_lag.get(lag, GapFigures()) + figures

    def lag_share(self, lag: int) -> float:
        count = self.by_lag[lag].tokens if lag in self.by_lag else 0
        return count / self.tokens if self.tokens else math.nan


def token_weights(
    correction: Correction,
    sampler: Sequence[float],
    learner: Sequence[float],
    lags: Sequence[int | None],
) -> tuple[list[float], CorrectionFigures]:
    """Per position (all three sequences as long as the episode's ids; `lags[i]` None where the model did not
    sample): the weight of that position's loss term, 0.0 where the model did not sample, and the figures. The
    ratio exp(learner - sampler) is the learner's probability of the drawn id over the sampler's, both exact: the
    same id at the same position, the sampler's log prob as it drew it."""
    if not len(sampler) == len(learner) == len(lags):
        raise ValueError(f"{len(sampler)} sampler, {len(learner)} learner log probs and {len(lags)} lags")
    weights: list[float] = []
    figures = CorrectionFigures()
    for behaviour, current, lag in zip(sampler, learner, lags):
        if lag is None:
            weights.append(0.0)
            continue
        figures.tokens += 1
        figures.by_lag[lag] = figures.by_lag.get(lag, GapFigures()) + gap_figures([behaviour], [current])
        if correction.mode == "tis":
            ratio = math.exp(min(current - behaviour, 700.0))
            if ratio > correction.tis_cap:
                figures.capped += 1
            weights.append(min(ratio, correction.tis_cap))
        elif correction.mode == "mask" and lag > correction.mask_lag:
            figures.masked += 1
            weights.append(0.0)
        else:
            weights.append(1.0)
    return weights, figures


def loss_fields(correction: Correction, weights: Sequence[Sequence[float]]) -> dict[str, list[list[Any]]]:
    """What the rollout output carries for `correction`, given each episode's weights over its completion ids: the
    weights under TOKEN_WEIGHT_KEY for `tis` (CorrectedGRPOTrainer scales each token's loss term by them); for `mask`
    an `env_mask` without the masked tokens (TRL leaves a token whose env_mask is 0 out of the loss, as it does
    supplied ids); nothing for `none`."""
    if correction.mode == "tis":
        return {TOKEN_WEIGHT_KEY: [list(row) for row in weights]}
    if correction.mode == "mask":
        return {"env_mask": [[int(weight > 0.0) for weight in row] for row in weights]}
    return {}
