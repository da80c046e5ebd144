"""P2's tables, notes and target readings from the histories it measured: per size the median and the worst."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from targets import Reading, worst

from benchkit.figures import Figure, Table, fmt
from benchkit.metrics import PREPROCESS_METRIC
from benchkit.timing import median, ratio

VARIANTS = ("stock", "hook", "token_in")
TIMER_PATH = {"stock": "template", "hook": "spliced", "token_in": "token_in"}
"""The server-side timer's `path` label each variant should be counted under."""
EPISODE_ROWS = (2, 4, 8, 16, 32, 64, 96, 128)
"""Calls shown in the episode table (as near as the episode step allows; every measured call is in the plot)."""


@dataclass
class History:
    """One history's measurements: every measured call, the size-table calls, and the slopes over its episode."""

    name: str
    calls: list[dict[str, Any]]
    sizes: list[dict[str, Any]]
    slopes: dict[str, tuple[float, float]]
    """Per variant, (server-side, end-to-end) ms per 1k history ids."""

    def slope_ratio(self, which: int) -> float:
        return ratio(self.slopes["hook"][which], self.slopes["stock"][which])


RATIOS: dict[str, Callable[[dict[str, Any]], float]] = {
    "hook/stock paired": lambda r: r["paired"]["hook/stock"],
    "hook/token-in paired": lambda r: r["paired"]["hook/token_in"],
    "/tokenize hook/stock": lambda r: ratio(r["tokenize_e2e"]["hook"], r["tokenize_e2e"]["stock"]),
    "server-side hook/stock": lambda r: ratio(r["server"]["hook"], r["server"]["stock"]),
}
"""The per-size ratios whose median and worst over the histories are shown (higher is worse for each)."""


def by_size(histories: list[History]) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    """Per size, (history name, its size row) of every history that reached it."""
    grouped: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for history in histories:
        for row in history.sizes:
            grouped.setdefault(row["size"], []).append((history.name, row))
    return dict(sorted(grouped.items()))


def label(size: int) -> str:
    return f"{size / 1024:g}k"


def median_table(histories: list[History], unavailable: str) -> Table:
    """The size table of earlier runs, each cell the median over the histories of its per-history value."""
    table = Table(
        f"By history size, median over {len(histories)} histories: 1-token chat completion and /tokenize, "
        f"ms{unavailable}",
        [
            "size",
            "history ids",
            "request",
            "measure",
            "stock",
            "hook",
            "token-in",
            "hook/stock",
            "token-in/stock",
            "hook/token-in",
            "hook/stock paired",
            "hook/token-in paired",
        ],
    )
    for size, rows in by_size(histories).items():
        rows_ = [row for _, row in rows]

        def med(get: Callable[[dict[str, Any]], float]) -> float:
            return median([get(row) for row in rows_ if get(row) == get(row)])

        ids = int(med(lambda r: r["ids"]))
        for name, key in (("e2e median", "e2e"), ("server-side median", "server")):
            paired = (
                [med(RATIOS["hook/stock paired"]), med(RATIOS["hook/token-in paired"])] if key == "e2e" else ["-", "-"]
            )
            table.add(
                label(size),
                ids,
                "chat, 1 token",
                name,
                *(med(lambda r, v=v, key=key: r[key][v]) for v in VARIANTS),
                med(lambda r, key=key: ratio(r[key]["hook"], r[key]["stock"])),
                med(lambda r, key=key: ratio(r[key]["token_in"], r[key]["stock"])),
                med(lambda r, key=key: ratio(r[key]["hook"], r[key]["token_in"])),
                *paired,
                digits=2,
            )
        for name, key in (("e2e median", "tokenize_e2e"), ("server-side median", "tokenize_server")):
            table.add(
                label(size),
                ids,
                "/tokenize",
                name,
                med(lambda r, key=key: r[key]["stock"]),
                med(lambda r, key=key: r[key]["hook"]),
                "-",
                med(lambda r, key=key: ratio(r[key]["hook"], r[key]["stock"])),
                *(["-"] * 4),
                digits=2,
            )
    return table


