"""`ngt check --logprobs`: recompute recorded log probs with transformers, exact sequence vs naive re-rendering."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jsonl import iter_jsonl
from nemo_gym_tok.records.rollout_record import full_output
from nemo_gym_tok.records.training import TrainingSequence, rollout_to_training_sequences

Scorer = Callable[[Sequence[int]], list[float]]
"""Log prob of each id given the ids before it (position 0 gets 0.0): one forward pass over the sequence."""


@dataclass(frozen=True)
class TurnCheck:
    """One model call: recorded (vLLM) log probs against a recompute along the training sequence."""

    rollout: str
    turn: int
    constrained_by: list[str] | None
    """[] free, non-empty constrained, None unknown (a record written before the field existed)."""
    abs_diffs: list[float]
    recorded_sum: float
    recomputed_sum: float
    naive_changed: int | None = None
    """Generated positions whose id the naive re-rendering replaced (length mismatch counts); None: not compared."""
    naive_sum: float | None = None
    """The log-prob sum recomputed along the naive sequence over the naive turn's first as many positions as were
    generated; None: not compared."""

    @property
    def kind(self) -> str:
        if self.constrained_by is None:
            return "unknown"
        return "constrained" if self.constrained_by else "free"


@dataclass
class LogprobReport:
    """Every turn checked, plus the rollouts that could not be (why)."""

    turns: list[TurnCheck] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    naive: bool = False

    def stats(self, kind: str) -> tuple[int, int, float, float, float, float]:
        """(turns, tokens, mean |diff|, max |diff|, mean |sum diff|, max |sum diff|) over turns of `kind`."""
        turns = [turn for turn in self.turns if turn.kind == kind]
        diffs = [diff for turn in turns for diff in turn.abs_diffs]
        sums = [abs(turn.recomputed_sum - turn.recorded_sum) for turn in turns]
        return (
            len(turns),
            len(diffs),
            _mean(diffs),
            max(diffs, default=math.nan),
            _mean(sums),
            max(sums, default=math.nan),
        )

    def free_mean(self) -> float:
        return self.stats("free")[2]

    def format(self) -> str:
        lines: list[str] = []
        for rollout in dict.fromkeys(turn.rollout for turn in self.turns):
            turns = [turn for turn in self.turns if turn.rollout == rollout]
            lines.append(f"rollout {rollout}:")
            for kind in ("free", "constrained", "unknown"):
                diffs = [diff for turn in turns if turn.kind == kind for diff in turn.abs_diffs]
                if diffs:
                    lines.append(f"  {kind} tokens {len(diffs)}: mean |diff| {_mean(diffs):.4f}, max {max(diffs):.4f}")
            for turn in turns:
                label = f"constrained by {', '.join(turn.constrained_by)}" if turn.constrained_by else turn.kind
                line = (
                    f"  turn {turn.turn} ({label}): sum recorded {turn.recorded_sum:.3f}, recomputed "
                    f"{turn.recomputed_sum:.3f}, diff {turn.recomputed_sum - turn.recorded_sum:+.3f}"
                )
                if turn.naive_changed is not None and turn.naive_sum is not None:
                    line += (
                        f"; naive: {turn.naive_changed}/{len(turn.abs_diffs)} ids differ, sum {turn.naive_sum:.3f} "
                        f"(moved {turn.naive_sum - turn.recomputed_sum:+.3f})"
                    )
                lines.append(line)
        lines.append("overall:")
        for kind in ("free", "constrained", "unknown"):
            count, tokens, mean, top, sum_mean, sum_max = self.stats(kind)
            if count:
                lines.append(
                    f"  {kind} turns {count} ({tokens} tokens): mean |diff| {mean:.4f} nats, max {top:.4f}; per-turn "
                    f"sum |diff| mean {sum_mean:.3f}, max {sum_max:.3f}"
                )
        constrained = [turn for turn in self.turns if turn.kind == "constrained"]
        if constrained:
            lines.append(
                "constrained turns (vLLM reports log probs of the grammar-masked distribution; a recompute of the "
                "model's own differs by design, see docs/training.md):"
            )
            lines += [
                f"  {turn.rollout} turn {turn.turn}: {', '.join(turn.constrained_by or ())}, sum diff "
                f"{turn.recomputed_sum - turn.recorded_sum:+.3f}"
                for turn in constrained
            ]
        if any(turn.kind == "unknown" for turn in self.turns):
            lines.append("unknown turns: the records do not say whether decoding was constrained (older records)")
        if self.naive:
            compared = [turn for turn in self.turns if turn.naive_changed is not None and turn.naive_sum is not None]
            changed = sum(turn.naive_changed or 0 for turn in compared)
            positions = sum(len(turn.abs_diffs) for turn in compared)
            moves = [abs((turn.naive_sum or 0.0) - turn.recomputed_sum) for turn in compared]
            lines.append(
                f"naive re-rendering (chat template over the final messages, re-tokenized): {changed} of {positions} "
                f"generated positions carry another id; per-turn log-prob sums move by {_mean(moves):.3f} nats on "
                f"average, {max(moves, default=math.nan):.3f} max ({len(compared)} turns compared)"
            )
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)}:")
            lines += [f"  {why}" for why in self.skipped]
        return "\n".join(lines)


def check_records(
    records: Iterable[tuple[str, dict[str, Any]]],
    score: Scorer,
    naive: Callable[[dict[str, Any]], NaiveSequence] | None = None,
) -> LogprobReport:
    """Check each (name, record); `naive` rebuilds a record's sequence the naive way (adds the contrast)."""
    report = LogprobReport(naive=naive is not None)
    for name, record in records:
        try:
            sequences = rollout_to_training_sequences(record)
        except ValueError as exc:
            report.skipped.append(f"{name}: {exc}")
            continue
        rebuilt: NaiveSequence | None = None
        if naive is not None:
            if len(sequences) > 1:
                report.skipped.append(f"{name}: naive contrast not made: the rollout has several token segments")
            else:
                try:
                    rebuilt = naive(record)
                except (ValueError, KeyError, TypeError) as exc:
                    report.skipped.append(f"{name}: naive contrast not made: {exc}")
        naive_scores = score(rebuilt.token_ids) if rebuilt is not None else None
        number = 0
        for sequence in sequences:
            scores = score(sequence.token_ids)
            for index, (start, end) in enumerate(sequence.turns):
                recorded = sequence.log_probs[start:end]
                recomputed = scores[start:end]
                changed = naive_sum = None
                if rebuilt is not None and naive_scores is not None and number < len(rebuilt.spans):
                    naive_start, naive_end = rebuilt.spans[number]
                    # Same number of positions as generated: the end marker a template adds after a turn cut by
                    # max_tokens was never sampled and would move the sum by itself.
                    naive_end = min(naive_end, naive_start + end - start)
                    changed = changed_positions(sequence.token_ids[start:end], rebuilt.token_ids[naive_start:naive_end])
                    naive_sum = sum(naive_scores[naive_start:naive_end])
                report.turns.append(
                    TurnCheck(
                        rollout=name,
                        turn=number,
                        constrained_by=_labels(sequence, index),
                        abs_diffs=[abs(a - b) for a, b in zip(recorded, recomputed)],
                        recorded_sum=sum(recorded),
                        recomputed_sum=sum(recomputed),
                        naive_changed=changed,
                        naive_sum=naive_sum,
                    )
                )
                number += 1
    return report


