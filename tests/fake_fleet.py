"""A fake vllm-router in front of the fake vLLM hosts (tests/fake_vllm.py), whose workers can die and come back."""

from __future__ import annotations

import threading

import httpx

from tests.fake_vllm import FakeVLLM

ROUTER = "http://router:30000"
STARTUP = {"version": "default", "weights": "/w/start", "paused": False}


class FakeFleet:
    """vllm-router 0.1.17's worker-list routes (`/list_workers`, `/add_worker`, `/remove_worker`) at ROUTER over the
    hosts of a FakeVLLM. A host in `down` refuses connections (a SIGKILLed vLLM), one in `hung` times out;
    `restart` brings one back on its
    start-up weights and label, as a restarted vLLM is. `timeline` records every (host, path) called, in order."""

    def __init__(self, vllm: FakeVLLM, workers: list[str]) -> None:
        self.vllm = vllm
        self.workers = list(workers)
        self.down: set[str] = set()
        self.hung: set[str] = set()
        self.timeline: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.scheme}://{request.url.netloc.decode()}"
        with self._lock:
            self.timeline.append((host, request.url.path))
        if host == ROUTER:
            return self.route(request)
        if host in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if host in self.hung:
            raise httpx.ReadTimeout("timed out", request=request)
        with self._lock:  # the fake's own state is shared by the keeper's threads
            return self.vllm.handler(request)

    def route(self, request: httpx.Request) -> httpx.Response:
        url = request.url.params.get("url", "")
        with self._lock:
            if request.url.path == "/list_workers":
                return httpx.Response(200, json={"urls": list(self.workers)})
            if request.url.path == "/remove_worker":
                if url in self.workers:
                    self.workers.remove(url)
                return httpx.Response(200, json={})
            if request.url.path == "/add_worker":
                if url in self.workers:
                    return httpx.Response(400, text=f"Worker {url} already exists")
                if url in self.down:  # the router waits for its /health, then gives up
                    return httpx.Response(503, text=f"Worker {url} did not become healthy")
                self.workers.append(url)
                return httpx.Response(200, json={})
        return httpx.Response(404, text="not found")

    def kill(self, host: str) -> None:
        self.down.add(host)

    def restart(self, host: str, *, weights: str = "/w/start", stale: list[float] | None = None) -> None:
        """`host` answers again, on its start-up `weights` under vLLM's start-up label; `stale`: the log probs it then
        serves whatever it loads (a reload that does not take)."""
        with self._lock:
            self.vllm.state[host] = {**STARTUP, "weights": weights}
            self.vllm.stale.pop(host, None)
            if stale is not None:
                self.vllm.stale[host] = stale
            self.down.discard(host)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))
