"""The fleet keeper's decisions against a fake router and fake vLLM workers, for the cases real servers cannot be made
to produce on cue: a worker back on its start-up weights between two polls, a resync whose probe fails, a push made
elsewhere mid-watch, a worker taken out by someone else, a fleet whose checkpoint the keeper was never told."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_gym_tok.weights import (
    PROBE_TOKEN_IDS,
    FleetKeeper,
    FleetWeights,
    KeeperError,
    WeightProbe,
    WeightPushError,
    push_weights,
)
from tests.fake_fleet import ROUTER, FakeFleet
from tests.fake_vllm import FakeVLLM

A, B = "http://a:8000", "http://b:8000"
SERVED = [-0.5] * (len(PROBE_TOKEN_IDS) - 1)
"""What the fleet's pushed weights serve at the probe ids (the fake serves -1.0 on any other weights)."""
SERVED_V2 = [-0.25] * (len(PROBE_TOKEN_IDS) - 1)


def checkpoint_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return checkpoint_dir(tmp_path / "step-1")


def fleet_on(checkpoint: Path, version: str = "v1") -> FakeFleet:
    """Both workers behind the router, serving `checkpoint` as `version`."""
    vllm = FakeVLLM([A, B])
    for state in vllm.state.values():
        state.update(version=version, weights=str(checkpoint))
    vllm.log_probs[str(checkpoint)] = SERVED
    return FakeFleet(vllm, [A, B])


def keeper_for(fleet: FakeFleet, weights: FleetWeights | None, **options: float) -> FleetKeeper:
    return FleetKeeper(
        ROUTER,
        fleet=weights,
        http=fleet.client(),
        poll_seconds=0.01,
        retry_seconds=options.pop("retry_seconds", 0.05),
        log=lambda line: None,
        **options,
    )


def probe() -> WeightProbe:
    return WeightProbe(PROBE_TOKEN_IDS, tuple(SERVED))


def test_a_worker_that_dies_is_dropped_at_once_and_comes_back_only_resynced_and_proven(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        fleet.kill(B)
        dropped = keeper.wait_for("dropped", B, timeout=5)
        assert B not in fleet.workers and "did not answer its weight version" in dropped.detail
        time.sleep(0.1)  # many polls while it is down: still out
        assert fleet.workers == [A] and keeper.states()[B] == "out"
        fleet.restart(B)  # back on its start-up weights, labelled default
        back = keeper.wait_for("readmitted", B, timeout=5)
    assert fleet.workers == [A, B]
    assert fleet.vllm.state[B] == {"version": "v1", "weights": str(checkpoint), "paused": False}
    assert "proven against the push's probe" in back.detail and "reloaded" in back.detail
    # The router got it back only after its reload, its label and its probe.
    added = fleet.timeline.index((ROUTER, "/add_worker"))
    after_restart = fleet.timeline[: added + 1]
    for path in ("/collective_rpc", "/update_weight_version", "/v1/completions"):
        assert (B, path) in after_restart, path


def test_a_worker_back_on_its_start_up_weights_between_two_polls_is_dropped_for_its_label(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        fleet.restart(B)  # no refused poll in between: only the label says so
        dropped = keeper.wait_for("dropped", B, timeout=5)
        keeper.wait_for("readmitted", B, timeout=5)
    assert "serves weight version 'default' (its start-up weights: it restarted)" in dropped.detail
    assert fleet.vllm.state[B]["version"] == "v1"


def test_a_resync_whose_probe_fails_keeps_the_worker_out_until_it_passes(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe()), retry_seconds=0.3) as keeper:
        fleet.kill(B)
        keeper.wait_for("dropped", B, timeout=5)
        fleet.restart(B, stale=[-3.0] * len(SERVED))  # whatever it loads, it serves other log probs
        failed = keeper.wait_for("resync_failed", B, timeout=5)
        reloads = [call for call in fleet.timeline if call == (B, "/collective_rpc")]
        while len([call for call in fleet.timeline if call == (B, "/collective_rpc")]) < len(reloads) + 4:
            time.sleep(0.05)  # more tries, each rolled back
        while keeper.states()[B] != "out":
            time.sleep(0.01)  # between two tries (0.3 s apart): its rollback done
        assert B not in fleet.workers
        assert fleet.vllm.state[B] == {"version": "default", "weights": "/w/start", "paused": False}
        assert len([e for e in keeper.events if e.kind == "resync_failed"]) == 1  # the same failure logged once
        del fleet.vllm.stale[B]
        keeper.wait_for("readmitted", B, timeout=5)
    assert "the probe failed" in failed.detail and B in failed.detail


def test_without_a_probe_a_peer_on_the_fleets_version_gives_the_expectation(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint))) as keeper:
        fleet.kill(B)
        keeper.wait_for("dropped", B, timeout=5)
        fleet.restart(B)
        back = keeper.wait_for("readmitted", B, timeout=5)
    assert f"log probs peer {A} serves" in back.detail


