"""P2: preprocessing cost of the hook vs stock templating vs token-in, by history size and over one growing episode.

    .venv/bin/python bench/p2_preprocess.py                 # starts the hooked bench vLLM (32k context, ~60 s)
    .venv/bin/python bench/p2_preprocess.py --vllm-url URL  # or uses one serving the bench model as tiny-qwen3

Several synthetic histories (--histories, kind-seed; default five: plain words, text decoded from random ids, tool
calls, reasoning, and a mix: bench/benchkit/episode.py KINDS), each an episode of up to 128 model calls (about 232 model
ids per assistant turn, about 253 prompt ids a turn, so call 128 holds about 32.3k ids). At the calls measured the same
request is sent three ways, interleaved, as a 1-token chat completion:
  hook      the history with the previous call's bundle on the last assistant message (the hook splices);
  stock     the same messages without a bundle (vLLM templates and tokenizes the text);
  token_in  the same messages without a bundle plus the spliced ids as `kv_transfer_params.prompt_token_ids` (vLLM's
            own token-reuse path: no templating).
Each variant is sent once untimed first (warm-up). Every request, timed or not, ends its last user message with
" (round N)": a request the server has not seen, as every real turn is. What the hook keeps per server (splice._memo)
holds what a real next turn finds there: the prompt it spliced for the previous call (while the episode was built),
never this request's own (the call before is sent once as a chat request first, so the hook keeps its prompt under a
chat request's template scope); and the placement rendering, which has every text a placeholder and so depends only
on the conversation's shape: every round after the warm-up finds this call's, as the turns of a tool-less environment
find each other's across rollouts (with tool calls, whose ids differ per rollout, a real turn renders its own). The
prefix cache holds the history for every variant alike; only the last few ids (the varied message) are computed again,
so the difference is preprocessing. Reported: end-to-end median latency, and the median of the hook's server-side
timer (`nemo_gym_tok_preprocess_seconds` on /metrics, paths `spliced`, `template`, `token_in`; /metrics is read
between consecutive requests, so each request's time is its own) where the server has it, else "n/a". At the calls
nearest the --sizes, more repeats and `/tokenize` with a bundle vs stock `/tokenize` as well. Then the slope (ms per
1k history ids) of each variant over the episode (Theil-Sen: the median of the slopes between every two calls, which
load spikes do not tilt). Per size and for the slope: the median over the histories and the worst of them (the targets
judge the worst).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from benchkit import episode as synthetic_episode
from benchkit.episode import DEFAULT_HISTORIES, Call, build_episode, nearest_calls, parse_history
from benchkit.figures import Figure, command, run_standalone
from benchkit.metrics import has_preprocess_timer, preprocess_delta, scrape
from benchkit.p2_tables import History, add_tables
from benchkit.server import MODEL, BenchError, bench_model, note
from benchkit.timing import median, post_ms, slope
from transformers import AutoTokenizer

VARIANTS = ("stock", "hook", "token_in")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 4096, 7168, 16384, 32768],
        help="history sizes (ids) of the size table: the episode's calls nearest to them",
    )
    p.add_argument("--calls", type=int, default=128, help="model calls in the episode (default 128)")
    p.add_argument(
        "--histories",
        nargs="+",
        default=list(DEFAULT_HISTORIES),
        help=f"histories measured, KIND-SEED (default {' '.join(DEFAULT_HISTORIES)})",
    )
    p.add_argument(
        "--repeats", type=int, default=20, help="timed repeats per variant at the size-table calls, per history (20)"
    )
    p.add_argument("--episode-repeats", type=int, default=3, help="timed repeats per variant at the other calls")
    p.add_argument("--episode-step", type=int, default=4, help="measure every Nth call of each episode (default 4)")
    return p


@dataclass
class Measured:
    e2e: dict[str, list[float]] = field(default_factory=dict)
    """Per variant, each timed request's client wall milliseconds."""
    server: dict[str, list[float]] = field(default_factory=dict)
    """Per variant, each timed request's server-side preprocessing milliseconds (empty without the timer)."""
    paths: dict[str, Counter] = field(default_factory=dict)
    """Per variant, the timer's `path` labels its requests were counted under."""

    def e2e_median(self, variant: str) -> float:
        return median(self.e2e.get(variant, []))

    def server_median(self, variant: str) -> float:
        return median(self.server.get(variant, []))

    def paired(self, variant: str, baseline: str) -> float:
        """The median over rounds of variant / baseline end to end, each round's two requests sent back to back:
        the machine's drift from round to round cancels, which a ratio of the two medians keeps."""
        pairs = zip(self.e2e.get(variant, []), self.e2e.get(baseline, []))
        return median([mine / theirs for mine, theirs in pairs if theirs > 0])


def measure(
    http: httpx.Client, url: str, path: str, bodies: dict[str, Callable[[int], bytes]], repeats: int
) -> Measured:
    """Warm up each variant once, then `repeats` interleaved rounds (order rotated each round); `bodies` give each
    variant's request of a round (round -1: the warm-up), each round's a request the server has not seen. /metrics is
    read between consecutive requests, so each request's server-side time is its own, whatever label it gets."""
    for body in bodies.values():
        post_ms(http, path, body(-1))
    result = Measured({v: [] for v in bodies}, {v: [] for v in bodies}, {v: Counter() for v in bodies})
    names = list(bodies)
    before = scrape(url, http)
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            result.e2e[name].append(post_ms(http, path, bodies[name](round_)))
            after = scrape(url, http)
            timed = preprocess_delta(before, after)
            before = after
            if timed is not None and timed[0] == 1:
                result.server[name].append(timed[1] * 1000)
                result.paths[name].update(timed[2])
    return result


