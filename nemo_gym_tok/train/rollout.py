"""GRPOTrainer's rollout_func over a running gym: push the trainer's weights (proven on every server), take the
step's episodes (collected on demand, or ahead of the trainer within a staleness bound), check every token is exact
and knows its weights, weigh the off-policy ones, measure the log-prob gaps, hand TRL the episodes."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.records.contiguity import NotContiguousError
from nemo_gym_tok.records.logprob_check import naive_sequence
from nemo_gym_tok.records.training import TrainingSequence, rollout_to_training_sequence
from nemo_gym_tok.train.ahead import AheadCollector
from nemo_gym_tok.train.checkpoints import save_checkpoint
from nemo_gym_tok.train.correction import Correction, CorrectionFigures, loss_fields, token_weights
from nemo_gym_tok.train.episodes import episode_from_sequence, rollout_output
from nemo_gym_tok.train.learner_logprobs import learner_log_probs
from nemo_gym_tok.train.logprob_gap import KINDS, GapFigures, exact_gap, sampled_positions
from nemo_gym_tok.train.prompts import PromptRows, prompt_key, prompt_of
from nemo_gym_tok.train.reward import REWARD_KEY
from nemo_gym_tok.train.staleness import PushLog, lag_counts, token_lags
from nemo_gym_tok.train.step_collect import collect_step
from nemo_gym_tok.train.step_metrics import StepMetrics
from nemo_gym_tok.train.text_pipeline import TextPipelineFigures, compared_positions, text_pipeline_figures
from nemo_gym_tok.weights import (
    PROBE_TOKEN_IDS,
    PauseMode,
    WeightProbe,
    WeightPushError,
    expected_log_probs,
    push_weights,
)

DEFAULT_PROBE_BOUND = 0.01
"""Nats, mean over the probe's ids: a float32 server matches the float32 trainer to about 0.001 (docs/training.md)."""


class EpisodeNotContiguousError(RuntimeError):
    """An episode's ids are not one sequence the model saw: it cannot be trained on exactly, so the step is refused."""


class ScheduleMismatchError(RuntimeError):
    """TRL asked for other prompts than the schedule the collection ran ahead along."""


