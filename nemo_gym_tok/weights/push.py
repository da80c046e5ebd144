"""A weight update over every vLLM server of a gym, all or none: pause, reload, prefix-cache reset, version, resume."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from nemo_gym_tok.common.net import shared_ssl_context
from nemo_gym_tok.router import is_vllm_router, list_workers
from nemo_gym_tok.weights.checkpoint import Checkpoint, check_checkpoint_dir, check_version_label
from nemo_gym_tok.weights.replica import PAUSE_MODES, PauseMode, Replica, ReplicaError, server_root

T = TypeVar("T")
EXACT_RELOAD_HINT = (
    "start it with `ngt vllm-serve` (or with NEMO_GYM_TOK_EXACT_RELOAD=1 and nemo_gym_tok installed where vLLM runs), "
    "whose worker-side reload packs the output layer again"
)


class WeightPushError(RuntimeError):
    """A push did not happen on every server. `replicas` names the servers that failed; `left_paused` the servers
    that could not be put back as they were and stay paused (nothing is served there on mixed weights)."""

    def __init__(self, message: str, replicas: Sequence[str] = (), left_paused: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.replicas = tuple(replicas)
        self.left_paused = tuple(left_paused)


@dataclass(frozen=True)
class ReplicaState:
    """What a server served before the push: what a rollback puts back."""

    url: str
    weight_version: str
    weights_path: str
    exact_reload: bool


@dataclass(frozen=True)
class PushReport:
    """A push that reached every server: the version, the checkpoint, the servers and how long each phase took."""

    version: str
    checkpoint_dir: str
    replicas: tuple[ReplicaState, ...]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)

    def format(self) -> str:
        phases = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.phases.items())
        servers = ", ".join(f"{state.url} ({state.weight_version} -> {self.version})" for state in self.replicas)
        return f"pushed {self.checkpoint_dir} as version {self.version} in {self.seconds:.2f}s ({phases}): {servers}"


def push_weights(
    urls: Sequence[str],
    checkpoint_dir: str | Path,
    *,
    version: str,
    api_key: str | None = None,
    pause_mode: PauseMode = "wait",
    timeout: float = 300.0,
    http: httpx.Client | None = None,
) -> PushReport:
    """Load the checkpoint at `checkpoint_dir` into every vLLM server in `urls` under the label `version`, or into none.

    Every server is asked first (weight routes served, key accepted, a reload that will be exact, the label new);
    then all pause (`pause_mode`), reload, drop their prefix caches, take the label and resume. A server that fails
    at any step is named in the WeightPushError, after every server was put back on the weights and label it had.
    `checkpoint_dir` is a path the servers can read (a Hugging Face directory: config.json and safetensors).
    `http` is the client to call them with (default: a new one with `timeout`). A URL where vllm-router answers
    stands for every worker it lists: a fleet behind a router moves to the new weights together or not at all.
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
        # One server named twice (its root and its /v1 URL, say, or by itself and by its router) is pushed once.
        servers = dict.fromkeys(server for url in urls for server in _servers_at(server_root(url), client))
        replicas = [Replica(url, client, api_key) for url in servers]
        with _timed(phases, "preflight"):
            states = _each(replicas, lambda replica: _preflight(replica, checkpoint, version))
        pushing = _Push(replicas, states, pause_mode)
        with _timed(phases, "pause"):
            pushing.pause_all()
        with _timed(phases, "reload"):
            pushing.step(lambda replica: replica.reload(checkpoint.path), "reload")
        with _timed(phases, "reset"):
            pushing.step(lambda replica: replica.reset_prefix_cache(running_requests=pause_mode == "keep"), "reset")
        with _timed(phases, "version"):
            pushing.step(lambda replica: replica.set_weight_version(version), "set the version")
        with _timed(phases, "resume"):
            pushing.resume_all()
    return PushReport(version, checkpoint.path, tuple(states), time.perf_counter() - started, phases)


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
    """The servers of one push and the rollback that puts every one of them back."""

    def __init__(self, replicas: list[Replica], states: list[ReplicaState], pause_mode: PauseMode) -> None:
        self.replicas, self.states, self.pause_mode = replicas, states, pause_mode
        self.changed = False

    def pause_all(self) -> None:
        paused: list[Replica] = []
        failures = _try_each(self.replicas, lambda replica: (replica.pause(self.pause_mode), paused.append(replica)))
        if failures:
            _try_each(paused, Replica.resume)
            raise _error("could not pause", failures, [])

    def step(self, action: Callable[[Replica], None], what: str) -> None:
        self.changed = True
        failures = _try_each(self.replicas, action)
        if failures:
            left_paused = self.roll_back()
            raise _error(f"could not {what}", failures, left_paused, rolled_back=True)

    def roll_back(self) -> list[str]:
        """Every server back on its previous weights and label, then resumed; the URLs where that failed, which stay
        paused."""
        by_url = {state.url: state for state in self.states}

        def restore(replica: Replica) -> None:
            state = by_url[replica.url]
            replica.reload(state.weights_path)
            replica.reset_prefix_cache(running_requests=self.pause_mode == "keep")
            replica.set_weight_version(state.weight_version)
            replica.resume()

        return [error.url for error in _try_each(self.replicas, restore)]

    def resume_all(self) -> None:
        failures = _try_each(self.replicas, Replica.resume)
        if failures:
            raise _error("pushed, but could not resume", failures, [failure.url for failure in failures])


def _error(what: str, failures: list[ReplicaError], left_paused: list[str], rolled_back: bool = False) -> Exception:
    lines = [f"{what} on {len(failures)} server(s): " + "; ".join(str(failure) for failure in failures)]
    if rolled_back:
        lines.append("every server was put back on the weights and version it had" if not left_paused else "")
    if left_paused:
        lines.append(
            f"left paused (could not be put back, so they serve nothing rather than mixed weights): "
            f"{', '.join(left_paused)}; push again, or POST /resume there once their weights are right"
        )
    failed = [failure.url for failure in failures]
    return WeightPushError(". ".join(line for line in lines if line), failed, left_paused)


def _each(replicas: Sequence[Replica], action: Callable[[Replica], T]) -> list[T]:
    """`action` on every server at once; the first failure raised as a WeightPushError naming every failing one."""
    results: list[T | None] = [None] * len(replicas)

    def run(index: int) -> None:
        results[index] = action(replicas[index])

    failures = _try_each(list(range(len(replicas))), run)
    if failures:
        raise _error("refused before any change", failures, [])
    return [result for result in results if result is not None]


def _try_each(items: Sequence[T], action: Callable[[T], object]) -> list[ReplicaError]:
    """`action` on every item in parallel threads (one per server); the ReplicaErrors raised, in item order."""
    if not items:
        return []

    def attempt(item: T) -> ReplicaError | None:
        try:
            action(item)
        except ReplicaError as exc:
            return exc
        return None

    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        outcomes = list(pool.map(attempt, items))
    return [outcome for outcome in outcomes if outcome is not None]


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - started


def _servers_at(url: str, client: httpx.Client) -> list[str]:
    """The vLLM servers `url` names: the workers of the vllm-router there, else the server itself."""
    if not is_vllm_router(url, client):
        return [url]
    return [server_root(worker) for worker in list_workers(url, http=client)]
