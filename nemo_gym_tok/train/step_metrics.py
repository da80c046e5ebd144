"""One training step's figures: reward, the exact-ids gap, the text pipeline's, timings; a line and a JSON object."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.train.correction import CorrectionFigures
from nemo_gym_tok.train.logprob_gap import KINDS, GapFigures
from nemo_gym_tok.train.text_pipeline import TextPipelineFigures


@dataclass(frozen=True)
class StepMetrics:
    """Measured on the episodes one step collected, at the weights that sampled them (pushed just before)."""

    step: int
    version: str
    episodes: int
    contiguous: int
    rewards: list[float]
    sampled_tokens: int
    exact: dict[str, GapFigures]
    """Per turn kind (free, constrained, unknown): the sampler's log probs against the learner's along the exact ids."""
    text: TextPipelineFigures | None
    """The same episodes' free turns re-rendered from their final messages; None when not measured."""
    push_seconds: float
    collect_seconds: float
    measure_seconds: float
    notes: list[str] = field(default_factory=list)
    wait_seconds: float = 0.0
    """How long the trainer waited for the step's episodes after its push (all of the collection when it runs on
    demand; none when a collector running ahead had them ready)."""
    probe_seconds: float = 0.0
    """The push's proof: every server's probe, in parallel (part of push_seconds)."""
    lags: dict[int, int] = field(default_factory=dict)
    """Sampled tokens per lag: how many pushes behind the trainer's weights the weights that drew them were."""
    correction: CorrectionFigures | None = None
    """Capped or masked tokens, and the sampler-versus-learner gap per lag."""

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    def line(self) -> str:
        """The one line `ngt train-demo` prints per step."""
        free = self.exact["free"]
        parts = [
            f"step {self.step:>2}",
            f"reward {self.reward_mean:.3f}",
            f"exact gap free mean {free.mean:.1e} max {free.max:.1e} clip {_percent(free.clip_share)}",
        ]
        constrained = self.exact["constrained"]
        if constrained.tokens:
            parts.append(f"constrained mean {constrained.mean:.3f}")
        if self.text is not None:
            parts.append(
                f"text: ids differ {_percent(self.text.differing_share)}, gap mean {self.text.gap.mean:.3f} "
                f"max {self.text.gap.max:.2f}, clip {_percent(self.text.gap.clip_share)}"
            )
        if any(lag > 0 for lag in self.lags):
            total_tokens = sum(self.lags.values())
            parts.append("lag " + " ".join(f"{lag}:{_percent(n / total_tokens)}" for lag, n in self.lags.items()))
        if self.correction is not None and (self.correction.capped or self.correction.masked):
            parts.append(f"capped {self.correction.capped} masked {self.correction.masked}")
        parts.append(f"push {self.push_seconds:.2f}s (probe {1000 * self.probe_seconds:.0f} ms)")
        parts.append(f"waited {self.wait_seconds:.1f}s")
        parts.append(f"contiguous {self.contiguous}/{self.episodes}")
        return " | ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """Flat, JSON-safe (NaN becomes null): one line of the metrics JSONL."""
        row: dict[str, Any] = {
            "step": self.step,
            "weight_version": self.version,
            "episodes": self.episodes,
            "contiguous": self.contiguous,
            "reward_mean": self.reward_mean,
            "rewards": self.rewards,
            "sampled_tokens": self.sampled_tokens,
        }
        for kind in KINDS:
            row.update(_gap_fields(f"exact_{kind}", self.exact[kind]))
        if self.text is not None:
            row["text_positions"] = self.text.positions
            row["text_differing"] = self.text.differing
            row["text_differing_share"] = self.text.differing_share
            row.update(_gap_fields("text", self.text.gap))
        row.update(
            push_seconds=self.push_seconds,
            probe_seconds=self.probe_seconds,
            collect_seconds=self.collect_seconds,
            wait_seconds=self.wait_seconds,
            measure_seconds=self.measure_seconds,
            lag_tokens={str(lag): count for lag, count in self.lags.items()},
            notes=self.notes,
        )
        if self.correction is not None:
            row.update(correction_tokens=self.correction.tokens, capped=self.correction.capped,
                       masked=self.correction.masked)  # fmt: skip
            for lag, figures in self.correction.by_lag.items():
                row.update(_gap_fields(f"lag{lag}", figures))
        return {key: (None if isinstance(value, float) and math.isnan(value) else value) for key, value in row.items()}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StepMetrics:
        """A line of the metrics JSONL read back (a committed run's figures recomputed by the code that printed them;
        each gap's sum is its mean times its tokens)."""
        text = None
        if "text_positions" in row:
            text = TextPipelineFigures(row["text_positions"], row["text_differing"], _gap_from(row, "text"))
        lags = {int(lag): count for lag, count in row.get("lag_tokens", {}).items()}
        correction = None
        if "correction_tokens" in row:
            by_lag = {lag: _gap_from(row, f"lag{lag}") for lag in lags if f"lag{lag}_tokens" in row}
            correction = CorrectionFigures(row["correction_tokens"], row["capped"], row["masked"], by_lag)
        return cls(
            step=row["step"],
            version=row["weight_version"],
            episodes=row["episodes"],
            contiguous=row["contiguous"],
            rewards=row["rewards"],
            sampled_tokens=row["sampled_tokens"],
            exact={kind: _gap_from(row, f"exact_{kind}") for kind in KINDS},
            text=text,
            push_seconds=row["push_seconds"],
            collect_seconds=row["collect_seconds"],
            measure_seconds=row["measure_seconds"],
            notes=row.get("notes", []),
            wait_seconds=row.get("wait_seconds", 0.0),
            probe_seconds=row.get("probe_seconds", 0.0),
            lags=lags,
            correction=correction,
        )


def append_metrics(path: Path, metrics: StepMetrics) -> None:
    """One JSON line per step, appended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(metrics.to_json(), allow_nan=False) + "\n")


def _gap_fields(prefix: str, figures: GapFigures) -> dict[str, Any]:
    return {
        f"{prefix}_tokens": figures.tokens,
        f"{prefix}_gap_mean": figures.mean,
        f"{prefix}_gap_max": figures.max,
        f"{prefix}_clip_share": figures.clip_share,
    }


def _percent(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{100 * share:.1f}%"


def read_metrics(path: Path) -> list[StepMetrics]:
    """Every step of a metrics JSONL, in order."""
    return [StepMetrics.from_json(row) for row in read_jsonl(path)]


def _gap_from(row: dict[str, Any], prefix: str) -> GapFigures:
    tokens = row[f"{prefix}_tokens"]
    if not tokens:
        return GapFigures()
    mean, share = row[f"{prefix}_gap_mean"], row[f"{prefix}_clip_share"]
    return GapFigures(tokens, mean * tokens, row[f"{prefix}_gap_max"], round(share * tokens))
