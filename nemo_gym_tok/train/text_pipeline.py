"""What a text pipeline would feed the learner: the final messages re-rendered and re-tokenized, turn by turn against
the ids the sampler drew."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nemo_gym_tok.records.logprob_check import NaiveSequence, changed_positions
from nemo_gym_tok.records.training import TrainingSequence
from nemo_gym_tok.train.logprob_gap import CLIP_EPSILON, GapFigures, gap_figures, turn_kind


@dataclass(frozen=True)
class TextPipelineFigures:
    """Over the generated positions of an episode's free turns: how many the re-rendered sequence puts another id at
    (a position past the end of its re-rendered turn counts), and the gap where both have a position: the sampler's
    log prob of the id it drew against the learner's log prob of whatever id the re-rendered sequence holds there."""

    positions: int = 0
    differing: int = 0
    gap: GapFigures = field(default_factory=GapFigures)

    @property
    def differing_share(self) -> float:
        return self.differing / self.positions if self.positions else float("nan")

    def __add__(self, other: TextPipelineFigures) -> TextPipelineFigures:
        return TextPipelineFigures(
            self.positions + other.positions, self.differing + other.differing, self.gap + other.gap
        )


def compared_positions(sequence: TrainingSequence, naive: NaiveSequence) -> list[int]:
    """The positions of `naive.token_ids` that `text_pipeline_figures` reads the learner's log probs at."""
    wanted: list[int] = []
    for index, (start, end) in enumerate(sequence.turns):
        if turn_kind(sequence, index) == "free" and index < len(naive.spans):
            naive_start, naive_end = naive.spans[index]
            wanted += range(max(naive_start, 1), min(naive_end, naive_start + end - start))
    return wanted


def text_pipeline_figures(
    sequence: TrainingSequence,
    naive: NaiveSequence,
    naive_learner: Sequence[float],
    epsilon: float = CLIP_EPSILON,
) -> TextPipelineFigures:
    """Turn k of `sequence` against assistant span k of `naive` (the k-th assistant message re-rendered), position by
    position from the start of each; `naive_learner[i]` is the learner's log prob of `naive.token_ids[i]` given the
    ids before it. Only free turns count (a constrained turn's sampler log probs are of another distribution).
    Raises ValueError when the re-rendering has fewer assistant spans than the sequence has turns."""
    if len(naive_learner) != len(naive.token_ids):
        raise ValueError(f"{len(naive_learner)} learner log probs for a naive sequence of {len(naive.token_ids)} ids")
    if len(naive.spans) < len(sequence.turns):
        raise ValueError(f"the re-rendering has {len(naive.spans)} assistant turns, the episode {len(sequence.turns)}")
    result = TextPipelineFigures()
    for index, (start, end) in enumerate(sequence.turns):
        if turn_kind(sequence, index) != "free":
            continue
        naive_start, naive_end = naive.spans[index]
        # As many positions as were generated: a template's end marker after a turn cut by max_tokens was never sampled.
        naive_end = min(naive_end, naive_start + end - start)
        aligned = naive_end - naive_start
        result = result + TextPipelineFigures(
            positions=end - start,
            differing=changed_positions(sequence.token_ids[start:end], naive.token_ids[naive_start:naive_end]),
            gap=gap_figures(sequence.log_probs[start : start + aligned], naive_learner[naive_start:naive_end], epsilon),
        )
    return result
