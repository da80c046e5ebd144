"""Turns a rollout record into one training sequence: token ids, loss mask, aligned log probs, turn spans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_gym_tok.contract.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY
from nemo_gym_tok.records.contiguity import BundledTurn, Decode, bundled_turns, check_contiguous, segments


@dataclass(frozen=True)
class TrainingSequence:
    """Framework-neutral: plain lists a trainer turns into tensors.

    `loss_mask[i]` is 1 where `token_ids[i]` was sampled by the model, 0 for everything the prompt supplied
    (system/user turns, tool results, template text, and the terminator a template adds after a turn cut by
    max_tokens). `log_probs[i]` is the sampling log prob where the mask is 1 and 0.0 elsewhere.

    A turn decoded under a grammar (`constrained_by` non-empty) reports log probs of the grammar-masked distribution,
    not of the model's: see docs/training.md before using them in importance ratios.
    """

    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    turns: list[tuple[int, int]]
    """[start, end) of each model call's generated ids in `token_ids`."""
    reward: float | None
    constrained_by: list[list[str] | None] = field(default_factory=list)
    """Per turn (as `turns`): what constrained its decoding (`["tool_choice:required"]`, ...), [] for a free turn,
    None where the record does not say (written before the field existed): unknown, not free."""
    forced_mask: list[int] | None = None
    """1 where `token_ids[i]` was generated in a constrained turn and forced by its grammar (log prob exactly 0.0),
    0 elsewhere (prompt ids included); None when a turn of the sequence has no mask (an older record)."""
    weight_versions: list[str | None] = field(default_factory=list)
    """Per turn (as `turns`): the vLLM weight version that sampled its first generated id; None where unknown (an
    older record, a server that could not say). Never a guess: see docs/training.md#weight-versions."""
    weight_version_spans: list[list[dict[str, Any]] | None] = field(default_factory=list)
    """Per turn: None, or where its generated ids span several versions, `[{version, start, end}]` with start and
    end counted in the turn's generated ids (add `turns[k][0]` for positions in `token_ids`)."""

    @property
    def spans_weight_versions(self) -> bool:
        """More than one weight version sampled this sequence's ids (turns with different versions, or a turn whose
        ids span several): its log probs are not all of one policy. Unknown turns do not count."""
        known = {v for v in self.weight_versions if v is not None}
        known |= {span["version"] for spans in self.weight_version_spans if spans for span in spans}
        return len(known) > 1 or any(self.weight_version_spans)

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

    Reads records of schema_version 1 and 2 alike (2 stores prompts packed; see nemo_gym_tok.records.rollout_record) and
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
    output = (record.get("response") or {}).get("output") or []
    return [_sequence(segment, float(reward) if reward is not None else None, output) for segment in segments(turns)]


def _sequence(turns: list[BundledTurn], reward: float | None, output: list[Any]) -> TrainingSequence:
    # A call whose splice replaced the previous final end token (GPT-OSS <|return|>) was conditioned on the
    # template's closing at that position; the sequence keeps the sampled id there, with its log prob.
    token_ids: list[int] = []
    loss_mask: list[int] = []
    log_probs: list[float] = []
    spans: list[tuple[int, int]] = []
    constraints: list[list[str] | None] = []
    forced: list[int] | None = []
    versions: list[str | None] = []
    version_spans: list[list[dict[str, Any]] | None] = []
    for turn in turns:
        versions.append(turn.weight_version)
        version_spans.append(turn.weight_version_spans)
        # The constraint fields stay on the bundled item as written (version 2 packing leaves them alone), at the
        # same output index as the full-prompt item bundled_turns read.
        item = output[turn.item_index]
        labels, mask = item.get(CONSTRAINED_BY_KEY), item.get(FORCED_MASK_KEY)
        constraints.append(list(labels) if isinstance(labels, list) else None)
        supplied = turn.prompt_token_ids[len(token_ids) :]
        if forced is not None and isinstance(mask, list) and len(mask) == len(turn.generation_token_ids):
            forced += [0] * len(supplied) + [int(flag) for flag in mask]
        else:
            forced = None  # one turn that does not say makes the whole sequence's mask unknown
        token_ids += supplied
        loss_mask += [0] * len(supplied)
        log_probs += [0.0] * len(supplied)
        start = len(token_ids)
        token_ids += turn.generation_token_ids
        loss_mask += [1] * len(turn.generation_token_ids)
        log_probs += turn.generation_log_probs
        spans.append((start, len(token_ids)))
    return TrainingSequence(
        token_ids, loss_mask, log_probs, spans, reward, constraints, forced, versions, version_spans
    )
