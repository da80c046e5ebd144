"""`ngt train-demo`: TRL's GRPOTrainer learns from the gym on the CPU; per-step reward, exact-ids gap, text pipeline."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

TIME_LIMIT_SECONDS = 600.0
MODELS = ("train", "default")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-demo",
        help="TRL's GRPOTrainer learning from the gym on the tiny model, on the CPU",
        description=(
            "Build the tiny model's training variant (cached), start a hooked vLLM with vLLM's weight routes "
            "(VLLM_SERVER_DEV_MODE=1) on a copy of it, start the non_ascii environment, the vllm_model adapter and an "
            "agent, and run TRL's GRPOTrainer on the CPU with nemo_gym_tok's rollout_func: before each step the "
            "trainer's weights are pushed to vLLM and every episode is collected through the agent, token-exact "
            "and on those weights. One line per step: mean reward, the learner-versus-sampler log-prob gap on the "
            "exact ids, what a text pipeline (the final messages re-rendered and re-tokenized) would feed the "
            "learner instead, the push time and the contiguous episodes. Records, a per-step metrics JSONL and a "
            "plot go to the output directory. Exit status 0 when the targets are met (docs/training.md)."
        ),
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--num-generations", type=int, default=4, help="episodes per prompt: GRPO's group (default 4)")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="distinct rows per step (default 2)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Adam's learning rate (default 1e-4)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what vLLM serves in (default float32: its log probs then match the float32 learner's)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="train",
        help="the tiny model's training variant (default), or the default model, whose random embeddings carry no "
        "feature the reward could move (the control)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(".ngt/train-demo"),
        help="where records, metrics.jsonl and train-demo.png go (default .ngt/train-demo); each run replaces them",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if min(args.steps, args.num_generations, args.prompts_per_step) < 1 or args.num_generations < 2:
        print("train-demo: steps and prompts per step must be >= 1, num-generations >= 2", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    # Imported here: `ngt --help` and the other commands do not pay for torch, TRL or the test harnesses.
    from transformers.utils import logging as transformers_logging

    from nemo_gym_tok.testing.tiny_model import TRAIN_VARIANT, build_tiny_model
    from nemo_gym_tok.train.train_demo import DemoSettings, run_train_demo
    from nemo_gym_tok.train.trainer import TrainingPlan

    transformers_logging.disable_progress_bar()  # a bar per checkpoint saved would bury the step lines

    model_dir = build_tiny_model(variant=TRAIN_VARIANT if args.model == "train" else None)
    print(f"model: {model_dir}", flush=True)
    plan = TrainingPlan(
        steps=args.steps,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        learning_rate=args.learning_rate,
    )
    settings = DemoSettings(model_dir, args.output_dir, plan, served_dtype=args.dtype)
    result = run_train_demo(
        settings, say=lambda line: print(line, flush=True), on_step=lambda m: print(m.line(), flush=True)
    )
    print()
    print(result.summary(TIME_LIMIT_SECONDS))
    return 0 if all(result.targets(TIME_LIMIT_SECONDS).values()) else 1