def worst_table(histories: list[History]) -> Table:
    headers = ["size", "histories"]
    for name in RATIOS:
        headers += [f"{name} median", f"{name} worst"]
    table = Table(f"By history size, median and worst of {len(histories)} histories (worst: which history)", headers)
    for size, rows in by_size(histories).items():
        cells: list[Any] = [label(size), len(rows)]
        for get in RATIOS.values():
            reading = worst((get(row), history) for history, row in rows)
            cells += [median([get(row) for _, row in rows]), f"{fmt(reading.value, 2)} ({reading.where})"]
        table.add(*cells, digits=2)
    return table


def history_table(histories: list[History]) -> Table:
    table = Table(
        "Every history at every size: 1-token chat end to end (e2e medians, ms) and the ratios",
        ["history", "size", "ids", "stock prompt ids", "e2e stock", "e2e hook", "e2e token-in", *RATIOS],
    )
    for history in histories:
        for row in history.sizes:
            e2e = row["e2e"]
            table.add(
                history.name,
                label(row["size"]),
                row["ids"],
                row.get("stock_ids"),
                e2e["stock"],
                e2e["hook"],
                e2e["token_in"],
                *(get(row) for get in RATIOS.values()),
                digits=2,
            )
    return table


def growth_table(history: History) -> Table:
    calls = history.calls
    shown = {min(calls, key=lambda row: abs(row["call"] - n))["call"] for n in EPISODE_ROWS} | {calls[-1]["call"]}
    table = Table(
        f"History {history.name} growing to {calls[-1]['call']} calls (bundle of the last call each turn), ms",
        [
            "call",
            "history ids",
            "e2e stock",
            "e2e hook",
            "e2e token-in",
            "server stock",
            "server hook",
            "server token-in",
            "hook/stock e2e",
            "hook/stock server",
        ],
    )
    for row in calls:
        if row["call"] in shown:
            e2e, server = row["e2e"], row["server"]
            table.add(
                row["call"],
                row["ids"],
                *(e2e[v] for v in VARIANTS),
                *(server[v] for v in VARIANTS),
                ratio(e2e["hook"], e2e["stock"]),
                ratio(server["hook"], server["stock"]),
                digits=2,
            )
    return table


def slope_table(histories: list[History]) -> Table:
    table = Table(
        "Slope over each episode (Theil-Sen linear fit): ms per 1k history ids",
        ["history", "server stock", "server hook", "server token-in", "server hook/stock", "e2e hook/stock"],
    )
    for history in histories:
        server = [history.slopes[v][0] for v in VARIANTS]
        table.add(history.name, *server, history.slope_ratio(0), history.slope_ratio(1), digits=3)
    table.add(
        "median",
        *(median([h.slopes[v][0] for h in histories]) for v in VARIANTS),
        median([h.slope_ratio(0) for h in histories]),
        median([h.slope_ratio(1) for h in histories]),
        digits=3,
    )
    return table


def readings(histories: list[History]) -> dict[str, Reading]:
    """The values P2's targets judge: the worst history (and size) of each."""
    rows = [(history.name, row) for history in histories for row in history.sizes]

    def where(name: str, row: dict[str, Any]) -> str:
        return f"{row['ids']} ids, history {name}"

    return {
        "P2.hook/stock.paired@7k.worst": worst(
            (RATIOS["hook/stock paired"](row), where(name, row)) for name, row in rows if row["size"] == 7168
        ),
        "P2.hook/token-in.paired.worst": worst(
            (RATIOS["hook/token-in paired"](row), where(name, row)) for name, row in rows
        ),
        **{
            f"P2.hook/token-in.paired@{size // 1024}k.worst": worst(
                (RATIOS["hook/token-in paired"](row), where(name, row)) for name, row in rows if row["size"] == size
            )
            for size in sorted({row["size"] for _, row in rows})
        },
        "P2.tokenize.hook/stock.worst": worst(
            (RATIOS["/tokenize hook/stock"](row), where(name, row)) for name, row in rows
        ),
        "P2.slope.server.hook/stock.worst": worst((h.slope_ratio(0), f"history {h.name}") for h in histories),
    }


