"""The learner's log probs of given ids: the trainer's model in float32, no gradient, one forward pass per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def learner_log_probs(
    model: Any, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]] | None = None
) -> list[list[float]]:
    """Per sequence, log p(ids[i] | ids[:i]) under `model`, as long as the sequence: the values a trainer's loss
    sees for those exact ids. With `positions` (per sequence, the indexes i >= 1 wanted), only those are computed
    (the output layer runs on their contexts alone) and every other position holds 0.0; without, every position but
    0 (which has no context, and holds 0.0). Float32 whatever the model's dtype, without gradient, in the model's
    current mode (the tiny Qwen3 has no dropout)."""
    device = next(model.parameters()).device
    results: list[list[float]] = []
    with torch.no_grad():
        for index, ids in enumerate(sequences):
            wanted = list(range(1, len(ids))) if positions is None else sorted(set(positions[index]))
            if any(not 1 <= i < len(ids) for i in wanted):
                raise ValueError(f"sequence {index}: positions must lie in [1, {len(ids)})")
            row = [0.0] * len(ids)
            if wanted:
                tokens = torch.tensor([list(ids)], device=device)
                contexts = torch.tensor([i - 1 for i in wanted], device=device)  # the logits at i - 1 predict ids[i]
                logits = model(input_ids=tokens, use_cache=False, logits_to_keep=contexts).logits[0].float()
                targets = tokens[0, contexts + 1]
                picked = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
                for i, value in zip(wanted, picked.cpu().tolist()):
                    row[i] = value
            results.append(row)
    return results
