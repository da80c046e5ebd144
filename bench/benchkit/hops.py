"""The hops the figures put in front of vLLM: the gym's servers as `ngt run` starts them, a bare pass-through,
and a recording proxy (what one hop sends the next, byte for byte)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchkit.server import MODEL, BenchError


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes
    status: int
    answer: bytes = b""


@dataclass
class RecordingProxy:
    """Forwards every request verbatim to `target` and records each one (method, path, raw body, status)."""

    target: str
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        client: httpx.AsyncClient | None = None

        async def forward(request: Request) -> Response:
            nonlocal client
            if client is None:
                client = httpx.AsyncClient(base_url=self.target, timeout=600)
            raw = await request.body()
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() in ("content-type", "authorization", "x-session-id", "accept")
            }
            upstream = await client.request(
                request.method, request.url.path, content=raw, headers=headers, params=request.query_params
            )
            self.exchanges.append(
                Exchange(request.method, request.url.path, raw, upstream.status_code, upstream.content)
            )
            kept = {k: v for k, v in upstream.headers.items() if k.lower() == "content-type"}
            return Response(upstream.content, status_code=upstream.status_code, headers=kept)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An ASGI app on a free loopback port in a thread of this process (as the tests serve the adapter)."""
    from nemo_gym_tok.servers.inprocess import serve_in_thread

    with serve_in_thread(app) as url:
        yield url


@contextlib.contextmanager
def gym(instances: dict[str, Any]) -> Iterator[Any]:
    """The servers of a gym config (`instances`: what a config file holds, e.g. {"policy_model":
    {"responses_api_models": {"vllm_model": {...}}}}) started as `ngt run` starts them: one process each, plus the
    head, on free ports. Yields the running `Gym` (its `urls` by instance name, `children` with their processes)."""
    import yaml

    from nemo_gym_tok.config import load_config
    from nemo_gym_tok.servers.launcher import Gym

    with tempfile.TemporaryDirectory(prefix="ngt-bench-") as directory:
        path = Path(directory) / "bench.yaml"
        path.write_text(yaml.safe_dump({"head_server": {"port": 0}, **instances}))
        config = load_config([path])
    with Gym(config) as running:
        yield running


@contextlib.contextmanager
def passthrough(upstream: str) -> Iterator[str]:
    """bench/benchkit/passthrough.py in its own process in front of `upstream`: a hop that does nothing but forward."""
    from nemo_gym_tok.common.net import free_port

    port = free_port("127.0.0.1")
    script = Path(__file__).with_name("passthrough.py")
    process = subprocess.Popen([sys.executable, str(script), upstream, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/v1/models", timeout=5)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise BenchError("the pass-through process did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def adapter_instance(base_url: str, **fields: Any) -> dict[str, Any]:
    """A vllm_model adapter config (token information on, as the gym's training configs run it)."""
    return {
        "responses_api_models": {
            "vllm_model": {"base_url": f"{base_url}/v1", "model": MODEL, "return_token_id_information": True, **fields}
        }
    }


@contextlib.contextmanager
def adapter_stack(url: str) -> Iterator[tuple[RecordingProxy, RecordingProxy, str]]:
    """The adapter (splice: hook, token information on) in this process, a recording proxy on each side of it:
    (client -> adapter recorder, adapter -> vLLM recorder, the URL clients post to)."""
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    to_vllm = RecordingProxy(url)
    with ExitStack() as stack:
        relay = stack.enter_context(serve_app(to_vllm.app()))
        config = VLLMModelConfig(**adapter_instance(relay, splice="hook")["responses_api_models"]["vllm_model"])
        adapter = stack.enter_context(serve_app(VLLMModel("policy_model", config).build_app()))
        to_adapter = RecordingProxy(adapter)
        yield to_adapter, to_vllm, stack.enter_context(serve_app(to_adapter.app()))
