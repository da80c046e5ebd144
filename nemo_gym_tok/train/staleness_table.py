"""`ngt train-async`'s table: the train demo at several staleness bounds on one vLLM and gym, side by side."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.records.training import rollout_to_training_sequence
from nemo_gym_tok.train.correction import Correction, CorrectionFigures
from nemo_gym_tok.train.staleness import token_versions
from nemo_gym_tok.train.step_metrics import StepMetrics
from nemo_gym_tok.train.train_demo import WINDOW, DemoResult, DemoSettings, clean_output, demo_servers, train_once

TABLE_FILE = "table.json"
TABLE_MARKDOWN = "table.md"
PLOT_FILE = "train-async.png"
REACH = 0.8
REACH_WINDOW = 3
GAIN_TOLERANCE = 0.05
"""The issue's bound: at staleness 2 with correction, the reward gain (and the last steps' reward) within 0.05 of
the synchronous run's."""


@dataclass(frozen=True)
class TableRun:
    """One row of the table: a staleness bound and a correction."""

    max_staleness: int
    correction: Correction

    @property
    def name(self) -> str:
        return f"staleness-{self.max_staleness}-{self.correction.mode}"


DEFAULT_RUNS = (
    TableRun(0, Correction("tis")),
    TableRun(1, Correction("tis")),
    TableRun(2, Correction("tis")),
    TableRun(4, Correction("tis")),
    TableRun(4, Correction("none")),
)


@dataclass(frozen=True)
class RunFigures:
    """What one run measured, as the table shows it (shares in [0, 1], gaps in nats)."""

    name: str
    max_staleness: int
    correction: str
    steps: int
    reward_first: float
    reward_last: float
    """Mean reward of the first and last WINDOW steps' episodes."""
    version_reward_first: float
    version_reward_last: float
    """The mean over the first and last WINDOW versions that drew episodes of each version's mean reward (a
    staleness-K run's step N trains on episodes of version N - K: by step, its first K + 1 steps all show the start-up
    policy's reward)."""
    steps_to_reach: int | None
    """The first step whose trailing REACH_WINDOW-step mean reward is at least REACH; None: never."""
    train_seconds: float
    trainer_idle_share: float
    sampler_idle_share: float
    lag_shares: dict[str, float]
    capped_share: float
    masked_share: float
    gap_by_lag: dict[str, float]
    episodes: int
    contiguous: int
    unknown_versions: int
    probe_ms_mean: float
    step_seconds_mean: float

    @property
    def reward_gain(self) -> float:
        return self.reward_last - self.reward_first

    @property
    def version_reward_gain(self) -> float:
        return self.version_reward_last - self.version_reward_first

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RunFigures:
        """A row of table.json (which also carries the gains, computed)."""
        return cls(**{name: value for name, value in row.items() if name not in ("reward_gain", "version_reward_gain")})


def run_figures(run: TableRun, result: DemoResult, label_prefix: str) -> RunFigures:
    metrics = result.metrics
    by_version = rewards_by_version(result.files["records"], label_prefix)
    versions = sorted(by_version)
    corrections = CorrectionFigures()
    for step in metrics:
        if step.correction is not None:
            corrections.add(step.correction)
    tokens = corrections.tokens
    train_seconds = result.train_seconds
    waited = sum(step.wait_seconds for step in metrics)
    return RunFigures(
        name=run.name,
        max_staleness=run.max_staleness,
        correction=run.correction.describe(),
        steps=len(metrics),
        reward_first=result.window(False),
        reward_last=result.window(True),
        version_reward_first=_mean([_mean(by_version[v]) for v in versions[:WINDOW]]),
        version_reward_last=_mean([_mean(by_version[v]) for v in versions[-WINDOW:]]),
        steps_to_reach=steps_to_reach([step.reward_mean for step in metrics]),
        train_seconds=train_seconds,
        trainer_idle_share=waited / train_seconds if train_seconds > 0 else math.nan,
        sampler_idle_share=1.0 - result.sampler_busy_share,
        lag_shares={str(lag): figures.tokens / tokens for lag, figures in sorted(corrections.by_lag.items())},
        capped_share=corrections.capped / tokens if tokens else math.nan,
        masked_share=corrections.masked / tokens if tokens else math.nan,
        gap_by_lag={str(lag): figures.mean for lag, figures in sorted(corrections.by_lag.items())},
        episodes=sum(step.episodes for step in metrics),
        contiguous=sum(step.contiguous for step in metrics),
        unknown_versions=unknown_versions(result.files["records"]),
        probe_ms_mean=1000 * _mean([step.probe_seconds for step in metrics]),
        step_seconds_mean=train_seconds / len(metrics) if metrics else math.nan,
    )


