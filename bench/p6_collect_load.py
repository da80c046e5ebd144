"""P6: `ngt collect` under load: long tool-calling episodes at several concurrencies, hook vs adapter vs no splice.

    .venv/bin/python bench/p6_collect_load.py                     # starts the hooked, then a stock bench vLLM
    .venv/bin/python bench/p6_collect_load.py --vllm-url URL --stock-url URL
    .venv/bin/python bench/p6_collect_load.py --quick

The grid_navigation environment with the simple agent and the vllm_model adapter, each its own process as `ngt run`
starts them, and `ngt collect`'s loop (`nemo_gym_tok.collect.collect`, in this process). Every row is one of the
environment's example grids with tool_choice: required, so every model call is a tool call and nothing ends the
episode before the agent's max_steps (--calls model calls per rollout); max_output_tokens --max-tokens; a seed per
row; the system message carries --opening-ids ids of reference text (the same in every row, so vLLM's prefix cache
holds it once) to bring the episode to about 16k ids at its end. Three setups, one gym each:
  hook      the hooked vLLM (`ngt vllm-serve`), adapter `splice: hook`, the agent sends each call's bundle back;
  adapter   a stock vLLM, adapter `splice: adapter` (its template proven once per scope, no /tokenize per turn);
  none      the same stock vLLM and adapter, the agent with `send_token_bundles: false`: no bundle goes back, so no
            prefix reaches the adapter, which asks vLLM to template the whole history every call (re-tokenized,
            drift-prone: the floor a user without the splice runs). Token ids still come back on every answer.
All the setups' gyms run at once (and both servers); each gym does a warm-up collection, then the RSS of every gym
process is read. Then, per --concurrency from the highest down, one collection through each setup in turn (the order
rotated per concurrency; the same rows and seeds for every setup, tagged per setup and concurrency so that no run finds
another's history in the prefix cache), each gym's RSS read after its run; then the RSS once more at the end. A run
has max(--waves x concurrency, --min-rollouts) rollouts: by default one wave at 32 and 64 (a wave's rollouts all make
--calls calls, so they run in step and one wave has no ramp to amortize) and three at 8, where one wave is too short
to time. A run of several waves is collected a wave at a time, the setups taking turns wave by wave (the order
rotated each round), and its figures are the sums over its waves: the same rollouts as one run of them all, but a
drift in the machine's load over the minutes the runs take hits every setup alike, as it would not if each setup ran
its waves back to back.
Reported per setup and concurrency: rollouts and generated tokens per second (vLLM's /metrics), the vLLM API
server's CPU per model call (/proc), and the ratios hook / none and adapter / none of rollouts per second.
Memory: the target (adapter and agent grow < 10%) is about memory that grows with the work done, so it is judged from
the RSS after the first run, at the highest concurrency, to the RSS at the end: the first run brings each process to
the peak of its in-flight work (at 64, 64 histories of 16k ids, their request and answer bodies at once), and glibc's
malloc keeps most of that freed memory mapped, so the growth from the warm-up measures the peak, not what stays. The
runs after it add work at a lower peak. (Issue 22: a probe of the agent and the adapter over repeated runs at 32 saw
their live Python objects and malloc's bytes in use flat run over run while RSS stayed near the first run's, and
malloc_trim gave a third of it and more back.) RSS cannot see a leak smaller than the freed memory the peak left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchkit import hops as gym_hops
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.gym_processes import api_server_pid, cpu_seconds, rss_kib
from benchkit.hops import adapter_instance
from benchkit.metrics import engine_work, http_requests, scrape
from benchkit.server import MODEL, REPO, BenchError, note, text_of_ids, vllm_server
from benchkit.timing import median, ratio
from targets import Reading

from nemo_gym_tok.common.jsonl import read_jsonl

GRIDS = REPO / "resources_servers" / "grid_navigation" / "data" / "example.jsonl"
ENVIRONMENT, AGENT = "grid_navigation", "grid_navigation_agent"
GYM_PROCESSES = ("head", "policy_model", ENVIRONMENT, AGENT)
SETUPS = ("hook", "adapter", "none")
SETUP_TEXT = {
    "hook": "hooked vLLM, splice: hook",
    "adapter": "stock vLLM, splice: adapter",
    "none": "stock vLLM, no splice (send_token_bundles: false)",
}
FILLER = "Reference note {n}: a wall blocks one cell; the edge of the grid blocks every move beyond it. "
QUICK = ["--concurrency", "8", "32", "--calls", "6"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--stock-url", help="a stock vLLM serving the bench model (else one is started after the hook's)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)} (default all)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64], help="default 8 32 64 (run 64 first)")
    p.add_argument(
        "--waves", type=float, default=1.0, help="rollouts per run: at least waves x concurrency (default 1)"
    )
    p.add_argument("--min-rollouts", type=int, default=24, help="rollouts per run: at least this many (default 24)")
    p.add_argument("--calls", type=int, default=20, help="model calls per rollout (the agent's max_steps; default 20)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--opening-ids", type=int, default=14300, help="reference text in the system message, in ids")
    p.add_argument("--warmup", type=int, default=4, help="warm-up rollouts per setup before the first RSS reading")
    p.add_argument("--quick", action="store_true", help=f"a short run: {' '.join(QUICK)}")
    return p


def rows(count: int, first: int, tag: str, max_tokens: int, reference: str) -> list[dict[str, Any]]:
    grids = read_jsonl(GRIDS)
    made = []
    for index in range(first, first + count):
        row = copy.deepcopy(grids[index % len(grids)])
        params = row["responses_create_params"]
        if reference:
            params["input"][0]["content"] += "\n\n" + reference
        params["input"][-1]["content"] += f" (Game {index}, {tag}.)"  # unique history per run: no cross-run cache hit
        params["max_output_tokens"] = max_tokens
        params["seed"] = index
        made.append(row)
    return made


def instances(setup: str, url: str, calls: int) -> dict[str, Any]:
    agent = {"model_server": "policy_model", "resources_server": ENVIRONMENT, "max_steps": calls}
    if setup == "none":
        agent["send_token_bundles"] = False  # no bundle in the history: no prefix, the whole history re-templated
    return {
        "policy_model": adapter_instance(url, splice="hook" if setup == "hook" else "adapter"),
        ENVIRONMENT: {"resources_servers": {ENVIRONMENT: {}}},
        AGENT: {"responses_api_agents": {"simple_agent": agent}},
    }


def rollouts_per_run(concurrency: int, waves: float, minimum: int) -> int:
    """Rollouts one timed run collects at `concurrency`: `waves` waves, and at least `minimum` (a low concurrency's
    wave is over in seconds)."""
    return max(1, round(waves * concurrency), minimum)


def concurrency_order(concurrencies: Sequence[int]) -> list[int]:
    """The runs' concurrencies, the highest first: its run takes every process to its peak of in-flight memory, so
    the runs after it show what memory the work leaves behind."""
    if bad := [c for c in concurrencies if c < 1]:
        raise BenchError(f"--concurrency must be at least 1, got {bad[0]}")
    return sorted(set(concurrencies), reverse=True)


def gym_rss(running: Any) -> dict[str, int]:
    return {child.name: rss_kib(child.process.pid) for child in running.children if child.name in GYM_PROCESSES}


def collect_rows(
    running: Any, directory: Path, name: str, made: list[dict[str, Any]], concurrency: int
) -> tuple[int, list[int], int]:
    """Collects `made`; returns the rollouts done, each one's ids at its end (the last call's prompt + answer) and the
    model calls whose prompt was spliced (by the hook or the adapter)."""
    from nemo_gym_tok.collect import collect

    input_path = directory / f"{name}-rows.jsonl"
    input_path.write_text("".join(json.dumps(row) + "\n" for row in made))
    summary = asyncio.run(
        collect(
            input_path,
            directory / f"{name}.jsonl",
            running.urls[AGENT],
            agent=AGENT,
            concurrency=concurrency,
            progress=False,
            timeout=3600,
        )
    )
    if summary.failed:
        raise BenchError(f"{summary.failed} rollout(s) of {name} failed: {summary.failures_path}")
    ends, spliced = [], 0
    for record in read_jsonl(directory / f"{name}.jsonl"):
        calls = [i for i in record["response"]["output"] if "generation_token_ids" in i]
        spliced += sum(1 for i in calls if (i.get("prefix_splice") or {}).get("applied"))
        if calls:
            last = calls[-1]
            ends.append(
                last.get("prompt_prefix_length", 0)
                + len(last.get("prompt_suffix_token_ids", []))
                + len(last["generation_token_ids"])
            )
    return summary.done_now, ends, spliced


def round_sizes(count: int, concurrency: int) -> list[int]:
    """A run of `count` rollouts at `concurrency` as rounds of one wave each (the last one takes what is left over)."""
    rounds = max(1, count // max(1, concurrency))
    return [count // rounds + (1 if k < count % rounds else 0) for k in range(rounds)]


def merged_run(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's rounds at one concurrency as one run: every count and time summed, the prefix-cache share over all
    its queries, the median rollout's ids at the end over all its rollouts."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in ("ends", "cache_hit"):
                merged[key] = merged.get(key, 0) + value
    merged["end_ids"] = median([end for part in parts for end in part["ends"]])
    merged["cache_hit"] = ratio(merged["cache_hits"], merged["cache_queries"])
    merged["rounds"] = len(parts)
    return merged


def timed_collection(
    setup: Setup, directory: Path, concurrency: int, made: list[dict[str, Any]], round_number: int = 0
) -> dict[str, Any]:
    """One collection of `made` (round `round_number` of its run) through `setup`'s gym, with what its vLLM did
    meanwhile (/metrics, /proc). Each round collects into its own output: a file of an earlier round would be
    resumed, not collected anew."""
    name = f"{setup.name}-c{concurrency}-r{round_number}"
    before, api_before = scrape(setup.url), cpu_seconds(setup.api_pid)
    wall = time.perf_counter()
    done, ends, spliced = collect_rows(setup.running, directory, name, made, concurrency)
    wall = time.perf_counter() - wall
    after, api_after = scrape(setup.url), cpu_seconds(setup.api_pid)
    requests = http_requests(before, after)
    return {
        "seconds": wall,
        "rollouts": done,
        "calls": requests.get("/v1/chat/completions", 0),
        "vllm_requests": sum(requests.values()),
        "api_cpu_s": api_after - api_before,
        "ends": ends,
        "spliced_calls": spliced,
        **{f"requests {handler}": count for handler, count in requests.items()},
        **engine_work(before, after),
    }


@dataclass
class Setup:
    """One setup's running gym, the vLLM it calls, and that vLLM's API server process."""

    name: str
    url: str
    running: Any
    api_pid: int | None


def run(url: str, args: argparse.Namespace, argv: Sequence[str], stock_url: str | None = None) -> Figure:
    if args.quick:
        args = parser().parse_args([*argv, *QUICK])
    started = time.monotonic()
    figure = Figure("P6", "ngt collect under load: long tool-calling episodes", command("p6_collect_load.py", argv))
    wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
    if unknown := sorted(set(wanted) - set(SETUPS)):
        raise BenchError(f"--setups: unknown {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    reference = text_of_ids(args.opening_ids, FILLER)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ngt-bench-p6-") as scratch, contextlib.ExitStack() as stack:
        directory = Path(scratch)
        setups: list[Setup] = []
        stock: str | None = None
        for name in (s for s in SETUPS if s in wanted):
            if name != "hook" and stock is None:
                stock = stack.enter_context(vllm_server(stock_url, hook=False))
            server = url if name == "hook" else str(stock)
            if (pid := api_server_pid(server)) is None:
                note(f"P6: no single vLLM API server process found for {server}: its CPU is not measured")
            setups.append(
                Setup(name, server, stack.enter_context(gym_hops.gym(instances(name, server, args.calls))), pid)
            )
        for setup in setups:
            note(f"P6 {setup.name}: warm-up ({args.warmup} rollouts) ...")
            warm = rows(args.warmup, 0, f"{setup.name} warm-up", args.max_tokens, reference)
            collect_rows(setup.running, directory, f"{setup.name}-warmup", warm, max(1, min(args.warmup, 8)))
            results[setup.name] = {"runs": {}, "rss_start_kib": gym_rss(setup.running), "rss_after_kib": {}}
        first = args.warmup
        turn = 0
        for concurrency in concurrency_order(args.concurrency):
            count = rollouts_per_run(concurrency, args.waves, args.min_rollouts)
            parts: dict[str, list[dict[str, Any]]] = {setup.name: [] for setup in setups}
            for round_number, size in enumerate(round_sizes(count, concurrency)):
                # Setups take turns, the order rotated each round, so drift in the machine's load hits each alike.
                shift = turn % len(setups)
                turn += 1
                for setup in setups[shift:] + setups[:shift]:
                    note(f"P6 {setup.name}: {size} of {count} rollouts at concurrency {concurrency} ...")
                    made = rows(size, first, f"{setup.name} c{concurrency}", args.max_tokens, reference)
                    parts[setup.name].append(timed_collection(setup, directory, concurrency, made, round_number))
                first += size
            for setup in setups:
                results[setup.name]["runs"][concurrency] = merged_run(parts[setup.name])
                results[setup.name]["rss_after_kib"][concurrency] = gym_rss(setup.running)
        for setup in setups:
            results[setup.name]["rss_end_kib"] = gym_rss(setup.running)
    add_tables(figure, results, args)
    figure.data = {"setups": results, "readings": readings(results)}
    figure.seconds = time.monotonic() - started
    return figure


def per_second(run: dict[str, float], key: str) -> float:
    return ratio(run[key], run["seconds"])


def add_tables(figure: Figure, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(
        f"{args.calls} model calls per rollout, max_tokens {args.max_tokens}, max({args.waves:g} x concurrency, "
        f"{args.min_rollouts}) rollouts per run (a run of several waves: one wave per round, the setups in turn, "
        "the order rotated each round; its figures summed over its rounds), the highest concurrency first",
        [
            "setup",
            "concurrency",
            "rollouts",
            "seconds",
            "rollouts/s",
            "generated tok/s",
            "calls/rollout",
            "spliced calls",
            "ids at the end",
            "prompt ids/call",
            "generated ids/call",
            "vLLM requests/call",
            "API server CPU ms/call",
            "prefix-cache hits",
        ],
    )
    for setup, result in results.items():
        for concurrency, r in result["runs"].items():
            table.add(
                setup,
                concurrency,
                r["rollouts"],
                r["seconds"],
                per_second(r, "rollouts"),
                per_second(r, "generation_tokens"),
                ratio(r["calls"], r["rollouts"]),
                f"{ratio(r['spliced_calls'], r['calls']):.0%}",
                r["end_ids"],
                ratio(r["prompt_tokens"], r["calls"]),
                ratio(r["generation_tokens"], r["calls"]),
                ratio(r["vllm_requests"], r["calls"]),
                ratio(r["api_cpu_s"] * 1000, r["calls"]),
                f"{r['cache_hit']:.1%}",
                digits=2,
            )
    figure.tables.append(table)
    if "none" in results:
        ratios = Table(
            "Rollouts per second against no splice (targets: hook >= 1.0, adapter >= 0.95)",
            ["concurrency", *(f"{s} / none" for s in ("hook", "adapter") if s in results)],
        )
        for concurrency, floor in results["none"]["runs"].items():
            cells = [
                ratio(per_second(results[s]["runs"][concurrency], "rollouts"), per_second(floor, "rollouts"))
                for s in ("hook", "adapter")
                if s in results and concurrency in results[s]["runs"]
            ]
            ratios.add(concurrency, *cells, digits=3)
        figure.tables.append(ratios)
    figure.tables.append(memory_table(results))
    figure.notes.append(
        "Setups: " + "; ".join(f"{s}: {SETUP_TEXT[s]}" for s in results) + ". Generated tokens and prompt ids from "
        "vLLM's /metrics over each run; ids at the end: the median rollout's last prompt + answer (its record); "
        "spliced calls: answers whose prefix_splice says applied. API server CPU: user + system time of the process "
        "serving the URL (/proc), not its engine core or workers. The stock setups share one server, each run's rows "
        "tagged apart; every row offers tools with tool_choice: required, so every answer is a tool call (a call "
        "ends where its JSON closes, short of max_tokens)."
    )
    figure.notes.append(
        "RSS (/proc VmRSS) of each gym process: start after the warm-up, then after its setup's run at each "
        "concurrency (the highest first), end after every run. The target judges the adapter (policy_model) and the "
        "agent from after the highest concurrency's run to the end: that run holds the peak of in-flight work "
        "(histories, bodies), whose freed memory glibc's malloc keeps mapped, so start -> end is mostly that peak. "
        "What grows after it grew with the work done (caches, kept state); a leak smaller than the kept free memory "
        "can hide in it."
    )


def memory_table(results: dict[str, dict[str, Any]]) -> Table:
    """Every gym process's RSS after the warm-up (start), after each run and at the end; the growth over the run and
    the growth the target judges (from after the run at the highest concurrency to the end)."""
    order = sorted({c for result in results.values() for c in result["rss_after_kib"]}, reverse=True)
    peak = f"after c{order[0]}" if order else "after the first run"
    memory = Table(
        f"RSS of the gym's processes, MiB (target: adapter and agent grow < 10% from {peak} to the end)",
        ["setup", "process", "start", *(f"after c{c}" for c in order), "end", "start -> end", f"{peak} -> end"],
    )
    for setup, result in results.items():
        after = result["rss_after_kib"]
        for name, start in result["rss_start_kib"].items():
            end = result["rss_end_kib"].get(name, 0)
            cells = [after[c].get(name, 0) / 1024 if c in after else float("nan") for c in order]
            memory.add(
                setup,
                name,
                start / 1024,
                *cells,
                end / 1024,
                f"{ratio(end - start, start):+.1%}",
                _judged(result, name),
            )
    return memory


def _judged(result: dict[str, Any], name: str) -> str:
    growth = rss_growth_after_peak(result, name)
    return "n/a" if growth is None else f"{growth:+.1%}"


def rss_growth_after_peak(result: dict[str, Any], name: str) -> float | None:
    """Process `name`'s RSS growth from after the run at the highest concurrency to the end of the run; None without
    a run after that one (one concurrency) or without the readings."""
    after = result["rss_after_kib"]
    if len(after) < 2:
        return None
    peak, end = after[max(after)].get(name), result["rss_end_kib"].get(name)
    if not peak or end is None:
        return None
    return ratio(end - peak, peak)


def readings(results: dict[str, dict[str, Any]]) -> dict[str, Reading]:
    """The worst (lowest) ratio over the concurrencies per setup, and the largest RSS growth of adapter and agent
    after the run at the highest concurrency (NaN, not measured, with one concurrency)."""
    found: dict[str, Reading] = {}
    if "none" in results:
        for setup in ("hook", "adapter"):
            if setup not in results:
                continue
            pairs = [
                (ratio(per_second(r, "rollouts"), per_second(results["none"]["runs"][c], "rollouts")), c)
                for c, r in results[setup]["runs"].items()
                if c in results["none"]["runs"]
            ]
            if pairs:
                value, concurrency = min(pairs)
                found[f"P6.{setup}_over_none.min"] = Reading(value, f"concurrency {concurrency}")
    growth = [
        (value, f"{setup} {name}, after c{max(result['rss_after_kib'])} -> end")
        for setup, result in results.items()
        for name in ("policy_model", AGENT)
        if (value := rss_growth_after_peak(result, name)) is not None
    ]
    if growth:
        found["P6.rss_growth.max"] = Reading(*max(growth))
    elif results:
        found["P6.rss_growth.max"] = Reading(math.nan, "one concurrency: no run after the highest one's")
    return found


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv, with_stock=True)


if __name__ == "__main__":
    sys.exit(main())
