"""TRL's GRPOTrainer on the CPU, fed by a GymRollout: one collection per optimizer step, float32 throughout."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from nemo_gym_tok.train.prompts import PromptRows
from nemo_gym_tok.train.reward import gym_reward


@dataclass(frozen=True)
class TrainingPlan:
    """How much to train: `prompts_per_step` distinct rows a step, each played `num_generations` times (GRPO's group),
    `steps` optimizer steps, each on the episodes collected just before it."""

    steps: int = 30
    num_generations: int = 4
    prompts_per_step: int = 2
    learning_rate: float = 1e-4
    seed: int = 0

    @property
    def episodes_per_step(self) -> int:
        return self.num_generations * self.prompts_per_step


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
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def load_policy(model_dir: str | Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) from a Hugging Face directory."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def grpo_trainer(
    model: Any, tokenizer: Any, rows: PromptRows, rollout: Any, plan: TrainingPlan, output_dir: str | Path
) -> GRPOTrainer:
    """The trainer: its data set is the rows' prompts (TRL repeats each `num_generations` times), its rollout_func
    `rollout` (a GymRollout), its reward `gym_reward`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'", category=UserWarning)
        return GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[gym_reward],
            args=grpo_config(plan, output_dir),
            train_dataset=Dataset.from_dict({"prompt": rows.prompts()}),
            rollout_func=rollout,
        )
