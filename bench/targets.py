"""The bench's targets, one table, and the pure met / NOT met verdict of each against what a run measured."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MET, MISSED, UNMEASURED = "met", "NOT met", "not measured"
SIZES = ("1k", "7k", "32k")
"""The history sizes figures name their per-size readings by (`...@7k.worst`)."""
ADAPTER_OVER_HOOK = "P1a-P2.adapter-hook.worst"
CHAINED_OVER_HOOK = "P1b-P2.adapter-hook.worst"
OVER_HOOK = {ADAPTER_OVER_HOOK: "P1a", CHAINED_OVER_HOOK: "P1b"}
"""The derived readings of the adapter beside the hook, by the figure whose adapter readings they compare."""


@dataclass(frozen=True)
class Target:
    """One target: what the figure must measure (`key` in the run's readings), compared with `threshold`."""

    name: str
    figure: str
    key: str
    comparison: str
    """"<=" or ">=": how the measured value must stand to `threshold`."""
    threshold: float
    wording: str
    """The docs' wording of what is measured and why."""


@dataclass(frozen=True)
class Reading:
    """A measured value of a target's key and where it was measured (the worst history, the size)."""

    value: float
    where: str = ""


@dataclass(frozen=True)
class Verdict:
    target: Target
    reading: Reading | None
    verdict: str
    """MET, MISSED, or UNMEASURED (no reading, or NaN: a figure not run, a size not in the run)."""

    def cell(self) -> str:
        """The measured value with its target and verdict, as the summary prints it."""
        wanted = f"target {self.target.comparison} {self.target.threshold:g}"
        if self.reading is None or self.verdict == UNMEASURED:
            return f"not measured ({wanted})"
        where = f" ({self.reading.where})" if self.reading.where else ""
        return f"{self.reading.value:.3f}{where}; {wanted}: {self.verdict}"


TARGETS: tuple[Target, ...] = (
    Target(
        "adapter's own share, p50",
        "P1",
        "P1.own_share.p50@7k",
        "<=",
        1.10,
        "adapter (splice: hook) / a bare forwarding hop, p50 at about 7k history ids (what the adapter adds beyond "
        "any hop; adapter / direct is printed beside it, informational)",
    ),
    Target(
        "adapter's own share, p95",
        "P1",
        "P1.own_share.p95@7k",
        "<=",
        1.10,
        "adapter (splice: hook) / a bare forwarding hop, p95 at about 7k history ids",
    ),
    Target(
        "adapter splice vs stock templating",
        "P1a",
        "P1a.adapter/stock.p50@7k.worst",
        "<=",
        0.8,
        "adapter (splice: adapter, stock vLLM) / direct stock, p50 at about 7k history ids, the worst history",
    ),
    Target(
        "adapter splice vs token-in, beside the hook",
        "P1a",
        ADAPTER_OVER_HOOK,
        "<=",
        0.05,
        "adapter (splice: adapter, stock vLLM) / direct token-in, p50, the worst history, minus P2's hook / token-in "
        "(paired) on the worst history, at the same size: the most over 1k, 7k and 32k (issue 40: the adapter's "
        "splice costs at most 5 points more than the hook's; needs P1a and P2 in one run)",
    ),
    Target(
        "adapter splice, the agent's way, vs token-in, beside the hook",
        "P1b",
        CHAINED_OVER_HOOK,
        "<=",
        0.05,
        "adapter (splice: adapter, stock vLLM), continued /v1/responses calls (previous_response_id and the new item, "
        "as the simple agent sends them) / direct token-in, p50, the worst history, minus P2's hook / token-in "
        "(paired) on the worst history, at the same size: the most over 1k, 7k and 32k (issue 40; needs P1b and P2 "
        "in one run)",
    ),
    Target(
        "hook vs stock templating",
        "P2",
        "P2.hook/stock.paired@7k.worst",
        "<=",
        0.8,
        "hook / stock, 1-token chat end to end (paired), at about 7k history ids, the worst history",
    ),
    Target(
        "hook vs token-in at 7k",
        "P2",
        "P2.hook/token-in.paired@7k.worst",
        "<=",
        1.10,
        "hook / token-in, 1-token chat end to end (paired), at about 7k history ids, the worst history (issue 40)",
    ),
    Target(
        "hook vs token-in at 32k",
        "P2",
        "P2.hook/token-in.paired@32k.worst",
        "<=",
        1.10,
        "hook / token-in, 1-token chat end to end (paired), at about 32k history ids, the worst history (issue 40)",
    ),
    Target(
        "the hook's extra time, flat in history length",
        "P9",
        "P9.hook-token-in.ms@32k-1k",
        "<=",
        1.0,
        "the hook's time over token-in (1-token chat end to end, the median of paired differences, the median of the "
        "histories) at about 32k history ids minus the same at about 1k, in ms (issue 40: the splice's cost does "
        "not grow with the history)",
    ),
    Target(
        "the agent's request bytes at 80 calls",
        "P10",
        "P10.agent-bytes/ids-json@last",
        "<=",
        1.2,
        "bytes of this project's simple agent's request at call 80 of one history / that call's prompt ids as compact "
        "JSON (issue 40: payloads that grow with the history, not with turns x history)",
    ),
    Target(
        "/tokenize with a bundle vs stock",
        "P2",
        "P2.tokenize.hook/stock.worst",
        "<=",
        1.0,
        "/tokenize with a bundle / stock /tokenize, end to end, the worst of every size and history",
    ),
    Target(
        "preprocessing slope",
        "P2",
        "P2.slope.server.hook/stock.worst",
        "<=",
        0.3,
        "server-side preprocessing slope (ms per 1k history ids over an episode) hook / stock, the worst history",
    ),
    Target(
        "requests per spliced turn, splice: adapter",
        "P3",
        "P3.adapter.per_spliced_turn",
        "<=",
        1.05,
        "vLLM requests per spliced turn with splice: adapter against a stock vLLM, averaged over several 10-turn "
        "episodes on one adapter (its one-off requests charged to the spliced turns)",
    ),
    Target(
        "collection under load, hook / no splice",
        "P6",
        "P6.hook_over_none.min",
        ">=",
        1.0,
        "`ngt collect` rollouts per second with the hook over a stock vLLM with no splice (drifting), the lowest over "
        "the concurrencies",
    ),
    Target(
        "collection under load, adapter splice / no splice",
        "P6",
        "P6.adapter_over_none.min",
        ">=",
        0.95,
        "`ngt collect` rollouts per second with splice: adapter on a stock vLLM over the same vLLM with no splice, the "
        "lowest over the concurrencies",
    ),
    Target(
        "collection under load, adapter and agent memory growth",
        "P6",
        "P6.rss_growth.max",
        "<=",
        0.10,
        "the largest growth of the adapter's and the agent's RSS from after the run at the highest concurrency (the "
        "peak of in-flight work) to the end of the run",
    ),
    Target(
        "requests per model call, splice: hook",
        "P3",
        "P3.hook.max_after_first",
        "<=",
        1.0,
        "vLLM requests per model call with splice: hook, the most of any call after the adapter's first (expected 1: "
        "the chat call)",
    ),
    Target(
        "router: consistent_hash vs round_robin prefix-cache hits",
        "P7",
        "P7.hit_rate.ch/rr.min",
        ">=",
        1.0,
        "vLLM's prefix-cache hit rate on two hooked replicas behind vllm-router, consistent_hash over round_robin "
        "(issue 31: above it), the lowest over the concurrencies",
    ),
)
"""Issue 22's and issue 31's "Done when" and the earlier targets; every one is judged on each run."""


def worst(candidates: Iterable[tuple[float, str]]) -> Reading:
    """The highest of (value, where) readings, NaN ones left out (every target's ratio is worse when higher);
    a NaN reading when none is left."""
    measured = [(value, where) for value, where in candidates if not math.isnan(value)]
    if not measured:
        return Reading(math.nan)
    value, where = max(measured, key=lambda pair: pair[0])
    return Reading(value, where)


def judge(target: Target, reading: Reading | None) -> Verdict:
    """MET when the reading stands to the threshold as `comparison` says (equal counts as met), MISSED otherwise,
    UNMEASURED without a reading or with NaN."""
    if reading is None or math.isnan(reading.value):
        return Verdict(target, reading, UNMEASURED)
    if target.comparison == "<=":
        met = reading.value <= target.threshold
    elif target.comparison == ">=":
        met = reading.value >= target.threshold
    else:
        raise ValueError(f"target {target.key!r}: unknown comparison {target.comparison!r}")
    return Verdict(target, reading, MET if met else MISSED)


def derived(readings: Mapping[str, Reading]) -> dict[str, Reading]:
    """Readings that compare two figures of one run: the adapter's splice beside the hook's (OVER_HOOK: whole-history
    chat calls, P1a, and continued Responses calls, P1b), where that figure and P2 both measured a size."""
    found: dict[str, Reading] = {}
    for key, figure in OVER_HOOK.items():
        gaps = []
        for size in SIZES:
            adapter = readings.get(f"{figure}.adapter/token-in.p50@{size}.worst")
            hook = readings.get(f"P2.hook/token-in.paired@{size}.worst")
            if adapter is not None and hook is not None and not math.isnan(adapter.value - hook.value):
                where = f"{size}: adapter {adapter.value:.3f}, hook {hook.value:.3f}"
                gaps.append(Reading(adapter.value - hook.value, where))
        if gaps:
            found[key] = max(gaps, key=lambda reading: reading.value)
    return found


def verdicts(readings: Mapping[str, Reading], targets: Sequence[Target] = TARGETS) -> list[Verdict]:
    """Every target judged, the misses first, then the unmeasured, then the met (each group in table order)."""
    order = {MISSED: 0, UNMEASURED: 1, MET: 2}
    readings = {**readings, **derived(readings)}
    judged = [judge(target, readings.get(target.key)) for target in targets]
    return sorted(judged, key=lambda v: order[v.verdict])


def text(judged: Sequence[Verdict]) -> str:
    """The verdicts as the text report prints them."""
    if not judged:
        return "targets: none measured"
    misses = sum(v.verdict == MISSED for v in judged)
    lines = [f"targets: {misses} NOT met, {sum(v.verdict == MET for v in judged)} met of {len(judged)}"]
    lines += [f"  {v.verdict:>12}  {v.target.figure:<4} {v.target.name}: {v.cell()}" for v in judged]
    return "\n".join(lines)
