"""A weight update over every vLLM server of a gym, all or none: pause, reload, prefix-cache reset, version, resume,
and (given a probe) the proof that every server serves the pushed weights."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from nemo_gym_tok.common.net import shared_ssl_context
from nemo_gym_tok.router import RouterError, remove_worker
from nemo_gym_tok.weights.checkpoint import Checkpoint, check_checkpoint_dir, check_version_label
from nemo_gym_tok.weights.probe import ProbeResult, WeightProbe, describe_failures, probe_replica
from nemo_gym_tok.weights.replica import PAUSE_MODES, PauseMode, Replica, ReplicaError, routed_roots, try_each

T = TypeVar("T")
EXACT_RELOAD_HINT = (
    "start it with `ngt vllm-serve` (or with NEMO_GYM_TOK_EXACT_RELOAD=1 and nemo_gym_tok installed where vLLM runs), "
    "whose worker-side reload packs the output layer again"
)


class WeightPushError(RuntimeError):
    """A push did not happen on every server. `replicas` names the servers that failed; `left_paused` the servers
    that could not be put back as they were and stay paused (nothing is served there on mixed weights);
    `unproven_version` the label that was served between the resume and a failed proof (a trainer refuses every turn
    labelled with it), None when no turn can carry the pushed label; `probes` the probe results that were measured."""

    def __init__(
        self,
        message: str,
        replicas: Sequence[str] = (),
        left_paused: Sequence[str] = (),
        *,
        unproven_version: str | None = None,
        probes: Sequence[ProbeResult] = (),
    ) -> None:
        super().__init__(message)
        self.replicas = tuple(replicas)
        self.left_paused = tuple(left_paused)
        self.unproven_version = unproven_version
        self.probes = tuple(probes)
        self.dropped: dict[str, str] = {}
        """Workers a router listed that gave no answer, taken out of that router before the push: URL -> why."""


@dataclass(frozen=True)
class ReplicaState:
    """What a server served before the push: what a rollback puts back."""

    url: str
    weight_version: str
    weights_path: str
    exact_reload: bool


@dataclass(frozen=True)
class PushReport:
    """A push that reached every server: the version, the checkpoint, the servers, how long each phase took, and (when
    the push was given a probe) each server's proof that it serves the pushed weights."""

    version: str
    checkpoint_dir: str
    replicas: tuple[ReplicaState, ...]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    probes: tuple[ProbeResult, ...] = ()
    dropped: dict[str, str] = field(default_factory=dict)
    """Workers a router listed that gave no answer: taken out of that router and left out of the push (URL -> why).
    Pushed or not, they serve nothing through the router until someone puts them back (FleetKeeper resyncs them)."""

    def format(self) -> str:
        phases = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.phases.items())
        servers = ", ".join(f"{state.url} ({state.weight_version} -> {self.version})" for state in self.replicas)
        text = f"pushed {self.checkpoint_dir} as version {self.version} in {self.seconds:.2f}s ({phases}): {servers}"
        if self.dropped:
            text += "; " + describe_dropped(self.dropped)
        if not self.probes:
            return text
        worst = max(self.probes, key=lambda result: result.mean_gap)
        slowest = max(result.seconds for result in self.probes)
        return (
            f"{text}; proven on {len(self.probes)} server(s) (probe {self.phases.get('probe', slowest):.3f}s, the "
            f"slowest server {slowest * 1000:.0f} ms): worst gap {worst.mean_gap:.4f} nats mean "
            f"({max(result.max_gap for result in self.probes):.4f} max)"
        )


