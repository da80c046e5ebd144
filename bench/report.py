"""Runs every bench/ figure (P1 to P10) on one bench server build and regenerates docs/performance.md and .png.

    .venv/bin/python bench/report.py            # what `make bench` runs (about 50 minutes on 2 cores)
    .venv/bin/python bench/report.py --quick    # a short smoke run (fewer calls and repeats; writes the docs too)

Starts the hooked bench vLLM once (the tiny model built with a 32,768-position limit, --max-model-len 32768) and
keeps it for every figure; a stock vLLM (hook off) joins for the figures that compare against it (P1's adapter
splice, P3, P6); P7 and P8 each start a pair of hooked replicas of their own (the same build and flags) behind
vllm-router. Each figure's section in the doc names the standalone command that reproduces it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import p1_adapter
import p2_preprocess
import p3_upstream_calls
import p4_collect
import p5_request_bytes
import p6_collect_load
import p7_routing
import p8_headerless
import p9_breakdown
import p10_client_bytes
from benchkit.figures import Figure, command, fmt, judged
from benchkit.machine import machine_facts
from benchkit.server import BENCH_ARGS, REPO, vllm_server
from benchkit.timing import median, ratio
from targets import MISSED, Verdict, text

FULL: dict[str, list[str]] = {
    "P1": [],
    "P2": [],
    "P3": [],
    "P4": [],
    "P5": [],
    "P6": [],
    "P7": [],
    "P8": [],
    "P9": [],
    "P10": [],
}
QUICK: dict[str, list[str]] = {
    "P1": ["--sizes", "1024", "7168", "--repeats", "5", "--splice-repeats", "3", "--histories", "words-0", "tools-2"],
    "P2": [
        "--calls",
        "24",
        "--sizes",
        "1024",
        "4096",
        "--repeats",
        "3",
        "--episode-repeats",
        "2",
        "--episode-step",
        "4",
        "--histories",
        "words-0",
        "tools-2",
    ],
    "P3": ["--turns", "4", "--episodes", "2"],
    "P4": ["--rollouts", "32", "--concurrency", "16", "--runs", "1"],
    "P5": ["--turns", "10", "--report", "1", "5", "10"],
    "P6": ["--quick"],
    "P7": ["--quick"],
    "P8": ["--quick"],
    "P9": ["--calls", "24", "--sizes", "1024", "4096", "--repeats", "3", "--histories", "words-0", "tools-2"],
    "P10": ["--calls", "20", "--report", "1", "10", "20"],
}
MODULES = {
    "P1": p1_adapter,
    "P2": p2_preprocess,
    "P3": p3_upstream_calls,
    "P4": p4_collect,
    "P5": p5_request_bytes,
    "P6": p6_collect_load,
    "P7": p7_routing,
    "P8": p8_headerless,
    "P9": p9_breakdown,
    "P10": p10_client_bytes,
}
SCRIPTS = {
    "P1": "p1_adapter.py",
    "P2": "p2_preprocess.py",
    "P3": "p3_upstream_calls.py",
    "P4": "p4_collect.py",
    "P5": "p5_request_bytes.py",
    "P6": "p6_collect_load.py",
    "P7": "p7_routing.py",
    "P8": "p8_headerless.py",
    "P9": "p9_breakdown.py",
    "P10": "p10_client_bytes.py",
}
ORDER = ("P2", "P9", "P5", "P10", "P4", "P1", "P3", "P6", "P7", "P8")
"""The hooked-only figures first; then the stock server joins for P1, P3 and P6; P7 and P8 last, each on a pair of
its own."""
NEEDS_STOCK = ("P1", "P3", "P6")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run: fewer calls, sizes and repeats")
    p.add_argument("--only", nargs="+", choices=list(MODULES), help="run these figures only")
    p.add_argument("--vllm-url", help="use this hooked bench vLLM instead of starting one")
    p.add_argument("--stock-url", help="use this stock bench vLLM instead of starting one")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where performance.md and .png go (default docs/)")
    p.add_argument("--no-docs", action="store_true", help="print the tables only")
    return p


def run_figure(key: str, url: str, stock: str | None, argv: list[str]) -> list[Figure]:
    module = MODULES[key]
    args = module.parser().parse_args(argv)
    result = module.run(url, args, argv, stock_url=stock) if key in NEEDS_STOCK else module.run(url, args, argv)
    return result if isinstance(result, list) else [result]


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    plan = QUICK if args.quick else FULL
    keys = [k for k in ORDER if not args.only or k in args.only]
    load_before = machine_facts()["load"]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(vllm_server(args.vllm_url))
        facts = machine_facts(url)
        facts["load"] = load_before
        servers: dict[str, str] = {}

        def run_one(key: str) -> list[Figure]:
            if key in NEEDS_STOCK and "stock" not in servers:
                servers["stock"] = stack.enter_context(vllm_server(args.stock_url, hook=False))
            return run_figure(key, url, servers.get("stock"), plan[key])

        figures, failed = collect_figures(keys, run_one)
    total = time.monotonic() - started
    print(text(judged(figures.values())) + "\n")
    print(f"report: {len(figures)} figures in {total / 60:.1f} min; command: {command('report.py', sys.argv[1:])}")
    for key, reason in failed.items():
        print(f"report: {key} FAILED ({reason}); the other figures are kept")
    if not args.no_docs:
        args.docs.mkdir(parents=True, exist_ok=True)
        plotted = plot(figures.get("P2"), args.docs / "performance.png")
        (args.docs / "performance.md").write_text(document(figures, facts, total, args, plotted, failed))
        written = [args.docs / "performance.md"] + ([args.docs / "performance.png"] if plotted else [])
        print(f"report: wrote {' and '.join(map(str, written))}")
    return 1 if failed else 0


def collect_figures(
    keys: Sequence[str], run_one: Callable[[str], list[Figure]]
) -> tuple[dict[str, Figure], dict[str, str]]:
    """Each key's figures, run in turn by `run_one`, and the keys whose run raised, with why. A figure that fails is
    reported and left out; the ones after it still run, and the ones before it are kept (a failure in the last
    figure of a 25-minute run used to lose them all)."""
    figures: dict[str, Figure] = {}
    failed: dict[str, str] = {}
    for key in keys:
        try:
            produced = run_one(key)
        except Exception as exc:  # noqa: BLE001 - reported and counted; the run goes on
            traceback.print_exc()
            failed[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        for figure in produced:
            figures[figure.key] = figure
            print(figure.text() + "\n", flush=True)
    return figures, failed


def plot(figure: Figure | None, path: Path) -> bool:
    """Per-call cost against history length for stock, hook and token-in (P2's episode): end-to-end latency, and the
    hook's server-side preprocessing timer where the server has it."""
    if figure is None or not figure.data.get("calls"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = figure.data["calls"]
    ids = [row["ids"] for row in calls]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = {
        "stock": "stock (vLLM templating)",
        "hook": "hook (bundle spliced)",
        "token_in": "token-in (kv_transfer_params ids)",
    }
    for ax, key, title in (
        (axes[0], "e2e", "1-token chat completion, end to end (median)"),
        (axes[1], "server", "server-side preprocessing (hook's timer, median)"),
    ):
        plotted = False
        for variant, style in (("stock", "o-"), ("hook", "s-"), ("token_in", "^-")):
            ys = [row[key][variant] for row in calls]
            if any(y == y for y in ys):
                ax.plot(ids, ys, style, markersize=3, linewidth=1, label=labels[variant])
                plotted = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("history ids (prompt length)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        if plotted:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                "unavailable: no nemo_gym_tok_preprocess_seconds\non this server's /metrics",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
            )
    fig.suptitle(
        f"Per-call cost as one episode grows, history {figure.data.get('history', '')} (bench/p2_preprocess.py)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def document(
    figures: dict[str, Figure],
    facts: dict[str, str],
    total: float,
    args: argparse.Namespace,
    plotted: bool,
    failed: dict[str, str] | None = None,
) -> str:
    run_command = "make bench" if not args.quick else command("report.py", ["--quick"])
    lines = [
        "# Performance",
        "",
        f"Generated by `{run_command}` ([bench/report.py](../bench/report.py)); do not edit by hand. "
        "Every figure is a ratio measured side by side in one run, on one server; absolute times move with the "
        "machine's load, the ratios much less.",
        "",
        "| | |",
        "| --- | --- |",
        f"| date | {facts['date']} |",
        f"| machine | {facts['cpu']}, {facts['memory']} RAM, shared (load average {facts['load']} at the start) |",
        f"| vLLM | {facts['vllm']} (CPU build), Python {facts['python']} |",
        f"| CPU placement | {facts['placement']} (measured at the start) |",
        "| model | the embedded tiny random Qwen3 (2 layers, hidden 128) built with `max_position_embeddings` 32768 "
        "(`build_tiny_model(max_position_embeddings=32768)`, its own cache entry; the test build keeps 8192) |",
        "| server | `ngt vllm-serve` (hook on) with `" + " ".join(BENCH_ARGS) + "`; a stock vLLM (hook off) with the "
        "same flags for the stock comparisons; prefix caching on (vLLM's default) |",
        f"| run time | {total / 60:.1f} min in all, server start-ups included |",
        *(
            f"| failed in this run | {key}: {reason} (its section is left out) |"
            for key, reason in (failed or {}).items()
        ),
        "",
        "Method: requests of the variants compared are interleaved (order rotated each round) after untimed warm-up "
        "requests; medians (and p95 where given). Prefix caching is on, so repeated identical prompts hit the cache "
        "for every variant alike: after the warm-up the engine recomputes only the last block, and what differs "
        "between variants is preprocessing (templating, tokenization, the splice) and what the hops add. A 1-token "
        "completion is the worst case for any per-request overhead; real turns generate many tokens and amortize it.",
        "",
    ]
    verdicts = judged(figures.values())
    headline = headlines(figures)
    if verdicts or headline:
        missed = sum(v.verdict == MISSED for v in verdicts)
        lines += [
            "## Summary",
            "",
            f"{missed} of {len(verdicts)} targets NOT met (listed first, then any not measured, then the met ones); "
            "then the figures without a target. A target judges the worst history where a figure measures several.",
            "",
            "| figure | measured | value | target | verdict |",
            "| --- | --- | --- | --- | --- |",
            *(summary_row(v) for v in verdicts),
            *headline,
            "",
        ]
    for key in ("P1", "P1a", "P1b", "P2", "P9", "P3", "P4", "P5", "P10", "P6", "P7", "P8"):
        figure = figures.get(key)
        if figure is None:
            continue
        lines += [f"## {key}: {figure.title}", "", "```bash", figure.command, "```", ""]
        if key == "P2" and plotted:
            lines += ["![Per-call cost against history length: stock, hook, token-in](performance.png)", ""]
        for table in figure.tables:
            lines += [table.markdown(), ""]
        lines += [note + "\n" for note in figure.notes]
        lines += [f"({figure.seconds:.0f} s)", ""]
    return "\n".join(lines).rstrip() + "\n"


def summary_row(verdict: Verdict) -> str:
    target, reading = verdict.target, verdict.reading
    value = "-" if reading is None or reading.value != reading.value else f"{reading.value:.3f}"
    if reading is not None and reading.where and value != "-":
        value += f" ({reading.where})"
    shown = f"**{verdict.verdict}**" if verdict.verdict == MISSED else verdict.verdict
    return (
        f"| {target.figure} | {target.name}: {target.wording} | {value} | {target.comparison} "
        f"{target.threshold:g} | {shown} |"
    )


def headlines(figures: dict[str, Figure]) -> list[str]:
    """One line per figure with its main ratios, no target of their own (the verdict rows above judge those)."""
    lines: list[str] = []

    def row(figure: str, measured: str) -> None:
        lines.append(f"| {figure} | {measured} | | none | |")

    if (p1 := figures.get("P1")) and p1.data.get("hook"):
        for r in p1.data["hook"]:
            row(
                "P1",
                f"adapter (splice: hook) at {r['ids']} history ids: / a bare forwarding hop p50 "
                f"{fmt(ratio(r['adapter'][0], r['bare hop'][0]), 2)}, p95 "
                f"{fmt(ratio(r['adapter'][1], r['bare hop'][1]), 2)}; "
                f"/ direct vLLM p50 {fmt(ratio(r['adapter'][0], r['direct'][0]), 2)}, p95 "
                f"{fmt(ratio(r['adapter'][1], r['direct'][1]), 2)}; a bare hop / direct p50 "
                f"{fmt(ratio(r['bare hop'][0], r['direct'][0]), 2)}",
            )
    if (p1a := figures.get("P1a")) and p1a.data.get("adapter"):
        rows = p1a.data["adapter"]
        for size in sorted({r["size"] for r in rows}):
            at = [r for r in rows if r["size"] == size]
            stock = [ratio(r["adapter"][0], r["direct stock"][0]) for r in at]
            token_in = [ratio(r["adapter"][0], r["direct token-in"][0]) for r in at]
            cpu = [r["adapter cpu"] for r in at if "adapter cpu" in r]
            row(
                "P1a",
                f"adapter (splice: adapter, stock vLLM) at about {size} history ids, p50 over {len(at)} histories: "
                f"{fmt(median(stock), 2)} x direct stock (worst {fmt(max(stock), 2)}), {fmt(median(token_in), 2)} x "
                f"direct token-in (worst {fmt(max(token_in), 2)})"
                + (f"; the adapter's CPU per call {fmt(median(cpu), 1)} ms (median)" if cpu else ""),
            )
    if (p2 := figures.get("P2")) and p2.data.get("histories"):
        histories = p2.data["histories"]
        slopes = p2.data["slopes"]
        row(
            "P2",
            f"preprocessing slope hook / stock: server-side {fmt(slopes['server'], 2)} (median of {len(histories)} "
            f"histories), end to end {fmt(slopes['e2e'], 2)}",
        )
        sizes = sorted({r["size"] for h in histories for r in h.sizes})
        for size in sizes:
            at = [r for h in histories for r in h.sizes if r["size"] == size]
            paired = [r["paired"]["hook/stock"] for r in at]
            token_in = [r["paired"]["hook/token_in"] for r in at]
            tokenize = [ratio(r["tokenize_e2e"]["hook"], r["tokenize_e2e"]["stock"]) for r in at]
            row(
                "P2",
                f"at about {size} history ids, {len(at)} histories, 1-token chat end to end, paired, median (worst): "
                f"hook / stock {fmt(median(paired), 2)} ({fmt(max(paired), 2)}), hook / token-in "
                f"{fmt(median(token_in), 2)} ({fmt(max(token_in), 2)}); /tokenize hook / stock "
                f"{fmt(median(tokenize), 2)} ({fmt(max(tokenize), 2)})",
            )
    if (p3 := figures.get("P3")) and p3.data.get("totals"):
        for key, totals in p3.data["totals"].items():
            row("P3", f"vLLM requests per model call, splice: {key}: {fmt(sum(totals) / len(totals), 2)}")
    if (p4 := figures.get("P4")) and p4.data.get("gym"):
        gym, bare = p4.data["gym"], p4.data["bare"]
        speed = ratio(
            median([r["rollouts"] / r["seconds"] for r in gym]), median([r["rollouts"] / r["seconds"] for r in bare])
        )
        cpu = median([ratio(r["cpu_ms"], r["calls"]) for r in gym])
        row(
            "P4",
            f"`ngt collect` rollouts/s over a bare asyncio loop: {fmt(speed, 2)}; gym CPU {fmt(cpu, 1)} ms per call",
        )
    if (p5 := figures.get("P5")) and p5.data.get("turns"):
        rows = p5.data["turns"]
        last = rows[-1]
        row(
            "P5",
            f"agent -> adapter request at turn {last['turn']}: {last['agent_bytes']} bytes "
            f"({fmt(ratio(last['agent_bytes'], last['prompt_ids']), 1)} per prompt id, {last['bundles']} bundle(s))",
        )
    if (p10 := figures.get("P10")) and p10.data.get("rows"):
        ratios = [f"{r['client']} ({r['hop']}) {fmt(r['ratio'], 2)}" for r in p10.data["rows"] if "ratio" in r]
        row(
            "P10",
            f"request bytes / the call's prompt ids as compact JSON at call {p10.data['last']}: " + "; ".join(ratios),
        )
    if (p7 := figures.get("P7")) and p7.data.get("runs"):
        for concurrency, ch, rr in p7_routing.paired(p7.data["runs"]):
            row(
                "P7",
                f"two hooked replicas behind vllm-router at concurrency {concurrency}: prefix-cache hit rate "
                f"consistent_hash {ch['cache_hit']:.1%}, round_robin {rr['cache_hit']:.1%}; rollouts/s "
                f"consistent_hash / round_robin {fmt(ratio(p7_routing.per_second(ch), p7_routing.per_second(rr)), 2)}",
            )
    if (p8 := figures.get("P8")) and p8.data.get("cases"):
        best = max(p8.data["cases"], key=lambda case: case["cache_hit"] if not case["header"] else -1.0)
        row(
            "P8",
            f"a client without x-session-id straight to vllm-router: the best policy for it, {best['policy']}, "
            f"{best['cache_hit']:.1%} prefix-cache hits, {best['one_replica']} of {best['conversations']} "
            "conversations on one replica",
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
