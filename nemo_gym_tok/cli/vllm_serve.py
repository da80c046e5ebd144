"""`ngt vllm-serve`: start vLLM's OpenAI server with the prefix-splice hook switched on."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
from collections.abc import Mapping

from nemo_gym_tok.vllm.hook import ENABLE_ENV

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "nemo_gym_tok_prefix_splice"
# vLLM's Harmony renderer (GPT-OSS) writes this date into every prompt's system message, today's date if unset.
START_DATE_ENV = "VLLM_SYSTEM_START_DATE"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm-serve",
        help="start vLLM's OpenAI server with the prefix-splice hook",
        description=(
            f"Run `python -m vllm.entrypoints.openai.api_server --model MODEL [vLLM args...]` with {ENABLE_ENV}=1, "
            "so this package's vLLM plugin splices the exact previous model tokens into every chat prompt that "
            "carries a token bundle or required_prefix_token_ids. Every argument after MODEL goes to vLLM unchanged. "
            f"{START_DATE_ENV} is pinned to the day the server starts (unless already set), so a GPT-OSS episode that "
            "crosses midnight keeps the system message its earlier prompts had."
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


def server_env(environ: Mapping[str, str], today: datetime.date | None = None) -> dict[str, str]:
    """vLLM's environment: the hook switched on, and the Harmony system date pinned unless the caller set it.

    The date is local, as vLLM's own default (`datetime.now()`) is.
    """
    env = {**environ, ENABLE_ENV: "1"}
    if not env.get(START_DATE_ENV):
        env[START_DATE_ENV] = (today or datetime.date.today()).strftime("%Y-%m-%d")
    return env


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
    os.execve(sys.executable, command, server_env(os.environ))
    return 0  # not reached
