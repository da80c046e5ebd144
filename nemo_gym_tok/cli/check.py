"""`ngt check`: the token-contiguity report of a rollouts file."""

from __future__ import annotations

import argparse
import sys

from nemo_gym_tok.contiguity import check_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="token-contiguity report over collected rollouts",
        description=(
            "Walk every rollout record of FILE: a rollout is token-contiguous when each model call's prompt ids start "
            "with all prompt+generation ids before it. Prints rollouts, model calls, contiguous rollouts, turns the "
            "prefix splice repaired, and the first failures. Reads records of schema_version 1 and 2; a record of "
            "any other version is a failure naming it. Exit status 0 when every rollout is contiguous, else 1."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="rollouts JSONL (from ngt collect)")
    parser.add_argument("--model", metavar="DIR", help="tokenizer directory, to show failures as decoded text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    decode = None
    if args.model:
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(args.model).decode
    try:
        report = check_file(args.file, decode)
    except OSError as exc:
        print(f"ngt: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1