def push_weights(
    urls: Sequence[str],
    checkpoint_dir: str | Path,
    *,
    version: str,
    api_key: str | None = None,
    pause_mode: PauseMode = "wait",
    timeout: float = 300.0,
    http: httpx.Client | None = None,
    probe: WeightProbe | None = None,
) -> PushReport:
    """Load the checkpoint at `checkpoint_dir` into every vLLM server in `urls` under the label `version`, or into none.

    Every server is asked first (weight routes served, key accepted, a reload that will be exact, the label new);
    then all pause (`pause_mode`), reload, drop their prefix caches, take the label and resume. With `probe` (the
    pushed weights' log probs of fixed ids, as the trainer computes them), every server then serves those ids'
    prompt log probs, and one off by more than `probe.max_mean_gap` nats mean fails the push. A server that fails at
    any step is named in the WeightPushError, after every server was put back on the weights and label it had; so is
    any other exception part-way (an answer unlike vLLM's, a KeyboardInterrupt: that one is raised again, the
    rollback's outcome in its notes). `checkpoint_dir` is a path the servers can read (a Hugging Face directory:
    config.json and safetensors). `http` is the client to call them with (default: a new one with `timeout`). A URL
    where vllm-router answers stands for every worker it lists: a fleet behind a router moves to the new weights
    together or not at all.
    """
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
    if not urls:
        raise ValueError("no vLLM server to push to: name at least one URL")
    version = check_version_label(version)
    checkpoint = check_checkpoint_dir(checkpoint_dir)
    started, phases = time.perf_counter(), {}
    own = None if http is not None else httpx.Client(timeout=timeout, verify=shared_ssl_context())
    with own if own is not None else contextlib.nullcontext(http) as client:
        routers = routed_roots(urls, client)
        if not routers:
            raise WeightPushError(f"no vLLM server to push to: the router at {', '.join(urls)} lists no worker")
        replicas = [Replica(url, client, api_key) for url in routers]
        with _timed(phases, "preflight"):
            states, dropped = _preflight_live(replicas, routers, checkpoint, version, client)
            replicas = [replica for replica in replicas if replica.url in states]
            # The probe's model name is read now, so that its cost after the resume is the probe's call alone.
            models = _each(replicas, Replica.served_model) if probe is not None else {}
        pushing = _Push(replicas, states, pause_mode, version)
        try:
            # From here a failure is about the live workers; the dropped ones are named on it as well.
            with _timed(phases, "pause"):
                pushing.pause_all()
            with _timed(phases, "reload"):
                pushing.step(lambda replica: replica.reload(checkpoint.path), "reload")
            with _timed(phases, "reset"):
                pushing.step(lambda replica: replica.reset_prefix_cache(running_requests=pause_mode == "keep"), "reset")
            with _timed(phases, "version"):
                pushing.step(lambda replica: replica.set_weight_version(version), "set the version")
            with _timed(phases, "resume"):
                pushing.resume_all(proving=probe is not None)
            probes: tuple[ProbeResult, ...] = ()
            if probe is not None:
                # vLLM serves no completion while paused: the proof comes after the resume, hence unproven_version.
                with _timed(phases, "probe"):
                    probes = pushing.prove(probe, models)
        except WeightPushError as exc:
            exc.dropped = dropped
            raise
        except Exception as exc:
            error = pushing.abandon(exc)
            error.dropped = dropped
            raise error from exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: still theirs to raise, once every server is back
            exc.add_note(str(pushing.abandon(exc)))
            raise
    seconds = time.perf_counter() - started
    return PushReport(version, checkpoint.path, tuple(states.values()), seconds, phases, probes, dropped)


def describe_dropped(dropped: dict[str, str]) -> str:
    """The line that names the workers a push took out of their router, and why."""
    return f"taken out of the router, not answering: {'; '.join(f'{url} ({why})' for url, why in dropped.items())}"


