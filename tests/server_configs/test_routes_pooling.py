"""The pooling routes on a real hooked vLLM serving the tiny model as an embedding model: token ids are refused.

A pooling model is its own server configuration (`--runner pooling --convert embed`), started once for this module.
Its routes render chat messages without the splice, so a request carrying a bundle or a required prefix gets a 400
that names the route and what to send instead (nemo_gym_tok.vllm.routes); the same request without ids is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.vllm.routes import POOLING_LABEL
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, VLLMServer
from tests.servers import hooked_server

pytestmark = pytest.mark.vllm

POOLING_ARGS = ("--max-model-len", "2048", "--runner", "pooling", "--convert", "embed")
BUNDLED = [
    {"role": "user", "content": "Where next?"},
    {
        "role": "assistant",
        "content": "North.",
        "prompt_token_ids": [9707, 13],
        "generation_token_ids": [25221, 13],
        "generation_log_probs": [-0.5, -0.1],
    },
    {"role": "user", "content": "And then?"},
]


@pytest.fixture(scope="module")
def pooling_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with hooked_server(
        tiny_model_dir,
        served_model_name="tiny-embed",
        extra_args=(*CPU_SERVING_ARGS, *POOLING_ARGS),
        env={},
        log_path=tmp_path_factory.mktemp("vllm-pooling") / "vllm.log",
        what="pooling server: ",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(pooling_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pooling_server.base_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_a_bundle_on_a_pooling_route_is_refused(http: httpx.Client, pooling_server: VLLMServer, path: str) -> None:
    answer = http.post(path, json={"model": pooling_server.served_model_name, "messages": BUNDLED})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith(POOLING_LABEL) and "generation_token_ids" in message and "token ids" in message


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_a_required_prefix_on_a_pooling_route_is_refused(
    http: httpx.Client, pooling_server: VLLMServer, path: str
) -> None:
    answer = http.post(
        path,
        json={
            "model": pooling_server.served_model_name,
            "messages": BUNDLED[:1],
            "required_prefix_token_ids": [9707],
        },
    )
    assert answer.status_code == 400, answer.text
    assert "required_prefix_token_ids" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_the_same_messages_without_ids_are_served(http: httpx.Client, pooling_server: VLLMServer, path: str) -> None:
    plain = [
        {key: value for key, value in message.items() if not key.endswith("_ids") and key != "generation_log_probs"}
        for message in BUNDLED
    ]
    answer = http.post(path, json={"model": pooling_server.served_model_name, "messages": plain})
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"]
