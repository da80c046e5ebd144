"""P9: where each millisecond of a next turn goes, the hook beside token-in, at about 1k, 7k and 32k history ids.

    .venv/bin/python bench/p9_breakdown.py                 # starts the hooked bench vLLM (stage timing on, ~60 s)
    .venv/bin/python bench/p9_breakdown.py --vllm-url URL  # or one started with NEMO_GYM_TOK_STAGE_TIMES=1

The histories of P2 (bench/benchkit/episode.py KINDS), each an episode of up to 128 calls. At the call nearest each
size, the call before it is sent once as a chat request (so the hook keeps the prompt it spliced for it, as a real
next turn finds it), then the same request two ways, interleaved, as a 1-token chat completion:
  hook      the history with the previous call's bundle on the last assistant message;
  token_in  the same messages without a bundle, the spliced ids as `kv_transfer_params.prompt_token_ids`.
Every round's request is one the server has not seen (its last user message ends in " (round N)").

What is measured, per request: the end-to-end time at the client; the server's stages, from the hook's stage timer
(`nemo_gym_tok_preprocess_stage_seconds` on /metrics, read between consecutive requests; NEMO_GYM_TOK_STAGE_TIMES=1
turns it on): prefix read (the request's prefix and its ids checked), the splice's stages (history key, proof, short
render, tail tokenize, prompt: nemo_gym_tok.splice.SPLICE_STAGES), vLLM preprocessing (vLLM's own chat
preprocessing of the request: for both variants its token-reuse step, which checks every id in Python), turn
measurement (the splice's telemetry of the turn it adds, run while the engine generates); and, in this process,
the request read (vLLM's ChatCompletionRequest parsed and validated from the same body, as its API server does).
What is left of the end-to-end time (HTTP, the engine's hand-off and step, the answer) is the rest. The table gives
the median over the histories of each history's medians; the hook's time over token-in is the median of each round's
paired difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import orjson
from benchkit.episode import DEFAULT_HISTORIES, Call, build_episode, nearest_calls, parse_history
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.metrics import Metrics, scrape
from benchkit.server import MODEL, bench_model, note
from benchkit.timing import median, post_ms
from targets import Reading
from transformers import AutoTokenizer

from nemo_gym_tok.splice import SPLICE_STAGES

VARIANTS = ("hook", "token_in")
STAGE_METRIC = "nemo_gym_tok_preprocess_stage_seconds_sum"
STAGES = ("prefix read", "template scope", *SPLICE_STAGES, "vLLM preprocessing", "turn measurement")
SIZES = (1024, 7168, 32768)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="history sizes (ids) measured")
    p.add_argument("--calls", type=int, default=128, help="model calls in each episode (default 128)")
    p.add_argument("--histories", nargs="+", default=list(DEFAULT_HISTORIES), help="histories measured, KIND-SEED")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds per size and history (default 20)")
    return p


def stage_deltas(before: Metrics, after: Metrics) -> dict[str, float]:
    """Milliseconds per stage of the hook's stage timer between two scrapes."""
    spent: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == STAGE_METRIC:
            grew = value - before.get((name, labels), 0.0)
            if grew > 0:
                spent[dict(labels).get("stage", "?")] = grew * 1000
    return spent


