"""TRL's GRPOTrainer with each token's loss term weighed by the rollout's off-policy correction (`token_weight`)."""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from nemo_gym_tok.train.correction import TOKEN_WEIGHT_KEY

LINEAR_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
"""TRL loss types whose per-token policy term is the advantage times a non-negative factor: weighing the advantage
weighs the term (TRL's own vLLM correction multiplies the per-token loss, the same thing for these)."""


class CorrectedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss takes the sampler's log probs as the behaviour policy, through the weights the rollout
    computed from them (nemo_gym_tok.train.correction). TRL 1.16 applies its own importance-sampling correction only
    with `use_vllm=True`, which a rollout through the gym does not use; TRL lets a subclass give advantages of shape
    (batch, completion length), and a per-token advantage scaled by w >= 0 scales that token's loss term by w.

    Episodes whose rollout output has no `token_weight` are trained as GRPOTrainer trains them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.loss_type not in LINEAR_LOSS_TYPES:
            raise ValueError(
                f"loss_type {self.loss_type!r}: the correction weighs the advantage per token, which scales the loss "
                f"term only for {', '.join(LINEAR_LOSS_TYPES)}"
            )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        # TRL copies each extra key of the rollout output onto the matching input row (for the reward functions).
        weights = [row.get(TOKEN_WEIGHT_KEY) for row in inputs]
        if all(weight is None for weight in weights):
            return output
        output["advantages"] = weighted_advantages(output["advantages"], output["completion_mask"], weights)
        return output


def weighted_advantages(advantages: torch.Tensor, completion_mask: torch.Tensor, weights: list[Any]) -> torch.Tensor:
    """(batch, completion length) advantages: row i's advantage times `weights[i]`, padded with 0.0. Each row's
    weights must be as long as its completion (TRL's completion mask counts its ids)."""
    batch, width = completion_mask.shape
    if len(weights) != batch:
        raise ValueError(f"{len(weights)} rows of token weights for a batch of {batch}")
    table = torch.zeros((batch, width), dtype=torch.float32, device=advantages.device)
    for row, weight in enumerate(weights):
        length = int(completion_mask[row].sum().item())
        if weight is None or len(weight) != length:
            found = "none" if weight is None else len(weight)
            raise ValueError(f"episode {row}: {found} token weights for {length} completion ids")
        table[row, :length] = torch.tensor(weight, dtype=torch.float32)
    base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    return base.to(torch.float32) * table
