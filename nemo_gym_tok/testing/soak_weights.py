"""The soak's weights: one push before the collection, a FleetKeeper throughout, and what the records say it served."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jsonl import scan_jsonl
from nemo_gym_tok.router import list_workers
from nemo_gym_tok.testing.soak_report import bundled_items
from nemo_gym_tok.weights import FleetKeeper, FleetWeights, KeeperEvent, WeightProbe, push_weights

READMIT_TIMEOUT = 600.0
"""Seconds the soak waits, after its collection, for a killed replica to be readmitted (a restart took 292 s once on
the loaded test machine)."""


@dataclass(frozen=True)
class KeepWeights:
    """Push `checkpoint_dir` to every replica as `version` (proven by `probe`, when given) before the collection, and
    keep the fleet on it with a FleetKeeper on the soak's router: every bundle must then carry `version`."""

    checkpoint_dir: Path
    version: str
    probe: WeightProbe | None = None


def start_keeper(router_url: str, plan: KeepWeights, log: Callable[[str], None]) -> FleetKeeper:
    """The push, then the keeper watching the router's workers on it."""
    report = push_weights([router_url], plan.checkpoint_dir, version=plan.version, probe=plan.probe)
    log(f"soak: {report.format()}")
    fleet = FleetWeights(report.version, report.checkpoint_dir, plan.probe)
    return FleetKeeper(router_url, fleet=fleet, log=lambda line: log(f"soak: {line}")).start()


def wait_readmitted(
    keeper: FleetKeeper, router_url: str, urls: Sequence[str], timeout: float = READMIT_TIMEOUT
) -> list[str]:
    """Until every one of `urls` is routed again (a killed replica resynced and proven), or `timeout`; the router's
    workers then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = keeper.states()
        if all(states.get(url) == "routed" for url in urls):
            break
        time.sleep(0.5)
    return list_workers(router_url)


def bundle_versions(rollouts: Path) -> Counter[str]:
    """Model calls per weight version (`weight_version` of every output item carrying a bundle; `None` when unlabelled)
    over a rollouts file, torn lines skipped."""
    return Counter(str(item.get("weight_version")) for item in bundled_items(scan_jsonl(rollouts)))


def replica_figures(
    events: Sequence[KeeperEvent], kills: Sequence[dict[str, Any]], started: float, collected_at: float
) -> list[dict[str, Any]]:
    """Per replica kill: seconds from the kill to the keeper's drop, from the restarted server's readiness to its
    readmission, the resync's own seconds, how it was proven, and how long the collection went on after it (negative:
    it was readmitted after the collection ended); None where the event never came. `started` is the soak's monotonic
    start, `collected_at` the collection's end in seconds from it."""
    figures = []
    for kill in kills:
        if kill["kind"] != "replica":
            continue
        url, killed_at = kill["target"], started + kill["at"]
        dropped = next((e for e in events if e.kind == "dropped" and e.worker == url and e.at >= killed_at), None)
        back = next((e for e in events if e.kind == "readmitted" and e.worker == url and e.at >= killed_at), None)
        ready_at = started + kill["ready_at"] if kill.get("ready_at") is not None else None
        figures.append(
            {
                "url": url,
                "drop_seconds": None if dropped is None else dropped.at - killed_at,
                "dropped_because": None if dropped is None else dropped.detail,
                "ready_to_routed_seconds": None if back is None or ready_at is None else back.at - ready_at,
                "resync_seconds": None if back is None else back.seconds,
                "readmitted": None if back is None else back.detail,
                "collecting_after_readmission": None if back is None else started + collected_at - back.at,
            }
        )
    return figures
