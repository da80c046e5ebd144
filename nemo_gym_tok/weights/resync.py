"""One worker brought to the fleet's weights and version and proven by the log-prob probe, before it serves anything."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from nemo_gym_tok.weights.probe import (
    DEFAULT_MAX_MEAN_GAP,
    PROBE_TOKEN_IDS,
    ProbeResult,
    WeightProbe,
    verify_replicas,
)
from nemo_gym_tok.weights.push import push_weights
from nemo_gym_tok.weights.replica import Replica

STARTUP_VERSION = "default"
"""The label vLLM's engine gives the weights it started with, until a version is set: a restarted worker answers it."""


@dataclass(frozen=True)
class FleetWeights:
    """What every worker of a fleet must serve: `version`, loaded from `checkpoint_dir` (None: the weights the workers
    started with, under STARTUP_VERSION), proven by `probe` when one is known (the trainer's log probs of the probe
    ids with those weights)."""

    version: str
    checkpoint_dir: str | None = None
    probe: WeightProbe | None = None


@dataclass(frozen=True)
class Resync:
    """What bringing one worker to the fleet took: whether it was reloaded (it served another version), the probe's
    result and where the probe's expectation came from (`trainer`, `peer <url>`, or `none`), and the seconds."""

    url: str
    version: str
    reloaded: bool
    proof: ProbeResult | None
    proven_by: str
    seconds: float

    def format(self) -> str:
        action = "reloaded and relabelled" if self.reloaded else "already on it"
        proof = f"proven against the {self.proven_by}: {self.proof.format()}" if self.proof else "not proven (no probe)"
        return f"{self.url} on version {self.version!r} ({action}) in {self.seconds:.2f}s, {proof}"


class ResyncError(RuntimeError):
    """A worker could not be brought to the fleet's weights (its reload refused, its probe failed, the fleet's
    checkpoint unknown); it stays out of the router."""


def peer_probe(
    peer_url: str,
    http: httpx.Client,
    *,
    api_key: str | None = None,
    max_mean_gap: float = DEFAULT_MAX_MEAN_GAP,
) -> WeightProbe:
    """A probe whose expectation is what a proven peer serves: its prompt log probs of PROBE_TOKEN_IDS. Valid where
    no trainer is at hand, because every worker of a fleet serves the same weights with the same vLLM, so a correct
    reload serves the peer's numbers (batching aside: far below the bound)."""
    peer = Replica(peer_url, http, api_key)
    served = peer.prompt_log_probs(PROBE_TOKEN_IDS, peer.served_model())
    return WeightProbe(PROBE_TOKEN_IDS, tuple(served), max_mean_gap)


def resync_worker(
    url: str,
    fleet: FleetWeights,
    *,
    served_version: str,
    probe: WeightProbe | None,
    proven_by: str,
    http: httpx.Client,
    api_key: str | None = None,
    timeout: float = 300.0,
) -> Resync:
    """Bring the worker at `url` (which serves `served_version` now, out of any router) to `fleet`: a worker on
    another version reloads the fleet's checkpoint, has its prefix cache reset and takes the fleet's label, all through
    the all-or-none push (rolled back on a failed probe); a worker on the fleet's label is probed as it is. Raises
    ResyncError, or the push's and probe's own errors, when it cannot be proven."""
    started = time.perf_counter()
    reloaded = served_version != fleet.version
    if reloaded:
        if fleet.checkpoint_dir is None:
            raise ResyncError(
                f"{url} serves version {served_version!r} and the fleet {fleet.version!r}, whose checkpoint the keeper "
                "was not told (push through FleetKeeper.push, or call FleetKeeper.pushed after each push)"
            )
        report = push_weights(
            [url], fleet.checkpoint_dir, version=fleet.version, api_key=api_key, http=http, timeout=timeout, probe=probe
        )
        proof = report.probes[0] if report.probes else None
    elif probe is not None:
        proof = verify_replicas([url], probe, version=fleet.version, api_key=api_key, http=http, timeout=timeout)[0]
    else:
        proof = None
    return Resync(url, fleet.version, reloaded, proof, proven_by if proof else "none", time.perf_counter() - started)