def _varied_body(call: Call, tokenizer: Any, variant: str) -> Callable[[int], bytes]:
    return lambda round_: orjson.dumps(call.varied(tokenizer, round_).chat(variant, max_tokens=1))


def _varied_tokenize_body(call: Call, tokenizer: Any, variant: str) -> Callable[[int], bytes]:
    def body(round_: int) -> bytes:
        varied = call.varied(tokenizer, 1000 + round_)  # not the chat rounds' requests
        return orjson.dumps(
            {
                "model": MODEL,
                "messages": varied.bundled if variant == "hook" else varied.plain,
                "add_generation_prompt": True,
                **synthetic_episode.tokenize_fields(varied.fields),
            }
        )

    return body


def _check_varied_ids(url: str, call: Call, tokenizer: Any) -> None:
    """The token-in variant's ids for a varied request are the hook's own for it (checked on a round never timed)."""
    probe = call.varied(tokenizer, -1000)
    with httpx.Client(base_url=url, timeout=600) as http:
        if synthetic_episode.tokenize(http, probe.bundled, probe.fields) != probe.prompt_ids:
            raise BenchError("the varied request's token-in ids are not the hook's spliced ids for it")


def measure_history(
    url: str, name: str, args: argparse.Namespace, tokenizer: Any, http: httpx.Client
) -> tuple[History, dict[str, Counter]]:
    """One history's episode measured: every --episode-step-th call (end to end and server-side), and at the calls
    nearest the --sizes more repeats and /tokenize as well; its slopes over the episode."""
    kind, seed = parse_history(name)
    note(f"P2: building history {name} ({args.calls} calls) on {url} ...")
    episode = build_episode(url, args.calls, kind=kind, seed=seed)
    _check_varied_ids(url, episode[len(episode) // 2], tokenizer)
    checkpoints = {call.number: size for call, size in zip(nearest_calls(episode, args.sizes), args.sizes)}
    calls: list[dict[str, Any]] = []
    sizes: list[dict[str, Any]] = []
    labels: dict[str, Counter] = {v: Counter() for v in VARIANTS}
    for call in episode[1:]:  # call 1 has no earlier turn: nothing to splice
        checkpoint = call.number in checkpoints
        if not checkpoint and (call.number - 2) % args.episode_step and call.number != episode[-1].number:
            continue
        # The call before, sent once as a chat request: the hook then keeps the prompt it spliced for that call's
        # messages under the chat request's template scope, as a real next turn finds it (the episode was built
        # through /tokenize, whose scope lacks a chat request's tool_choice).
        post_ms(http, "/v1/chat/completions", orjson.dumps(episode[call.number - 2].chat("hook", max_tokens=1)))
        chat = {v: _varied_body(call, tokenizer, v) for v in VARIANTS}
        measured = measure(
            http, url, "/v1/chat/completions", chat, args.repeats if checkpoint else args.episode_repeats
        )
        row = {
            "call": call.number,
            "ids": call.history_ids,
            "e2e": {v: measured.e2e_median(v) for v in VARIANTS},
            "server": {v: measured.server_median(v) for v in VARIANTS},
            "paired": {
                "hook/stock": measured.paired("hook", "stock"),
                "hook/token_in": measured.paired("hook", "token_in"),
            },
        }
        calls.append(row)
        for v in VARIANTS:
            labels[v].update(measured.paths[v])
        if checkpoint:
            tokenize = {v: _varied_tokenize_body(call, tokenizer, v) for v in ("stock", "hook")}
            t_measured = measure(http, url, "/tokenize", tokenize, args.repeats)
            sizes.append(
                {
                    **row,
                    "size": checkpoints[call.number],
                    "stock_ids": len(synthetic_episode.tokenize(http, call.plain, call.fields)),
                    "tokenize_e2e": {v: t_measured.e2e_median(v) for v in tokenize},
                    "tokenize_server": {v: t_measured.server_median(v) for v in tokenize},
                }
            )
        if call.number % 32 == 0:
            note(
                f"P2: {name} call {call.number}, {call.history_ids} ids: e2e ms "
                + ", ".join(f"{v} {row['e2e'][v]:.1f}" for v in VARIANTS)
            )
    xs = [row["ids"] / 1000 for row in calls]
    fitted = {
        v: (slope(xs, [row["server"][v] for row in calls]), slope(xs, [row["e2e"][v] for row in calls]))
        for v in VARIANTS
    }
    return History(name, calls, sorted(sizes, key=lambda r: r["size"]), fitted), labels


def run(url: str, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(bench_model())
    histories: list[History] = []
    labels: dict[str, Counter] = {v: Counter() for v in VARIANTS}
    with httpx.Client(base_url=url, timeout=600) as http:
        for name in args.histories:
            history, seen = measure_history(url, name, args, tokenizer, http)
            histories.append(history)
            for v in VARIANTS:
                labels[v].update(seen[v])
    # Read after the requests: a labelled histogram shows on /metrics only once something was timed.
    timer = has_preprocess_timer(scrape(url))
    figure = Figure("P2", "Preprocessing: hook vs stock templating vs token-in", command("p2_preprocess.py", argv))
    add_tables(figure, histories, timer, labels, args)
    figure.seconds = time.monotonic() - started
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
