"""`ngt train-demo`'s run: a hooked dev-mode vLLM on a copy of the model, the non_ascii gym, GRPOTrainer on the CPU,
the records, per-step metrics and a plot under one directory."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from transformers import PrinterCallback

from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.train.logprob_gap import GapFigures, total
from nemo_gym_tok.train.plot import plot_steps
from nemo_gym_tok.train.prompts import PromptRows
from nemo_gym_tok.train.rollout import GymRollout
from nemo_gym_tok.train.step_metrics import StepMetrics, append_metrics
from nemo_gym_tok.train.text_pipeline import TextPipelineFigures
from nemo_gym_tok.train.trainer import TrainingPlan, grpo_trainer, load_policy
from nemo_gym_tok.vllm_server import VLLMServer
from nemo_gym_tok.weights import PROBE_TOKEN_IDS, Replica

REPO_ROOT = Path(__file__).resolve().parents[2]
GYM_CONFIG = REPO_ROOT / "configs" / "train_demo.yaml"
ROWS_FILE = REPO_ROOT / "resources_servers" / "non_ascii" / "data" / "example.jsonl"
AGENT = "non_ascii_agent"
SERVED_MODEL_NAME = "tiny-qwen3-train"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "train-demo.png"
TRL_LOG_FILE = "trl-log.jsonl"
FRESH_ENTRIES = ("records", "checkpoints", "served-model", "trainer", METRICS_FILE, PLOT_FILE, TRL_LOG_FILE, "vllm.log")
"""What a run writes under its directory: removed first, so each run starts clean."""
GAP_TARGET = 0.01
REWARD_GAIN_TARGET = 0.2
WINDOW = 5


def _on_policy_gap(metrics: StepMetrics) -> float:
    if metrics.correction is None or not metrics.correction.by_lag:
        return metrics.exact["free"].mean
    return metrics.correction.by_lag[0].mean if 0 in metrics.correction.by_lag else math.nan


def vllm_args(dtype: str) -> tuple[str, ...]:
    """The served model's flags: `dtype` (float32 keeps the sampler's log probs equal to the float32 learner's),
    eager mode, and no chunked prefill (vLLM's CPU engine and seeded requests, see nemo_gym_tok.vllm_server)."""
    return (
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "4096",
        "--no-enable-chunked-prefill",
        "--seed",
        "0",
    )


@dataclass(frozen=True)
class DemoSettings:
    model_dir: Path
    """The model trained and served (a copy is served; the checkpoints are pushed over it)."""
    output_dir: Path
    plan: TrainingPlan = TrainingPlan()
    served_dtype: str = "float32"
    text_pipeline: bool = True


@dataclass
class DemoResult:
    """The run's steps and what they say about the targets."""

    metrics: list[StepMetrics]
    seconds: float
    setup_seconds: float
    files: dict[str, Path] = field(default_factory=dict)
    train_seconds: float = math.nan
    """trainer.train() alone: the window the idle shares are of."""
    sampler_busy_share: float = math.nan
    """The share of the training window the collector spent collecting."""

    def window(self, last: bool) -> float:
        rewards = [m.reward_mean for m in self.metrics]
        chosen = rewards[-WINDOW:] if last else rewards[:WINDOW]
        return sum(chosen) / len(chosen) if chosen else math.nan

    @property
    def reward_gain(self) -> float:
        return self.window(True) - self.window(False)

    @property
    def worst_exact_gap(self) -> float:
        """The largest per-step mean free-turn gap over the tokens the trainer's own weights drew (lag 0: every token
        of the synchronous loop; an older token's gap is the policy's move, not the pipeline's)."""
        gaps = [gap for gap in map(_on_policy_gap, self.metrics) if not math.isnan(gap)]  # steps with lag-0 tokens
        return max(gaps, default=math.nan)

    def exact_total(self) -> GapFigures:
        """Free turns over every step."""
        return total(m.exact["free"] for m in self.metrics)

    def text_total(self) -> TextPipelineFigures | None:
        """The text pipeline over every step (None when not measured)."""
        texts = [m.text for m in self.metrics if m.text is not None]
        return sum(texts, TextPipelineFigures()) if texts else None

    def summary(self, time_limit: float) -> str:
        """What `ngt train-demo` prints at the end: the figures over the run, the targets, the files."""
        exact = self.exact_total()
        episodes = sum(m.episodes for m in self.metrics)
        lines = [
            f"reward: first {WINDOW} steps {self.window(False):.3f}, last {WINDOW} steps {self.window(True):.3f} "
            f"(gain {self.reward_gain:+.3f}) over {len(self.metrics)} steps, {episodes} episodes",
            f"exact ids, free turns ({exact.tokens} sampled tokens): gap mean {exact.mean:.2e} nats, max "
            f"{exact.max:.2e}; worst step mean {self.worst_exact_gap:.2e}; clipped by a 0.2 ratio clip "
            f"{100 * exact.clip_share:.1f}%",
        ]
        text = self.text_total()
        if text is not None:
            lines.append(
                f"text pipeline (final messages re-rendered, re-tokenized), same episodes and weights: "
                f"{100 * text.differing_share:.1f}% of sampled positions carry another id, gap mean "
                f"{text.gap.mean:.3f} nats, max {text.gap.max:.2f}; clipped {100 * text.gap.clip_share:.1f}%"
            )
        pushes = [m.push_seconds for m in self.metrics]
        if pushes:
            probe = sum(m.probe_seconds for m in self.metrics) / len(self.metrics)
            step_seconds = self.train_seconds / len(self.metrics)
            lines.append(
                f"weight push: {sum(pushes) / len(pushes):.2f} s mean, {max(pushes):.2f} s max; its probe "
                f"{1000 * probe:.0f} ms mean ({100 * probe / step_seconds:.2f}% of a step)"
            )
        contiguous = sum(m.contiguous for m in self.metrics)
        lines.append(f"token-contiguous episodes: {contiguous}/{episodes}")
        lines.append(f"time: {self.seconds:.0f} s ({self.setup_seconds:.0f} s start-up)")
        lines += [f"target {'met' if ok else 'MISSED'}: {name}" for name, ok in self.targets(time_limit).items()]
        lines += [f"{name}: {path}" for name, path in self.files.items()]
        return "\n".join(lines)

    def targets(self, time_limit: float) -> dict[str, bool]:
        return {
            f"reward: last {WINDOW} steps >= first {WINDOW} + {REWARD_GAIN_TARGET}": self.reward_gain
            >= REWARD_GAIN_TARGET,
            "every episode token-contiguous": bool(self.metrics)
            and all(m.contiguous == m.episodes for m in self.metrics),
            f"exact gap of the tokens the trainer's own weights drew <= {GAP_TARGET} nats mean at every step": (
                self.worst_exact_gap <= GAP_TARGET
            ),
            f"wall time <= {time_limit:.0f} s, vLLM's start included": self.seconds <= time_limit,
        }


@dataclass
class DemoServers:
    """A hooked dev-mode vLLM on a copy of the model and the train gym, for one or several runs."""

    vllm: VLLMServer
    gym: Gym

    @property
    def agent_url(self) -> str:
        return self.gym.urls[AGENT]


@contextmanager
def demo_servers(settings: DemoSettings, out: Path, say: Callable[[str], None] = print) -> Iterator[DemoServers]:
    """Start vLLM (serving `settings.served_dtype`, weight routes on) on `out/served-model` and the gym; both stopped
    on the way out."""
    served = out / "served-model"
    shutil.rmtree(served, ignore_errors=True)
    shutil.copytree(settings.model_dir, served)
    say(f"starting a hooked vLLM ({settings.served_dtype}, weight routes on) on a copy of {settings.model_dir}...")
    vllm = VLLMServer(
        served,
        served_model_name=SERVED_MODEL_NAME,
        extra_args=vllm_args(settings.served_dtype),
        env={DEV_MODE_ENV: "1"},
        log_path=out / "vllm.log",
    ).start()
    try:
        with httpx.Client(timeout=300) as http:  # vLLM's first prompt-log-prob request is slow: not the first probe's
            Replica(vllm.base_url, http).prompt_log_probs(PROBE_TOKEN_IDS, SERVED_MODEL_NAME)
        overrides = [
            f"policy_base_url={vllm.base_url}/v1",
            f"policy_model_name={SERVED_MODEL_NAME}",
            "head_server.port=0",
        ]
        with Gym(load_config([GYM_CONFIG], overrides)) as gym:
            yield DemoServers(vllm, gym)
    finally:
        vllm.stop()


def clean_output(out: Path, entries: Sequence[str]) -> None:
    """Remove what an earlier run wrote under `out`, so a run starts clean."""
    out.mkdir(parents=True, exist_ok=True)
    for name in entries:
        entry = out / name
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def train_once(
    servers: DemoServers,
    settings: DemoSettings,
    out: Path,
    *,
    label_prefix: str = "",
    say: Callable[[str], None] = print,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> DemoResult:
    """One training run on running servers, from the model's initial weights (the first push puts them back):
    records, metrics.jsonl and TRL's log under `out`. Pushes are labelled `label_prefix + step`."""
    started = time.monotonic()
    metrics_path = out / METRICS_FILE

    def step_done(metrics: StepMetrics) -> None:
        append_metrics(metrics_path, metrics)
        if on_step is not None:
            on_step(metrics)

    plan = settings.plan
    model, tokenizer = load_policy(settings.model_dir)
    rows = PromptRows(read_jsonl(ROWS_FILE))
    rollout = GymRollout(
        rows,
        agent_url=servers.agent_url,
        vllm_urls=[servers.vllm.base_url],
        model_dir=settings.model_dir,
        tokenizer=tokenizer,
        work_dir=out,
        agent=AGENT,
        auth_token=servers.gym.auth_token,
        version_label=lambda step: f"{label_prefix}{step}",
        text_pipeline=settings.text_pipeline,
        on_step=step_done,
        schedule=plan.schedule(rows),
        max_staleness=plan.max_staleness,
        correction=plan.correction,
        pause_mode=plan.pause_mode,
    )
    trainer = grpo_trainer(model, tokenizer, rows, rollout, plan, out / "trainer")
    say(
        f"training {plan.steps} steps of {plan.episodes_per_step} episodes ({plan.prompts_per_step} prompts x "
        f"{plan.num_generations}), staleness {plan.max_staleness}, correction {plan.correction.describe()}, "
        f"pauses {plan.pause_mode}"
    )
    trainer.remove_callback(PrinterCallback)  # the step lines are ours; TRL's own logs go to a file
    training_started = time.monotonic()
    try:
        trainer.train()
    finally:
        rollout.close()
    ended = time.monotonic()
    result = DemoResult(rollout.metrics, ended - started, 0.0)
    result.train_seconds = ended - training_started
    if rollout.collector is not None and rollout.collector.started_at is not None:
        window = ended - rollout.collector.started_at
        result.sampler_busy_share = rollout.collector.busy_seconds(ended) / window if window > 0 else math.nan
    trl_log = out / TRL_LOG_FILE
    trl_log.write_text("".join(json.dumps(entry) + "\n" for entry in trainer.state.log_history), encoding="utf-8")
    result.files = {"records": rollout.records_dir, "metrics": metrics_path, "TRL's log": trl_log}
    shutil.rmtree(rollout.checkpoints_dir, ignore_errors=True)
    return result


def run_train_demo(
    settings: DemoSettings,
    *,
    say: Callable[[str], None] = print,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> DemoResult:
    """Start vLLM and the gym, train, write records, metrics and the plot; servers stopped on the way out."""
    started = time.monotonic()
    out = settings.output_dir
    clean_output(out, FRESH_ENTRIES)
    with demo_servers(settings, out, say) as servers:
        setup_seconds = time.monotonic() - started
        say(f"servers up ({setup_seconds:.0f} s)")
        result = train_once(servers, settings, out, say=say, on_step=on_step)
    result.seconds, result.setup_seconds = time.monotonic() - started, setup_seconds
    if result.metrics:
        result.files["plot"] = plot_steps(result.metrics, out / PLOT_FILE)
    return result
