"""`ngt export-nemo-gym`: convert an `ngt collect` output into NeMo Gym's rollout rows and failures sidecar."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nemo_gym_tok.collect import FAILURES_SUFFIX, CollectError, export_nemo_gym

DESCRIPTION = (
    "Write the rollouts of IN (an `ngt collect` output, schema_version 2 or 1) as the rows NeMo Gym's rollout "
    "collection writes, one JSON object a line, into OUT: the record's fields (the input row's, `response`, "
    "`reward`, the verifier's extras, `rollout_id`), each bundled output item with its whole `prompt_token_ids` "
    "(what NeMo RL reads; schema 2 stores it packed) beside `generation_token_ids` and `generation_log_probs`, "
    "`_ng_task_index` (one per distinct input row, in input order, unless the row has its own), `_ng_rollout_index` "
    "and `agent_ref` ({type, name}; the row's own if it has one); no schema_version (a row is a version 1 record, "
    "which `ngt check` reads). The response gets the fields NeMo Gym's response model requires where a record lacks "
    "them (tools, tool_choice and parallel_tool_calls as the row sent them, unknown usage details as null). "
    f"Rollouts in IN{FAILURES_SUFFIX} go to NeMo Gym's sidecar, <OUT stem>_failures.jsonl, with _ng_failure_class "
    "agent_run_error (the agent answered an error) or agent_request_failed (no answer, a timeout, or a gateway "
    "429/502/503/504). OUT and the sidecar are replaced whole, only once every record converted: a bad record "
    "writes nothing. IN is only read."
)


def register(subparsers: Any) -> None:
    """Add the `export-nemo-gym` parser to the `ngt` subcommands."""
    parser = subparsers.add_parser(
        "export-nemo-gym",
        help="convert an `ngt collect` output into NeMo Gym rollout rows (full prompt ids) + failures sidecar",
        description=DESCRIPTION,
        epilog="exit status: 0 when written, 2 when IN cannot be read or converted (the message names the line).",
    )
    parser.add_argument("input", metavar="IN", help="an `ngt collect` --output file")
    parser.add_argument("output", metavar="OUT", help="the NeMo Gym rows file to write (replaced)")
    parser.add_argument(
        "--agent",
        metavar="NAME",
        help="agent name for agent_ref where a record's rollout_id names none (must match where it does)",
    )
    parser.add_argument(
        "--repeats",
        type=_at_least_one,
        metavar="R",
        help="the collection's --repeats; needed only when the input has the same row twice, to "
        "number its rollouts as NeMo Gym does (default: one more than the highest repeat seen)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; print the one-line summary. Returns the exit status."""
    try:
        summary = export_nemo_gym(args.input, args.output, agent=args.agent, repeats=args.repeats)
    except (CollectError, OSError) as exc:
        print(f"ngt export-nemo-gym: {exc}", file=sys.stderr)
        return 2
    print(summary.line(), flush=True)
    return 0


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
