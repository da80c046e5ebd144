"""P1: the vllm_model adapter's latency vs calling vLLM directly with the same token capture (hook and adapter splice).

    .venv/bin/python bench/p1_adapter.py                      # starts the hooked bench vLLM, later a stock one
    .venv/bin/python bench/p1_adapter.py --vllm-url URL [--stock-url URL2] [--no-adapter-splice]

The same episode's requests at about 1k, 7k and 32k history ids (bundle of the previous call on the last assistant
message), as 1-token chat completions, interleaved:
  hook mode     the adapter (`splice: hook`, token information on, served as `ngt run` serves it: its own process)
                in front of the hooked vLLM, vs the body the adapter sends vLLM (recorded once through a proxy:
                the same messages, bundle and token-capture fields) posted to the same vLLM directly;
  adapter mode  the adapter with `splice: adapter` in front of a stock vLLM (NEMO_GYM_TOK_PREFIX_SPLICE=0): its
                local render and splice (its template proven once per scope), then a token-in chat call; vs direct
                stock (the same messages without a bundle, same capture fields: stock templating) and vs direct
                token-in (the same with the spliced ids). As an episode's next turn: the call before goes through
                the adapter first, and each round is a request never sent before (" (round N)", as in P2).
The adapter mode is measured on several histories (--histories, kind-seed: bench/benchkit/episode.py KINDS), the hook
mode on the first. Warm-up first; prefix caching is on, so every repeat of every variant hits the cache alike.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import orjson
from benchkit.chained import ChainedCall, capture_fields, chained_summary, timed_chained
from benchkit.episode import (
    DEFAULT_HISTORIES,
    GENERATED_PER_TURN,
    Call,
    build_episode,
    calls_for,
    nearest_calls,
    parse_history,
    tokenize,
    word_ids,
)
from benchkit.figures import Figure, Table, command, fmt, run_standalone
from benchkit.gym_processes import cpu_seconds
from benchkit.hops import RecordingProxy, adapter_instance, gym, passthrough, serve_app
from benchkit.server import JSON_HEADERS, MODEL, BenchError, bench_model, note, vllm_server
from benchkit.timing import interleaved, median, percentile, post_ms, ratio
from targets import Reading, worst
from transformers import AutoTokenizer

from nemo_gym_tok.common.exact_json import loads_exact


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--stock-url", help="a stock vLLM serving it (else one is started for the adapter-splice figure)")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=GENERATED_PER_TURN,
        help=f"tokens the answer before each continued call generates (P1b; {GENERATED_PER_TURN})",
    )
    p.add_argument("--no-adapter-splice", action="store_true", help="skip the splice: adapter figure (no stock server)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 7168, 32768], help="history sizes (ids)")
    p.add_argument("--repeats", type=int, default=40, help="timed repeats per variant and size, hook mode (40)")
    p.add_argument(
        "--splice-repeats", type=int, default=20, help="timed repeats per variant, size and history, adapter mode (20)"
    )
    p.add_argument(
        "--histories",
        nargs="+",
        default=list(DEFAULT_HISTORIES),
        help=f"histories of the adapter-mode figure, KIND-SEED (default {' '.join(DEFAULT_HISTORIES)})",
    )
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
    return loads_exact(proxy.posts("/v1/chat/completions")[-1].body)


Body = bytes | Callable[[int], bytes]
"""A variant's request: the same bytes every time, or made per round (round -1, -2: the warm-ups)."""


