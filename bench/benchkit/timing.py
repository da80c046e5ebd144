"""Timing requests (interleaved, after warm-up), the statistics of the figures, and CPU time of processes."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from benchkit.server import JSON_HEADERS, BenchError


def post_ms(http: httpx.Client, path: str, content: bytes) -> float:
    """Wall milliseconds of one POST of pre-serialized JSON, its answer read whole; BenchError unless 200."""
    started = time.perf_counter()
    answer = http.post(path, content=content, headers=JSON_HEADERS)
    elapsed = (time.perf_counter() - started) * 1000
    if answer.status_code != 200:
        raise BenchError(f"POST {http.base_url}{path} answered HTTP {answer.status_code}: {answer.text[:500]}")
    return elapsed


def interleaved(requests: dict[str, Callable[[], float]], repeats: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """`warmup` untimed rounds, then `repeats` rounds of every request, the order rotated each round, so that drift
    in machine load hits each variant alike. Returns each variant's milliseconds."""
    names = list(requests)
    for _ in range(warmup):
        for name in names:
            requests[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(requests[name]())
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen slope (the median of the slopes between every two points): a linear fit that a few load spikes on a
    shared machine do not tilt, as they tilt least squares. NaN with fewer than two points."""
    points = [(x, y) for x, y in zip(xs, ys) if y == y]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1]
    return statistics.median(slopes) if slopes else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
