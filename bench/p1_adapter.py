"""P1: the vllm_model adapter's latency vs calling vLLM directly with the same token capture (hook and adapter splice).

    .venv/bin/python bench/p1_adapter.py                      # starts the hooked bench vLLM, later a stock one
    .venv/bin/python bench/p1_adapter.py --vllm-url URL [--stock-url URL2] [--no-adapter-splice]

The same episode's requests at about 1k, 7k and 32k history ids (bundle of the previous call on the last assistant
message), as 1-token chat completions, interleaved:
  hook mode     the adapter (`splice: hook`, token information on, served as `ngt run` serves it: its own process)
                in front of the hooked vLLM, vs the body the adapter sends vLLM (recorded once through a proxy:
                the same messages, bundle and token-capture fields) posted to the same vLLM directly;
  adapter mode  the adapter with `splice: adapter` in front of a stock vLLM (NEMO_GYM_TOK_PREFIX_SPLICE=0): its
                /tokenize, local render and splice, then a token-in chat call; vs direct stock (the same messages
                without a bundle, same capture fields: stock templating) and vs direct token-in (exactly the adapter's
                final call, recorded).
Warm-up first; prefix caching is on, so every repeat of every variant hits the cache alike.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson
from _episode import Call, build_episode, calls_for, nearest_calls
from _figures import Figure, Table, command, run_standalone
from _hops import RecordingProxy, adapter_instance, gym, passthrough, serve_app
from _server import JSON_HEADERS, MODEL, BenchError, note, vllm_server
from _timing import interleaved, percentile, post_ms, ratio


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--stock-url", help="a stock vLLM serving it (else one is started for the adapter-splice figure)")
    p.add_argument("--no-adapter-splice", action="store_true", help="skip the splice: adapter figure (no stock server)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 7168, 32768], help="history sizes (ids)")
    p.add_argument("--repeats", type=int, default=40, help="timed repeats per variant and size (default 40)")
    return p


@contextlib.contextmanager
def recorded_adapter(vllm_url: str, splice: str) -> Iterator[tuple[str, RecordingProxy]]:
    """The adapter in this process in front of a recording proxy to `vllm_url`: what it sends vLLM, byte for byte."""
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    proxy = RecordingProxy(vllm_url)
    with serve_app(proxy.app()) as proxy_url:
        config = VLLMModelConfig(**adapter_instance(proxy_url, splice=splice)["responses_api_models"]["vllm_model"])
        with serve_app(VLLMModel("policy_model", config).build_app()) as adapter_url:
            yield adapter_url, proxy


def upstream_chat_body(adapter_url: str, proxy: RecordingProxy, body: dict[str, Any]) -> dict[str, Any]:
    """The chat body the adapter sends vLLM for `body`."""
    answer = httpx.post(
        f"{adapter_url}/v1/chat/completions", content=orjson.dumps(body), headers=JSON_HEADERS, timeout=600
    )
    if answer.status_code != 200:
        raise BenchError(f"the adapter answered HTTP {answer.status_code}: {answer.text[:500]}")
    return orjson.loads(proxy.posts("/v1/chat/completions")[-1].body)


def timed_table(
    title: str,
    baselines: Sequence[str],
    calls: list[Call],
    bodies: dict[int, dict[str, tuple[str, bytes]]],
    repeats: int,
) -> tuple[Table, list[dict[str, Any]]]:
    """Per call, its variants (name -> (URL, body)) interleaved; p50/p95 of each, and the first over each baseline."""
    rows: list[dict[str, Any]] = []
    for call in calls:
        targets = bodies[call.number]
        with httpx.Client(timeout=600) as http:
            requests = {
                name: (lambda url=url, body=body: post_ms(http, url, body)) for name, (url, body) in targets.items()
            }
            times = interleaved(requests, repeats, warmup=2)
        rows.append(
            {
                "call": call.number,
                "ids": call.history_ids,
                **{name: (percentile(t, 50), percentile(t, 95)) for name, t in times.items()},
            }
        )
    names = list(bodies[calls[0].number])
    headers = ["history ids"] + [f"{n} {q}" for n in names for q in ("p50", "p95")]
    headers += [f"{names[0]}/{b} {q}" for b in baselines for q in ("p50", "p95")]
    table = Table(title, headers)
    for row in rows:
        cells = [row["ids"]] + [row[n][i] for n in names for i in (0, 1)]
        cells += [ratio(row[names[0]][i], row[b][i]) for b in baselines for i in (0, 1)]
        table.add(*cells, digits=2)
    return table, rows


def run(url: str, args: argparse.Namespace, argv: Sequence[str], stock_url: str | None = None) -> list[Figure]:
    """The hook-mode figure (P1) and, unless --no-adapter-splice, the splice: adapter figure (P1a)."""
    started = time.monotonic()
    method = (
        f"p50 and p95 of {args.repeats} timed requests per variant after 2 untimed rounds, variants interleaved "
        "(order rotated each round), one keep-alive client; the adapter runs as its own process (as `ngt run` "
        "starts it). Prefix caching is on: repeats hit the cache alike."
    )
    figure = Figure(
        "P1", "Adapter (splice: hook) vs direct vLLM, 1-token chat completion", command("p1_adapter.py", argv)
    )
    note(f"P1: building the episode on {url} ...")
    episode = build_episode(url, calls_for(max(args.sizes)))
    calls = nearest_calls(episode, args.sizes)

    # Hook mode: the adapter in its own process vs its upstream body sent directly.
    with recorded_adapter(url, "hook") as (recorder, proxy):
        direct = {call.number: upstream_chat_body(recorder, proxy, call.chat("hook", max_tokens=1)) for call in calls}
    with gym({"policy_model": adapter_instance(url, splice="hook")}) as running, passthrough(url) as hop:
        adapter_url = running.urls["policy_model"]
        bodies = {
            call.number: {
                "adapter": (f"{adapter_url}/v1/chat/completions", orjson.dumps(call.chat("hook", max_tokens=1))),
                "direct": (f"{url}/v1/chat/completions", orjson.dumps(direct[call.number])),
                "bare hop": (f"{hop}/v1/chat/completions", orjson.dumps(direct[call.number])),
            }
            for call in calls
        }
        note("P1: timing the adapter (splice: hook) vs direct vLLM ...")
        table, rows = timed_table(
            "Adapter (splice: hook) in front of the hooked vLLM vs direct, same token capture, ms",
            ["direct", "bare hop"],
            calls,
            bodies,
            args.repeats,
        )
    figure.tables.append(table)
    figure.data["hook"] = rows
    capture = sorted(k for k in direct[calls[0].number] if k not in ("model", "messages", "max_tokens"))
    figure.notes.append(
        "Direct requests carry what the adapter sends vLLM: the messages with the bundle, max_tokens 1 "
        f"and {', '.join(capture)}. Bare hop: the same direct requests through bench/_passthrough.py, "
        "a process that only forwards bytes (served and forwarding as the adapter is): what any hop "
        "costs here before doing any work; adapter/bare hop is the adapter's own share."
    )
    figure.notes.append(method)
    figure.seconds = time.monotonic() - started
    figures = [figure]
    if args.no_adapter_splice:
        return figures

    started = time.monotonic()
    adapter_figure = Figure(
        "P1a",
        "Adapter (splice: adapter) against stock vLLM vs direct, 1-token chat completion",
        command("p1_adapter.py", argv),
    )
    with vllm_server(stock_url, hook=False) as stock:
        with recorded_adapter(stock, "adapter") as (recorder, proxy):
            token_in = {
                call.number: upstream_chat_body(recorder, proxy, call.chat("hook", max_tokens=1)) for call in calls
            }
            upstream_per_call = len(proxy.exchanges) / len(calls)
        with gym({"policy_model": adapter_instance(stock, splice="adapter")}) as running:
            adapter_url = running.urls["policy_model"]
            bodies = {}
            for call in calls:
                final = token_in[call.number]
                plain = {k: v for k, v in final.items() if k != "kv_transfer_params"}
                bodies[call.number] = {
                    "adapter": (f"{adapter_url}/v1/chat/completions", orjson.dumps(call.chat("hook", max_tokens=1))),
                    "direct stock": (f"{stock}/v1/chat/completions", orjson.dumps(plain)),
                    "direct token-in": (f"{stock}/v1/chat/completions", orjson.dumps(final)),
                }
            note("P1a: timing the adapter (splice: adapter) vs direct stock vLLM ...")
            table, rows = timed_table(
                "Adapter (splice: adapter) in front of a stock vLLM vs direct stock and direct token-in, ms",
                ["direct stock", "direct token-in"],
                calls,
                bodies,
                args.repeats,
            )
    adapter_figure.tables.append(table)
    adapter_figure.data["adapter"] = rows
    adapter_figure.notes.append(
        "splice: adapter makes a /tokenize call, a local render and the splice before its token-in chat call "
        f"({upstream_per_call:.1f} vLLM requests per call while recording, the first call's /v1/models included). "
        "direct stock: the same messages without a bundle and the same capture fields (vLLM templates the text); "
        "direct token-in: exactly the adapter's final call. The stock vLLM runs with NEMO_GYM_TOK_PREFIX_SPLICE=0."
    )
    adapter_figure.notes.append(method)
    adapter_figure.seconds = time.monotonic() - started
    return figures + [adapter_figure]


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv, with_stock=True)


if __name__ == "__main__":
    sys.exit(main())
