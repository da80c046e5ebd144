"""The Cohere v2 chat routes on a real hooked vLLM (VLLM_ENABLE_COHERE_API=1, the `cohere` SDK installed): ids refused.

vLLM serves /cohere/v2/chat (and /cohere/v2/chat/render with --enable-scale-out) only with that variable set and the
SDK importable: the suite's shared server is started with it (conftest.py). The routes rebuild the conversation from
the messages' text and their request model drops top-level fields, so a bundle or a required prefix sent there gets
a 400 naming the route and what to send instead (nemo_gym_tok.vllm.routes); the same request without ids is served.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_tok.vllm import routes
from nemo_gym_tok.vllm.routes import COHERE_MODULE, COHERE_PATHS, ROUTE_METHODS, ROUTES, not_served
from nemo_gym_tok.vllm_server import VLLMServer

COHERE_GUARD = (COHERE_MODULE, "CohereErrorEnvelopeMiddleware", "dispatch")
REJECTED = "nemo_gym_tok_prefix_splice_rejected_total"
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
PLAIN = [{key: value for key, value in message.items() if key == "role" or key == "content"} for message in BUNDLED]


def test_the_cohere_routes_are_guarded_and_need_their_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the hook's route list (so `ngt vllm-compat` checks the guard's method in every release); the guard is left
    out only where the package its routes need does not import (vLLM then serves no Cohere route)."""
    refusing = {path for route in ROUTES if route.policy == "refuse" for path in route.paths}
    assert set(COHERE_PATHS) <= refusing and COHERE_GUARD in ROUTE_METHODS
    assert not not_served(COHERE_GUARD, "0.32.0")  # the SDK is a test dependency: installed here and on CI
    monkeypatch.setitem(routes.ROUTE_NEEDS, COHERE_GUARD, "nemo_gym_tok_no_such_package")
    assert not_served(COHERE_GUARD, "0.32.0")


def test_without_the_sdk_the_hook_installs_without_the_cohere_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM defines the guarded middleware only when `cohere` imports: without it the hook still installs (no Cohere
    route to guard); with the SDK importable, the middleware's absence is a move, named like any other."""
    import importlib

    from nemo_gym_tok.vllm import hook

    def guarded() -> list[str]:
        """The route methods routes.install would wrap here (recorded, nothing wrapped)."""
        names: list[str] = []
        routes.install(lambda owner, name, make_wrapper: names.append(name))
        return names

    with_sdk = guarded()
    assert "dispatch" in with_sdk
    monkeypatch.delattr(importlib.import_module(COHERE_MODULE), COHERE_GUARD[1])
    assert hook.check_internals() == [".".join(COHERE_GUARD)]
    monkeypatch.setitem(routes.ROUTE_NEEDS, COHERE_GUARD, "nemo_gym_tok_no_such_package")
    assert hook.check_internals() == []
    assert guarded() == [name for name in with_sdk if name != "dispatch"]


@pytest.fixture(scope="module")
def cohere_server(vllm_server: VLLMServer) -> VLLMServer:
    """The suite's shared hooked server: conftest starts it with VLLM_ENABLE_COHERE_API=1 (no server of its own)."""
    return vllm_server


@pytest.fixture(scope="module")
def http(cohere_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cohere_server.base_url, timeout=300) as client:
        yield client


def _rejected(http: httpx.Client) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith(REJECTED))
    return float(line.split()[-1])


@pytest.mark.vllm
def test_a_plain_cohere_chat_is_served(cohere_server: VLLMServer, http: httpx.Client) -> None:
    answer = http.post(
        "/cohere/v2/chat",
        json={
            "model": cohere_server.served_model_name,
            "messages": PLAIN,
            "max_tokens": 3,
            "seed": 1,
        },
    )
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["message"]["role"] == "assistant" and reply["usage"]["tokens"]["output_tokens"] >= 1


@pytest.mark.vllm
def test_a_plain_cohere_render_is_served(cohere_server: VLLMServer, http: httpx.Client) -> None:
    """The render route answers the prompt ids, the same as /tokenize renders the same conversation."""
    answer = http.post("/cohere/v2/chat/render", json={"model": cohere_server.served_model_name, "messages": PLAIN})
    assert answer.status_code == 200, answer.text
    tokenized = http.post("/tokenize", json={"model": cohere_server.served_model_name, "messages": PLAIN})
    assert answer.json()["token_ids"] == tokenized.json()["tokens"]


@pytest.mark.vllm
@pytest.mark.parametrize("path", COHERE_PATHS)
def test_a_bundle_on_a_cohere_route_is_refused(cohere_server: VLLMServer, http: httpx.Client, path: str) -> None:
    before = _rejected(http)
    answer = http.post(
        path,
        json={"model": cohere_server.served_model_name, "messages": BUNDLED, "max_tokens": 3},
        headers={"X-Request-Id": "ngt-cohere-1"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["message"].startswith(f"{path} does not splice token ids"), error
    assert "generation_token_ids" in error["message"] and "/v1/chat/completions" in error["message"]
    assert error["id"] == "ngt-cohere-1"  # Cohere's error shape, as vLLM answers every other error there
    assert _rejected(http) == before + 1


@pytest.mark.vllm
@pytest.mark.parametrize("path", COHERE_PATHS)
def test_a_required_prefix_on_a_cohere_route_is_refused(
    cohere_server: VLLMServer, http: httpx.Client, path: str
) -> None:
    """A top-level field the Cohere request model would drop without a word."""
    answer = http.post(
        path,
        json={
            "model": cohere_server.served_model_name,
            "messages": PLAIN,
            "max_tokens": 3,
            "required_prefix_token_ids": [9707, 13],
        },
    )
    assert answer.status_code == 400, answer.text
    message = answer.json()["message"]
    assert message.startswith(f"{path} does not splice token ids") and "required_prefix_token_ids" in message