def timed_rows(
    calls: list[Call],
    sizes: Sequence[int],
    bodies: dict[int, dict[str, tuple[str, Body]]],
    repeats: int,
    adapter_pid: int | None = None,
) -> list[dict[str, Any]]:
    """Per call (the one nearest each of `sizes`), its variants (name -> (URL, body)) interleaved; p50/p95 of each.
    A body made per round is made before its request is timed. With `adapter_pid`, also the CPU milliseconds that
    process spent per adapter request (only the "adapter" variant reaches it)."""
    rows: list[dict[str, Any]] = []
    warmup = 2
    for call, size in zip(calls, sizes):
        targets = bodies[call.number]
        with httpx.Client(timeout=600) as http:
            requests = {name: _timed_request(http, url, body) for name, (url, body) in targets.items()}
            cpu_before = cpu_seconds(adapter_pid)
            times = interleaved(requests, repeats, warmup=warmup)
            cpu_ms = (cpu_seconds(adapter_pid) - cpu_before) * 1000 / (repeats + warmup)
        rows.append(
            {
                "call": call.number,
                "size": size,
                "ids": call.history_ids,
                **{name: (percentile(t, 50), percentile(t, 95)) for name, t in times.items()},
                **({"adapter cpu": cpu_ms} if adapter_pid is not None else {}),
            }
        )
    return rows


def _timed_request(http: httpx.Client, url: str, body: Body) -> Callable[[], float]:
    rounds = itertools.count(-2)
    if isinstance(body, bytes):
        return lambda: post_ms(http, url, body)
    return lambda: post_ms(http, url, body(next(rounds)))


def varied_bodies(
    call: Call, tokenizer: Any, recorded: dict[str, Any], adapter_url: str, stock_url: str
) -> dict[str, tuple[str, Body]]:
    """The adapter-mode variants of `call`, each round a request never sent before (its last user message ends in
    " (round N)", as P2's do): the adapter gets the bundled messages; direct stock the messages alone and direct
    token-in the messages with the call's spliced ids, both with the capture fields the adapter sent (`recorded`)."""
    fields = {key: value for key, value in recorded.items() if key not in ("messages", "kv_transfer_params")}

    def adapter(round_: int) -> bytes:
        return orjson.dumps(call.varied(tokenizer, round_).chat("hook", max_tokens=1))

    def stock(round_: int) -> bytes:
        return orjson.dumps({**fields, "messages": call.varied(tokenizer, round_).plain})

    def token_in(round_: int) -> bytes:
        varied = call.varied(tokenizer, round_)
        return orjson.dumps(
            {**fields, "messages": varied.plain, "kv_transfer_params": {"prompt_token_ids": varied.prompt_ids}}
        )

    chat = "/v1/chat/completions"
    return {
        "adapter": (f"{adapter_url}{chat}", adapter),
        "direct stock": (f"{stock_url}{chat}", stock),
        "direct token-in": (f"{stock_url}{chat}", token_in),
    }


def timed_table(title: str, names: Sequence[str], baselines: Sequence[str], rows: list[dict[str, Any]]) -> Table:
    """p50/p95 of every variant and of the first over each baseline; a history column where rows name one."""
    history = any("history" in row for row in rows)
    stock = any("stock ids" in row for row in rows)
    headers = (["history"] if history else []) + ["history ids"] + (["stock prompt ids"] if stock else [])
    headers += [f"{n} {q}" for n in names for q in ("p50", "p95")]
    headers += [f"{names[0]}/{b} {q}" for b in baselines for q in ("p50", "p95")]
    table = Table(title, headers)
    for row in rows:
        cells = ([row["history"]] if history else []) + [row["ids"]] + ([row.get("stock ids")] if stock else [])
        cells += [row[n][i] for n in names for i in (0, 1)]
        cells += [ratio(row[names[0]][i], row[b][i]) for b in baselines for i in (0, 1)]
        table.add(*cells, digits=2)
    return table


