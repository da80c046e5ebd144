"""P3: HTTP requests reaching vLLM per model call through the vllm_model adapter (hook mode: expected 1).

    .venv/bin/python bench/p3_upstream_calls.py                       # starts the hooked bench vLLM
    .venv/bin/python bench/p3_upstream_calls.py --vllm-url URL [--stock-url URL2]

Real multi-turn conversations through the adapter (its own process, as `ngt run` starts it; token information on),
each turn sending the history with the last call's bundle: on /v1/chat/completions and on /v1/responses, with
`splice: hook` against the hooked vLLM, and (with --stock-url) with `splice: adapter` against a stock vLLM. The count
is vLLM's own `http_requests_total` (every handler but /metrics, /health and the like), read from /metrics before
and after each turn.
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
from _episode import user_message
from _figures import Figure, Table, command, run_standalone
from _hops import adapter_instance, gym
from _metrics import http_requests, scrape
from _server import JSON_HEADERS, MODEL, BenchError

BUNDLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--stock-url", help="a stock vLLM serving it: also count splice: adapter")
    p.add_argument("--turns", type=int, default=10, help="turns per conversation (default 10)")
    p.add_argument("--max-tokens", type=int, default=16)
    return p


def without_bundle(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in BUNDLE}


def conversation(
    http: httpx.Client, adapter: str, vllm: str, endpoint: str, turns: int, max_tokens: int
) -> list[dict[str, int]]:
    """Play `turns` turns; per turn, the requests vLLM answered, by handler."""
    history: list[dict[str, Any]] = [user_message(0)]
    counts = []
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
        result = answer.json()
        new = [result["choices"][0]["message"]] if endpoint == "/v1/chat/completions" else result["output"]
        if not any(all(k in item for k in BUNDLE) for item in new):
            raise BenchError(f"turn {turn} on {endpoint} came back without a token bundle")
        # The next request carries the last call's bundle only (earlier ones stripped), as the agent sends it.
        history = [without_bundle(item) for item in history] + new + [user_message(turn)]
    return counts


def run(url: str, args: argparse.Namespace, argv: Sequence[str], stock_url: str | None = None) -> Figure:
    started = time.monotonic()
    figure = Figure("P3", "vLLM requests per model call through the adapter", command("p3_upstream_calls.py", argv))
    table = Table(
        "HTTP requests vLLM answered per model call (vLLM's http_requests_total)",
        ["adapter", "endpoint", "turns", "requests / call", "min", "max", "first call", "by handler"],
    )
    setups = [("splice: hook", "hook", url)] + ([("splice: adapter", "adapter", stock_url)] if stock_url else [])
    instances = {f"policy_{mode}": adapter_instance(base, splice=mode) for _, mode, base in setups}
    results: dict[str, Any] = {}
    with gym(instances) as running, httpx.Client(timeout=600) as http:
        for label, mode, base in setups:
            for endpoint in ("/v1/chat/completions", "/v1/responses"):
                counts = conversation(http, running.urls[f"policy_{mode}"], base, endpoint, args.turns, args.max_tokens)
                totals = [sum(turn.values()) for turn in counts]
                handlers = Counter()
                for turn in counts:
                    handlers.update(turn)
                table.add(
                    label,
                    endpoint,
                    len(counts),
                    sum(totals) / len(totals),
                    min(totals),
                    max(totals),
                    totals[0],
                    ", ".join(f"{h} {n}" for h, n in sorted(handlers.items())),
                    digits=2,
                )
                results[f"{mode} {endpoint}"] = totals
    figure.tables.append(table)
    figure.notes.append(
        f"{args.turns} turns per conversation, max_tokens {args.max_tokens}; each request carries the previous call's "
        "bundle on the last assistant message. Expected: 1 per call with the hook (the chat call; token ids come back "
        "on it), 2 with splice: adapter (/tokenize, then the token-in chat call; its first call also asks /v1/models "
        "once for the tokenizer path)."
    )
    figure.data = results
    figure.seconds = time.monotonic() - started
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv, with_stock=True)


if __name__ == "__main__":
    sys.exit(main())
