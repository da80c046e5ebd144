"""`ngt collect`: run an input file's rollouts against a running agent and append them to a resumable JSONL file."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect import (
    DEFAULT_HEAD_URL,
    FAILURES_SUFFIX,
    HEAD_URL_ENV,
    CollectError,
    collect,
    export_nemo_gym,
    read_rows,
    resolve_agent_url,
)
from nemo_gym_tok.servers.client import AUTH_TOKEN_ENV


def register(subparsers: Any) -> None:
    """Add the `collect` parser to the `ngt` subcommands."""
    parser = subparsers.add_parser(
        "collect",
        help="run rollouts of a JSONL file against a running agent; resumable, failures to a side file",
        description=(
            "POST every row of --input (each non-empty line a JSON object) --repeats times to the agent's /run and "
            "append each rollout record, tagged with a rollout_id naming its row by content (row_hash, occurrence), "
            "its repeat and the agent, as one line of --output. The agent's URL comes from the head server that "
            f"`ngt run` started. Failed rollouts go to <output>{FAILURES_SUFFIX} with their reason. Rerunning the "
            "same command resumes: rollouts already in --output are skipped (even after a kill mid-write, and if "
            "rows were added or reordered), failed ones and those cut by Ctrl-C are run again. An --output holding "
            "another agent's rollouts, or rows the input does not have, is refused. When the gym runs "
            f"with an auth_token, set ${AUTH_TOKEN_ENV} to it: it is sent as the bearer token."
        ),
        epilog=(
            "exit status: 0 when every rollout in scope is in --output, 1 when some failed this run (they are in "
            f"<output>{FAILURES_SUFFIX}; rerun to retry them), 2 when the run could not start or had to stop (bad or "
            "missing input, head unreachable, unknown agent, output not writable, output of another input or agent), "
            "130 on Ctrl-C. With --nemo-gym-output, the export's errors also give 2."
        ),
    )
    parser.add_argument(
        "--input", required=True, type=Path, metavar="ROWS.jsonl", help="input rows, one JSON object a line"
    )
    parser.add_argument(
        "--output",
        required=True,
        type=Path,
        metavar="ROLLOUTS.jsonl",
        help="rollout records are appended here; existing ones are kept and skipped",
    )
    parser.add_argument(
        "--agent", required=True, metavar="NAME", help="instance name of the agent server in the config"
    )
    parser.add_argument(
        "--head-url",
        default=os.environ.get(HEAD_URL_ENV) or DEFAULT_HEAD_URL,
        metavar="URL",
        help=f"head server URL (default: ${HEAD_URL_ENV} or {DEFAULT_HEAD_URL})",
    )
    parser.add_argument(
        "--concurrency", type=_at_least(1), default=8, metavar="N", help="rollouts in flight at once (default 8)"
    )
    parser.add_argument(
        "--limit", type=_at_least(0), default=None, metavar="K", help="use only the first K input rows (default: all)"
    )
    parser.add_argument("--repeats", type=_at_least(1), default=1, metavar="R", help="rollouts per row (default 1)")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="time limit of one rollout; a rollout over it counts as failed (default 1800)",
    )
    parser.add_argument(
        "--nemo-gym-output",
        type=Path,
        metavar="ROWS.jsonl",
        help="after the run, also write every rollout of --output as NeMo Gym's rollout rows (whole "
        "prompt_token_ids on each bundled item, _ng_task_index, _ng_rollout_index, agent_ref) "
        "here, and its failed ones to <stem>_failures.jsonl (as `ngt export-nemo-gym` does); "
        "--output stays the resumable record file",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the agent, collect, print the one-line summary. Returns the exit status."""
    try:
        read_rows(args.input, args.limit)  # input errors first: they need no running servers to report
        auth_token = os.environ.get(AUTH_TOKEN_ENV) or None  # from the environment: a flag would show in `ps`
        agent_url = resolve_agent_url(args.head_url, args.agent, auth_token=auth_token)
        summary = asyncio.run(
            collect(
                args.input,
                args.output,
                agent_url,
                agent=args.agent,
                concurrency=args.concurrency,
                limit=args.limit,
                repeats=args.repeats,
                timeout=args.timeout,
                auth_token=auth_token,
            )
        )
    except CollectError as exc:
        print(f"ngt collect: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. an unwritable output directory or a full disk: finished lines stay intact
        print(f"ngt collect: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"ngt collect: interrupted; finished rollouts are in {args.output}, those in flight were dropped (not "
            "failures); rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(summary.line(), flush=True)
    if args.nemo_gym_output is not None:
        try:  # after a run with failures too: the sidecar is where NeMo Gym users look for them
            # No repeats: every rollout in scope is in --output or its failures file now, so the highest repeat seen
            # gives the numbering, also over rollouts an earlier run collected with more --repeats.
            exported = export_nemo_gym(args.output, args.nemo_gym_output, agent=args.agent)
        except (CollectError, OSError) as exc:
            print(f"ngt collect: exporting to {args.nemo_gym_output}: {exc}", file=sys.stderr)
            return 2
        print(exported.line().replace("export-nemo-gym:", "collect: NeMo Gym rows:", 1), flush=True)
    return 1 if summary.failed else 0


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
