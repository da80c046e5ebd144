"""`ngt tiny-model [DIR]`: build (or reuse the cached) tiny random-weight Qwen3 model and print its directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `tiny-model` parser to the `ngt` subcommands."""
    parser = subparsers.add_parser(
        "tiny-model",
        help="build the tiny random-weight Qwen3 test model (or reuse a finished build) and print its directory",
        description=(
            "Build the tiny random-weight Qwen3 model (Qwen's real tokenizer, our chat template) offline and "
            "print the directory, ready for `python -m vllm.entrypoints.openai.api_server --model DIR`. "
            "A finished build of the same spec is reused. Without DIR it goes to the cache: "
            "$NGT_CACHE_DIR or ~/.cache/nemo_gym_tok."
        ),
    )
    parser.add_argument(
        "dir",
        nargs="?",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to put the model (default: a spec-hashed directory in the cache)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a finished build")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build or reuse the model; print its directory on stdout. Returns the exit status."""
    # Imported here so `ngt --help` and other subcommands do not pay for this package's imports.
    from nemo_gym_tok.testing.tiny_model import build_tiny_model

    try:
        path = build_tiny_model(args.dir, force=args.force)
    except FileExistsError as exc:
        print(f"ngt tiny-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
