"""`ngt vllm-serve`: start vLLM's OpenAI server with the prefix-splice hook switched on."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from nemo_gym_tok.vllm.hook import ENABLE_ENV

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "nemo_gym_tok_prefix_splice"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm-serve",
        help="start vLLM's OpenAI server with the prefix-splice hook",
        description=(
            f"Run `python -m vllm.entrypoints.openai.api_server --model MODEL [vLLM args...]` with {ENABLE_ENV}=1, "
            "so this package's vLLM plugin splices the exact previous model tokens into every chat prompt that "
            "carries a token bundle or required_prefix_token_ids. Every argument after MODEL goes to vLLM unchanged."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="model directory or name, as vLLM's --model")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="VLLM_ARGS", help="passed to vLLM as they are")
    parser.set_defaults(func=run)


def plugin_is_registered() -> bool:
    entry_points = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    return any(entry_point.name == PLUGIN_NAME for entry_point in entry_points)


def vllm_command(model: str, vllm_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *vllm_args]


def run(args: argparse.Namespace) -> int:
    if not plugin_is_registered():
        print(
            f"ngt: the {PLUGIN_NAME} vLLM plugin is not registered; install this package "
            "(`make setup`, or `pip install -e .`) in the environment that runs vLLM",
            file=sys.stderr,
        )
        return 2
    command = vllm_command(args.model, args.vllm_args)
    # exec, so signals and the exit status are vLLM's own.
    os.execve(sys.executable, command, {**os.environ, ENABLE_ENV: "1"})
    return 0  # not reached
