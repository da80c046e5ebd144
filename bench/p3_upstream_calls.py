"""P3: HTTP requests reaching vLLM per model call through the vllm_model adapter, hook mode and splice: adapter.

    .venv/bin/python bench/p3_upstream_calls.py                       # starts the hooked bench vLLM
    .venv/bin/python bench/p3_upstream_calls.py --vllm-url URL [--stock-url URL2]

Real multi-turn conversations through the adapter (its own process, as `ngt run` starts it; token information on),
each turn sending the history with the last call's bundle: on /v1/chat/completions and on /v1/responses, with
`splice: hook` against the hooked vLLM, and (with --stock-url) with `splice: adapter` against a stock vLLM. The count
is vLLM's own `http_requests_total` (every handler but /metrics, /health and the like), read from /metrics before
and after each turn. Each adapter plays --episodes conversations per endpoint, one after the other, as a user's
rollouts reach one adapter: its one-off requests (/v1/models; with splice: adapter, one /tokenize per template scope
and server proving its local template) are paid once and amortized over them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from benchkit.episode import user_message
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.hops import adapter_instance, gym
from benchkit.metrics import http_requests, scrape
from benchkit.server import JSON_HEADERS, MODEL, BenchError
from targets import Reading

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from responses_api_models.vllm_model.local_splice import DEFAULT_PROOF_MAX_AGE_SECONDS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--stock-url", help="a stock vLLM serving it: also count splice: adapter")
    p.add_argument("--turns", type=int, default=10, help="turns per conversation (default 10)")
    p.add_argument("--episodes", type=int, default=5, help="conversations per adapter and endpoint (default 5)")
    p.add_argument("--max-tokens", type=int, default=16)
    return p


def without_bundle(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in BUNDLE_FIELDS}


def proved_here(result: dict[str, Any], new: list[dict[str, Any]]) -> bool:
    """Whether the answer's `prefix_splice.proof` says this request proved the template (a /tokenize)."""
    for telemetry in [result.get("prefix_splice")] + [item.get("prefix_splice") for item in new]:
        if isinstance(telemetry, dict) and isinstance(telemetry.get("proof"), dict):
            return bool(telemetry["proof"].get("this_request"))
    return False


def conversation(
    http: httpx.Client, adapter: str, vllm: str, endpoint: str, turns: int, max_tokens: int
) -> tuple[list[dict[str, int]], int]:
    """Play `turns` turns; per turn, the requests vLLM answered, by handler; and how many answers proved a template."""
    history: list[dict[str, Any]] = [user_message(0)]
    counts, proofs = [], 0
    for turn in range(1, turns + 1):
        if endpoint == "/v1/chat/completions":
            body = {"model": MODEL, "messages": history, "max_tokens": max_tokens, "seed": turn}
        else:
            body = {"model": MODEL, "input": history, "max_output_tokens": max_tokens, "seed": turn}
        before = scrape(vllm, http)
        answer = http.post(f"{adapter}{endpoint}", content=orjson.dumps(body), headers=JSON_HEADERS)
        after = scrape(vllm, http)
        if answer.status_code != 200:
            raise BenchError(f"the adapter answered HTTP {answer.status_code} on {endpoint}: {answer.text[:500]}")
        counts.append(http_requests(before, after))
        result = loads_exact(answer.content)
        new = [result["choices"][0]["message"]] if endpoint == "/v1/chat/completions" else result["output"]
        proofs += proved_here(result, new)
        if not any(all(k in item for k in BUNDLE_FIELDS) for item in new):
            raise BenchError(f"turn {turn} on {endpoint} came back without a token bundle")
        # The next request carries the last call's bundle only (earlier ones stripped), as the agent sends it.
        history = [without_bundle(item) for item in history] + new + [user_message(turn)]
    return counts, proofs


