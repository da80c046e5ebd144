"""The sampler's log probs in TRL's loss: CorrectedGRPOTrainer (real TRL 1.16, the tiny model on the CPU) scales each
token's loss term by the rollout's weight, and the loss moves when the weights do. No vLLM: the rollout_func hands
fixed episodes, so the loss can be computed by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")

PROMPT_IDS = [151644, 872, 198]
COMPLETIONS = [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21]]
REWARDS = [0.0, 1.0, 0.0, 1.0]


class FixedEpisodes:
    """A rollout_func that hands the same four episodes every call, with the given token weights."""

    def __init__(self, weights: list[list[float]] | None) -> None:
        self.weights = weights

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        output: dict[str, Any] = {
            "prompt_ids": [PROMPT_IDS] * 4,
            "completion_ids": COMPLETIONS,
            "logprobs": [[-1.0] * 3] * 4,
            "env_mask": [[1, 1, 1]] * 4,
            "gym_reward": REWARDS,
        }
        if self.weights is not None:
            output["token_weight"] = self.weights
        return output


@pytest.fixture(scope="module")
def build(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from nemo_gym_tok.train.prompts import PromptRows, prompt_of
    from nemo_gym_tok.train.trainer import TrainingPlan, grpo_trainer, load_policy

    rows = PromptRows([{"responses_create_params": {"input": f"prompt {index}"}} for index in range(2)])
    plan = TrainingPlan(steps=1, num_generations=2, prompts_per_step=2)

    def make(weights: list[list[float]] | None):
        model, tokenizer = load_policy(tiny_model_dir)
        trainer = grpo_trainer(model, tokenizer, rows, FixedEpisodes(weights), plan, tmp_path_factory.mktemp("t"))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this test does not run
        inputs = [{"prompt": prompt_of(row)} for row in plan.schedule(rows)[0]]
        batch = trainer._generate_and_score_completions(inputs)
        return trainer, batch

    return make


def test_the_advantage_of_each_token_is_scaled_by_its_weight(build) -> None:
    weights = [[1.0, 2.0, 0.5], [1.0, 1.0, 1.0], [0.25, 1.0, 1.0], [2.0, 2.0, 2.0]]
    _, batch = build(weights)
    advantages = batch["advantages"]
    assert tuple(advantages.shape) == (4, 3)
    # GRPO's group advantages of rewards (0, 1) in each group of two, scaled per token.
    _, plain = build(None)
    group = plain["advantages"]
    assert group.dim() == 1 and group[0] < 0 < group[1]
    for row in range(4):
        for column in range(3):
            assert advantages[row, column].item() == pytest.approx(group[row].item() * weights[row][column])


def test_the_loss_moves_with_the_weights_and_equals_the_hand_computed_one(build) -> None:
    weights = [[1.0, 2.0, 0.5], [1.0, 1.0, 1.0], [0.25, 1.0, 1.0], [2.0, 2.0, 2.0]]
    trainer, batch = build(weights)
    loss = trainer.compute_loss(trainer.model, batch).item()
    untouched, plain = build(None)
    plain_loss = untouched.compute_loss(untouched.model, plain).item()
    # At the weights that just computed the "old" log probs every ratio is 1, so with TRL's default loss ("dapo":
    # the per-token terms summed over the batch's 12 completion tokens) the loss is -sum(advantage x weight) / 12.
    assert trainer.loss_type == "dapo"
    group = plain["advantages"].tolist()
    expected = -sum(a * sum(w) for a, w in zip(group, weights)) / 12
    assert loss == pytest.approx(expected, abs=1e-6)
    assert plain_loss == pytest.approx(-sum(group) * 3 / 12, abs=1e-6)
    assert not math.isclose(loss, plain_loss, abs_tol=1e-4)


def test_weights_that_do_not_fit_the_completion_are_refused(build) -> None:
    with pytest.raises(ValueError, match="episode 1: 2 token weights for 3 completion ids"):
        build([[1.0] * 3, [1.0] * 2, [1.0] * 3, [1.0] * 3])