def _preflight_live(
    replicas: list[Replica],
    routers: dict[str, str | None],
    checkpoint: Checkpoint,
    version: str,
    http: httpx.Client,
) -> tuple[dict[str, ReplicaState], dict[str, str]]:
    """Every server's preflight, by URL, and the workers dropped: one that a router listed and that gives no answer
    at all (connection refused, timed out) is down, so it is taken out of that router and the push goes on over the
    live fleet without it. A server that answers and refuses, or one named by itself that does not answer, refuses
    the push before any change (no router is edited then)."""
    states: dict[str, ReplicaState] = {}

    def run(replica: Replica) -> None:
        states[replica.url] = _preflight(replica, checkpoint, version)

    failures = try_each(replicas, run)
    down = [failure for failure in failures if failure.unreachable and routers.get(failure.url)]
    refused = [failure for failure in failures if failure not in down]
    if refused:
        error = _error(f"refused before any change on {len(refused)} server(s)", refused, [])
        if down:
            error.add_note(f"not answering either: {', '.join(failure.url for failure in down)}")
        raise error
    dropped: dict[str, str] = {}
    for failure in down:
        router = routers[failure.url]
        assert router is not None
        try:
            remove_worker(router, failure.url, http=http)
        except RouterError as exc:
            raise _error(
                f"{failure.url} does not answer and could not be taken out of its router ({exc}); nothing was pushed",
                [failure],
                [],
            ) from exc
        dropped[failure.url] = str(failure).removeprefix(f"{failure.url}: ")
    if not states:
        error = WeightPushError(f"no worker answered, so nothing was pushed; {describe_dropped(dropped)}", [*dropped])
        error.dropped = dropped
        raise error
    return states, dropped


def _preflight(replica: Replica, checkpoint: Checkpoint, version: str) -> ReplicaState:
    current = replica.weight_version()
    if current == version:
        raise ReplicaError(
            replica.url,
            f"already serves weight version {version!r}: a push needs a new label, or turns labelled {version!r} "
            "would come from two sets of weights",
        )
    status = replica.reload_status()
    if status is not None:
        served_ties, checkpoint_ties = status.get("tie_word_embeddings"), checkpoint.tie_word_embeddings
        if checkpoint_ties is not None and served_ties is not None and bool(served_ties) != checkpoint_ties:
            tying = {True: "ties its output layer to the embedding", False: "has its own output layer"}
            raise ReplicaError(
                replica.url,
                f"serves a model that {tying[bool(served_ties)]}, and the checkpoint {tying[checkpoint_ties]}: "
                "vLLM would load it without its output layer's own values",
            )
        return ReplicaState(replica.url, current, str(status.get("weights_path", "")), True)
    weights_path, device, tied = replica.served_weights()
    ties = tied if tied is not None else checkpoint.tie_word_embeddings
    if device == "cpu" and ties is not False:
        what = "a model with tied embeddings" if ties else "a model whose checkpoint is not readable here (tied?)"
        raise ReplicaError(
            replica.url,
            f"is vLLM's CPU build without nemo_gym_tok's exact reload, serving {what}: after vLLM's own reload a tied "
            "output layer serves log probs of the new body with the old output layer (docs/training.md); "
            + EXACT_RELOAD_HINT,
        )
    return ReplicaState(replica.url, current, weights_path, False)


