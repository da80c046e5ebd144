"""Turns a rollout record into one training sequence: token ids, loss mask, aligned log probs, turn spans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.contiguity import BundledTurn, Decode, bundled_turns, check_contiguous, segments


@dataclass(frozen=True)
class TrainingSequence:
    """Framework-neutral: plain lists a trainer turns into tensors.

    `loss_mask[i]` is 1 where `token_ids[i]` was sampled by the model, 0 for everything the prompt supplied
    (system/user turns, tool results, template text, and the terminator a template adds after a turn cut by
    max_tokens). `log_probs[i]` is the sampling log prob where the mask is 1 and 0.0 elsewhere.
    """

    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    turns: list[tuple[int, int]]
    """[start, end) of each model call's generated ids in `token_ids`."""
    reward: float | None

    def __len__(self) -> int:
        return len(self.token_ids)


class NoTokenBundlesError(ValueError):
    """The record has no token bundles: collect with the adapter's `return_token_id_information: true`."""


class SeveralSegmentsError(ValueError):
    """The episode restarted its token sequence (`start_token_segment`): use rollout_to_training_sequences."""


def rollout_to_training_sequence(record: dict[str, Any], decode: Decode | None = None) -> TrainingSequence:
    """The whole episode as one sequence; raises NotContiguousError (first differing position, decoded context).

    An episode whose harness started a new token segment has one sequence per segment: this raises
    SeveralSegmentsError for it; `rollout_to_training_sequences` returns them all.
    """
    sequences = rollout_to_training_sequences(record, decode)
    if len(sequences) > 1:
        raise SeveralSegmentsError(
            f"the rollout has {len(sequences)} token segments (its harness sent start_token_segment); "
            "use rollout_to_training_sequences, which returns one sequence per segment"
        )
    return sequences[0]


def rollout_to_training_sequences(record: dict[str, Any], decode: Decode | None = None) -> list[TrainingSequence]:
    """One sequence per token segment of the episode (one for an episode that never restarted its ids).

    Reads records of schema_version 1 and 2 alike (2 stores prompts packed; see nemo_gym_tok.rollout_record) and
    raises UnknownSchemaVersionError, naming the version, for any other.
    """
    turns = bundled_turns(record)
    if not turns:
        raise NoTokenBundlesError(
            "the rollout has no token bundles; collect it through a vllm_model adapter with "
            "return_token_id_information: true"
        )
    check_contiguous(turns, decode)
    reward = record.get("reward")
    return [_sequence(segment, float(reward) if reward is not None else None) for segment in segments(turns)]


def _sequence(turns: list[BundledTurn], reward: float | None) -> TrainingSequence:
    # A call whose splice replaced the previous final end token (GPT-OSS <|return|>) was conditioned on the
    # template's closing at that position; the sequence keeps the sampled id there, with its log prob.
    token_ids: list[int] = []
    loss_mask: list[int] = []
    log_probs: list[float] = []
    spans: list[tuple[int, int]] = []
    for turn in turns:
        supplied = turn.prompt_token_ids[len(token_ids):]
        token_ids += supplied
        loss_mask += [0] * len(supplied)
        log_probs += [0.0] * len(supplied)
        start = len(token_ids)
        token_ids += turn.generation_token_ids
        loss_mask += [1] * len(turn.generation_token_ids)
        log_probs += turn.generation_log_probs
        spans.append((start, len(token_ids)))
    return TrainingSequence(token_ids, loss_mask, log_probs, spans, reward)