def rewards_by_version(records_dir: Path, label_prefix: str) -> dict[int, list[float]]:
    """Each episode's reward under the push that drew its first sampled id (`label_prefix` + step), from the run's
    record files."""
    found: dict[int, list[float]] = {}
    for path in sorted(records_dir.glob("step-[0-9][0-9][0-9].jsonl")):  # not the rows beside them
        for record in read_jsonl(path):
            label = rollout_to_training_sequence(record).weight_versions[0]
            if label is None or not label.startswith(label_prefix):
                raise ValueError(f"{path}: an episode drawn by {label!r}, not by a push of this run ({label_prefix}N)")
            found.setdefault(int(label.removeprefix(label_prefix)), []).append(float(record["reward"]))
    return found


def unknown_versions(records_dir: Path) -> int:
    """Sampled ids of unknown weight version in a run's record files, read again (the run refuses a step with one,
    so a finished run should have none: this counts what the files say, not what the run believed)."""
    count = 0
    for path in sorted(records_dir.glob("step-[0-9][0-9][0-9].jsonl")):  # not the rows beside them
        for record in read_jsonl(path):
            sequence = rollout_to_training_sequence(record)
            versions = token_versions(sequence)
            count += sum(1 for version, sampled in zip(versions, sequence.loss_mask) if sampled and version is None)
    return count


def steps_to_reach(rewards: Sequence[float], level: float = REACH, window: int = REACH_WINDOW) -> int | None:
    """The first step whose trailing `window`-step mean reward is at least `level` (None: never)."""
    for step in range(window - 1, len(rewards)):
        if _mean(rewards[step - window + 1 : step + 1]) >= level:
            return step
    return None


def run_staleness_table(
    settings: DemoSettings,
    runs: Sequence[TableRun] = DEFAULT_RUNS,
    *,
    say: Callable[[str], None] = print,
    on_step: Callable[[str, StepMetrics], None] | None = None,
) -> list[RunFigures]:
    """Every run on one vLLM and gym (each from the model's initial weights), the table written after each run to
    `table.json` and at the end to `table.md` and the plot."""
    out = settings.output_dir
    clean_output(out, [run.name for run in runs] + [TABLE_FILE, TABLE_MARKDOWN, PLOT_FILE, "served-model", "vllm.log"])
    nonce = uuid.uuid4().hex[:6]  # labels new on this server whatever ran before
    figures: list[RunFigures] = []
    steps: dict[str, list[StepMetrics]] = {}
    with demo_servers(settings, out, say) as servers:
        for run in runs:
            plan = replace(settings.plan, max_staleness=run.max_staleness, correction=run.correction)
            run_settings = replace(settings, plan=plan, text_pipeline=False)
            result = train_once(
                servers,
                run_settings,
                out / run.name,
                label_prefix=f"{run.name}-{nonce}-",
                say=say,
                on_step=None if on_step is None else lambda metrics, name=run.name: on_step(name, metrics),
            )
            figures.append(run_figures(run, result, f"{run.name}-{nonce}-"))
            steps[run.name] = result.metrics
            write_table(out / TABLE_FILE, figures)
            say(format_row(figures[-1]))
    (out / TABLE_MARKDOWN).write_text(markdown_table(figures), encoding="utf-8")
    plot_table(figures, steps, out / PLOT_FILE)
    return figures


def write_table(path: Path, figures: Sequence[RunFigures]) -> None:
    rows = [
        {**asdict(row), "reward_gain": row.reward_gain, "version_reward_gain": row.version_reward_gain}
        for row in figures
    ]
    path.write_text(json.dumps(_json_safe(rows), indent=1) + "\n", encoding="utf-8")


def read_table(path: Path) -> list[dict[str, Any]]:
    return loads_exact(path.read_text(encoding="utf-8"))