class _Push:
    """The servers of one push, what was done to them so far, and the rollback that puts every one of them back."""

    def __init__(
        self, replicas: list[Replica], states: dict[str, ReplicaState], pause_mode: PauseMode, version: str
    ) -> None:
        self.replicas, self.states, self.pause_mode, self.version = replicas, states, pause_mode, version
        self.touched = False
        """A pause was asked of some server: from here on, an interrupted push rolls every server back."""
        self.resumed = False
        """A resume was asked: the new label may have been served, so a push that fails from here leaves it unproven."""

    def pause_all(self) -> None:
        self.touched = True
        paused: list[Replica] = []
        failures = try_each(self.replicas, lambda replica: (replica.pause(self.pause_mode), paused.append(replica)))
        if failures:
            # Nothing changed but the pause: the servers that took it resume; one that cannot is named, still paused.
            stuck = [failure.url for failure in try_each(paused, Replica.resume)]
            raise _error(f"could not pause on {len(failures)} server(s)", failures, stuck)

    def step(self, action: Callable[[Replica], None], what: str) -> None:
        failures = try_each(self.replicas, action)
        if failures:
            left_paused = self.roll_back()
            raise _error(f"could not {what} on {len(failures)} server(s)", failures, left_paused, rolled_back=True)

    def roll_back(self, *, pause_first: bool = False) -> list[str]:
        """Every server back on its previous weights and label, then resumed (paused first when it may be serving);
        the URLs where that failed, which stay paused (or no longer answer)."""

        def restore(replica: Replica) -> None:
            state = self.states[replica.url]
            if pause_first:
                replica.pause(self.pause_mode)
            replica.reload(state.weights_path)
            replica.reset_prefix_cache(running_requests=self.pause_mode == "keep")
            replica.set_weight_version(state.weight_version)
            replica.resume()

        return [error.url for error in try_each(self.replicas, restore)]

    def resume_all(self, *, proving: bool) -> None:
        self.resumed = True
        failures = try_each(self.replicas, Replica.resume)
        if not failures:
            return
        if not proving:
            raise _error(
                f"pushed, but could not resume on {len(failures)} server(s)", failures, [f.url for f in failures]
            )
        # A server that cannot resume cannot be proven, and the others serve what is then an unproven label.
        left_paused = self.roll_back(pause_first=True)
        head = f"could not resume on {len(failures)} server(s), so the push cannot be proven"
        raise _error(head, failures, left_paused, rolled_back=True, unproven_version=self.version)

    def prove(self, probe: WeightProbe, models: dict[str, str]) -> tuple[ProbeResult, ...]:
        """Every server's probe; a server off the expected log probs (or silent) rolls every server back."""
        results: dict[str, ProbeResult] = {}

        def ask(replica: Replica) -> None:
            results[replica.url] = probe_replica(replica, probe, models.get(replica.url))

        errors = try_each(self.replicas, ask)
        ordered = tuple(results[replica.url] for replica in self.replicas if replica.url in results)
        failing = [result for result in ordered if not result.ok(probe.max_mean_gap)]
        if not failing and not errors:
            return ordered
        left_paused = self.roll_back(pause_first=True)
        named = [*(result.url for result in failing), *(error.url for error in errors)]
        head = f"the probe failed on {len(named)} server(s): {describe_failures(failing, errors, probe.max_mean_gap)}"
        raise _error(
            head, [], left_paused, rolled_back=True, unproven_version=self.version, named=named, probes=ordered
        )

    def abandon(self, cause: BaseException) -> WeightPushError:
        """The error for a push stopped part-way by `cause` (not a server's refusal), every server rolled back first."""
        what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        if not self.touched:
            return WeightPushError(f"push stopped before any change by {what}; no server was changed")
        left_paused = self.roll_back(pause_first=True)
        unproven = self.version if self.resumed else None
        return _error(f"push stopped part-way by {what}", [], left_paused, rolled_back=True, unproven_version=unproven)


def _error(
    head: str,
    failures: list[ReplicaError],
    left_paused: list[str],
    *,
    rolled_back: bool = False,
    unproven_version: str | None = None,
    named: Sequence[str] = (),
    probes: Sequence[ProbeResult] = (),
) -> WeightPushError:
    lines = [f"{head}: " + "; ".join(str(failure) for failure in failures) if failures else head]
    if rolled_back and not left_paused:
        lines.append("every server was put back on the weights and version it had")
    if left_paused:
        lines.append(
            f"left paused (could not be put back, so they serve nothing rather than mixed weights): "
            f"{', '.join(left_paused)}; push again, or POST /resume there once their weights are right"
        )
    if unproven_version is not None:
        lines.append(
            f"version {unproven_version!r} was served between the resume and the failure and is unproven: refuse "
            f"every turn labelled {unproven_version!r}"
        )
    failed = [*named, *(failure.url for failure in failures)]
    return WeightPushError(". ".join(lines), failed, left_paused, unproven_version=unproven_version, probes=probes)


def _each(replicas: Sequence[Replica], action: Callable[[Replica], T]) -> dict[str, T]:
    """`action` on every server at once, before any change; its results by URL, or a WeightPushError naming every
    failing server."""
    results: dict[str, T] = {}

    def run(replica: Replica) -> None:
        results[replica.url] = action(replica)

    failures = try_each(replicas, run)
    if failures:
        raise _error(f"refused before any change on {len(failures)} server(s)", failures, [])
    return {replica.url: results[replica.url] for replica in replicas}


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - started
