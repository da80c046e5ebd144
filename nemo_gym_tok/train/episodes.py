"""One episode as GRPOTrainer's rollout_func returns it: first prompt, everything after it, who supplied each id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.records.training import TrainingSequence

SUPPLIED_LOG_PROB = 0.0
"""The log prob given where the model did not sample (env_mask 0): what TrainingSequence.log_probs holds there; TRL
multiplies it by the mask wherever it reads it."""


@dataclass(frozen=True)
class Episode:
    """`prompt_ids` are the first model call's prompt; `completion_ids` every id after it (generated turns, user turns,
    tool results and template text alike); `env_mask[i]` is 1 where the model sampled `completion_ids[i]` and 0 where
    the environment or the template supplied it; `logprobs[i]` is the sampler's log prob where `env_mask[i]` is 1,
    `SUPPLIED_LOG_PROB` elsewhere."""

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float]
    reward: float


def episode_from_sequence(sequence: TrainingSequence) -> Episode:
    """Split a training sequence at the end of its first prompt. Raises ValueError for a sequence without a
    generated id (nothing to learn from) or without a reward."""
    if not sequence.turns:
        raise ValueError("the episode has no model turn: nothing was sampled")
    if sequence.reward is None:
        raise ValueError("the episode has no reward: its environment's /verify gave none")
    start = sequence.turns[0][0]
    mask = list(sequence.loss_mask[start:])
    logprobs = [lp if sampled else SUPPLIED_LOG_PROB for lp, sampled in zip(sequence.log_probs[start:], mask)]
    return Episode(
        prompt_ids=list(sequence.token_ids[:start]),
        completion_ids=list(sequence.token_ids[start:]),
        env_mask=mask,
        logprobs=logprobs,
        reward=float(sequence.reward),
    )


def rollout_output(episodes: Sequence[Episode], reward_key: str) -> dict[str, Any]:
    """The dict GRPOTrainer expects from a rollout_func: one entry per episode under each key, the reward under
    `reward_key` (an extra key TRL hands to the reward functions)."""
    return {
        "prompt_ids": [episode.prompt_ids for episode in episodes],
        "completion_ids": [episode.completion_ids for episode in episodes],
        "env_mask": [episode.env_mask for episode in episodes],
        "logprobs": [episode.logprobs for episode in episodes],
        reward_key: [episode.reward for episode in episodes],
    }
