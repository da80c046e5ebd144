"""The fleet keeper: watches every worker of a vllm-router and keeps out of it any that could serve stale weights.

A worker restarted after a push serves its start-up weights, labelled `default`, and vllm-router's health check takes
it back as soon as it answers. The keeper asks every worker the router lists for its weight version every
`poll_seconds`: a worker that does not answer, or answers with a version the fleet has left, is removed from the router
at once (a vLLM restart takes far longer than a poll, so a restarted worker is out before it can serve). A removed
worker that answers again is brought to the fleet's checkpoint and version, proven by the log-prob probe, and only then
added back. Every decision is a KeeperEvent, logged and kept in `events`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import httpx

from nemo_gym_tok.common.net import server_root, shared_ssl_context
from nemo_gym_tok.router import RouterError, add_worker, list_workers, remove_worker, worker_base_url
from nemo_gym_tok.weights.probe import WeightProbe, WeightProbeError
from nemo_gym_tok.weights.push import PushReport, WeightPushError, push_weights
from nemo_gym_tok.weights.replica import PauseMode, Replica, ReplicaError
from nemo_gym_tok.weights.resync import STARTUP_VERSION, FleetWeights, ResyncError, peer_probe, resync_worker

logger = logging.getLogger(__name__)

DEFAULT_POLL_SECONDS = 0.5
DEFAULT_ANSWER_TIMEOUT = 10.0
"""Seconds a worker may take to answer GET /weight_info before it counts as not answering (a dead one is refused at
once; this bounds a hung one)."""
DEFAULT_RETRY_SECONDS = 10.0
"""Between two tries to resync a worker that failed one."""
DEFAULT_UNKNOWN_GRACE = 120.0
"""Seconds a routed worker may serve a label the keeper has not been told of (a push under way whose `pushed` call has
not come yet) before it is dropped: past that it is a worker pushed apart from the fleet."""

ROUTED, OUT, RESYNCING, RETIRED = "routed", "out", "resyncing", "retired"
_MISSING = "missing"  # was routed, no longer listed, not by the keeper's hand: judged on the next check


class KeeperError(RuntimeError):
    """The keeper cannot watch this fleet (the router does not answer, no worker answers, the workers disagree)."""


@dataclass(frozen=True)
class KeeperEvent:
    """One decision: `kind` is `dropped`, `readmitted`, `resync_failed`, `retired`, `watching` or `pushed`; `at` is
    time.monotonic(); `seconds` is, for `dropped`, the time since the worker's last good answer and, for `readmitted`,
    the time its resync took."""

    kind: str
    worker: str
    detail: str
    at: float
    seconds: float | None = None

    def format(self) -> str:
        return f"fleet keeper: {self.kind} {self.worker}: {self.detail}"


@dataclass
class _Worker:
    url: str
    state: str
    last_ok: float | None = None
    dropped_at: float | None = None
    unknown_since: float | None = None
    next_try: float = 0.0
    failure: str = ""


class FleetKeeper:
    """Keeps the workers of the vllm-router at `router_url` on the fleet's weights: see the module's docstring.

    `fleet` is what the workers serve now (default: the one label every answering worker reports, its checkpoint
    unknown until a push). Tell the keeper of every push: `push` pushes through it (the watch holds off meanwhile),
    `pushed(report, probe)` after a push made elsewhere. Use as a context manager, or `start()` / `stop()`."""

    def __init__(
        self,
        router_url: str,
        *,
        fleet: FleetWeights | None = None,
        api_key: str | None = None,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        answer_timeout: float = DEFAULT_ANSWER_TIMEOUT,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        unknown_grace: float = DEFAULT_UNKNOWN_GRACE,
        push_timeout: float = 300.0,
        http: httpx.Client | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.router_url = server_root(router_url)
        self.api_key = api_key
        self.poll_seconds, self.retry_seconds, self.unknown_grace = poll_seconds, retry_seconds, unknown_grace
        self.push_timeout = push_timeout
        self.log = log or logger.info
        self.events: list[KeeperEvent] = []
        self._fleet = fleet
        self._stale: set[str] = set()
        self._generation = 0
        self._peer: tuple[int, WeightProbe, str] | None = None
        self._workers: dict[str, _Worker] = {}
        self._pushing = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._push_lock = threading.Lock()  # one change of weights at a time: a push, or a worker's resync
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resyncs: list[threading.Thread] = []
        # Each worker's check runs on its own and a poll does not wait for it: a worker slow to answer (a busy
        # engine) must not hold up the drop of one that died.
        self._checks = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ngt-fleet-check")
        self._checking: dict[str, Future[None]] = {}
        self._notes: dict[str, str] = {}
        self._own: list[httpx.Client] = []
        if http is None:
            tls = shared_ssl_context()
            # The watch's calls are short (a dead worker is refused at once); a resync's reload may take minutes.
            watch_timeout = httpx.Timeout(answer_timeout, connect=min(answer_timeout, 2.0))
            self._own = [
                httpx.Client(timeout=watch_timeout, verify=tls),
                httpx.Client(timeout=push_timeout, verify=tls),
            ]
        self._watch_http = http or self._own[0]
        self._push_http = http or self._own[1]

    # -- the fleet's state -------------------------------------------------------------------------------------------

    @property
    def fleet(self) -> FleetWeights | None:
        """What every routed worker must serve."""
        return self._fleet

    def states(self) -> dict[str, str]:
        """Each known worker's state: `routed`, `out` (dropped, resynced once it answers), `resyncing`, `retired`."""
        with self._lock:
            return {url: ("routed" if w.state == _MISSING else w.state) for url, w in self._workers.items()}

    def pushed(self, report: PushReport, probe: WeightProbe | None = None) -> None:
        """Tell the keeper of a push made elsewhere (`push_weights` over the router's workers): the fleet now serves
        `report.version` from `report.checkpoint_dir`, proven by `probe` (the push's own, if it had one). Workers the
        push dropped as unreachable are resynced once they answer."""
        with self._lock:
            old = self._fleet.version if self._fleet else None
            if old is not None and old != report.version:
                self._stale.add(old)
            self._stale.discard(report.version)
            if report.version != STARTUP_VERSION:
                self._stale.add(STARTUP_VERSION)
            self._fleet = FleetWeights(report.version, str(report.checkpoint_dir), probe)
            self._generation += 1
            for url in report.dropped:
                self._mark_out(url, "dropped by the push: it did not answer")
        self._event("pushed", self.router_url, f"the fleet serves version {report.version!r} ({report.checkpoint_dir})")

    def push_failed(self, error: WeightPushError) -> None:
        """Tell the keeper of a push that failed: its unproven version counts as stale (a worker serving it is
        dropped), and workers it dropped as unreachable are resynced once they answer."""
        with self._lock:
            unproven = error.unproven_version
            if unproven is not None and (self._fleet is None or unproven != self._fleet.version):
                self._stale.add(unproven)
            for url in error.dropped:
                self._mark_out(url, "dropped by the push: it did not answer")

    def push(
        self,
        checkpoint_dir: str | Path,
        version: str,
        *,
        probe: WeightProbe | None = None,
        pause_mode: PauseMode = "wait",
    ) -> PushReport:
        """`push_weights` over the router's live workers, all or none, the watch held off meanwhile (the labels change
        one worker after another); the fleet's state follows the outcome. Raises WeightPushError as push_weights."""
        with self._push_lock:
            with self._lock:
                self._pushing = True
            try:
                report = push_weights(
                    [self.router_url],
                    checkpoint_dir,
                    version=version,
                    api_key=self.api_key,
                    pause_mode=pause_mode,
                    timeout=self.push_timeout,
                    http=self._push_http,
                    probe=probe,
                )
                self.pushed(report, probe)
            except WeightPushError as exc:
                self.push_failed(exc)
                raise
            finally:
                with self._lock:
                    self._pushing = False
        return report

    def add(self, worker_url: str) -> None:
        """A worker to join the fleet: resynced and proven once it answers, then added to the router."""
        with self._lock:
            url = worker_base_url(worker_url)
            self._mark_out(url, "to join: resynced and proven before the router gets it", kind="watching")

    def retire(self, worker_url: str) -> None:
        """Stop watching a worker (taken out on purpose), and take it out of the router if it is there."""
        url = worker_base_url(worker_url)
        with self._lock:
            self._workers.setdefault(url, _Worker(url, RETIRED)).state = RETIRED
        try:
            remove_worker(self.router_url, url, http=self._watch_http)
        except RouterError:
            pass  # not listed: nothing to take out
        self._event("retired", url, "taken out on purpose; no longer watched")

    def wait_for(self, kind: str, worker: str, *, after: float = 0.0, timeout: float = 300.0) -> KeeperEvent:
        """The first event of `kind` about `worker` at or after monotonic time `after`; TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [e for e in self.events if e.kind == kind and e.worker == worker and e.at >= after]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind!r} event for {worker} within {timeout:.0f}s: {self.events[-5:]}")
                self._changed.wait(left)

    # -- running -----------------------------------------------------------------------------------------------------

    def start(self) -> FleetKeeper:
        """Read the router's workers, check each once (dropping those that must go), then watch on a thread."""
        try:
            listed = list_workers(self.router_url, http=self._watch_http)
        except RouterError as exc:
            raise KeeperError(f"the fleet keeper cannot read the router's workers: {exc}") from exc
        if self._fleet is None:
            self._fleet = FleetWeights(self._common_label(listed))
        if self._fleet.version != STARTUP_VERSION:
            self._stale.add(STARTUP_VERSION)
        wait(self._cycle())  # every listed worker checked once before start() returns
        self._thread = threading.Thread(target=self._run, name="ngt-fleet-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; a resync under way finishes first (it may be mid-reload)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._checks.shutdown(wait=True)
        for thread in list(self._resyncs):
            thread.join(timeout=self.push_timeout)
        for client in self._own:
            client.close()

    def __enter__(self) -> FleetKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _common_label(self, listed: Sequence[str]) -> str:
        labels: dict[str, str] = {}
        for url in listed:
            try:
                labels[url] = Replica(url, self._watch_http, self.api_key).weight_version()
            except ReplicaError as exc:
                if exc.status is not None:
                    raise KeeperError(f"the fleet keeper cannot read a worker's weight version: {exc}") from exc
        distinct = set(labels.values())
        if len(distinct) != 1:
            raise KeeperError(
                f"the fleet keeper needs the fleet's weight version: the router's workers answer {labels or 'nothing'}"
                "; push one version to every worker first, or pass fleet=FleetWeights(...)"
            )
        return distinct.pop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self._cycle()
            except Exception as exc:  # the watch must outlive any one surprise; it is logged and the next poll runs
                logger.exception("fleet keeper: a watch cycle failed")
                self._note("router", self.router_url, f"a watch cycle failed: {type(exc).__name__}: {exc}")

    def _cycle(self) -> list[Future[None]]:
        """One poll: the router's list read, each due worker's check started unless its last one is still running;
        the checks started."""
        try:
            listed = set(list_workers(self.router_url, http=self._watch_http))
        except RouterError as exc:
            self._note("router", self.router_url, f"the router did not answer /list_workers: {exc}")
            return []
        now = time.monotonic()
        with self._lock:
            for url in listed - self._workers.keys():
                self._workers[url] = _Worker(url, ROUTED, last_ok=now)
                self._event_locked("watching", url, "listed by the router")
            for worker in self._workers.values():
                if worker.state == ROUTED and worker.url not in listed:
                    worker.state = _MISSING
                elif worker.state in (OUT, RETIRED) and worker.url in listed:
                    # Someone added it back: watched again, and dropped again if it must go.
                    if worker.state == RETIRED:
                        self._event_locked("watching", worker.url, "listed by the router again")
                    worker.state = ROUTED
            due = [w for w in self._workers.values() if w.state in (ROUTED, _MISSING) or self._due(w, now)]
            pushing = self._pushing
        started = []
        for worker in due:
            running = self._checking.get(worker.url)
            if running is None or running.done():
                self._checking[worker.url] = self._checks.submit(self._check, worker, pushing)
                started.append(self._checking[worker.url])
        return started

    def _due(self, worker: _Worker, now: float) -> bool:
        return worker.state == OUT and now >= worker.next_try

    def _read(self, url: str) -> tuple[str | None, str]:
        try:
            return Replica(url, self._watch_http, self.api_key).weight_version(), ""
        except ReplicaError as exc:
            return None, str(exc)

    def _check(self, worker: _Worker, pushing: bool) -> None:
        label, error = self._read(worker.url)
        now = time.monotonic()
        with self._lock:
            fleet, stale = self._fleet, set(self._stale)
        assert fleet is not None
        if worker.state == _MISSING:
            if label is None:
                with self._lock:
                    self._mark_out(worker.url, f"taken out of the router while it did not answer ({error})")
            else:
                with self._lock:
                    worker.state = RETIRED
                self._event("retired", worker.url, "taken out of the router by someone else while it answered")
        elif worker.state == ROUTED and not pushing:
            if label is None:
                self._drop(worker, f"did not answer its weight version: {error}")
            elif label == fleet.version:
                worker.last_ok, worker.unknown_since = now, None
            elif label in stale:
                restarted = " (its start-up weights: it restarted)" if label == STARTUP_VERSION else ""
                self._drop(worker, f"serves weight version {label!r}{restarted}, not the fleet's {fleet.version!r}")
            elif worker.unknown_since is None:
                worker.unknown_since = now
            elif now - worker.unknown_since > self.unknown_grace:
                held = now - worker.unknown_since
                self._drop(
                    worker,
                    f"serves weight version {label!r} for {held:.0f}s, a label the keeper was not told of (the "
                    f"fleet's is {fleet.version!r})",
                )
        elif worker.state == OUT and label is not None:
            with self._lock:
                worker.state = RESYNCING
            thread = threading.Thread(target=self._resync, args=(worker, label), name=f"ngt-resync {worker.url}")
            with self._lock:
                self._resyncs = [t for t in self._resyncs if t.is_alive()] + [thread]
            thread.start()

    def _drop(self, worker: _Worker, reason: str) -> None:
        try:
            remove_worker(self.router_url, worker.url, http=self._watch_http)
        except RouterError as exc:
            if exc.status is None or "not one of its workers" not in str(exc):
                self._note("drop", worker.url, f"could not be taken out of the router: {exc}")
                return  # still routed: tried again at the next poll
        now = time.monotonic()
        with self._lock:
            worker.state, worker.dropped_at, worker.unknown_since, worker.next_try = OUT, now, None, 0.0
            since = now - worker.last_ok if worker.last_ok is not None else None
            self._event_locked("dropped", worker.url, f"{reason}; resynced once it answers", since)

    def _mark_out(self, url: str, reason: str, kind: str = "dropped") -> None:
        """(Lock held.) `url` out of the router, to be resynced once it answers; the event of `kind` says why."""
        worker = self._workers.setdefault(url, _Worker(url, OUT))
        if worker.state != RESYNCING:
            worker.state, worker.next_try = OUT, 0.0
        worker.dropped_at = time.monotonic()
        self._event_locked(kind, url, reason)

    def _resync(self, worker: _Worker, label: str) -> None:
        try:
            with self._push_lock:
                while True:
                    with self._lock:
                        fleet, generation = self._fleet, self._generation
                    assert fleet is not None
                    probe, proven_by = self._probe_for(fleet, generation, worker.url)
                    done = resync_worker(
                        worker.url,
                        fleet,
                        served_version=label,
                        probe=probe,
                        proven_by=proven_by,
                        http=self._push_http,
                        api_key=self.api_key,
                        timeout=self.push_timeout,
                    )
                    with self._lock:
                        if generation == self._generation:
                            break
                    label = Replica(worker.url, self._push_http, self.api_key).weight_version()  # pushed meanwhile
                try:
                    add_worker(self.router_url, worker.url, http=self._push_http)
                except RouterError as exc:
                    if worker.url not in list_workers(self.router_url, http=self._push_http):
                        raise
                    logger.info("fleet keeper: %s was in the router already: %s", worker.url, exc)
        except (ResyncError, WeightPushError, WeightProbeError, ReplicaError, RouterError, ValueError) as exc:
            self._resync_failed(worker, f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # the thread's last word: the worker stays out, and the next try may succeed
            logger.exception("fleet keeper: resyncing %s failed", worker.url)
            self._resync_failed(worker, f"{type(exc).__name__}: {exc}")
            return
        now = time.monotonic()
        with self._lock:
            worker.state, worker.last_ok, worker.failure = ROUTED, now, ""
            out_for = f"; out of the router for {now - worker.dropped_at:.1f}s" if worker.dropped_at else ""
            self._event_locked("readmitted", worker.url, f"{done.format()}{out_for}", done.seconds)

    def _resync_failed(self, worker: _Worker, reason: str) -> None:
        with self._lock:
            worker.state, worker.next_try = OUT, time.monotonic() + self.retry_seconds
            repeated, worker.failure = reason == worker.failure, reason
            if not repeated:  # the same failure every retry is logged once
                detail = f"{reason}; stays out, tried again every {self.retry_seconds:g}s"
                self._event_locked("resync_failed", worker.url, detail)

    def _probe_for(self, fleet: FleetWeights, generation: int, exclude: str) -> tuple[WeightProbe | None, str]:
        """The probe that proves a resync, and where its expectation comes from: the push's own probe, else what a
        routed peer on the fleet's version serves (cached per push), else none."""
        if fleet.probe is not None:
            return fleet.probe, "push's probe"
        if self._peer is not None and self._peer[0] == generation:
            return self._peer[1], self._peer[2]
        with self._lock:
            peers = [w.url for w in self._workers.values() if w.state == ROUTED and w.url != exclude]
        for url in peers:
            if self._read(url)[0] != fleet.version:
                continue
            try:
                probe = peer_probe(url, self._push_http, api_key=self.api_key)
            except ReplicaError:
                continue
            self._peer = (generation, probe, f"log probs peer {url} serves")
            return probe, self._peer[2]
        return None, "none"

    # -- events ------------------------------------------------------------------------------------------------------

    def _event(self, kind: str, worker: str, detail: str, seconds: float | None = None) -> None:
        with self._lock:
            self._event_locked(kind, worker, detail, seconds)

    def _event_locked(self, kind: str, worker: str, detail: str, seconds: float | None = None) -> None:
        event = KeeperEvent(kind, worker, detail, time.monotonic(), seconds)
        self.events.append(event)
        self._changed.notify_all()
        self.log(event.format())

    def _note(self, kind: str, where: str, message: str) -> None:
        """A failure of the keeper's own calls, logged when it differs from the last one of its kind."""
        with self._lock:
            if self._notes.get(kind) == message:
                return
            self._notes[kind] = message
        self.log(f"fleet keeper: {where}: {message}")
