"""`ngt train-demo`: TRL's GRPOTrainer learns from the gym on the CPU; per-step reward, exact-ids gap, text pipeline."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from nemo_gym_tok.train.correction import CORRECTION_MODES, DEFAULT_TIS_CAP, Correction
from nemo_gym_tok.weights import PAUSE_MODES

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
            "trainer's weights are pushed to vLLM (each push proven by a log-prob probe) and the step's episodes are "
            "collected through the agent, token-exact and on those weights; with --max-staleness K collection runs up "
            "to K steps ahead of the trainer, every token labelled with the weights that drew it and weighed by "
            "--correction. One line per step: mean reward, the learner-versus-sampler log-prob gap on the "
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
    add_async_arguments(parser)
    parser.set_defaults(func=run)


def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of collection running ahead of the trainer (train-demo and train-async alike)."""
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="how many pushes behind the trainer a sampled token may be: collection of step N's episodes starts "
        "once step N - K's weights are served (default 0: each step collects after its own push, the synchronous loop)",
    )
    parser.add_argument(
        "--correction",
        choices=CORRECTION_MODES,
        default="tis",
        help="how tokens of older weights enter the loss: tis (token-level truncated importance sampling against the "
        "sampler's own log probs, capped at --tis-cap; the default), mask (tokens more than --mask-lag pushes behind "
        "leave the loss), none",
    )
    parser.add_argument("--tis-cap", type=float, default=DEFAULT_TIS_CAP, help="the ratio cap of tis (default 2)")
    parser.add_argument("--mask-lag", type=int, default=0, help="mask keeps tokens at most this lag (default 0)")
    parser.add_argument(
        "--pause-mode",
        choices=PAUSE_MODES,
        default="keep",
        help="how pushes treat requests in flight: keep (frozen, then go on with the new weights, the ids of each "
        "version told apart; the default) or wait (finish on the old weights first)",
    )


def training_plan(args: argparse.Namespace, **choices: Any) -> Any:
    """The TrainingPlan of the sizes both commands take (steps, group, prompts, learning rate) and `choices`."""
    from nemo_gym_tok.train.trainer import TrainingPlan  # torch and TRL: only once a command runs

    return TrainingPlan(
        steps=args.steps,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        learning_rate=args.learning_rate,
        **choices,
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """A usage mistake in the shared flags, or None."""
    if min(args.steps, args.num_generations, args.prompts_per_step) < 1 or args.num_generations < 2:
        return "steps and prompts per step must be >= 1, num-generations >= 2"
    if args.max_staleness < 0 or args.mask_lag < 0:
        return "--max-staleness and --mask-lag must be >= 0"
    try:
        Correction(args.correction, tis_cap=args.tis_cap, mask_lag=args.mask_lag)
    except ValueError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem is not None:
        print(f"train-demo: {problem}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    # Imported here: `ngt --help` and the other commands do not pay for torch, TRL or the test harnesses.
    from transformers.utils import logging as transformers_logging

    from nemo_gym_tok.testing.tiny_model import TRAIN_VARIANT, build_tiny_model
    from nemo_gym_tok.train.train_demo import DemoSettings, run_train_demo

    transformers_logging.disable_progress_bar()  # a bar per checkpoint saved would bury the step lines

    model_dir = build_tiny_model(variant=TRAIN_VARIANT if args.model == "train" else None)
    print(f"model: {model_dir}", flush=True)
    plan = training_plan(
        args,
        max_staleness=args.max_staleness,
        correction=Correction(args.correction, tis_cap=args.tis_cap, mask_lag=args.mask_lag),
        pause_mode=args.pause_mode,
    )
    settings = DemoSettings(model_dir, args.output_dir, plan, served_dtype=args.dtype)
    result = run_train_demo(
        settings, say=lambda line: print(line, flush=True), on_step=lambda m: print(m.line(), flush=True)
    )
    print()
    print(result.summary(TIME_LIMIT_SECONDS))
    return 0 if all(result.targets(TIME_LIMIT_SECONDS).values()) else 1
