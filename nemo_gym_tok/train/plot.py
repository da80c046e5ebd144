"""The train demo's figure: reward per step, and the log-prob gap and clip share of the exact ids beside the text
pipeline's."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from nemo_gym_tok.train.step_metrics import StepMetrics


def plot_steps(metrics: Sequence[StepMetrics], path: Path, title: str = "TRL's GRPOTrainer on the gym (CPU)") -> Path:
    """Write a PNG of three panels (reward; gap mean per token, log scale; share of tokens a 0.2 clip would clip)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m.step for m in metrics]
    figure, (reward, gap, clip) = plt.subplots(1, 3, figsize=(15, 4.2))
    reward.plot(steps, [m.reward_mean for m in metrics], marker="o", color="tab:green")
    reward.set(title="mean reward per step", xlabel="step", ylabel="reward", ylim=(0, 1))

    floor = 1e-9  # a gap of exactly 0 on a log axis
    exact_mean = [max(m.exact["free"].mean, floor) for m in metrics]
    exact_max = [max(m.exact["free"].max, floor) for m in metrics]
    gap.plot(steps, exact_mean, marker="o", color="tab:blue", label="exact ids: mean")
    gap.plot(steps, exact_max, linestyle="--", color="tab:blue", label="exact ids: max")
    texts = [m for m in metrics if m.text is not None]
    if texts:
        gap.plot([m.step for m in texts], [m.text.gap.mean for m in texts], marker="s", color="tab:red",
                 label="text pipeline: mean")  # fmt: skip
        gap.plot([m.step for m in texts], [m.text.gap.max for m in texts], linestyle="--", color="tab:red",
                 label="text pipeline: max")  # fmt: skip
    gap.axhline(0.01, color="grey", linewidth=0.8, linestyle=":", label="0.01 nats")
    gap.set(title="|learner - sampler| log prob per sampled token", xlabel="step", ylabel="nats", yscale="log")
    gap.legend(fontsize=7, loc="center right")

    clip.plot(steps, [_share(m.exact["free"].clip_share) for m in metrics], marker="o", color="tab:blue",
              label="exact ids")  # fmt: skip
    if texts:
        clip.plot([m.step for m in texts], [_share(m.text.gap.clip_share) for m in texts], marker="s",
                  color="tab:red", label="text pipeline")  # fmt: skip
    clip.set(title="share of tokens outside the ratio clip [0.8, 1.2]", xlabel="step", ylabel="share", ylim=(0, 1))
    clip.legend(fontsize=7, loc="upper right")

    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _share(value: float) -> float:
    return 0.0 if math.isnan(value) else value
