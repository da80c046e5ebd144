"""P7: what vLLM's router buys: prefix-cache hit rate and rollouts/s, consistent_hash vs round_robin, two replicas."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from benchkit import hops as gym_hops
from benchkit.figures import Figure, Table, command, judged, standalone_argv
from benchkit.gym_processes import api_server_pid, cpu_seconds
from benchkit.metrics import Metrics, engine_work, http_requests, scrape
from benchkit.replicas import replicas, reset_prefix_cache, worker_cpus
from benchkit.server import MODEL, REPO, BenchError, note, text_of_ids
from benchkit.timing import ratio
from targets import Reading, text

from nemo_gym_tok.common.jsonl import read_jsonl

GAME = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"
ENVIRONMENT, AGENT = "number_guess", "number_guess_agent"
POLICIES = ("consistent_hash", "round_robin")
SHORT = {"consistent_hash": "CH", "round_robin": "RR"}
NOTES = "Note {n}: a guess below the secret is answered Higher., one above it Lower.; halve the range each turn. "
QUICK = ["--rollouts", "16", "32", "--rounds", "1", "--warmup", "2"]

METHOD = """\
Two hooked bench vLLMs (the bench server's flags, each on its own port, VLLM_SERVER_DEV_MODE=1 for POST
/reset_prefix_cache; prefix caching on, vLLM's default, 128-id blocks on the CPU build) and, per policy, one gym as
`ngt run` starts it: the vllm_model adapter (splice: hook) behind the vllm-router that the launcher starts in front of
both replicas with that policy (its `router: {worker_urls, policy}` field), the number_guess environment and the
simple agent, each its own process; `ngt collect`'s loop in this process. The adapter sends every call's
conversation key as `x-session-id`: consistent_hash keys on it, round_robin ignores it. Rows: the environment's
example games with --calls model calls per rollout (max_rounds; a random model seldom guesses right, so nearly every
rollout makes all of them), max_output_tokens --max-tokens, a seed each, and the opening user message starting with
the game's own tag (unique per run, policy and row) followed by about --opening-ids ids of notes: no two rollouts share
a full cache block, so every prefix-cache hit is a rollout finding its own earlier turns on the replica it is sent
to. Both gyms run at once; each does a warm-up collection first. Then, per concurrency, --rounds rounds: in each, the
policies take turns (the order rotated each round, so a drift in the machine's load hits both alike), and before each
collection both replicas' prefix caches are emptied. The hit rate: vLLM's vllm:prefix_cache_hits over
vllm:prefix_cache_queries (prompt ids looked up / found cached), deltas over the collection summed over both replicas;
rollouts per second: rollouts over the collection's wall time. Every rollout's record is checked for token contiguity
(nemo_gym_tok.records.contiguity.check_file) and says which replica served each call (`replica`)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__ + "\n\n" + METHOD, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replica-urls", nargs="+", help=f"hooked vLLMs serving the bench model as {MODEL!r} (else two)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="default 8 32")
    p.add_argument(
        "--rollouts",
        type=int,
        nargs="+",
        default=[48, 64],
        help="rollouts per run, one per --concurrency (default 48 64)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds a run is split into, policies alternating (default 2)")
    p.add_argument("--calls", type=int, default=4, help="model calls per rollout (number_guess max_rounds; default 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--opening-ids", type=int, default=384, help="notes in each opening user message, in ids")
    p.add_argument("--warmup", type=int, default=4, help="warm-up rollouts per gym before the first run")
    p.add_argument("--quick", action="store_true", help=f"a short run: {' '.join(QUICK)}")
    return p


def rows(count: int, first: int, tag: str, max_tokens: int, opening: str) -> list[dict[str, Any]]:
    """Rows `first` to `first + count` of the example games, each opening with its own tag (so no rollout shares a
    cache block with another, nor with another run's), then `opening`."""
    games = read_jsonl(GAME)
    made = []
    for index in range(first, first + count):
        row = copy.deepcopy(games[index % len(games)])
        params = row["responses_create_params"]
        user = params["input"][-1]
        user["content"] = f"Game {index} ({tag}). {opening}{user['content']}"
        params["max_output_tokens"] = max_tokens
        params["seed"] = index
        made.append(row)
    return made


def instances(workers: Sequence[str], policy: str, calls: int) -> dict[str, Any]:
    """A gym config: the adapter behind a router (policy) the launcher starts in front of `workers`."""
    adapter = {
        "model": MODEL,
        "return_token_id_information": True,
        "splice": "hook",
        "router": {"worker_urls": list(workers), "policy": policy},
    }
    agent = {"model_server": "policy_model", "resources_server": ENVIRONMENT, "max_steps": calls + 2}
    return {
        "policy_model": {"responses_api_models": {"vllm_model": adapter}},
        ENVIRONMENT: {"resources_servers": {ENVIRONMENT: {"max_rounds": calls}}},
        AGENT: {"responses_api_agents": {"simple_agent": agent}},
    }


def runs_plan(concurrencies: Sequence[int], rollouts: Sequence[int], rounds: int) -> list[tuple[int, list[int]]]:
    """Per concurrency, the sizes of its rounds (a run of `rollouts` split into `rounds`, the rollouts left over to
    the first rounds; never more rounds than rollouts)."""
    if len(rollouts) != len(concurrencies):
        raise BenchError(f"--rollouts needs one count per --concurrency ({len(concurrencies)}), got {len(rollouts)}")
    if bad := [c for c in (*concurrencies, *rollouts, rounds) if c < 1]:
        raise BenchError(f"--concurrency, --rollouts and --rounds must be at least 1, got {bad[0]}")
    plan = []
    for concurrency, count in zip(concurrencies, rollouts, strict=True):
        parts = min(rounds, count)
        plan.append((concurrency, [count // parts + (1 if k < count % parts else 0) for k in range(parts)]))
    return plan


def spread(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Where a collection's calls went: model calls per replica, rollouts per replica their first call went to, and
    rollouts whose calls all went to one replica (each call's bundle names its `replica`)."""
    turns: Counter[str] = Counter()
    sessions: Counter[str] = Counter()
    one_replica = 0
    for record in records:
        served = [
            str(item.get("replica") or "?")
            for item in record["response"]["output"]
            if isinstance(item, dict) and item.get("generation_token_ids") is not None
        ]
        if not served:
            continue
        turns.update(served)
        sessions[served[0]] += 1
        one_replica += len(set(served)) == 1
    return {"turns": turns, "sessions": sessions, "one_replica": one_replica}


def block_size(metrics: Metrics) -> int | None:
    """The KV cache block size a vLLM reports (`vllm:cache_config_info`'s block_size label): prefix-cache hits come
    in whole blocks."""
    for (name, labels), _ in metrics.items():
        if name == "vllm:cache_config_info":
            found = dict(labels).get("block_size", "")
            return int(found) if found.isdigit() else None
    return None


def own_history_ceiling(calls: Sequence[tuple[int, int]], block: int) -> int:
    """The prompt ids a rollout's calls (prompt ids, generated ids; in order) can find in the prefix cache from its own
    history: each call after the first, sent to the replica that ran the call before it, finds that call's full
    blocks (its prompt and all but its last generated id went through the model), but never the block of its own last
    prompt id (vLLM computes that one). The first call finds nothing: no two rollouts share a block here."""
    return sum(
        min((prompt + generated - 1) // block, (following - 1) // block) * block
        for (prompt, generated), (following, _) in zip(calls, calls[1:])
    )


def fleet_work(before: Mapping[str, Metrics], after: Mapping[str, Metrics]) -> dict[str, float]:
    """What the replicas' engines did between two scrapes of each, summed over the replicas: prompt and generated
    ids, prefix-cache queries and hits (ids), the hit rate over them all, and the chat calls they answered."""
    total = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "cache_hits": 0.0, "cache_queries": 0.0, "calls": 0.0}
    for url, now in after.items():
        work = engine_work(before[url], now)
        for key in ("prompt_tokens", "generation_tokens", "cache_hits", "cache_queries"):
            total[key] += work[key]
        total["calls"] += http_requests(before[url], now).get("/v1/chat/completions", 0)
    total["cache_hit"] = ratio(total["cache_hits"], total["cache_queries"])
    return total


def merged(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's rounds at one concurrency as one run: counts, times and spreads summed, the hit rate over all the
    queries (not the mean of the rounds' rates)."""
    run: dict[str, Any] = {"turns": Counter(), "sessions": Counter(), "rounds": len(parts)}
    for part in parts:
        for key, value in part.items():
            if key in ("turns", "sessions"):
                run[key].update(value)
            elif key not in ("cache_hit", "ceiling_rate", "failures"):
                run[key] = run.get(key, 0) + value
    run["cache_hit"] = ratio(run.get("cache_hits", 0.0), run.get("cache_queries", 0.0))
    run["ceiling_rate"] = ratio(run.get("ceiling", float("nan")), run.get("cache_queries", 0.0))
    run["failures"] = [f for part in parts for f in part.get("failures", [])]
    return run


def per_second(run: Mapping[str, Any]) -> float:
    return ratio(run["rollouts"], run["seconds"])


def collect_rows(gym: Any, directory: Path, name: str, made: list[dict[str, Any]], concurrency: int) -> Path:
    from nemo_gym_tok.collect import collect

    rows_path = directory / f"{name}-rows.jsonl"
    rows_path.write_text("".join(json.dumps(row) + "\n" for row in made))
    output = directory / f"{name}.jsonl"
    summary = asyncio.run(
        collect(
            rows_path,
            output,
            gym.urls[AGENT],
            agent=AGENT,
            concurrency=concurrency,
            progress=False,
            timeout=3600,
            auth_token=gym.auth_token,
        )
    )
    if summary.failed or summary.done_now != len(made):
        raise BenchError(f"{name}: {summary.done_now} of {len(made)} rollouts done: {summary.failures_path}")
    return output


def timed_collection(
    gym: Any,
    workers: Sequence[str],
    http: httpx.Client,
    directory: Path,
    name: str,
    made: list[dict[str, Any]],
    concurrency: int,
) -> dict[str, Any]:
    """Both replicas' prefix caches emptied, then one collection of `made` through `gym`, with what the replicas'
    engines did meanwhile (/metrics), where its calls went and whether every rollout is contiguous."""
    from nemo_gym_tok.records.contiguity import bundled_turns, check_file

    reset = all([reset_prefix_cache(url, http) for url in workers])
    before = {url: scrape(url, http) for url in workers}
    pids = [api_server_pid(url) for url in workers]
    cpu = sum(cpu_seconds(pid) for pid in pids)
    wall = time.perf_counter()
    output = collect_rows(gym, directory, name, made, concurrency)
    wall = time.perf_counter() - wall
    cpu = sum(cpu_seconds(pid) for pid in pids) - cpu
    after = {url: scrape(url, http) for url in workers}
    report = check_file(output)
    records = read_jsonl(output)
    where = spread(records)
    block = block_size(after[workers[0]]) or 0
    ceiling = sum(
        own_history_ceiling(
            [(len(t.prompt_token_ids), len(t.generation_token_ids)) for t in bundled_turns(record)], block
        )
        for record in records
    )
    return {
        "seconds": wall,
        "rollouts": len(made),
        "contiguous": report.contiguous,
        "checked": report.rollouts,
        "failures": [] if report.ok else [f"{name}: {report.format()}"],
        "reset": int(reset),
        "api_cpu_s": cpu,
        "ceiling": ceiling if block else float("nan"),
        **where,
        **fleet_work(before, after),
    }


def run(url: str | None, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    """P7 on its own pair of replicas (`url`, the report's one bench server, is not one of them: the two must start
    alike, and their caches are reset between runs), or on --replica-urls."""
    if args.quick:
        args = parser().parse_args([*argv, *QUICK])
    started = time.monotonic()
    figure = Figure(
        "P7", "vLLM's router: consistent_hash vs round_robin on two hooked replicas", command("p7_routing.py", argv)
    )
    plan = runs_plan(args.concurrency, args.rollouts, args.rounds)
    opening = text_of_ids(args.opening_ids, NOTES)
    parts: dict[str, dict[int, list[dict[str, Any]]]] = {p: {c: [] for c, _ in plan} for p in POLICIES}
    with (
        tempfile.TemporaryDirectory(prefix="ngt-bench-p7-") as scratch,
        contextlib.ExitStack() as stack,
        httpx.Client(timeout=120) as http,
    ):
        directory = Path(scratch)
        workers = stack.enter_context(replicas(args.replica_urls))
        if len(workers) < 2:
            raise BenchError(f"P7 needs two replicas or more, got {workers}")
        placement = {url: worker_cpus(url) for url in workers}
        gyms = {}
        for policy in POLICIES:
            note(f"P7 {policy}: starting its gym behind a vllm-router in front of {', '.join(workers)} ...")
            gyms[policy] = stack.enter_context(gym_hops.gym(instances(workers, policy, args.calls)))
        first = 0
        for policy in POLICIES:
            note(f"P7 {policy}: warm-up ({args.warmup} rollouts) ...")
            warm = rows(args.warmup, first, f"{policy} warm-up", args.max_tokens, opening)
            collect_rows(gyms[policy], directory, f"{SHORT[policy]}-warmup", warm, max(1, min(args.warmup, 8)))
            first += args.warmup
        turn = 0
        for concurrency, sizes in plan:
            for round_number, size in enumerate(sizes):
                shift = turn % len(POLICIES)  # the policies take turns, the order rotated each round
                turn += 1
                for policy in POLICIES[shift:] + POLICIES[:shift]:
                    name = f"{SHORT[policy]}-c{concurrency}-r{round_number}"
                    note(f"P7 {policy}: {size} of {sum(sizes)} rollouts at concurrency {concurrency} ...")
                    made = rows(size, first, f"{policy} c{concurrency} r{round_number}", args.max_tokens, opening)
                    parts[policy][concurrency].append(
                        timed_collection(gyms[policy], workers, http, directory, name, made, concurrency)
                    )
                first += size
    results = {policy: {c: merged(p) for c, p in by.items()} for policy, by in parts.items()}
    add_tables(figure, results, workers, args, placement)
    figure.data = {"runs": results, "workers": workers, "placement": placement, "readings": readings(results)}
    figure.seconds = time.monotonic() - started
    return figure


def share(counts: Mapping[str, int], workers: Sequence[str]) -> str:
    """Counts per replica in the workers' order (A / B ...), anything else (a call naming no replica) after."""
    cells = [str(counts.get(url, 0)) for url in workers]
    other = sum(n for url, n in counts.items() if url not in workers)
    return " / ".join(cells) + (f" (+{other} unnamed)" if other else "")


def affinity_headers(workers: Sequence[str], sessions: str) -> list[str]:
    """The headers of affinity_cells, `sessions` naming what a session is (rollouts, conversations)."""
    names = " / ".join(chr(ord("A") + i) for i in range(len(workers)))
    return [
        "cache queries",
        "cache hits",
        "hit rate",
        "own-history ceiling",
        f"{sessions} per replica ({names})",
        f"calls per replica ({names})",
        f"{sessions} on one replica",
        "contiguous",
    ]


def affinity_cells(run: Mapping[str, Any], workers: Sequence[str], sessions: int, checked: int) -> list[Any]:
    """The cells P7's and P8's tables share for one run: cache queries and hits, the hit rate beside the own-history
    ceiling, sessions and calls per replica, sessions kept on one replica, and how many of `checked` are contiguous."""
    return [
        int(run["cache_queries"]),
        int(run["cache_hits"]),
        f"{run['cache_hit']:.1%}",
        f"{run['ceiling_rate']:.1%}",
        share(run["sessions"], workers),
        share(run["turns"], workers),
        f"{ratio(run['one_replica'], sessions):.0%}",
        f"{run['contiguous']}/{checked}",
    ]


def replicas_named(workers: Sequence[str], placement: Mapping[str, str] | None) -> str:
    """ "Replicas: A url (its vLLM worker pinned to CPU n), B ...": the names the tables' "A / B" columns use."""
    return "Replicas: " + ", ".join(
        f"{chr(ord('A') + i)} {url} (its vLLM worker pinned to CPU {(placement or {}).get(url, 'unknown')})"
        for i, url in enumerate(workers)
    )


def add_tables(
    figure: Figure,
    results: Mapping[str, Mapping[int, Mapping[str, Any]]],
    workers: Sequence[str],
    args: Any,
    placement: Mapping[str, str] | None = None,
) -> None:
    table = Table(
        f"{args.calls} model calls per rollout at most, max_tokens {args.max_tokens}, about {args.opening_ids} ids "
        f"of notes in each opening; a run in {args.rounds} round(s), the policies taking turns, both replicas' "
        "prefix caches emptied before each",
        [
            "policy",
            "concurrency",
            "rollouts",
            "seconds",
            "rollouts/s",
            "calls/rollout",
            "prompt ids/call",
            "API servers CPU ms/call",
            *affinity_headers(workers, "rollouts"),
        ],
    )
    for policy, by in results.items():
        for concurrency, r in by.items():
            table.add(
                policy,
                concurrency,
                r["rollouts"],
                r["seconds"],
                per_second(r),
                ratio(r["calls"], r["rollouts"]),
                ratio(r["prompt_tokens"], r["calls"]),
                ratio(r["api_cpu_s"] * 1000, r["calls"]),
                *affinity_cells(r, workers, r["rollouts"], r["checked"]),
                digits=2,
            )
    figure.tables.append(table)
    ratios = Table(
        "consistent_hash against round_robin",
        [
            "concurrency",
            "hit rate CH",
            "hit rate RR",
            "hit rate CH/RR",
            "rollouts/s CH",
            "rollouts/s RR",
            "rollouts/s CH/RR",
        ],
    )
    for concurrency, ch, rr in paired(results):
        ratios.add(
            concurrency,
            f"{ch['cache_hit']:.1%}",
            f"{rr['cache_hit']:.1%}",
            ratio(ch["cache_hit"], rr["cache_hit"]),
            per_second(ch),
            per_second(rr),
            ratio(per_second(ch), per_second(rr)),
            digits=3,
        )
    figure.tables.append(ratios)
    figure.notes.append(METHOD.replace("\n", " "))
    figure.notes.append(
        replicas_named(workers, placement)
        + ". Rollouts per replica: where each rollout's first call went; rollouts on one replica: those whose every "
        "call went to the same one. Cache queries and hits count prompt ids, summed over both replicas. Own-history "
        "ceiling: the hits every call after a rollout's first would get on the replica that ran its previous call "
        "(that call's full cache blocks, never the block of the call's own last prompt id), over the queries: what "
        "perfect session affinity gets here; the first call of a rollout finds nothing. API servers CPU: user + "
        "system time of both replicas' vLLM API server processes (/proc; the hook splices there), not their engine "
        "cores or workers."
    )
    if not all(r.get("reset") == r.get("rounds") for by in results.values() for r in by.values()):
        figure.notes.append(
            "The replicas have no /reset_prefix_cache (started without VLLM_SERVER_DEV_MODE=1): each run's rows are "
            "tagged apart, so no run finds another's blocks, but the caches were not emptied between runs."
        )
    figure.notes += [
        f"NOT contiguous: {failure}" for by in results.values() for r in by.values() for failure in r["failures"]
    ]


def paired(
    results: Mapping[str, Mapping[int, Mapping[str, Any]]],
) -> list[tuple[int, Mapping[str, Any], Mapping[str, Any]]]:
    """(concurrency, consistent_hash's run, round_robin's run) for every concurrency both ran."""
    ch, rr = results.get("consistent_hash", {}), results.get("round_robin", {})
    return [(c, ch[c], rr[c]) for c in ch if c in rr]


def readings(results: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Reading]:
    """The lowest consistent_hash / round_robin hit-rate ratio over the concurrencies."""
    pairs = [(ratio(ch["cache_hit"], rr["cache_hit"]), f"concurrency {c}") for c, ch, rr in paired(results)]
    pairs = [(value, where) for value, where in pairs if value == value]
    if not pairs:
        return {}
    return {"P7.hit_rate.ch/rr.min": Reading(*min(pairs))}


def main(argv: Sequence[str] | None = None) -> None:
    argv = standalone_argv(argv)
    args = parser().parse_args(argv)
    figure = run(None, args, argv)
    print(figure.text())
    print("\n" + text(judged([figure])))


if __name__ == "__main__":
    sys.exit(main())