class GymRollout:
    """`rollout_func(prompts, trainer)` for TRL's GRPOTrainer, on a gym that is already running.

    Per call (one per optimizer step, the prompts already repeated num_generations times): the trainer's model is
    saved to `work_dir/checkpoints/step-N` and pushed to every vLLM in `vllm_urls` as version `version_label(N)`
    (N = trainer.state.global_step; `pause_mode` as push_weights takes it), each server proven by a log-prob probe
    against the trainer's own (`probe_bound` nats mean; None: no probe). The step's episodes are then collected
    through the agent at `agent_url` into `work_dir/records/step-NNN.jsonl`: on demand, or, given a `schedule` (the
    rows of every step, `PromptRows.schedule`), by a collector that runs up to `max_staleness` steps ahead of the
    trainer. Every episode must be token-contiguous and every sampled token's weights known, pushed by this run and
    at most `max_staleness` pushes behind the trainer's (errors otherwise); `correction` weighs the tokens of older
    weights. The episodes go to TRL as it wants them (`prompt_ids`, `completion_ids`, `env_mask`, `logprobs`, the
    reward under `REWARD_KEY`, and with token TIS the weights under `TOKEN_WEIGHT_KEY` for CorrectedGRPOTrainer).
    Each step's `StepMetrics` go to `on_step`. `close()` stops a collector running ahead.
    """

    def __init__(
        self,
        rows: PromptRows,
        *,
        agent_url: str,
        vllm_urls: Sequence[str],
        model_dir: str | Path,
        tokenizer: Any,
        work_dir: str | Path,
        agent: str | None = None,
        auth_token: str | None = None,
        vllm_api_key: str | None = None,
        version_label: Callable[[int], str] = str,
        keep_checkpoints: int = 2,
        text_pipeline: bool = True,
        on_step: Callable[[StepMetrics], None] | None = None,
        collect_timeout: float = 600.0,
        schedule: Sequence[Sequence[dict[str, Any]]] | None = None,
        max_staleness: int = 0,
        correction: Correction = Correction("none"),
        pause_mode: PauseMode = "wait",
        probe_bound: float | None = DEFAULT_PROBE_BOUND,
    ) -> None:
        if keep_checkpoints < 2:
            raise ValueError(
                "keep_checkpoints must be at least 2: a failed push rolls the servers back to the last one"
            )
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_staleness and schedule is None:
            raise ValueError(
                "max_staleness > 0 needs the schedule of the rows each step trains on (PromptRows.schedule): "
                "collection can run ahead only along a known order"
            )
        self.rows = rows
        self.agent_url, self.agent, self.auth_token = agent_url, agent, auth_token
        self.vllm_urls, self.vllm_api_key = list(vllm_urls), vllm_api_key
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.work_dir = Path(work_dir)
        self.version_label = version_label
        self.keep_checkpoints = keep_checkpoints
        self.text_pipeline = text_pipeline
        self.on_step = on_step
        self.collect_timeout = collect_timeout
        self.max_staleness = max_staleness
        self.correction = correction
        self.pause_mode: PauseMode = pause_mode
        self.probe_bound = probe_bound
        self.metrics: list[StepMetrics] = []
        self.push_log = PushLog()
        self.collector = AheadCollector(schedule, self.collect_batch, max_staleness) if schedule is not None else None
        self._checkpoints: list[Path] = []

    @property
    def records_dir(self) -> Path:
        return self.work_dir / "records"

    @property
    def checkpoints_dir(self) -> Path:
        return self.work_dir / "checkpoints"

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        step = int(trainer.state.global_step)
        version = self.version_label(step)
        model = trainer.accelerator.unwrap_model(trainer.model)

        started = time.perf_counter()
        probe_seconds = self.push(model, step, version)
        pushed = time.perf_counter()
        records, collect_seconds = self.episodes_of(step, prompts)
        collected = time.perf_counter()
        sequences = self.exact_sequences(records)
        lags = [token_lags(s, self.push_log, version, self.max_staleness) for s in sequences]
        episodes = [episode_from_sequence(sequence) for sequence in sequences]
        learner = learner_log_probs(model, [s.token_ids for s in sequences], [sampled_positions(s) for s in sequences])
        exact = self.exact_gaps(sequences, learner)
        weighed = [
            token_weights(self.correction, s.log_probs, scores, lag) for s, scores, lag in zip(sequences, learner, lags)
        ]
        corrections = CorrectionFigures()
        for _, figures in weighed:
            corrections.add(figures)
        text, notes = self.text_figures(model, records, sequences)
        metrics = StepMetrics(
            step=step,
            version=version,
            episodes=len(records),
            contiguous=len(sequences),
            rewards=[episode.reward for episode in episodes],
            sampled_tokens=sum(sum(episode.env_mask) for episode in episodes),
            exact=exact,
            text=text,
            push_seconds=pushed - started,
            collect_seconds=collect_seconds,
            measure_seconds=time.perf_counter() - collected,
            notes=notes,
            wait_seconds=collected - pushed,
            probe_seconds=probe_seconds,
            lags=lag_counts(lags),
            correction=corrections,
        )
        self.metrics.append(metrics)
        if self.on_step is not None:
            self.on_step(metrics)
        completions = [weights[sequence.turns[0][0] :] for (weights, _), sequence in zip(weighed, sequences)]
        return {**rollout_output(episodes, REWARD_KEY), **loss_fields(self.correction, completions)}

    def close(self) -> None:
        """Stop the collector running ahead, if any (a batch under way finishes on its own)."""
        if self.collector is not None:
            self.collector.stop()

    def push(self, model: Any, step: int, version: str) -> float:
        """Save the model as step `step`'s checkpoint and push it to every server as `version` (all or none), each
        server proven by the probe; the probe's seconds. A push refused by its probe leaves `version` marked unproven
        in the push log (a turn sampled under it in the meantime is refused) and raises."""
        checkpoint = save_checkpoint(model, self.model_dir, self.checkpoints_dir / f"step-{step}")
        probe = None
        if self.probe_bound is not None:
            probe = WeightProbe(PROBE_TOKEN_IDS, expected_log_probs(model), self.probe_bound)
        try:
            report = push_weights(
                self.vllm_urls,
                checkpoint,
                version=version,
                api_key=self.vllm_api_key,
                pause_mode=self.pause_mode,
                probe=probe,
            )
        except WeightPushError as exc:
            if exc.unproven_version is not None:
                self.push_log.failed(exc.unproven_version)
            raise
        self.push_log.pushed(version)
        self._checkpoints.append(checkpoint)
        # The servers load from the latest; the one before stays for a rollback of the next push.
        while len(self._checkpoints) > self.keep_checkpoints:
            shutil.rmtree(self._checkpoints.pop(0), ignore_errors=True)
        return report.phases.get("probe", 0.0)

    def episodes_of(self, step: int, prompts: list[Any]) -> tuple[list[dict[str, Any]], float]:
        """Step `step`'s records and the seconds their collection took: from the collector running ahead (which
        the push just allowed up to `step + max_staleness`), or collected now."""
        if self.collector is None:
            started = time.perf_counter()
            records = self.collect_batch(step, [self.rows.row_for(prompt) for prompt in prompts])
            return records, time.perf_counter() - started
        planned = [prompt_key(prompt_of(row)) for row in self.collector.schedule[step]]
        if [prompt_key(prompt) for prompt in prompts] != planned:
            raise ScheduleMismatchError(
                f"step {step}: TRL asked for other prompts than the schedule the collection runs ahead along; build "
                "the trainer with nemo_gym_tok.train.trainer.grpo_trainer (its data set is the schedule, unshuffled)"
            )
        self.collector.allow(step)
        records = self.collector.take(step)
        return records, self.collector.timings[step].seconds

    def collect_batch(self, step: int, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """One record per row through the agent, into `records/step-NNN.jsonl`."""
        return collect_step(
            rows,
            self.records_dir / f"step-{step:03d}.jsonl",
            self.agent_url,
            agent=self.agent,
            timeout=self.collect_timeout,
            auth_token=self.auth_token,
        )

    def exact_sequences(self, records: list[dict[str, Any]]) -> list[TrainingSequence]:
        """Each record's training sequence; EpisodeNotContiguousError, counting them, when any is not contiguous."""
        sequences, broken = [], []
        for index, record in enumerate(records):
            try:
                sequences.append(rollout_to_training_sequence(record, decode=self.tokenizer.decode))
            except NotContiguousError as exc:
                broken.append(f"episode {index}: {exc}")
        if broken:
            raise EpisodeNotContiguousError(
                f"{len(records) - len(broken)} of {len(records)} episodes token-contiguous; " + " | ".join(broken[:3])
            )
        return sequences

    def exact_gaps(self, sequences: list[TrainingSequence], learner: list[list[float]]) -> dict[str, GapFigures]:
        """The sampler's log probs against the learner's (float32, no gradient, at the trainer's weights) along the
        exact ids, per turn kind."""
        exact = {kind: GapFigures() for kind in KINDS}
        for sequence, scores in zip(sequences, learner):
            for kind, figures in exact_gap(sequence, scores).items():
                exact[kind] = exact[kind] + figures
        return exact

    def text_figures(
        self, model: Any, records: list[dict[str, Any]], sequences: list[TrainingSequence]
    ) -> tuple[TextPipelineFigures | None, list[str]]:
        """With `text_pipeline`, the same gap along each episode's re-rendered final messages, and notes on the
        episodes left out of it."""
        if not self.text_pipeline:
            return None, []
        pairs, notes = [], []
        for index, (record, sequence) in enumerate(zip(records, sequences)):
            try:  # a measurement: an episode the re-rendering cannot place is left out of it, and said so
                pairs.append((sequence, naive_sequence(record, self.tokenizer)))
            except (ValueError, KeyError, TypeError) as exc:
                notes.append(f"episode {index} left out of the text pipeline: {exc}")
        positions = [compared_positions(sequence, rebuilt) for sequence, rebuilt in pairs]
        scores = learner_log_probs(model, [rebuilt.token_ids for _, rebuilt in pairs], positions)
        text = TextPipelineFigures()
        for (sequence, rebuilt), learner in zip(pairs, scores):
            text = text + text_pipeline_figures(sequence, rebuilt, learner)
        return text, notes
