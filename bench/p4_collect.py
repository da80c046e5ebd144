"""P4: `ngt collect` rollouts per second through the gym vs a bare asyncio loop making the same model calls.

    .venv/bin/python bench/p4_collect.py                 # starts the hooked bench vLLM
    .venv/bin/python bench/p4_collect.py --vllm-url URL

The number_guess environment with the simple agent and the vllm_model adapter (token information on, splice: hook),
each its own process as `ngt run` starts them, and `ngt collect`'s loop (`nemo_gym_tok.collect.collect`, in this
process) at concurrency 64; rows are the environment's example game (each row's opening unique, its own seed,
max_output_tokens 64), 4 model calls per rollout (max_rounds 4). First an untimed run through a second, identical
adapter behind a recording proxy: it warms vLLM's prefix cache and records every chat body the adapter sent vLLM.
Then, alternating, timed runs of
  gym   `collect` through the agent (model calls, environment steps, verification, the rollout file);
  bare  one asyncio task per recorded episode, its recorded chat bodies posted in order straight to vLLM (each
        answer read and parsed), 64 episodes at a time: the same calls, messages and max_tokens.
Reported: rollouts and model calls per second, their ratio, and the gym's CPU milliseconds per model call (user +
system CPU of the head, adapter, environment and agent processes, plus the collector in this process), with what
vLLM's engine did in each run (prompt and generated tokens, prefix-cache hit share) to show the runs did the same
work.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from benchkit import hops as gym_hops
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.hops import RecordingProxy, adapter_instance, serve_app
from benchkit.metrics import engine_work, http_requests, scrape
from benchkit.server import JSON_HEADERS, MODEL, REPO, BenchError, note
from benchkit.timing import median, process_cpu_seconds, ratio

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.jsonl import read_jsonl

GAME = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"
GYM_PROCESSES = ("head", "policy_model", "number_guess", "number_guess_agent")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--rollouts", type=int, default=128, help="rollouts per run (default 128)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="timed runs of each kind, alternating (default 3)")
    return p


def rows(count: int, max_tokens: int) -> list[dict[str, Any]]:
    examples = read_jsonl(GAME)
    made = []
    for index in range(count):
        row = copy.deepcopy(examples[index % len(examples)])
        params = row["responses_create_params"]
        params["input"][-1]["content"] += f" (Game {index}.)"  # names the episode in every call's messages
        params["max_output_tokens"] = max_tokens
        params["seed"] = index
        made.append(row)
    return made


def episodes_of(bodies: list[bytes]) -> list[list[bytes]]:
    """Recorded chat bodies grouped by episode (the opening user message names it), each in call order."""
    grouped: dict[str, list[tuple[int, bytes]]] = {}
    for body in bodies:
        messages = loads_exact(body)["messages"]
        opening = next(m["content"] for m in messages if m.get("role") == "user")
        grouped.setdefault(str(opening), []).append((len(messages), body))
    return [[body for _, body in sorted(calls, key=lambda item: item[0])] for calls in grouped.values()]


async def bare(url: str, episodes: list[list[bytes]], concurrency: int) -> int:
    """Each episode's bodies in order, `concurrency` episodes at a time; returns the calls made."""
    limit = asyncio.Semaphore(concurrency)
    made = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def episode(bodies: list[bytes]) -> None:
            nonlocal made
            async with limit:
                for body in bodies:
                    answer = await http.post("/v1/chat/completions", content=body, headers=JSON_HEADERS)
                    if answer.status_code != 200:
                        raise BenchError(f"bare call answered HTTP {answer.status_code}: {answer.text[:300]}")
                    loads_exact(answer.content)
                    made += 1

        await asyncio.gather(*(episode(e) for e in episodes))
    return made


def gym_cpu(running: Any) -> dict[str, float]:
    return {
        child.name: process_cpu_seconds(child.process.pid) for child in running.children if child.name in GYM_PROCESSES
    }


