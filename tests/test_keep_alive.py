"""Servers the gym starts keep an idle connection open past clients' 5 s: the client is the side that drops it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.vllm_server import VLLMServer

IDLE_SECONDS = 6.5
"""Past uvicorn's and vLLM's own 5 s, which httpx and the OpenAI SDK also keep an idle connection for."""


def same_connection_after_idling(url: str) -> bool:
    """GET `url`, stay idle IDLE_SECONDS, GET it again: True when the second call went over the first's connection
    (a client that keeps connections longer than the server would otherwise find it closed, or have it reset)."""
    with httpx.Client(limits=httpx.Limits(keepalive_expiry=2 * SERVER_KEEPALIVE_SECONDS)) as http:
        first = http.get(url)
        first_address = local_address(first)
        time.sleep(IDLE_SECONDS)
        second = http.get(url)
        second_address = local_address(second)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    return first_address == second_address


def local_address(answer: httpx.Response) -> tuple[str, int]:
    """The client's end of the connection `answer` came over (read while the connection is open)."""
    return answer.extensions["network_stream"].get_extra_info("client_addr")


def test_the_hooked_vllm_keeps_an_idle_connection_open(vllm_server: VLLMServer) -> None:
    assert IDLE_SECONDS < SERVER_KEEPALIVE_SECONDS
    assert same_connection_after_idling(f"{vllm_server.base_url}/health")


def test_a_launched_gym_server_keeps_an_idle_connection_open(tmp_path: Path) -> None:
    config = tmp_path / "one.yaml"
    config.write_text("capital_lookup:\n  resources_servers:\n    capital_lookup: {}\n")
    with Gym(load_config([config], ["head_server.port=0"])) as running:
        assert same_connection_after_idling(f"{running.urls['capital_lookup']}/health")
