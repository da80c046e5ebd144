"""TRL's GRPOTrainer on the CPU, fed by a GymRollout: one batch of episodes per optimizer step, float32 throughout."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from nemo_gym_tok.train.corrected_trainer import CorrectedGRPOTrainer
from nemo_gym_tok.train.correction import Correction
from nemo_gym_tok.train.prompts import PromptRows, prompt_of
from nemo_gym_tok.train.reward import gym_reward
from nemo_gym_tok.weights import PauseMode


@dataclass(frozen=True)
class TrainingPlan:
    """How much to train: `prompts_per_step` distinct rows a step, each played `num_generations` times (GRPO's group),
    `steps` optimizer steps. With `max_staleness` 0 each step trains on episodes collected after its own push; with
    N > 0 collection runs up to N steps ahead, on whatever weights are served, and `correction` weighs the tokens
    of older weights. `pause_mode` is how pushes treat requests in flight (push_weights)."""

    steps: int = 30
    num_generations: int = 4
    prompts_per_step: int = 2
    learning_rate: float = 1e-4
    seed: int = 0
    max_staleness: int = 0
    correction: Correction = Correction("tis")
    pause_mode: PauseMode = "wait"

    @property
    def episodes_per_step(self) -> int:
        return self.num_generations * self.prompts_per_step

    def schedule(self, rows: PromptRows) -> list[list[dict[str, Any]]]:
        """The rows of every step, known before training (PromptRows.schedule with this plan's sizes and seed)."""
        return rows.schedule(self.steps, self.prompts_per_step, self.num_generations, self.seed)


def grpo_config(plan: TrainingPlan, output_dir: str | Path) -> GRPOConfig:
    """CPU, float32, TRL's own generation off (`use_vllm=False`: the rollout_func samples through the gym), one
    generation batch per optimizer step (so every step trains on episodes of the weights it pushed), no KL term."""
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        num_generations=plan.num_generations,
        per_device_train_batch_size=plan.episodes_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=plan.steps,
        learning_rate=plan.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        gradient_checkpointing=False,
        disable_dropout=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=plan.seed,
        data_seed=plan.seed,
        shuffle_dataset=False,  # the data set is the plan's schedule, already shuffled, which collection runs along
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def load_policy(model_dir: str | Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) from a Hugging Face directory."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def grpo_trainer(
    model: Any, tokenizer: Any, rows: PromptRows, rollout: Any, plan: TrainingPlan, output_dir: str | Path
) -> CorrectedGRPOTrainer:
    """The trainer (TRL's GRPOTrainer, whose loss takes the rollout's token weights: CorrectedGRPOTrainer): its data
    set is the plan's schedule of prompts in order (TRL repeats each `num_generations` times), its rollout_func
    `rollout` (a GymRollout built with the same schedule), its reward `gym_reward`."""
    prompts = [
        prompt_of(batch[index]) for batch in plan.schedule(rows) for index in range(0, len(batch), plan.num_generations)
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'", category=UserWarning)
        return CorrectedGRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[gym_reward],
            args=grpo_config(plan, output_dir),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            rollout_func=rollout,
        )