def changed_positions(exact: Sequence[int], naive: Sequence[int]) -> int:
    """Positions of `exact` whose id differs in `naive` (position by position; a missing position differs)."""
    return sum(1 for index, token in enumerate(exact) if index >= len(naive) or naive[index] != token)


@dataclass(frozen=True)
class NaiveSequence:
    """The episode re-rendered from its final messages: ids and each assistant turn's [start, end)."""

    token_ids: list[int]
    spans: list[tuple[int, int]]


def naive_sequence(record: dict[str, Any], tokenizer: Any) -> NaiveSequence:
    """What a trainer gets without the bundles: chat template over the final messages, tokenized, assistant spans.

    Each assistant span covers the characters the template renders for that message (content through its end
    marker; trailing whitespace the template adds after the marker is not generated and is left out), mapped to
    tokens through the tokenizer's offsets.
    """
    from nemo_gym_tok.contract.conversion import responses_to_chat_request
    from nemo_gym_tok.types.responses import ResponsesRequest

    params = dict(record.get("responses_create_params") or {})
    initial = params.get("input") or []
    if isinstance(initial, str):
        initial = [{"role": "user", "content": initial}]
    params["input"] = [*initial, *full_output(record)]
    chat = responses_to_chat_request(ResponsesRequest.model_validate(params))
    messages, tools = chat["messages"], chat.get("tools")

    def render(upto: int, prompt: bool) -> str:
        return str(
            tokenizer.apply_chat_template(
                messages[:upto],
                tools=tools,
                tokenize=False,
                add_generation_prompt=prompt,
            )
        )

    text = render(len(messages), False)
    char_spans: list[tuple[int, int]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(index, True), render(index + 1, False)
        if text.startswith(before) and text.startswith(through) and len(through) > len(before):
            start, end = len(before), len(through)
        else:  # the template rewrites earlier turns (drops reasoning, ...): find this turn's rendering instead
            chunk = through[len(before) :] if through.startswith(before) else through
            found = text.find(chunk.rstrip(), cursor)
            if found < 0:
                raise ValueError(f"cannot find assistant message {index} in the rendered conversation")
            start, end = found, found + len(chunk)
        end = start + len(text[start:end].rstrip())
        char_spans.append((start, end))
        cursor = end
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    spans = []
    for start, end in char_spans:
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        spans.append((inside[0], inside[-1] + 1) if inside else (0, 0))
    return NaiveSequence(ids, spans)


def transformers_scorer(model_dir: str | Path, device: str | None = None) -> Scorer:
    """A float32 model from `model_dir` (CUDA when available, else CPU) scoring one sequence per forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()

    def score(token_ids: Sequence[int]) -> list[float]:
        if len(token_ids) < 2:
            return [0.0] * len(token_ids)
        ids = torch.tensor([list(token_ids)], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return [0.0, *picked.cpu().tolist()]

    return score


def read_records(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """(name, record) per line of each JSONL file; the name is the rollout id or file:line. The gym's one policy
    (nemo_gym_tok.common.jsonl): a torn last line skipped with a warning, any other bad line a JsonlError."""
    records = []
    for path in paths:
        records += [(f"{Path(path).name}:{number}", record) for number, record in iter_jsonl(path)]
    return records


def _labels(sequence: TrainingSequence, index: int) -> list[str] | None:
    return sequence.constrained_by[index] if index < len(sequence.constrained_by) else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
