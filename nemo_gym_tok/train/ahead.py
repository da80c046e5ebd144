"""Collection that runs ahead of the trainer along a known schedule, bounded: batch N starts only once the weights of
step N - max_staleness are served, so no token is more than max_staleness pushes behind when step N trains on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CollectBatch = Callable[[int, Sequence[dict[str, Any]]], list[dict[str, Any]]]
"""(step, rows) -> one record per row, in the rows' order."""


class CollectorStoppedError(RuntimeError):
    """The collector was stopped, or failed on an earlier batch, before the batch asked for was collected."""


@dataclass(frozen=True)
class BatchTiming:
    """When one batch was collected, in seconds on the collector's clock (time.monotonic)."""

    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class AheadCollector:
    """Collects `schedule[0]`, `schedule[1]`, ... one batch after the other on its own thread. `allow(step)` says the
    weights of `step` are served: batches up to `step + max_staleness` may then start. `take(step)` waits for batch
    `step` and hands it over (an error of the collector's is raised there). With `max_staleness` 0 each batch waits
    for its own step's push: the synchronous loop."""

    def __init__(self, schedule: Sequence[Sequence[dict[str, Any]]], collect: CollectBatch, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.schedule = [list(batch) for batch in schedule]
        self.collect = collect
        self.max_staleness = max_staleness
        self.timings: dict[int, BatchTiming] = {}
        self.started_at: float | None = None
        self._allowed = -1
        self._done: dict[int, list[dict[str, Any]]] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ngt-ahead-collector", daemon=True)

    def allow(self, step: int) -> None:
        """The weights of `step` are served (pushed and proven): batches up to `step + max_staleness` may start.
        The first call starts the collector."""
        with self._condition:
            self._allowed = max(self._allowed, step)
            self._condition.notify_all()
        if self.started_at is None:
            self.started_at = time.monotonic()
            self._thread.start()

    def take(self, step: int) -> list[dict[str, Any]]:
        """Batch `step`'s records, once collected (blocking until then)."""
        if not 0 <= step < len(self.schedule):
            raise IndexError(f"step {step} is outside the schedule's {len(self.schedule)} batches")
        with self._condition:
            while step not in self._done:
                if self._failure is not None:
                    raise CollectorStoppedError(f"batch {step} was not collected: {self._failure}") from self._failure
                if self._stopping:
                    raise CollectorStoppedError(f"batch {step} was not collected: the collector was stopped")
                self._condition.wait()
            return self._done.pop(step)

    def stop(self, timeout: float = 30.0) -> None:
        """No batch starts after this; a batch under way finishes (or fails) on its own within `timeout`."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def busy_seconds(self, until: float) -> float:
        """Seconds spent collecting between the start and `until` (time.monotonic)."""
        return sum(max(0.0, min(t.ended, until) - t.started) for t in self.timings.values() if t.started < until)

    def _run(self) -> None:
        for step, rows in enumerate(self.schedule):
            with self._condition:
                while step > self._allowed + self.max_staleness and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
            started = time.monotonic()
            try:
                records = self.collect(step, rows)
            except BaseException as exc:  # handed to the trainer's thread, which raises it in take()
                with self._condition:
                    self._failure = exc
                    self._condition.notify_all()
                return
            with self._condition:
                self.timings[step] = BatchTiming(started, time.monotonic())
                self._done[step] = records
                self._condition.notify_all()