def add_tables(
    figure: Figure, histories: list[History], timer: bool, labels: dict[str, Counter], args: argparse.Namespace
) -> None:
    unavailable = (
        "" if timer else f" (server-side timer unavailable: this server's /metrics has no {PREPROCESS_METRIC})"
    )
    figure.tables += [
        median_table(histories, unavailable),
        worst_table(histories),
        history_table(histories),
        growth_table(histories[0]),
        slope_table(histories),
    ]
    slopes = [h.slope_ratio(0) for h in histories]
    e2e_slope = median([h.slope_ratio(1) for h in histories])
    figure.notes.append(
        f"Server-side slope hook/stock: median {fmt(median(slopes), 3)}, worst "
        f"{fmt(worst((s, '') for s in slopes).value, 3)} of {len(histories)} histories (target <= 0.3 on the worst)"
        if timer
        else "Server-side slope hook/stock: unavailable (no preprocessing timer on this server's /metrics); "
        f"end-to-end slope hook/stock: median {fmt(e2e_slope, 3)}"
    )
    mislabelled = {v: dict(labels[v]) for v in VARIANTS if set(labels[v]) - {TIMER_PATH[v]}}
    if mislabelled:
        figure.notes.append(
            "The server's timer labelled requests otherwise than expected (variant: {path: requests}): "
            f"{mislabelled}; the figures above are per request and do not depend on the label."
        )
    figure.notes.append(
        f"Histories ({', '.join(h.name for h in histories)}; kind-seed, bench/benchkit/episode.py KINDS): words is "
        "plain words with 1 id in 20 of any kind (the one history of earlier runs), random is text decoded from ids "
        "of any kind, tools ends every assistant turn with a tool call answered by a tool message (the requests carry"
        " a tool definition), reasoning opens every assistant turn with <think> text the template drops from earlier "
        "turns (stock vLLM then templates a shorter prompt than the spliced one, which keeps the model's own ids of "
        "every turn: see stock prompt ids), mixed draws one of the four per turn. Each ratio is taken within a "
        "history; the median and the worst are over the histories at that size, and the targets judge the worst. The "
        "growth table and the plot show the first history."
    )
    figure.notes.append(
        f"{args.repeats} timed repeats per variant at the size-table calls, {args.episode_repeats} at every "
        f"{args.episode_step}th other call, per history, after one untimed warm-up each; variants interleaved, order "
        "rotated each round. e2e: client wall time of the request, answer read; paired: the median over rounds of the "
        "two variants' ratio within a round (sent back to back), which the machine's drift between rounds does not "
        "move as it moves a ratio of medians. Server-side: the hook's timer (nemo_gym_tok_preprocess_seconds), one "
        "request at a time: /metrics is read between consecutive requests and each request's sum delta is its own; "
        "medians. Prefix caching is on: repeated prompts hit the cache for all three variants alike. The hook finds "
        "the prompt it spliced for the previous call (a real next turn does) and the placement rendering of the "
        "call's shape (shared by requests of that shape; a conversation with tool calls renders its own, one more "
        "rendering). All three variants go to the hooked server, whose plugin also speeds up vLLM's own rendering of "
        "every chat request (Jinja's sandbox shortcuts, docs/hook.md): its stock variant templates faster than a vLLM "
        "without the plugin (P1a's direct stock)."
    )
    figure.data = {
        "calls": histories[0].calls,
        "history": histories[0].name,
        "histories": histories,
        "timer": timer,
        "slopes": {"server": median(slopes), "e2e": e2e_slope},
        "readings": readings(histories),
    }