def splice_summary(rows: list[dict[str, Any]]) -> tuple[Table, dict[str, Reading]]:
    """Per size, the median and the worst over the histories of adapter / direct stock and / direct token-in (p50);
    and the readings the targets judge."""
    table = Table(
        "Adapter (splice: adapter) by size: median and worst of the histories, p50 ratios (worst: which history)",
        [
            "size",
            "histories",
            "/direct stock median",
            "/direct stock worst",
            "/direct token-in median",
            "/direct token-in worst",
            "adapter - direct token-in p50 ms, median",
            "adapter CPU ms per call, median",
        ],
    )
    readings: dict[str, Reading] = {}
    token_in: list[tuple[float, str]] = []
    for size in sorted({row["size"] for row in rows}):
        at = [row for row in rows if row["size"] == size]
        cells: list[Any] = [f"{size / 1024:g}k", len(at)]
        for baseline in ("direct stock", "direct token-in"):
            pairs = [(ratio(r["adapter"][0], r[baseline][0]), f"{r['ids']} ids, history {r['history']}") for r in at]
            reading = worst(pairs)
            cells += [median([value for value, _ in pairs]), f"{fmt(reading.value, 2)} ({reading.where})"]
            if baseline == "direct stock" and size == 7168:
                readings["P1a.adapter/stock.p50@7k.worst"] = reading
            if baseline == "direct token-in":
                token_in += pairs
                readings[f"P1a.adapter/token-in.p50@{size // 1024}k.worst"] = reading
        cells.append(median([r["adapter"][0] - r["direct token-in"][0] for r in at]))
        cells.append(median([r.get("adapter cpu", float("nan")) for r in at]))
        table.add(*cells, digits=2)
    readings["P1a.adapter/token-in.p50.worst"] = worst(token_in)
    return table, readings