def run(url: str, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    from nemo_gym_tok.collect import collect

    started = time.monotonic()
    figure = Figure("P4", "ngt collect vs a bare asyncio loop, same model calls", command("p4_collect.py", argv))
    proxy = RecordingProxy(url)
    agent = {"model_server": "policy_model", "resources_server": "number_guess", "max_steps": 6}
    with tempfile.TemporaryDirectory(prefix="ngt-bench-p4-") as scratch, serve_app(proxy.app()) as proxy_url:
        directory = Path(scratch)
        input_path = directory / "rows.jsonl"
        input_path.write_text("".join(json.dumps(row) + "\n" for row in rows(args.rollouts, args.max_tokens)))
        instances = {
            "policy_model": adapter_instance(url, splice="hook"),
            "policy_model_rec": adapter_instance(proxy_url, splice="hook"),
            "number_guess": {"resources_servers": {"number_guess": {"max_rounds": 4}}},
            "number_guess_agent": {"responses_api_agents": {"simple_agent": agent}},
            "number_guess_agent_rec": {
                "responses_api_agents": {"simple_agent": {**agent, "model_server": "policy_model_rec"}}
            },
        }
        with gym_hops.gym(instances) as running:
            note(f"P4: recording run ({args.rollouts} rollouts, concurrency {args.concurrency}) ...")
            summary = asyncio.run(
                collect(
                    input_path,
                    directory / "recorded.jsonl",
                    running.urls["number_guess_agent_rec"],
                    agent="number_guess_agent_rec",
                    concurrency=args.concurrency,
                    progress=False,
                    timeout=1200,
                )
            )
            if summary.failed:
                raise BenchError(f"the recording run failed {summary.failed} rollout(s): {summary.failures_path}")
            episodes = episodes_of([e.body for e in proxy.posts("/v1/chat/completions")])
            recorded_calls = sum(map(len, episodes))
            results: dict[str, list[dict[str, float]]] = {"gym": [], "bare": []}
            for index in range(args.runs):
                for kind in ("gym", "bare") if index % 2 == 0 else ("bare", "gym"):
                    note(f"P4: timed {kind} run {index + 1} of {args.runs} ...")
                    before = scrape(url)
                    cpu_before, own_before = gym_cpu(running), time.process_time()
                    wall = time.perf_counter()
                    if kind == "gym":
                        output = directory / f"gym-{index}.jsonl"
                        summary = asyncio.run(
                            collect(
                                input_path,
                                output,
                                running.urls["number_guess_agent"],
                                agent="number_guess_agent",
                                concurrency=args.concurrency,
                                progress=False,
                                timeout=1200,
                            )
                        )
                        if summary.failed:
                            raise BenchError(f"{summary.failed} rollout(s) failed: {summary.failures_path}")
                        rollouts = summary.done_now
                    else:
                        asyncio.run(bare(url, episodes, args.concurrency))
                        rollouts = len(episodes)
                    wall = time.perf_counter() - wall
                    own = time.process_time() - own_before
                    after = scrape(url)
                    cpu = {name: seconds - cpu_before[name] for name, seconds in gym_cpu(running).items()}
                    requests = http_requests(before, after)
                    model_calls = requests.get("/v1/chat/completions", 0)
                    results[kind].append(
                        {
                            "seconds": wall,
                            "rollouts": rollouts,
                            "calls": model_calls,
                            "vllm_requests": sum(requests.values()),
                            "cpu_ms": (own + (sum(cpu.values()) if kind == "gym" else 0.0)) * 1000,
                            "collector_ms": own * 1000,
                            **{f"{name}_ms": seconds * 1000 for name, seconds in cpu.items()},
                            **engine_work(before, after),
                        }
                    )

    table = Table(
        f"{args.rollouts} rollouts per run, concurrency {args.concurrency}, max_tokens {args.max_tokens}",
        [
            "run",
            "seconds",
            "rollouts",
            "model calls",
            "rollouts/s",
            "calls/s",
            "CPU ms / call",
            "vLLM requests / call",
            "prompt tokens",
            "generated tokens",
            "prefix-cache hits",
        ],
    )
    for kind in ("gym", "bare"):
        for number, r in enumerate(results[kind], 1):
            table.add(
                f"{kind} {number}",
                r["seconds"],
                r["rollouts"],
                r["calls"],
                r["rollouts"] / r["seconds"],
                r["calls"] / r["seconds"],
                ratio(r["cpu_ms"], r["calls"]),
                ratio(r["vllm_requests"], r["calls"]),
                int(r["prompt_tokens"]),
                int(r["generation_tokens"]),
                f"{r['cache_hit']:.1%}",
                digits=2,
            )
    figure.tables.append(table)

    def med(kind: str, key: str) -> float:
        return median([r[key] / r["seconds"] if key in ("rollouts", "calls") else r[key] for r in results[kind]])

    summary_table = Table("Medians", ["measure", "gym", "bare", "gym/bare"])
    for label, key in (("rollouts/s", "rollouts"), ("model calls/s", "calls")):
        gym, bare_ = med("gym", key), med("bare", key)
        summary_table.add(label, gym, bare_, ratio(gym, bare_), digits=2)
    per_call = {kind: median([ratio(r["cpu_ms"], r["calls"]) for r in results[kind]]) for kind in results}
    summary_table.add(
        "client-side CPU ms per model call",
        per_call["gym"],
        per_call["bare"],
        ratio(per_call["gym"], per_call["bare"]),
        digits=2,
    )
    figure.tables.append(summary_table)
    breakdown = Table("Gym CPU ms per model call, by process (median over the gym runs)", ["process", "CPU ms / call"])
    for name in ("collector", *GYM_PROCESSES):
        breakdown.add(
            name, median([ratio(r.get(f"{name}_ms", float("nan")), r["calls"]) for r in results["gym"]]), digits=2
        )
    figure.tables.append(breakdown)
    figure.notes.append(
        f"The recording run made {recorded_calls} model calls in {len(episodes)} episodes; the bare loop replays "
        "them. CPU of the gym: user + system time of its processes (/proc) during the run, plus this process's "
        "(the collector's) own; of the bare loop: this process's. Both runs hit vLLM's prefix cache warmed by the "
        "recording run; rows carry a seed each, so the gym's runs regenerate what was recorded."
    )
    figure.data = results
    figure.seconds = time.monotonic() - started
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