def targets(figures: Sequence[RunFigures]) -> dict[str, bool]:
    """The issue's targets over the table."""
    by_key = {(row.max_staleness, row.correction): row for row in figures}
    sync = next((row for row in figures if row.max_staleness == 0), None)
    corrected_2 = by_key.get((2, Correction("tis").describe()))
    result = {
        "every episode token-contiguous": all(row.contiguous == row.episodes for row in figures),
        "every token's weights known (0 unknown)": all(row.unknown_versions == 0 for row in figures),
    }
    if sync is not None and corrected_2 is not None:
        # The gain is judged by the weights that drew each episode: by step, a staleness-K run's first K + 1 steps
        # train on the start-up weights' episodes, which lowers its first-window mean and inflates its gain however
        # well it learns (docs/training.md, "Learning"). The last window is compared too, so that the start cannot
        # carry a run that ends lower.
        result[
            f"staleness 2 with correction: reward gain by drawing weights within {GAIN_TOLERANCE} of the synchronous "
            "run's"
        ] = abs(corrected_2.version_reward_gain - sync.version_reward_gain) <= GAIN_TOLERANCE
        result[
            f"staleness 2 with correction: last {WINDOW} steps' reward within {GAIN_TOLERANCE} of the synchronous run's"
        ] = abs(corrected_2.reward_last - sync.reward_last) <= GAIN_TOLERANCE
    return result


def format_row(row: RunFigures) -> str:
    lags = " ".join(f"{lag}:{100 * share:.0f}%" for lag, share in row.lag_shares.items())
    gaps = " ".join(f"{lag}:{gap:.1e}" for lag, gap in row.gap_by_lag.items())
    reach = "-" if row.steps_to_reach is None else str(row.steps_to_reach)
    return (
        f"{row.name}: reward {row.reward_first:.3f} -> {row.reward_last:.3f} ({row.reward_gain:+.3f}; by drawing "
        f"weights {row.version_reward_first:.3f} -> {row.version_reward_last:.3f}), 0.8 at step "
        f"{reach}, {row.train_seconds:.0f} s, idle trainer {100 * row.trainer_idle_share:.0f}% sampler "
        f"{100 * row.sampler_idle_share:.0f}%, lags {lags}, capped {_percent(row.capped_share)} masked "
        f"{_percent(row.masked_share)}, gap by lag {gaps}, contiguous {row.contiguous}/{row.episodes}"
    )


def markdown_table(figures: Sequence[RunFigures]) -> str:
    head = (
        f"| staleness | correction | reward, first / last {WINDOW} steps (gain) | reward by drawing weights, first / "
        f"last {WINDOW} versions (gain) | steps to {REACH} | training time, s "
        "| trainer idle | sampler idle | tokens by lag | capped / masked | gap by lag, nats mean | probe per push, ms |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in figures:
        lags = ", ".join(f"{lag}: {_percent(share)}" for lag, share in row.lag_shares.items())
        gaps = ", ".join(f"{lag}: {gap:.2g}" for lag, gap in row.gap_by_lag.items())
        reach = "not reached" if row.steps_to_reach is None else str(row.steps_to_reach)
        lines.append(
            f"| {row.max_staleness} | {row.correction} | {row.reward_first:.3f} / {row.reward_last:.3f} "
            f"({row.reward_gain:+.3f}) | {row.version_reward_first:.3f} / {row.version_reward_last:.3f} "
            f"({row.version_reward_gain:+.3f}) | {reach} | {row.train_seconds:.0f} | "
            f"{_percent(row.trainer_idle_share)} | {_percent(row.sampler_idle_share)} | {lags} | "
            f"{_percent(row.capped_share)} / {_percent(row.masked_share)} | {gaps} | {row.probe_ms_mean:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_table(figures: Sequence[RunFigures], steps: dict[str, list[StepMetrics]], path: Path) -> Path:
    """Reward per step of every run; the sampler-versus-learner gap by lag of every run (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, gap) = plt.subplots(1, 2, figsize=(13, 4.2))
    for row in figures:
        metrics = steps[row.name]
        reward.plot([m.step for m in metrics], [m.reward_mean for m in metrics], marker=".", label=row.name)
        lags = [int(lag) for lag in row.gap_by_lag]
        gap.plot(lags, [max(row.gap_by_lag[str(lag)], 1e-9) for lag in lags], marker="o", label=row.name)
    reward.set(title="mean reward per step", xlabel="step", ylabel="reward", ylim=(0, 1))
    reward.legend(fontsize=7)
    gap.set(title="|learner - sampler| per sampled token, by lag", xlabel="lag (pushes behind the trainer)",
            ylabel="nats (mean)", yscale="log")  # fmt: skip
    gap.legend(fontsize=7)
    figure.suptitle("TRL's GRPOTrainer on the gym, collection running ahead (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _percent(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{100 * share:.1f}%"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value
