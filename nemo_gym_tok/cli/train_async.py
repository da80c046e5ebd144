"""`ngt train-async`: the train demo at several staleness bounds, side by side: the staleness table."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from nemo_gym_tok.cli.train_demo import MODELS, training_plan

DEFAULT_STALENESS = "0,1,2,4"
DEFAULT_UNCORRECTED = "4"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-async",
        help="the train demo at staleness 0, 1, 2 and 4 (and 4 without correction) on one vLLM: the staleness table",
        description=(
            "Start one hooked float32 vLLM with vLLM's weight routes and the non_ascii gym (as `ngt train-demo`), "
            "then train TRL's GRPOTrainer from the tiny model's initial weights once per staleness bound: "
            "collection of step N's episodes starts once step N - K's weights are served and runs while the "
            "trainer steps; pushes pause in `keep` mode (requests in flight go on with the new weights, each id "
            "labelled with the weights that drew it); the tokens of older weights enter the loss through "
            "token-level truncated importance sampling against the sampler's own log probs (cap 2), or "
            "uncorrected for the bounds named by --uncorrected. Per run: the reward of the first and last 5 "
            "steps, the step the reward reaches 0.8, the training time, the trainer's and the sampler's idle "
            "share, the share of tokens at each lag, the share capped, the sampler-versus-learner gap by lag and "
            "the probe's cost per push. Writes table.json, table.md and train-async.png (and each run's records "
            "and metrics) to the output directory. Exit 0 when the targets are met (docs/training.md)."
        ),
    )
    parser.add_argument(
        "--staleness", default=DEFAULT_STALENESS, help=f"bounds run with correction (default {DEFAULT_STALENESS})"
    )
    parser.add_argument(
        "--uncorrected",
        default=DEFAULT_UNCORRECTED,
        help=f"bounds run without correction (default {DEFAULT_UNCORRECTED})",
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--num-generations", type=int, default=4, help="episodes per prompt (default 4)")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="distinct rows per step (default 2)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Adam's learning rate (default 1e-4)")
    parser.add_argument("--model", choices=MODELS, default="train", help="the tiny model's variant (default train)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(".ngt/train-async"),
        help="where the table, the plot and each run's records go (default .ngt/train-async); replaced each run",
    )
    parser.set_defaults(func=run)


def bounds(text: str) -> list[int]:
    """`0,1,2,4` -> [0, 1, 2, 4]; ValueError for anything but non-negative integers."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"staleness bounds are integers >= 0 separated by commas (0,1,2,4), got {text!r}")
    return [int(part) for part in parts]


def run(args: argparse.Namespace) -> int:
    try:
        corrected, uncorrected = bounds(args.staleness), bounds(args.uncorrected)
    except ValueError as exc:
        print(f"train-async: {exc}", file=sys.stderr)
        return 2
    if not corrected and not uncorrected:
        print("train-async: no run: give --staleness or --uncorrected", file=sys.stderr)
        return 2
    if min(args.steps, args.num_generations, args.prompts_per_step) < 1 or args.num_generations < 2:
        print("train-async: steps and prompts per step must be >= 1, num-generations >= 2", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    # Imported here: `ngt --help` and the other commands do not pay for torch, TRL or the test harnesses.
    from transformers.utils import logging as transformers_logging

    from nemo_gym_tok.testing.tiny_model import TRAIN_VARIANT, build_tiny_model
    from nemo_gym_tok.train.correction import Correction
    from nemo_gym_tok.train.staleness_table import TableRun, run_staleness_table, targets
    from nemo_gym_tok.train.train_demo import DemoSettings

    transformers_logging.disable_progress_bar()
    runs = [TableRun(bound, Correction("tis")) for bound in corrected]
    runs += [TableRun(bound, Correction("none")) for bound in uncorrected]
    model_dir = build_tiny_model(variant=TRAIN_VARIANT if args.model == "train" else None)
    print(f"model: {model_dir}; runs: {', '.join(run.name for run in runs)}", flush=True)
    plan = training_plan(args, pause_mode="keep")
    settings = DemoSettings(model_dir, args.output_dir, plan)
    figures = run_staleness_table(
        settings,
        runs,
        say=lambda line: print(line, flush=True),
        on_step=lambda name, metrics: print(f"{name} | {metrics.line()}", flush=True),
    )
    print()
    print((args.output_dir / "table.md").read_text(encoding="utf-8"))
    met = targets(figures)
    for name, ok in met.items():
        print(f"target {'met' if ok else 'MISSED'}: {name}")
    out = args.output_dir
    print(f"table: {out / 'table.json'}, {out / 'table.md'}; plot: {out / 'train-async.png'}")
    return 0 if all(met.values()) else 1
