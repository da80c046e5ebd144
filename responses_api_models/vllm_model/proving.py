"""One request's dealings with its template scope's proof on one vLLM server: is there one, renew it by the probe
conversation, or prove it anew by the server's /tokenize ids (the proofs themselves: template_proof.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.local_template import ScopedRenderer
from responses_api_models.vllm_model.template_proof import Proof, TemplateProofs
from responses_api_models.vllm_model.upstream import answer_json

Post = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""POST `path` with a JSON body to the vLLM URL the conversation is on; returns the httpx response."""


PROBE_MESSAGES = ({"role": "user", "content": "ngt template probe: 1 + 1 = 2?"},)
"""A conversation every chat template renders: the server's ids for it, with a scope's tools and arguments, are
asked again on a new connection to renew a proof (template_proof.py) for a few dozen ids instead of a history."""


@dataclass
class Proving:
    """One request's dealings with its scope's proof on one server: is there one, renew it, prove it anew."""

    proofs: TemplateProofs
    renderer: ScopedRenderer
    """The request's renderer (its scope's), which renders the probe locally."""
    server: str
    post: Post
    epoch: Callable[[], int]
    tokenize_body: dict[str, Any]
    relied_on: int = -1
    """The connection epoch the request's splice relies on: the proof's (confirm() checks it after the answer)."""
    _probe_ids: list[int] | None = None

    async def standing(self) -> tuple[Proof | None, bool]:
        """The proof this request may rely on, and whether it renewed it: current on this epoch, or young enough and
        renewed by the server giving its probe ids again. (None, False): prove anew."""
        epoch = self.epoch()
        proof = self.proofs.current(self.server, self.renderer.render_scope, epoch)
        if proof is not None:
            self.relied_on = epoch
            return proof, False
        proof = self.proofs.renewable(self.server, self.renderer.render_scope)
        if proof is None or proof.probe_ids is None:
            return None, False
        probe = await server_template_ids(self.post, self._probe_body(), tolerate_refusal=True)
        if probe is None or tuple(probe) != proof.probe_ids:
            return None, False
        self.relied_on = self.epoch()
        return self.proofs.renew(self.server, self.renderer.render_scope, proof, self.relied_on), True

    async def prove(self) -> list[int]:
        """The server's ids for the whole prompt (the caller compares them with the local copy's) and, asked at the
        same time, for the probe, kept with the proof when the local copy gives the same."""
        template_ids, probe = await asyncio.gather(
            server_template_ids(self.post, self.tokenize_body),
            server_template_ids(self.post, self._probe_body(), tolerate_refusal=True),
        )
        local_probe = await asyncio.to_thread(self._local_probe_ids)
        self._probe_ids = probe if probe is not None and probe == local_probe else None
        return template_ids

    def record(self) -> None:
        self.relied_on = self.epoch()
        self.proofs.record(self.server, self.renderer.render_scope, self.relied_on, self._probe_ids)

    def _probe_body(self) -> dict[str, Any]:
        body = {key: value for key, value in self.tokenize_body.items() if key != "continue_final_message"}
        return {**body, "messages": list(PROBE_MESSAGES), "add_generation_prompt": True}

    def _local_probe_ids(self) -> list[int] | None:
        renderer = self.renderer
        try:
            return renderer.encode(renderer.render(list(PROBE_MESSAGES), add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a template that cannot render the probe: proofs are renewed by the request
            return None


async def server_template_ids(
    post: Post, tokenize_body: dict[str, Any], *, tolerate_refusal: bool = False
) -> list[int] | None:
    """The server's /tokenize ids; its 4xx raised as the caller's error, or None with `tolerate_refusal` (a probe
    the template cannot render)."""
    response = await post("/tokenize", tokenize_body)
    if response.status_code >= 400 and tolerate_refusal:
        return None
    if response.status_code >= 400:
        # `post` raises for every 5xx itself; a 4xx is the server refusing the prompt (a bad message, an unknown tool
        # choice): the caller's to fix.
        raise ApiError(response.status_code, error_message(response), error_type="upstream_invalid_request")
    return [int(token) for token in answer_json(response, "vLLM /tokenize")["tokens"]]