def test_a_push_through_the_keeper_moves_the_fleet_and_a_worker_back_later_gets_the_new_weights(
    checkpoint: Path, tmp_path: Path
) -> None:
    fleet = fleet_on(checkpoint)
    step2 = checkpoint_dir(tmp_path / "step-2")
    fleet.vllm.log_probs[str(step2)] = SERVED_V2
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        fleet.kill(B)
        keeper.wait_for("dropped", B, timeout=5)
        report = keeper.push(step2, "v2", probe=WeightProbe(PROBE_TOKEN_IDS, tuple(SERVED_V2)))
        assert [state.url for state in report.replicas] == [A] and keeper.fleet.version == "v2"
        fleet.restart(B)
        keeper.wait_for("readmitted", B, timeout=5)
    assert fleet.vllm.state[B] == {"version": "v2", "weights": str(step2), "paused": False}


def test_a_push_made_elsewhere_drops_nobody_and_then_the_old_label_is_stale(checkpoint: Path, tmp_path: Path) -> None:
    fleet = fleet_on(checkpoint)
    step2 = checkpoint_dir(tmp_path / "step-2")
    fleet.vllm.log_probs[str(step2)] = SERVED_V2
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        with fleet.client() as http:
            report = push_weights([ROUTER], step2, version="v2", http=http)
        time.sleep(0.2)  # the new label on every worker, the keeper not told yet: a push under way, nobody dropped
        assert not [e for e in keeper.events if e.kind == "dropped"] and fleet.workers == [A, B]
        keeper.pushed(report)
        fleet.vllm.state[B].update(version="v1", weights=str(checkpoint))  # one left behind on the old weights
        dropped = keeper.wait_for("dropped", B, timeout=5)
        keeper.wait_for("readmitted", B, timeout=5)
    assert "serves weight version 'v1', not the fleet's 'v2'" in dropped.detail
    assert fleet.vllm.state[B]["version"] == "v2" and fleet.vllm.state[B]["weights"] == str(step2)


def test_a_label_the_keeper_was_never_told_of_is_dropped_once_its_grace_runs_out(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe()), unknown_grace=0.1) as keeper:
        fleet.vllm.state[B]["version"] = "rogue"
        dropped = keeper.wait_for("dropped", B, timeout=5)
        keeper.wait_for("readmitted", B, timeout=5)
    assert "a label the keeper was not told of" in dropped.detail and fleet.vllm.state[B]["version"] == "v1"


def test_a_worker_taken_out_by_someone_else_stays_out_while_one_taken_out_dead_comes_back(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        fleet.workers.remove(B)  # an operator's remove_worker, B still answering
        retired = keeper.wait_for("retired", B, timeout=5)
        time.sleep(0.1)
        assert fleet.workers == [A] and keeper.states()[B] == "retired"
        fleet.workers.append(B)  # and the operator's add_worker: watched again
        keeper.wait_for("watching", B, after=retired.at, timeout=5)
        fleet.vllm.state[B]["version"] = "default"
        keeper.wait_for("readmitted", B, timeout=5)
        fleet.workers.remove(B)
        keeper.wait_for("retired", B, after=retired.at + 1e-9, timeout=5)
        fleet.kill(A)
        fleet.workers.remove(A)  # someone dropped the dead one first
        out = keeper.wait_for("dropped", A, timeout=5)
        fleet.restart(A)
        keeper.wait_for("readmitted", A, timeout=5)
    assert "while it did not answer" in out.detail and fleet.workers == [A]


def test_a_fleet_whose_checkpoint_the_keeper_was_not_told_keeps_a_restarted_worker_out(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    with keeper_for(fleet, None) as keeper:
        assert keeper.fleet == FleetWeights("v1")  # the one label every worker answered
        fleet.kill(B)
        keeper.wait_for("dropped", B, timeout=5)
        fleet.restart(B)
        failed = keeper.wait_for("resync_failed", B, timeout=5)
        assert B not in fleet.workers and "was not told" in failed.detail


def test_a_fleet_never_pushed_takes_a_restarted_worker_back_as_it_is_proven_by_a_peer(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint, version="default")
    with keeper_for(fleet, None) as keeper:
        fleet.kill(B)
        keeper.wait_for("dropped", B, timeout=5)
        fleet.restart(B, weights=str(checkpoint))  # the same start-up weights as its peer
        back = keeper.wait_for("readmitted", B, timeout=5)
    assert "(already on it)" in back.detail and f"peer {A}" in back.detail


def test_the_keeper_refuses_a_fleet_on_mixed_labels(checkpoint: Path) -> None:
    fleet = fleet_on(checkpoint)
    fleet.vllm.state[B]["version"] = "v0"
    with pytest.raises(KeeperError, match="push one version to every worker first"):
        keeper_for(fleet, None).start()


def test_a_failed_push_through_the_keeper_leaves_the_fleet_where_it_was(checkpoint: Path, tmp_path: Path) -> None:
    fleet = fleet_on(checkpoint)
    step2 = checkpoint_dir(tmp_path / "step-2")
    with keeper_for(fleet, FleetWeights("v1", str(checkpoint), probe())) as keeper:
        fleet.vllm.fail[(B, "reload_weights")] = str(step2)
        with pytest.raises(WeightPushError, match="could not reload"):
            keeper.push(step2, "v2")
        time.sleep(0.1)
        assert keeper.fleet.version == "v1" and fleet.workers == [A, B]
        assert not [e for e in keeper.events if e.kind == "dropped"]
