"""GRPOTrainer's rollout_func over a running gym: push the trainer's weights, collect through the agent, check every
episode is exact and on-policy, measure the log-prob gaps, hand TRL the episodes."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.records.contiguity import NotContiguousError
from nemo_gym_tok.records.logprob_check import naive_sequence
from nemo_gym_tok.records.training import TrainingSequence, rollout_to_training_sequence
from nemo_gym_tok.train.checkpoints import save_checkpoint
from nemo_gym_tok.train.episodes import episode_from_sequence, rollout_output
from nemo_gym_tok.train.learner_logprobs import learner_log_probs
from nemo_gym_tok.train.logprob_gap import KINDS, GapFigures, exact_gap, sampled_positions
from nemo_gym_tok.train.prompts import PromptRows
from nemo_gym_tok.train.reward import REWARD_KEY
from nemo_gym_tok.train.step_collect import collect_step
from nemo_gym_tok.train.step_metrics import StepMetrics
from nemo_gym_tok.train.text_pipeline import TextPipelineFigures, compared_positions, text_pipeline_figures
from nemo_gym_tok.train.weight_check import check_weight_versions
from nemo_gym_tok.weights import push_weights


class EpisodeNotContiguousError(RuntimeError):
    """An episode's ids are not one sequence the model saw: it cannot be trained on exactly, so the step is refused."""


class GymRollout:
    """`rollout_func(prompts, trainer)` for TRL's GRPOTrainer, on a gym that is already running.

    Per call (one per optimizer step, the prompts already repeated num_generations times): the trainer's model is
    saved to `work_dir/checkpoints/step-N` and pushed to every vLLM in `vllm_urls` as version `version_label(N)`
    (N = trainer.state.global_step), each prompt's row is collected through the agent at `agent_url` into
    `work_dir/records/step-NNN.jsonl`, every episode must be token-contiguous and every turn sampled by that version
    (errors otherwise), and the episodes are returned as TRL wants them (`prompt_ids`, `completion_ids`, `env_mask`,
    `logprobs`, and the reward under `REWARD_KEY` for `gym_reward`). Each step's `StepMetrics` go to `on_step`.
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
    ) -> None:
        if keep_checkpoints < 2:
            raise ValueError(
                "keep_checkpoints must be at least 2: a failed push rolls the servers back to the last one"
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
        self.metrics: list[StepMetrics] = []
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
        self.push(model, step, version)
        pushed = time.perf_counter()
        rows = [self.rows.row_for(prompt) for prompt in prompts]
        records = collect_step(
            rows,
            self.records_dir / f"step-{step:03d}.jsonl",
            self.agent_url,
            agent=self.agent,
            timeout=self.collect_timeout,
            auth_token=self.auth_token,
        )
        collected = time.perf_counter()
        sequences = self.exact_sequences(records)
        check_weight_versions([(f"episode {index}", s) for index, s in enumerate(sequences)], version)
        episodes = [episode_from_sequence(sequence) for sequence in sequences]
        exact, text, notes = self.measure(model, records, sequences)
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
            collect_seconds=collected - pushed,
            measure_seconds=time.perf_counter() - collected,
            notes=notes,
        )
        self.metrics.append(metrics)
        if self.on_step is not None:
            self.on_step(metrics)
        return rollout_output(episodes, REWARD_KEY)

    def push(self, model: Any, step: int, version: str) -> None:
        """Save the model as step `step`'s checkpoint and push it to every server as `version` (all or none)."""
        checkpoint = save_checkpoint(model, self.model_dir, self.checkpoints_dir / f"step-{step}")
        push_weights(self.vllm_urls, checkpoint, version=version, api_key=self.vllm_api_key)
        self._checkpoints.append(checkpoint)
        # The servers load from the latest; the one before stays for a rollback of the next push.
        while len(self._checkpoints) > self.keep_checkpoints:
            shutil.rmtree(self._checkpoints.pop(0), ignore_errors=True)

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

    def measure(
        self, model: Any, records: list[dict[str, Any]], sequences: list[TrainingSequence]
    ) -> tuple[dict[str, GapFigures], TextPipelineFigures | None, list[str]]:
        """The learner's log probs (float32, no gradient) along the exact ids against the sampler's, per turn kind;
        with `text_pipeline`, the same along each episode's re-rendered final messages; and notes on episodes left
        out of the latter."""
        exact = {kind: GapFigures() for kind in KINDS}
        learner = learner_log_probs(model, [s.token_ids for s in sequences], [sampled_positions(s) for s in sequences])
        for sequence, scores in zip(sequences, learner):
            for kind, figures in exact_gap(sequence, scores).items():
                exact[kind] = exact[kind] + figures
        if not self.text_pipeline:
            return exact, None, []
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
        return exact, text, notes
