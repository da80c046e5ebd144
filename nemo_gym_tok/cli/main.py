"""Entry point of the `ngt` command: builds the parser from each subcommand module and dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `register(subparsers)` which adds its parser and sets `func=run(args) -> int`.
_SUBCOMMAND_MODULES = (
    "nemo_gym_tok.cli.run",
    "nemo_gym_tok.cli.collect",
    "nemo_gym_tok.cli.export_nemo_gym",
    "nemo_gym_tok.cli.tiny_model",
    "nemo_gym_tok.cli.vllm_serve",
    "nemo_gym_tok.cli.check",
    "nemo_gym_tok.cli.inspect_cmd",
    "nemo_gym_tok.cli.demo",
    "nemo_gym_tok.cli.train_demo",
    "nemo_gym_tok.cli.train_async",
    "nemo_gym_tok.cli.template_sweep",
    "nemo_gym_tok.cli.vllm_compat",
    "nemo_gym_tok.cli.push_weights",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngt",
        description="nemo_gym_tok: token-exact multi-turn rollouts for RL on LLM agents.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