def run(url: str, args: argparse.Namespace, argv: Sequence[str], stock_url: str | None = None) -> list[Figure]:
    """The hook-mode figure (P1) and, unless --no-adapter-splice, the splice: adapter figure (P1a)."""
    started = time.monotonic()
    method = (
        "p50 and p95 of {repeats} timed requests per variant after 2 untimed rounds, variants interleaved "
        "(order rotated each round), one keep-alive client; the adapter runs as its own process (as `ngt run` "
        "starts it). Prefix caching is on: repeats hit the cache alike."
    )
    figure = Figure(
        "P1", "Adapter (splice: hook) vs direct vLLM, 1-token chat completion", command("p1_adapter.py", argv)
    )
    episodes: dict[str, list[Call]] = {}
    previous: dict[tuple[str, int], Call] = {}

    def calls_of(history: str) -> list[Call]:
        if history not in episodes:
            kind, seed = parse_history(history)
            note(f"P1: building history {history} on {url} ...")
            episode = build_episode(url, calls_for(max(args.sizes)), kind=kind, seed=seed)
            episodes[history] = nearest_calls(episode, args.sizes)
            for call in episodes[history]:
                previous[(history, call.number)] = episode[max(0, call.number - 2)]
        return episodes[history]

    calls = calls_of(args.histories[0])

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
        rows = timed_rows(calls, args.sizes, bodies, args.repeats)
    figure.tables.append(
        timed_table(
            f"Adapter (splice: hook) in front of the hooked vLLM vs direct, same token capture, history "
            f"{args.histories[0]}, ms",
            ["adapter", "direct", "bare hop"],
            ["bare hop", "direct"],
            rows,
        )
    )
    figure.data["hook"] = rows
    figure.data["readings"] = {
        f"P1.own_share.{q}@7k": Reading(
            ratio(row["adapter"][i], row["bare hop"][i]), f"{row['ids']} ids, history {args.histories[0]}"
        )
        for row in rows
        if row["size"] == 7168
        for i, q in ((0, "p50"), (1, "p95"))
    }
    capture = sorted(k for k in direct[calls[0].number] if k not in ("model", "messages", "max_tokens"))
    figure.notes.append(
        "Direct requests carry what the adapter sends vLLM: the messages with the bundle, max_tokens 1 "
        f"and {', '.join(capture)}. Bare hop: the same direct requests through bench/benchkit/passthrough.py, "
        "a process that only forwards bytes (served and forwarding as the adapter is): what any hop "
        "costs here before doing any work; adapter/bare hop is the adapter's own share (the target), adapter/direct "
        "is informational."
    )
    figure.notes.append(method.format(repeats=args.repeats))
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
    names = ["adapter", "direct stock", "direct token-in"]
    rows = []
    chained_rows: list[dict[str, Any]] = []
    tokenizer = AutoTokenizer.from_pretrained(bench_model())
    with vllm_server(stock_url, hook=False) as stock:
        # What the adapter sends for a call: recorded once per call, after the call before it (as in an episode), for
        # a varied request never timed; its capture fields go on every direct request, and its ids must be the
        # varied call's spliced ids (the direct token-in requests send those).
        with recorded_adapter(stock, "adapter") as (recorder, proxy):
            recorded: dict[tuple[str, int], dict[str, Any]] = {}
            stock_ids: dict[tuple[str, int], int] = {}
            for history in args.histories:
                for call in calls_of(history):
                    upstream_chat_body(recorder, proxy, previous[(history, call.number)].chat("hook", max_tokens=1))
                    varied = call.varied(tokenizer, -1)
                    body = upstream_chat_body(recorder, proxy, varied.chat("hook", max_tokens=1))
                    if body["kv_transfer_params"]["prompt_token_ids"] != varied.prompt_ids:
                        raise BenchError(f"the adapter's ids for call {call.number} of {history} are not the hook's")
                    recorded[(history, call.number)] = body
                    with httpx.Client(base_url=stock, timeout=600) as http:
                        stock_ids[(history, call.number)] = len(tokenize(http, varied.plain, varied.fields))
            upstream_per_call = len(proxy.exchanges) / (2 * len(recorded))
            words = word_ids(tokenizer)
            chained = {
                (history, call.number): ChainedCall(
                    previous[(history, call.number)],
                    call,
                    args.answer_tokens,
                    None if parse_history(history)[0] == "random" else words,
                )
                for history in args.histories
                for call in calls_of(history)
            }
            capture = {key: capture_fields(c, recorder, proxy, url, tokenizer) for key, c in chained.items()}
        with gym({"policy_model": adapter_instance(stock, splice="adapter")}) as running:
            adapter_url = running.urls["policy_model"]
            adapter_pid = next(child.process.pid for child in running.children if child.name == "policy_model")
            for history in args.histories:
                bodies = {}
                for call in calls_of(history):
                    # The turn before goes through the adapter first, untimed, as it does in an episode: the adapter
                    # keeps the prompt it spliced for it, which the timed turn's prefix opens with.
                    before = previous[(history, call.number)].chat("hook", max_tokens=1)
                    with httpx.Client(timeout=600) as http:
                        post_ms(http, f"{adapter_url}/v1/chat/completions", orjson.dumps(before))
                    bodies[call.number] = varied_bodies(
                        call, tokenizer, recorded[(history, call.number)], adapter_url, stock
                    )
                note(f"P1a: timing the adapter (splice: adapter) vs direct stock vLLM, history {history} ...")
                timed = timed_rows(calls_of(history), args.sizes, bodies, args.splice_repeats, adapter_pid)
                rows += [{**row, "history": history, "stock ids": stock_ids[(history, row["call"])]} for row in timed]
            chained_started = time.monotonic()
            for history in args.histories:
                note(f"P1b: timing continued /v1/responses calls vs direct token-in, history {history} ...")
                for call, size in zip(calls_of(history), args.sizes):
                    key = (history, call.number)
                    timed = timed_chained(
                        chained[key], capture[key], adapter_url, stock, url, tokenizer, args.splice_repeats, adapter_pid
                    )
                    chained_rows.append({**timed, "history": history, "size": size})
            chained_seconds = time.monotonic() - chained_started
    summary, readings = splice_summary(rows)
    adapter_figure.tables += [
        summary,
        timed_table(
            "Adapter (splice: adapter) in front of a stock vLLM vs direct stock and direct token-in, every history, ms",
            names,
            ["direct stock", "direct token-in"],
            rows,
        ),
    ]
    adapter_figure.data["adapter"] = rows
    adapter_figure.data["readings"] = readings
    adapter_figure.notes.append(
        "splice: adapter proves its copy of the template once per server and template scope (one /tokenize), then "
        "renders and splices locally before its token-in chat call "
        f"({upstream_per_call:.2f} vLLM requests per call while recording {2 * len(recorded)} calls, the one-off "
        "/v1/models and proofs included; P3 counts them per turn). Each timed call comes after the call before it "
        "(sent once, untimed), as in an episode: the adapter keeps the prompt it spliced for that one, which the "
        "timed call's prefix opens with. Every round's request is one never sent before (its last user message ends "
        'in " (round N)", as in P2), for every variant alike. direct stock: the same messages without a bundle '
        "and the capture fields the adapter sends (vLLM templates the text); direct token-in: the same with the "
        "call's spliced ids as kv_transfer_params.prompt_token_ids (checked once to be the adapter's own ids). "
        "The stock vLLM runs with NEMO_GYM_TOK_PREFIX_SPLICE=0. Histories: "
        f"{', '.join(args.histories)} (kind-seed, bench/benchkit/episode.py KINDS); the targets judge the worst."
    )
    adapter_figure.notes.append(
        "Stock prompt ids: the prompt vLLM templates from the same messages (/tokenize). A template that leaves out "
        "earlier turns' thinking (Qwen3's, the reasoning history) makes it shorter than the spliced prompt, which "
        "keeps the model's own ids of every turn: there direct stock computes another, shorter prompt, and direct "
        "token-in is the like-for-like comparison."
    )
    adapter_figure.notes.append(method.format(repeats=args.splice_repeats) + " Repeats per history and size.")
    adapter_figure.seconds = time.monotonic() - started - chained_seconds
    chained = chained_figure(chained_rows, args, argv)
    chained.seconds = chained_seconds
    return figures + [adapter_figure, chained]


