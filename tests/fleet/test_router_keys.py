"""A keyed fleet behind the real vllm-router with no open door. A worker added through the router's unauthenticated
/add_worker (a stand-in that records what it is sent and answers through the real replica) receives no key that
opens a weight route, and the gym refuses every answer while the router lists it; the adapter's key is asked at the
gym's start and refused where it opens the weight routes; a router beyond loopback is refused before it starts.
`make test-fleet` (one keyed hooked replica of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nemo_gym_tok.collect import CollectSummary
from nemo_gym_tok.config import load_config
from nemo_gym_tok.router import add_worker, list_workers, remove_worker
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.launcher import Gym, LaunchError
from nemo_gym_tok.testing.gym_configs import demo_config_behind_router
from nemo_gym_tok.vllm.route_auth import WEIGHTS_KEY_ENV
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer
from nemo_gym_tok.weights import DEV_MODE_ENV
from tests.fleet.number_guess import collect_number_guess
from tests.relay_worker import relay_worker
from tests.servers import hooked_server

MODEL = "tiny-qwen3"
INFERENCE_KEY, WEIGHTS_KEY = "inference-key-fleet", "weights-key-fleet"
ADAPTER_KEY = "policy_model.responses_api_models.vllm_model.api_key"


@pytest.fixture(scope="module")
def keyed_replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A hooked replica with the weight routes on and the keys split (`ngt vllm-serve --weights-api-key`)."""
    with hooked_server(
        tiny_model_dir,
        served_model_name=MODEL,
        extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS, "--api-key", INFERENCE_KEY),
        env={**TEST_BED_ENV, DEV_MODE_ENV: "1", WEIGHTS_KEY_ENV: WEIGHTS_KEY},
        log_path=tmp_path_factory.mktemp("keyed-replica") / "vllm.log",
        what="keyed hooked replica: ",
    ) as server:
        yield server


def stand_in(replica_url: str, seen: list[dict[str, Any]]) -> FastAPI:
    """A worker nobody declared: healthy, and every call answered by the real replica (so its answers are valid and
    even name that replica), each request's path and Authorization header recorded first."""
    return relay_worker(replica_url, seen=seen)


def run_collect(gym: Gym, output: Path, repeats: int) -> CollectSummary:
    return collect_number_guess(gym, output, repeats, concurrency=4, timeout=300)


def gym_config(directory: Path, replica: VLLMServer, adapter_key: str, **router: Any) -> Any:
    config = demo_config_behind_router(directory, [replica.base_url])
    if router:
        text = config.read_text().replace(
            "      router:\n", "      router:\n" + "".join(f"        {k}: {json.dumps(v)}\n" for k, v in router.items())
        )
        config.write_text(text)
    overrides = [f"policy_model_name={MODEL}", "head_server.port=0", f"{ADAPTER_KEY}={adapter_key}"]
    return load_config([config], overrides)


def test_an_added_worker_gets_no_key_that_opens_a_weight_route_and_the_gym_refuses_its_answers(
    keyed_replica: VLLMServer, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []
    with Gym(gym_config(tmp_path, keyed_replica, INFERENCE_KEY)) as gym:
        router_url = next(iter(gym.routers.values())).url
        before = run_collect(gym, tmp_path / "before.jsonl", repeats=1)
        assert before.failed == 0 and before.done_now == before.total, before.line()

        with serve_in_thread(stand_in(keyed_replica.base_url, seen)) as stand_in_url:
            with httpx.Client(timeout=120) as http:
                add_worker(router_url, stand_in_url, http=http)  # 200, no key asked: the open door
                assert stand_in_url in list_workers(router_url, http=http)
                during = run_collect(gym, tmp_path / "during.jsonl", repeats=2)
                remove_worker(router_url, stand_in_url, http=http)
        reasons = during.failures_path.read_text() if during.failures_path.exists() else ""
        print(f"with the stand-in listed: {during.line()}; the stand-in was sent {len(seen)} request(s)")
        assert during.done_now == 0 and during.failed == during.total, during.line()
        assert "does not declare" in reasons and stand_in_url in reasons

        after = run_collect(gym, tmp_path / "after.jsonl", repeats=1)
        assert after.failed == 0 and after.done_now == after.total, after.line()

    # What reached the stand-in: the adapter's inference key at most, never the weights key, and that key opens no
    # weight route on the real replica.
    sent = {request["authorization"] for request in seen}
    assert sent <= {f"Bearer {INFERENCE_KEY}"}, sent
    for authorization in sent:
        answer = httpx.post(
            f"{keyed_replica.base_url}/collective_rpc", json=[], headers={"Authorization": authorization}, timeout=30
        )
        assert answer.status_code == 401, answer.text


def test_an_adapter_key_that_opens_the_weight_routes_is_refused_at_the_gyms_start(
    keyed_replica: VLLMServer, tmp_path: Path
) -> None:
    with pytest.raises(LaunchError, match="opens the weight routes of worker .*--weights-api-key"):
        with Gym(gym_config(tmp_path, keyed_replica, WEIGHTS_KEY)):
            pass


def test_a_router_beyond_loopback_or_with_a_key_of_its_own_is_refused_before_it_starts(
    keyed_replica: VLLMServer, tmp_path: Path
) -> None:
    with pytest.raises(LaunchError, match="admin routes to the network.*/add_worker"):
        with Gym(gym_config(tmp_path, keyed_replica, INFERENCE_KEY, host="0.0.0.0")):
            pass
    with pytest.raises(LaunchError, match="give the key to the adapter instead"):
        with Gym(gym_config(tmp_path, keyed_replica, INFERENCE_KEY, api_key=INFERENCE_KEY)):
            pass
