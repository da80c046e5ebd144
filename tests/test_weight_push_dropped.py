"""A push over a router's workers when one of them is down: taken out of the router, the push goes on over the live
fleet and names it; a worker that answers and refuses still refuses the whole push (a fake router and fake vLLMs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_gym_tok.weights import WeightPushError, push_weights
from tests.fake_fleet import ROUTER, FakeFleet
from tests.fake_vllm import FakeVLLM

A, B = "http://a:8000", "http://b:8000"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def fleet() -> FakeFleet:
    return FakeFleet(FakeVLLM([A, B]), [A, B])


def push(fleet: FakeFleet, checkpoint: Path, urls: list[str] | None = None):
    with fleet.client() as http:
        return push_weights(urls or [ROUTER], checkpoint, version="v1", http=http)


@pytest.mark.parametrize("fault", ["down", "hung"])
def test_a_worker_that_does_not_answer_is_taken_out_of_the_router_and_the_push_goes_on(
    checkpoint: Path, fault: str
) -> None:
    fake = fleet()
    getattr(fake, fault).add(B)
    report = push(fake, checkpoint)
    assert [state.url for state in report.replicas] == [A] and fake.vllm.state[A]["version"] == "v1"
    assert list(report.dropped) == [B] and fake.workers == [A]
    reason = "Connection refused" if fault == "down" else "timed out"
    assert reason in report.dropped[B] and f"taken out of the router, not answering: {B} (" in report.format()


def test_a_worker_that_answers_and_refuses_still_refuses_the_push_and_the_router_is_left_alone(
    checkpoint: Path,
) -> None:
    fake = fleet()
    fake.vllm.fail[(B, "/weight_info")] = None
    fake.down.add(A)
    with pytest.raises(WeightPushError, match=f"refused before any change on 1 server.*{B}") as refused:
        push(fake, checkpoint)
    assert fake.workers == [A, B] and refused.value.dropped == {}
    assert f"not answering either: {A}" in "".join(refused.value.__notes__)


def test_a_server_named_by_itself_that_does_not_answer_refuses_the_push(checkpoint: Path) -> None:
    fake = fleet()
    fake.down.add(B)
    with pytest.raises(WeightPushError, match="refused before any change"):
        push(fake, checkpoint, [A, B])
    assert fake.vllm.state[A]["version"] == "v0"


def test_no_worker_answering_pushes_nothing(checkpoint: Path) -> None:
    fake = fleet()
    fake.down.update([A, B])
    with pytest.raises(WeightPushError, match="no worker answered") as refused:
        push(fake, checkpoint)
    assert set(refused.value.dropped) == {A, B} and fake.workers == []


def test_a_push_that_fails_after_a_drop_names_the_dropped_worker_too(checkpoint: Path) -> None:
    fake = fleet()
    fake.down.add(B)
    fake.vllm.fail[(A, "reload_weights")] = str(checkpoint)
    with pytest.raises(WeightPushError, match="could not reload") as refused:
        push(fake, checkpoint)
    assert list(refused.value.dropped) == [B]
    assert fake.vllm.state[A] == {"version": "v0", "weights": "/w/0", "paused": False}


def test_a_router_listing_no_worker_pushes_nothing(checkpoint: Path) -> None:
    fake = fleet()
    fake.workers.clear()
    with pytest.raises(WeightPushError, match=f"the router at {ROUTER} lists no worker"):
        push(fake, checkpoint)