def chained_figure(rows: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    """P1b: the adapter (splice: adapter) called as the simple agent calls it, a continued /v1/responses call."""
    figure = Figure(
        "P1b",
        "Adapter (splice: adapter), the agent's way: /v1/responses with previous_response_id vs direct token-in",
        command("p1_adapter.py", argv),
    )
    summary, readings = chained_summary(rows)
    figure.tables += [
        summary,
        timed_table(
            "Continued /v1/responses calls through the adapter vs direct token-in, every history, ms",
            ["adapter", "direct token-in"],
            ["direct token-in"],
            rows,
        ),
    ]
    figure.data["chained"] = rows
    figure.data["readings"] = readings
    figure.notes.append(
        "As the simple agent calls the adapter (chain_responses, its default). Each round builds a chain through the "
        "adapter, untimed: the call before the timed one sent whole with its bundle (1 token, kept), then a continued "
        f"call with one user turn (max_output_tokens {args.answer_tokens}, kept with its chat messages: a prompt the "
        "adapter spliced itself, as every chained call after the second is). That answer is sampled from plain-word "
        "ids (allowed_token_ids, bench/benchkit/episode.py word_ids) as the histories' own turns mostly are, but on "
        "the random history: the bench model is random, and its free text is byte soup whose tokenization (the turn's "
        "measurement, the adapter's as the hook's) cost up to ten times a real model's text and varied with the "
        "server's random state. The timed call sends that answer's "
        'previous_response_id and one user message never sent before (" (round N)"), max_output_tokens 1: the '
        "adapter expands the kept history, takes its chat messages, converts only the new item, splices the new turn "
        "locally and keeps its own answer (deleted after the round, untimed). Direct token-in: the same history's "
        "chat messages with the capture fields the adapter sends vLLM and the ids the hooked server splices for it "
        "(checked once per call to be the adapter's own ids), to the same stock vLLM. History ids: the timed call's "
        "prompt, whose last two turns are the chain's. The adapter's CPU is read "
        "from /proc around each timed call (its total over the timed calls, per call)."
    )
    figure.notes.append(
        f"p50 and p95 of {args.splice_repeats} timed rounds per history and size after 2 untimed ones, the two "
        "variants' order alternating; paired: the median over rounds of one round's adapter / token-in."
    )
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv, with_stock=True)


if __name__ == "__main__":
    sys.exit(main())
