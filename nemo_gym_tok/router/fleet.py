"""One fleet behind a router: each worker's fingerprint (tokenizer, chat template) asked and compared when it joins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.keys import key_headers
from nemo_gym_tok.common.net import shared_ssl_context
from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, fingerprint_difference

PROBE_MESSAGES = [{"role": "user", "content": "."}]
PROBE_PATH = "/v1/chat/completions"


class FleetMismatchError(RuntimeError):
    """A worker serves another tokenizer or chat template than the rest, or cannot be asked which it serves: refused
    before it takes any call."""


def worker_fingerprint(
    worker_url: str, model: str, *, http: httpx.Client, api_key: str | None = None
) -> dict[str, str] | None:
    """The fingerprint a hooked worker serves with (one generated id, asked of the worker itself, not through the
    router); None for a worker without the hook, whose answers do not say."""
    headers = key_headers(api_key)
    try:
        answer = http.post(f"{worker_url.rstrip('/')}{PROBE_PATH}", json=probe_body(model), headers=headers)
    except httpx.TransportError as exc:
        raise FleetMismatchError(
            f"worker {worker_url} could not be asked for its fingerprint: {type(exc).__name__}: {exc} (is it up?)"
        ) from None
    if answer.status_code != 200:
        raise FleetMismatchError(
            f"worker {worker_url} could not be asked for its fingerprint: HTTP {answer.status_code} {answer.text[:200]}"
        )
    return answered_fingerprint(loads_exact(answer.content))


def probe_body(model: str) -> dict[str, Any]:
    """The chat call that asks a hooked worker its fingerprint: one generated id, with log probs (so the hook attaches
    its bundle, which names the fingerprint)."""
    return {"model": model, "messages": PROBE_MESSAGES, "max_tokens": 1, "logprobs": True}


def answered_fingerprint(answer: Any) -> dict[str, str] | None:
    """The fingerprint a worker's answer to `probe_body` names, None when it names none (no hook)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    message = (choices or [{}])[0].get("message") if isinstance(choices, list) and choices else None
    found = message.get(FINGERPRINT_KEY) if isinstance(message, dict) else None
    return dict(found) if isinstance(found, dict) else None


def check_fleet(
    worker_urls: Sequence[str],
    model: str,
    *,
    http: httpx.Client | None = None,
    api_key: str | None = None,
    expected: dict[str, str] | None = None,
) -> dict[str, dict[str, str] | None]:
    """Each worker's fingerprint; raises FleetMismatchError naming the first worker whose fingerprint differs from
    `expected` (else from the first hooked worker's). Workers without the hook say nothing and are returned as None:
    the caller decides whether an unproven worker may join."""
    client = http or httpx.Client(timeout=120, verify=shared_ssl_context())
    try:
        found = {url: worker_fingerprint(url, model, http=client, api_key=api_key) for url in worker_urls}
    finally:
        if http is None:
            client.close()
    reference_url = None
    for url, fingerprint in found.items():
        if fingerprint is None:
            continue
        if expected is None:
            expected, reference_url = fingerprint, url
            continue
        if fingerprint.get("sha256") != expected.get("sha256"):
            against = f"worker {reference_url}" if reference_url else "the fleet"
            raise FleetMismatchError(
                f"worker {url} serves {fingerprint_difference(expected, fingerprint)} unlike {against}: the ids it "
                "samples would not be the fleet's, so it is not put behind the router. Serve every worker from the "
                "same model directory and --chat-template"
            )
    return found


def weight_routes_opened_by(worker_url: str, api_key: str, *, http: httpx.Client) -> int | None:
    """The status a worker answers when `api_key` asks for one of its weight routes, None when the key does not open
    them (401 or 403) or the worker serves none (404). Asked with a body vLLM refuses before acting (`[]` to
    /collective_rpc: 400 where the key opens it), so nothing changes on the worker."""
    headers = key_headers(api_key)
    try:
        answer = http.post(f"{worker_url.rstrip('/')}/collective_rpc", json=[], headers=headers)
    except httpx.TransportError as exc:
        raise FleetMismatchError(
            f"worker {worker_url} could not be asked whether the adapter's key opens its weight routes: "
            f"{type(exc).__name__}: {exc} (is it up?)"
        ) from None
    return None if answer.status_code in (401, 403, 404) else answer.status_code