def request_read_ms(body: bytes, repeats: int = 7) -> float:
    """vLLM's parse and validation of a chat request body, as its API server does it, timed in this process."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ChatCompletionRequest.model_validate_json(body)
        times.append((time.perf_counter() - started) * 1000)
    return median(times)


def measure_call(
    http: httpx.Client, url: str, previous: Call, call: Call, tokenizer: Any, repeats: int
) -> dict[str, Any]:
    """One call of one history: per variant the medians of e2e and of each stage, the request read, and the paired
    differences hook - token-in."""
    post_ms(http, "/v1/chat/completions", orjson.dumps(previous.chat("hook", max_tokens=1)))
    body: dict[str, Callable[[int], bytes]] = {
        variant: (lambda round_, v=variant: orjson.dumps(call.varied(tokenizer, round_).chat(v, max_tokens=1)))
        for variant in VARIANTS
    }
    for variant in VARIANTS:  # warm-up: untimed
        post_ms(http, "/v1/chat/completions", body[variant](-1))
    e2e: dict[str, list[float]] = {v: [] for v in VARIANTS}
    stages: dict[str, dict[str, list[float]]] = {v: {stage: [] for stage in STAGES} for v in VARIANTS}
    before = scrape(url, http)
    for round_ in range(repeats):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            e2e[variant].append(post_ms(http, "/v1/chat/completions", body[variant](round_)))
            after = scrape(url, http)
            spent = stage_deltas(before, after)
            before = after
            for stage in STAGES:
                stages[variant][stage].append(spent.get(stage, 0.0))
    return {
        "call": call.number,
        "ids": call.history_ids,
        "e2e": {v: median(e2e[v]) for v in VARIANTS},
        "read": {v: request_read_ms(body[v](10_000)) for v in VARIANTS},
        "stages": {v: {stage: median(values) for stage, values in stages[v].items()} for v in VARIANTS},
        "timed": any(value for values in stages["hook"].values() for value in values),
        "extra": median([mine - theirs for mine, theirs in zip(e2e["hook"], e2e["token_in"])]),
        "ratio": median([mine / theirs for mine, theirs in zip(e2e["hook"], e2e["token_in"]) if theirs > 0]),
    }


def run(url: str, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(bench_model())
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for name in args.histories:
            kind, seed = parse_history(name)
            note(f"P9: building history {name} ({args.calls} calls) on {url} ...")
            episode = build_episode(url, args.calls, kind=kind, seed=seed)
            for size, call in zip(args.sizes, nearest_calls(episode, args.sizes)):
                measured = measure_call(http, url, episode[call.number - 2], call, tokenizer, args.repeats)
                rows.append({"history": name, "size": size, **measured})
                note(f"P9: {name} at {call.history_ids} ids: hook - token-in {measured['extra']:.2f} ms")
    title = "Where each millisecond of a next turn goes: the hook beside token-in"
    figure = Figure("P9", title, command("p9_breakdown.py", argv))
    figure.tables += [breakdown_table(rows, args.sizes), history_table(rows)]
    if not all(row["timed"] for row in rows):
        figure.notes.append("The server has no stage timer (start it with NEMO_GYM_TOK_STAGE_TIMES=1): stages read 0.")
    figure.data["rows"] = rows
    figure.data["readings"] = readings(rows, args.sizes)
    figure.seconds = time.monotonic() - started
    return figure


def label(size: int) -> str:
    return f"{size // 1024}k"


def breakdown_table(rows: list[dict[str, Any]], sizes: Sequence[int]) -> Table:
    """Per size, the median over histories of each part, for each variant and the hook's excess."""
    headers = ["size", "ids", "variant", "e2e", "request read", *STAGES, "rest"]
    table = Table(f"Where the time goes, ms: median over {len({r['history'] for r in rows})} histories", headers)
    for size in sizes:
        at = [row for row in rows if row["size"] == size]
        parts = {variant: _parts(at, variant) for variant in VARIANTS}
        ids = median([row["ids"] for row in at])
        for variant in VARIANTS:
            table.add(label(size), int(ids), variant.replace("_", "-"), *parts[variant], digits=2)
        excess = [mine - theirs for mine, theirs in zip(parts["hook"], parts["token_in"])]
        # e2e: the paired difference (not a difference of medians), and the rest what the parts leave of it
        excess[0] = median([row["extra"] for row in at])
        excess[-1] = excess[0] - sum(excess[1:-1])
        table.add(label(size), int(ids), "hook - token-in", *excess, digits=2)
    return table


def _parts(rows: list[dict[str, Any]], variant: str) -> list[float]:
    e2e = median([row["e2e"][variant] for row in rows])
    read = median([row["read"][variant] for row in rows])
    stages = [median([row["stages"][variant][stage] for row in rows]) for stage in STAGES]
    return [e2e, read, *stages, e2e - read - sum(stages)]


def history_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        "Every history and size: 1-token chat end to end, ms (medians) and the hook's excess (paired)",
        ["history", "size", "ids", "hook", "token-in", "hook - token-in", "hook / token-in"],
    )
    for row in rows:
        table.add(
            row["history"],
            label(row["size"]),
            row["ids"],
            row["e2e"]["hook"],
            row["e2e"]["token_in"],
            row["extra"],
            row["ratio"],
            digits=2,
        )
    return table


def readings(rows: list[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Reading]:
    """The flatness target's reading: the hook's excess at the largest size minus at the smallest (medians over
    histories of the paired differences)."""
    if not rows or len(sizes) < 2:
        return {}
    low, high = min(sizes), max(sizes)
    excess = {size: median([row["extra"] for row in rows if row["size"] == size]) for size in (low, high)}
    where = f"{label(high)} {excess[high]:.2f} ms, {label(low)} {excess[low]:.2f} ms"
    return {"P9.hook-token-in.ms@32k-1k": Reading(excess[high] - excess[low], where)}


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
