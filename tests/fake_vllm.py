"""A fake of vLLM's weight routes and its prompt log probs for several hosts: the push's error paths on cue."""

from __future__ import annotations

import json

import httpx

from nemo_gym_tok.weights import STATUS_METHOD

HOSTS = ["http://a:8000", "http://b:8000"]
SERVED_MODEL = "fake-policy"


class FakeVLLM:
    """vLLM's weight routes for several hosts, each with its weights, version and pause state. `fail` makes one
    host's route answer 500 (`reload` of a given path, `resume`, ...); `garbage` makes its next answer there 200 with a
    body that is not JSON; `interrupt` raises KeyboardInterrupt at its next call there (a Ctrl-C that lands while the
    push waits on it). Those two happen once, so that the rollback's own call goes through.
    `log_probs` maps a weights path to the prompt log probs a host serving it answers (`stale` overrides a host's);
    every position not given serves -1.0."""

    def __init__(self, hosts: list[str], *, exact: bool = True, device: str = "cpu") -> None:
        self.state = {host: {"version": "v0", "weights": "/w/0", "paused": False} for host in hosts}
        self.fail: dict[tuple[str, str], str | None] = {}
        self.garbage: set[tuple[str, str]] = set()
        self.interrupt: set[tuple[str, str]] = set()
        self.log_probs: dict[str, list[float]] = {}
        self.stale: dict[str, list[float]] = {}
        self.calls: list[tuple[str, str, dict]] = []
        self.exact, self.device = exact, device

    def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = f"{request.url.scheme}://{request.url.netloc.decode()}", request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((host, path, {**dict(request.url.params), **body}))
        state = self.state[host]
        route = body.get("method", path) if path == "/collective_rpc" else path
        if (host, route) in self.interrupt:
            self.interrupt.discard((host, route))
            raise KeyboardInterrupt
        if (host, route) in self.garbage:
            self.garbage.discard((host, route))
            return httpx.Response(200, text="<html>proxy error</html>")
        failing = (host, route) in self.fail
        if failing and self.fail[(host, route)] in (None, body.get("kwargs", {}).get("weights_path")):
            return httpx.Response(500, json={"error": f"{route} failed"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": state["version"]})
        if route == STATUS_METHOD:
            if not self.exact:
                return httpx.Response(500, json={"error": "Method not implemented"})
            weights = {"exact_reload": True, "device": self.device, "weights_path": state["weights"]}
            return httpx.Response(200, json={"results": [{**weights, "tie_word_embeddings": True}]})
        if path == "/server_info":
            config = {"model_config": {"model": state["weights"]}, "device_config": {"device_type": self.device}}
            return httpx.Response(200, json={"vllm_config": config})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": SERVED_MODEL, "object": "model"}]})
        if path == "/v1/completions":
            return self.completion(host, body)
        if route == "reload_weights":
            state["weights"] = body["kwargs"]["weights_path"]
        elif path == "/update_weight_version":
            state["version"] = body["new_version"]
        elif path in ("/pause", "/resume"):
            state["paused"] = path == "/pause"
        elif path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})

    def completion(self, host: str, body: dict) -> httpx.Response:
        state = self.state[host]
        if state["paused"]:  # vLLM queues it until the resume: a push that probes while paused would hang here
            return httpx.Response(503, json={"error": "paused"})
        ids = body["prompt"]
        served = self.stale.get(host) or self.log_probs.get(state["weights"]) or [-1.0] * (len(ids) - 1)
        positions = [None] + [{str(ids[i + 1]): {"logprob": served[i], "rank": 1}} for i in range(len(ids) - 1)]
        choice = {"index": 0, "text": "x", "prompt_logprobs": positions, "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-1", "model": body["model"], "choices": [choice]})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))

    def back_as_before(self) -> bool:
        """Every host on its first weights and label, serving (not paused)."""
        return all(state == {"version": "v0", "weights": "/w/0", "paused": False} for state in self.state.values())
