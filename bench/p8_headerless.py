"""P8: a client that sends no session header straight to vLLM's router: each policy's prefix-cache hits and spread."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from benchkit.figures import Figure, Table, command, standalone_argv
from benchkit.metrics import scrape
from benchkit.replicas import replicas, reset_prefix_cache, worker_cpus
from benchkit.server import MODEL, BenchError, note, text_of_ids
from benchkit.timing import ratio
from p7_routing import (
    NOTES,
    affinity_cells,
    affinity_headers,
    block_size,
    fleet_work,
    own_history_ceiling,
    replicas_named,
)

from nemo_gym_tok.router import SESSION_HEADER, RouterProcess, RouterSpec

CASES: tuple[tuple[str, bool], ...] = (
    ("consistent_hash", True),
    ("consistent_hash", False),
    ("sticky_least_loaded", False),
    ("cache_aware", False),
    ("round_robin", False),
    ("power_of_two", False),
)
"""(policy, whether the client sends `x-session-id`): the gym's own case first, as the reference."""
QUICK = ["--conversations", "8", "--concurrency", "4", "--turns", "3"]

METHOD = """\
Two hooked bench vLLMs (P7's pair: the bench server's flags, prefix caching on, dev mode for /reset_prefix_cache)
and, per case, a vllm-router started in front of both with that policy (nemo_gym_tok.router.RouterProcess, as `ngt
run` starts it). A client in this process plays --conversations conversations of --turns calls each, --concurrency
at once, straight to the router's /v1/chat/completions, as a NeMo Gym vllm_model, TRL or OpenAI-SDK loop pointed at a
router does: the history as messages, the previous call's prompt + generation ids as the top-level
`required_prefix_token_ids` (what a client must send through a router, docs/clients.md), `logprobs: true` (so the
hook answers with the bundle, which names the replica that served it), and no `x-session-id`, except in the first
case, which sends one per conversation (what the gym's adapter sends on every call). Each conversation opens with a
tag of its own and about --opening-ids ids of notes, so no two share a cache block: every prefix-cache hit is a
conversation finding its own earlier turns on the replica it is sent to. Before each case both replicas' prefix
caches are emptied; the hit rate is vllm:prefix_cache_hits over vllm:prefix_cache_queries summed over both. Four
calls straight to each replica warm them up before the first case."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__ + "\n\n" + METHOD, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replica-urls", nargs="+", help=f"hooked vLLMs serving the bench model as {MODEL!r} (else two)")
    p.add_argument("--conversations", type=int, default=32, help="per case (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once (default 8)")
    p.add_argument("--turns", type=int, default=4, help="model calls per conversation (default 4)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--opening-ids", type=int, default=384, help="notes in each opening user message, in ids")
    p.add_argument("--json", type=Path, help="also write the cases' figures to this file (docs/scaling.md quotes it)")
    p.add_argument("--quick", action="store_true", help=f"a short run: {' '.join(QUICK)}")
    return p


def case_name(policy: str, header: bool) -> str:
    return f"{policy} {'with' if header else 'without'} {SESSION_HEADER}"


async def conversation(
    http: httpx.AsyncClient, router: str, index: int, tag: str, opening: str, args: argparse.Namespace, header: bool
) -> list[dict[str, Any]]:
    """One conversation's calls: the replica that served each, its prompt and generated id counts, and whether its
    prompt started with the previous call's prompt + generation ids."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Game {index} ({tag}). {opening}Guess my number, 1 to 100."}
    ]
    headers = {SESSION_HEADER: f"{tag}-{index}"} if header else {}
    prefix: list[int] | None = None
    calls = []
    for turn in range(args.turns):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "seed": index * 100 + turn,
            "logprobs": True,
        }
        if prefix is not None:
            body["required_prefix_token_ids"] = prefix
        response = await http.post(f"{router}/v1/chat/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise BenchError(f"{tag} conversation {index} call {turn}: {response.status_code} {response.text[:400]}")
        message = response.json()["choices"][0]["message"]
        prompt, generated = message["prompt_token_ids"], message["generation_token_ids"]
        calls.append(
            {
                "replica": str(message.get("replica") or "?"),
                "prompt": len(prompt),
                "generated": len(generated),
                "contiguous": prefix is None or prompt[: len(prefix)] == prefix,
            }
        )
        prefix = [*prompt, *generated]
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning:
            assistant["reasoning"] = reasoning  # the router keeps `reasoning`, drops `reasoning_content`
        messages = [*messages, assistant, {"role": "user", "content": "Higher." if turn % 2 == 0 else "Lower."}]
    return calls


async def play(router: str, tag: str, opening: str, args: argparse.Namespace, header: bool) -> list[list[dict]]:
    limit = asyncio.Semaphore(args.concurrency)

    async def one(index: int) -> list[dict[str, Any]]:
        async with limit:
            return await conversation(http, router, index, tag, opening, args, header)

    async with httpx.AsyncClient(timeout=600) as http:
        return list(await asyncio.gather(*(one(index) for index in range(args.conversations))))


def summary(conversations: Sequence[Sequence[Mapping[str, Any]]], block: int) -> dict[str, Any]:
    """Where the calls went (per replica: conversations by their first call, calls), conversations whose calls all
    went to one replica, contiguous conversations and the own-history ceiling (p7_routing.own_history_ceiling)."""
    sessions: Counter[str] = Counter()
    turns: Counter[str] = Counter()
    for calls in conversations:
        sessions[calls[0]["replica"]] += 1
        turns.update(call["replica"] for call in calls)
    return {
        "conversations": len(conversations),
        "sessions": dict(sessions),
        "turns": dict(turns),
        "one_replica": sum(len({call["replica"] for call in calls}) == 1 for calls in conversations),
        "contiguous": sum(all(call["contiguous"] for call in calls) for calls in conversations),
        "ceiling": sum(
            own_history_ceiling([(call["prompt"], call["generated"]) for call in calls], block)
            for calls in conversations
        )
        if block
        else float("nan"),
    }


def run_case(workers: Sequence[str], policy: str, header: bool, args: argparse.Namespace, http: httpx.Client) -> dict:
    tag = f"{policy}-{'h' if header else 'n'}-{time.monotonic_ns()}"
    opening = text_of_ids(args.opening_ids, NOTES)
    with RouterProcess(RouterSpec(tuple(workers), policy=policy)) as router:
        for url in workers:
            reset_prefix_cache(url, http)
        before = {url: scrape(url, http) for url in workers}
        wall = time.perf_counter()
        conversations = asyncio.run(play(router.url, tag, opening, args, header))
        wall = time.perf_counter() - wall
        after = {url: scrape(url, http) for url in workers}
    work = fleet_work(before, after)
    found = summary(conversations, block_size(after[workers[0]]) or 0)
    found.update(policy=policy, header=header, seconds=wall, **work)
    found["ceiling_rate"] = ratio(found["ceiling"], work["cache_queries"])
    return found


def warm_up(workers: Sequence[str], args: argparse.Namespace, http: httpx.Client) -> None:
    """A few calls straight to each replica, so that no case pays for the first calls' warm-up."""
    opening = text_of_ids(args.opening_ids, NOTES)
    for url in workers:
        for index in range(4):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Warm-up {index}. {opening}"}],
                "max_tokens": args.max_tokens,
            }
            response = http.post(f"{url}/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise BenchError(f"warm-up call to {url}: {response.status_code} {response.text[:300]}")


def run(url: str | None, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    """P8 on a pair of replicas of its own (`url`, the report's bench server, is not one of them), or --replica-urls."""
    if args.quick:
        args = parser().parse_args([*argv, *QUICK])
    started = time.monotonic()
    figure = Figure(
        "P8",
        "a client without a session header, straight to vLLM's router: its policies",
        command("p8_headerless.py", argv),
    )
    results = []
    with contextlib.ExitStack() as stack, httpx.Client(timeout=120) as http:
        workers = stack.enter_context(replicas(args.replica_urls))
        if len(workers) < 2:
            raise BenchError(f"P8 needs two replicas or more, got {workers}")
        placement = {url: worker_cpus(url) for url in workers}
        warm_up(workers, args, http)
        for policy, header in CASES:
            note(f"P8 {case_name(policy, header)}: {args.conversations} conversations of {args.turns} calls ...")
            results.append(run_case(workers, policy, header, args, http))
    add_table(figure, results, workers, args, placement)
    figure.data = {"cases": results, "workers": workers, "placement": placement}
    figure.seconds = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps({"command": figure.command, **figure.data}, indent=1) + "\n")
    return figure


def add_table(
    figure: Figure,
    results: Sequence[Mapping[str, Any]],
    workers: Sequence[str],
    args: argparse.Namespace,
    placement: Mapping[str, str],
) -> None:
    table = Table(
        f"{args.conversations} conversations of {args.turns} calls, {args.concurrency} at once, max_tokens "
        f"{args.max_tokens}, about {args.opening_ids} ids of notes in each opening; both prefix caches emptied "
        "before each case",
        [
            "policy",
            SESSION_HEADER,
            "seconds",
            "conversations/s",
            *affinity_headers(workers, "conversations"),
        ],
    )
    for r in results:
        table.add(
            r["policy"],
            "sent" if r["header"] else "none",
            r["seconds"],
            ratio(r["conversations"], r["seconds"]),
            *affinity_cells(r, workers, r["conversations"], r["conversations"]),
            digits=2,
        )
    figure.tables.append(table)
    figure.notes.append(METHOD.replace("\n", " "))
    figure.notes.append(
        replicas_named(workers, placement)
        + ". Conversations per replica: where each one's first call went; on one replica: those whose every call "
        "went to the same one. The own-history ceiling is what perfect affinity gets here (p7_routing.py)."
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = standalone_argv(argv)
    args = parser().parse_args(argv)
    figure = run(None, args, argv)
    print(figure.text())
    failed = [r for r in figure.data["cases"] if r["contiguous"] != r["conversations"]]
    if failed:
        raise SystemExit(
            f"P8: not every conversation contiguous in {[case_name(r['policy'], r['header']) for r in failed]}"
        )


if __name__ == "__main__":
    sys.exit(main())