def per_spliced_turn(totals: list[int], episodes: int) -> float:
    """vLLM requests per spliced turn (every turn after an episode's first carries a bundle): 1 for the chat call,
    plus every request beyond one per model call (the one-offs: /v1/models, proofs), charged to the spliced turns."""
    spliced = len(totals) - episodes
    return 1 + (sum(totals) - len(totals)) / spliced if spliced > 0 else float("nan")


def run(url: str, args: argparse.Namespace, argv: Sequence[str], stock_url: str | None = None) -> Figure:
    started = time.monotonic()
    figure = Figure("P3", "vLLM requests per model call through the adapter", command("p3_upstream_calls.py", argv))
    table = Table(
        "HTTP requests vLLM answered per model call (vLLM's http_requests_total)",
        [
            "adapter",
            "endpoint",
            "episodes x turns",
            "requests / call",
            "requests / spliced turn",
            "first episode: / spliced turn",
            "min",
            "max",
            "first call",
            "proving answers",
            "by handler",
        ],
    )
    setups = [("splice: hook", "hook", url)] + ([("splice: adapter", "adapter", stock_url)] if stock_url else [])
    instances = {f"policy_{mode}": adapter_instance(base, splice=mode) for _, mode, base in setups}
    results: dict[str, Any] = {}
    readings: dict[str, Reading] = {}
    with gym(instances) as running, httpx.Client(timeout=600) as http:
        for label, mode, base in setups:
            every: list[int] = []
            for endpoint in ("/v1/chat/completions", "/v1/responses"):
                totals, first_episode, proofs, handlers = [], [], 0, Counter()
                for episode in range(args.episodes):
                    counts, proved = conversation(
                        http, running.urls[f"policy_{mode}"], base, endpoint, args.turns, args.max_tokens
                    )
                    proofs += proved
                    turn_totals = [sum(turn.values()) for turn in counts]
                    totals += turn_totals
                    first_episode = first_episode or turn_totals
                    for turn in counts:
                        handlers.update(turn)
                table.add(
                    label,
                    endpoint,
                    f"{args.episodes} x {args.turns}",
                    sum(totals) / len(totals),
                    per_spliced_turn(totals, args.episodes),
                    per_spliced_turn(first_episode, 1),
                    min(totals),
                    max(totals),
                    totals[0],
                    proofs,
                    ", ".join(f"{h} {n}" for h, n in sorted(handlers.items())),
                    digits=2,
                )
                results[f"{mode} {endpoint}"] = totals
                every += totals
            episodes = 2 * args.episodes
            if mode == "adapter":
                readings["P3.adapter.per_spliced_turn"] = Reading(
                    per_spliced_turn(every, episodes), f"{episodes} episodes of {args.turns} turns, both endpoints"
                )
            else:
                readings["P3.hook.max_after_first"] = Reading(
                    float(max(every[1:], default=float("nan"))), f"{len(every) - 1} calls"
                )
    figure.tables.append(table)
    figure.notes.append(
        f"{args.episodes} conversations of {args.turns} turns per adapter and endpoint, played one after the other on "
        f"one adapter (chat first), max_tokens {args.max_tokens}; each request carries the previous call's bundle on "
        "the last assistant message, so every turn after a conversation's first is spliced. requests / spliced turn: "
        "1 (the chat call) plus every request beyond one per model call (the adapter's one-off /v1/models, a proof's "
        "/tokenize) charged to the spliced turns, so it is never below the truth; first episode: the same over the "
        "fresh adapter's first conversation alone. Expected: 1 per call with the hook (the chat call; token ids come "
        "back on it; the first call may also ask /v1/models); with splice: adapter, 1 per spliced turn once its "
        "template is proven: two /tokenize per template scope (template, its arguments, tools) and server (the "
        "prompt and a short probe), the probe alone again after a new connection to the server, both again after "
        f"{DEFAULT_PROOF_MAX_AGE_SECONDS:g} s (proving answers: those whose prefix_splice.proof says this_request)."
    )
    figure.data = {"totals": results, "readings": readings}
    figure.seconds = time.monotonic() - started
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv, with_stock=True)


if __name__ == "__main__":
    sys.exit(main())
