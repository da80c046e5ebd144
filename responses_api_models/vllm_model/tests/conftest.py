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

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.splice import PREFIX_KEY
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
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


TOKEN_FIELDS = (PREFIX_KEY, *BUNDLE_FIELDS)


def without_token_fields(body: dict[str, Any]) -> dict[str, Any]:
    """What a stock vLLM acts on: it ignores the bundle fields and the required prefix."""
    body = {k: v for k, v in body.items() if k not in TOKEN_FIELDS}
    if isinstance(body.get("messages"), list):
        body["messages"] = [{k: v for k, v in m.items() if k not in TOKEN_FIELDS} for m in body["messages"]]
    return body


def recording_proxy_app(
    target: str, proxy: RecordingProxy, *, as_stock_vllm: bool = False, drop_message_bundles: bool = False
) -> FastAPI:
    """as_stock_vllm: strip token fields from requests; drop_message_bundles: strip the hook's bundle from answers."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=target, timeout=300, limits=pool_limits())

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        if as_stock_vllm and raw:
            raw = json.dumps(without_token_fields(json.loads(raw))).encode()
        upstream = await client.request(
            request.method, f"/{path}", content=raw, headers={"content-type": "application/json"}
        )
        answer = upstream.json()
        if drop_message_bundles:
            for choice in answer.get("choices", []) if isinstance(answer, dict) else []:
                for key in TOKEN_FIELDS:
                    choice.get("message", {}).pop(key, None)
        if request.method == "POST":
            proxy.exchanges.append((f"/{path}", json.loads(raw), answer))
        return Response(json.dumps(answer), status_code=upstream.status_code, media_type="application/json")

    return app


def serve_proxy(vllm_server: VLLMServer, **options: bool) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(url="")
    with serve_in_thread(recording_proxy_app(vllm_server.base_url, proxy, **options)) as url:
        proxy.url = url
        yield proxy


@pytest.fixture
def recording_proxy(vllm_server: VLLMServer) -> Iterator[RecordingProxy]:
    yield from serve_proxy(vllm_server)


@pytest.fixture
def stock_vllm(vllm_server: VLLMServer) -> Iterator[RecordingProxy]:
    """The shared server seen as a stock vLLM (no hook): token fields never reach its renderer."""
    yield from serve_proxy(vllm_server, as_stock_vllm=True)


@pytest.fixture
def stock_training_adapter(stock_vllm: RecordingProxy, vllm_server: VLLMServer) -> Iterator[str]:
    """splice: hook in front of a server that does not splice: the adapter must notice and refuse."""
    yield from adapter(stock_vllm.url, vllm_server.served_model_name, return_token_id_information=True, splice="hook")


def adapter(base_url: str | list[str], model: str, **fields: Any) -> Iterator[str]:
    config = VLLMModelConfig(base_url=base_url, model=model, **fields)
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


@pytest.fixture
def training_adapter(recording_proxy: RecordingProxy, vllm_server: VLLMServer) -> Iterator[str]:
    """The adapter with token information on, in front of the recording proxy (so tests see what vLLM got)."""
    yield from adapter(f"{recording_proxy.url}/v1", vllm_server.served_model_name, return_token_id_information=True)


@pytest.fixture
def bundle_free_vllm(vllm_server: VLLMServer) -> Iterator[RecordingProxy]:
    """The shared hooked server with its message bundles removed, so the adapter must use its other sources."""
    yield from serve_proxy(vllm_server, drop_message_bundles=True)


@pytest.fixture
def tokenize_fallback_adapter(bundle_free_vllm: RecordingProxy, vllm_server: VLLMServer) -> Iterator[str]:
    """return_token_ids off and no message bundle: prompt ids come from /tokenize (which the hook splices too)."""
    yield from adapter(
        bundle_free_vllm.url,
        vllm_server.served_model_name,
        return_token_id_information=True,
        use_return_token_ids=False,
    )
