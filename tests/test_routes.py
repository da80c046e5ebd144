"""Every vLLM route that renders chat messages, on the real hooked server: spliced with the full check, or a 400.

The shared server runs with --enable-scale-out (the render routes, /inference/v1/generate) and
--trust-request-chat-template (a test's own template). The routes and their policy: nemo_gym_tok.vllm.routes.ROUTES,
docs/clients.md.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm.routes import ROUTES
from nemo_gym_tok.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def http(vllm_server: VLLMServer):
    with httpx.Client(base_url=vllm_server.base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def second_turn(vllm_server: VLLMServer, http: httpx.Client) -> list[dict]:
    """[user, assistant carrying its bundle (a turn the model generated, cut by max_tokens), user]."""
    first = [{"role": "user", "content": "Where next?"}]
    answer = http.post(
        "/v1/chat/completions",
        json={
            "model": vllm_server.served_model_name,
            "messages": first,
            "max_tokens": 12,
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 0,
        },
    )
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assistant = {"role": "assistant", "content": message["content"], **{key: message[key] for key in BUNDLE_FIELDS}}
    return [*first, assistant, {"role": "user", "content": "And then?"}]


def _prefix(messages: list[dict]) -> list[int]:
    return messages[1]["prompt_token_ids"] + messages[1]["generation_token_ids"]


def _spliced_metric(vllm_server: VLLMServer) -> float:
    text = httpx.get(f"{vllm_server.base_url}/metrics", timeout=30).text
    name = 'nemo_gym_tok_preprocess_seconds_count{path="spliced"}'
    # The labelled series appears with its first splice: a server that has spliced nothing yet has none.
    line = next((line for line in text.splitlines() if line.startswith(name)), f"{name} 0")
    return float(line.split()[-1])


def test_the_render_route_splices_as_tokenize_does(vllm_server: VLLMServer, http: httpx.Client, second_turn) -> None:
    """/v1/chat/completions/render answers the spliced ids (the model's own prefix, then the template's next turn),
    the same as /tokenize; the engine generates from them on /inference/v1/generate (the scale-out flow)."""
    body = {"model": vllm_server.served_model_name, "messages": second_turn}
    before = _spliced_metric(vllm_server)
    rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    assert _spliced_metric(vllm_server) == before + 1
    assert ids[: len(_prefix(second_turn))] == _prefix(second_turn)  # the model's own ids, cut by max_tokens
    tokenized = http.post("/tokenize", json=body)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == ids
    generated = http.post(
        "/inference/v1/generate",
        json={
            "model": vllm_server.served_model_name,
            "token_ids": ids,
            "sampling_params": {"max_tokens": 3},
        },
    )
    assert generated.status_code == 200, generated.text
    assert generated.json()["usage"]["prompt_tokens"] == len(ids)


def test_the_render_route_refuses_a_stale_prefix(vllm_server: VLLMServer, http: httpx.Client, second_turn) -> None:
    body = {
        "model": vllm_server.served_model_name,
        "messages": [m for m in second_turn if not set(BUNDLE_FIELDS) & set(m)][:1],
        "required_prefix_token_ids": [*_prefix(second_turn), 11, 12],
    }
    answer = http.post("/v1/chat/completions/render", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "required_prefix_token_ids"


def _planted_template() -> str:
    """A template whose text after the last user message differs only where the assistant's text is the splice's
    own placeholder and the user's is not: exactly the neutral rendering the full check (and the deferred
    verification) compares with, never the server's own rendering nor the placement rendering the fast path reads.
    The assistant's text is trimmed, so the server's rendering is not the placement rendering filled in, and the
    fast path leaves its proof to SplicedPrompt.verify. A unique comment keeps the server's caches cold."""
    return (
        "{#- " + uuid.uuid4().hex + " -#}{%- set ns = namespace(a='') -%}{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}{%- set ns.a = m.content -%}"
        "<|im_start|>assistant\n{{ m.content | trim }}<|im_end|>\n"
        "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- if ns.a.startswith('ngtbody') and not m.content.startswith('ngt') -%}"
        "<|im_start|>system\nplanted<|im_end|>\n{%- endif -%}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )


def _planted_conversation(vllm_server: VLLMServer, http: httpx.Client) -> tuple[str, list[dict]]:
    template = _planted_template()
    first = [{"role": "user", "content": "hello"}]
    prompt = http.post(
        "/tokenize",
        json={
            "model": vllm_server.served_model_name,
            "messages": first,
            "chat_template": template,
        },
    ).json()["tokens"]
    generation = http.post(
        "/tokenize",
        json={
            "model": vllm_server.served_model_name,
            "prompt": " hi <|im_end|>",
            "add_special_tokens": False,
        },
    ).json()["tokens"]
    assistant = {
        "role": "assistant",
        "content": " hi ",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }
    return template, [*first, assistant, {"role": "user", "content": "and?"}]


def test_the_render_route_runs_the_check_only_the_deferred_verification_would(
    vllm_server: VLLMServer, http: httpx.Client
) -> None:
    """A splice the fast path's immediate checks pass and only its verification refuses: an unstreamed chat
    completion (verified while the engine generates, by the hook's response wrapper) says so; the render route,
    whose answer never passes that wrapper, must refuse it at once (before the route guards it returned the
    unverified ids, 200)."""
    template, messages = _planted_conversation(vllm_server, http)
    body = {"model": vllm_server.served_model_name, "messages": messages, "chat_template": template}
    rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 400, rendered.text
    assert "cannot prove such a prompt exact" in rendered.json()["error"]["message"]
    template, messages = _planted_conversation(vllm_server, http)  # cold caches: the fast path is taken again
    completed = http.post(
        "/v1/chat/completions", json={**body, "messages": messages, "chat_template": template, "max_tokens": 2}
    )
    assert completed.status_code == 400, completed.text
    assert "could not be confirmed in time" in completed.json()["error"]["message"]


def test_the_batch_route_splices_with_the_full_check(vllm_server: VLLMServer, http: httpx.Client, second_turn) -> None:
    model = vllm_server.served_model_name
    before = _spliced_metric(vllm_server)
    answer = http.post(
        "/v1/chat/completions/batch",
        json={
            "model": model,
            "messages": [second_turn, second_turn[:1]],
            "max_tokens": 2,
        },
    )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2
    assert _spliced_metric(vllm_server) == before + 1
    template, planted = _planted_conversation(vllm_server, http)
    refused = http.post(
        "/v1/chat/completions/batch",
        json={
            "model": model,
            "messages": [planted],
            "chat_template": template,
            "max_tokens": 2,
        },
    )
    assert refused.status_code == 400, refused.text
    assert "cannot prove such a prompt exact" in refused.json()["error"]["message"]


REFUSING = [path for route in ROUTES if route.policy == "refuse" for path in route.paths]
SERVED_HERE = [
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/messages/render",
    "/v1/responses",
    "/v1/responses/render",
]


def _request(path: str, model: str, messages: list[dict], **extra) -> dict:
    if path.startswith("/v1/responses"):
        return {"model": model, "input": messages, "max_output_tokens": 2, **extra}
    return {"model": model, "messages": messages, "max_tokens": 2, **extra}


@pytest.mark.parametrize("path", SERVED_HERE)
def test_routes_that_cannot_splice_refuse_token_ids(
    vllm_server: VLLMServer, http: httpx.Client, second_turn, path: str
) -> None:
    """A bundle, or a required prefix, on a route that would render the messages from their text: 400 naming the
    route and /v1/chat/completions; the same conversation without ids is served as stock vLLM serves it."""
    assert path in REFUSING
    model = vllm_server.served_model_name
    plain = [{key: value for key, value in m.items() if key not in BUNDLE_FIELDS} for m in second_turn]
    for body in (
        _request(path, model, second_turn),
        _request(path, model, plain, required_prefix_token_ids=_prefix(second_turn)),
    ):
        answer = http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith(f"{path} does not splice token ids") and "/v1/chat/completions" in message
    assert http.post(path, json=_request(path, model, plain)).status_code == 200


def test_pooling_routes_are_not_served_by_a_generating_model(vllm_server: VLLMServer, http: httpx.Client) -> None:
    """The pooling routes exist only on a pooling model's server (where the guard refuses token ids: docs/clients.md);
    this server generates, so a client sending messages there gets no silent rendering either."""
    for path in ("/pooling", "/classify", "/v1/embeddings", "/score", "/rerank"):
        assert path in REFUSING
        answer = http.post(path, json={"model": vllm_server.served_model_name, "messages": [], "input": "x"})
        assert answer.status_code == 404, (path, answer.status_code, answer.text[:200])
