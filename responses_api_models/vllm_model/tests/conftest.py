"""Adapter fixtures: the adapter served in-process in front of the shared real vLLM, and a recording proxy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm.server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig


@dataclass
class RecordingProxy:
    """Forwards every request to the real vLLM; records each POST's path, body as vLLM received it, and answer."""

    url: str
    exchanges: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body, _ in self.exchanges if p == path]

    def answers(self, path: str) -> list[Any]:
        return [answer for p, _, answer in self.exchanges if p == path]


def recording_proxy_app(target: str, proxy: RecordingProxy) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=target, timeout=300)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        upstream = await client.request(request.method, f"/{path}", content=raw, headers={"content-type": "application/json"})
        if request.method == "POST":
            proxy.exchanges.append((f"/{path}", json.loads(raw), upstream.json()))
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    return app


@pytest.fixture
def recording_proxy(vllm_server: VLLMServer) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(url="")
    with serve_in_thread(recording_proxy_app(vllm_server.base_url, proxy)) as url:
        proxy.url = url
        yield proxy


def adapter(base_url: str | list[str], model: str, **fields: Any) -> Iterator[str]:
    config = VLLMModelConfig(base_url=base_url, model=model, **fields)
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


@pytest.fixture
def training_adapter(recording_proxy: RecordingProxy, vllm_server: VLLMServer) -> Iterator[str]:
    """The adapter with token information on, in front of the recording proxy (so tests see what vLLM got)."""
    yield from adapter(f"{recording_proxy.url}/v1", vllm_server.served_model_name, return_token_id_information=True)


@pytest.fixture
def tokenize_fallback_adapter(recording_proxy: RecordingProxy, vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        recording_proxy.url, vllm_server.served_model_name, return_token_id_information=True, use_return_token_ids=False
    )
