"""When the adapter's copy of the chat template last rendered a request exactly as a vLLM server did, per scope.

A proof is one request whose prompt the server's `/tokenize` and the adapter's local tokenizer and template turned
into the same ids. It holds for later requests to the same server process with the same template scope (the
request's own chat template, its template arguments and its tools: everything but the messages that the template
sees), so those splice without a round trip. The proof also keeps the server's ids for a short probe conversation of
the scope. When the adapter opened a new connection to that server since the proof, or a call to it failed (a
restarted server, which may serve another template, can only be reached over a new connection: VLLMUpstream counts
both), the probe is asked again: the same ids renew the proof at the cost of a few dozen ids, other ids send the
next request down the full proof. A proof older than `max_age_seconds` is dropped: the bound for what no connection
shows (a proxy in front of several servers). Proving says what one request does about its scope's proof.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.splice_host import ScopedRenderer
from responses_api_models.vllm_model.upstream import answer_json


@dataclass(frozen=True)
class Proof:
    """When a scope was proven on a server, on which of its connection epochs (see VLLMUpstream.epoch), and the
    server's ids for the scope's probe conversation then (None where the template cannot render the probe)."""

    proven_at: float
    epoch: int
    probe_ids: tuple[int, ...] | None = None


class TemplateProofs:
    """Proofs by (server, scope); bounded, least recently used first out."""

    def __init__(
        self, max_age_seconds: float, *, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_age_seconds = max_age_seconds
        self._max_entries = max_entries
        self._clock = clock
        self._proofs: OrderedDict[tuple[str, str], Proof] = OrderedDict()
        self.proven = 0
        """Requests that proved a scope (each cost a /tokenize of its prompt)."""
        self.renewed = 0
        """Proofs renewed on a new connection by the probe's ids."""

    def current(self, server: str, scope: str, epoch: int) -> Proof | None:
        """The proof that still holds for `scope` on `server` at connection epoch `epoch`, else None."""
        proof = self.renewable(server, scope)
        return proof if proof is not None and proof.epoch == epoch else None

    def renewable(self, server: str, scope: str) -> Proof | None:
        """The proof of `scope` on `server` that is young enough to renew by its probe, whatever its epoch."""
        proof = self._proofs.get((server, scope))
        if proof is None:
            return None
        if self._clock() - proof.proven_at > self.max_age_seconds:
            del self._proofs[(server, scope)]
            return None
        self._proofs.move_to_end((server, scope))
        return proof

    def record(self, server: str, scope: str, epoch: int, probe_ids: list[int] | None) -> None:
        """`scope` was just proven on `server`, whose connection epoch (read after the proving calls) is `epoch`."""
        self.proven += 1
        self._put((server, scope), Proof(self._clock(), epoch, tuple(probe_ids) if probe_ids is not None else None))

    def renew(self, server: str, scope: str, proof: Proof, epoch: int) -> Proof:
        """The server gave `proof`'s probe ids again at epoch `epoch`: the proof holds there, from its first time."""
        self.renewed += 1
        renewed = Proof(proof.proven_at, epoch, proof.probe_ids)
        self._put((server, scope), renewed)
        return renewed

    def _put(self, key: tuple[str, str], proof: Proof) -> None:
        self._proofs[key] = proof
        self._proofs.move_to_end(key)
        while len(self._proofs) > self._max_entries:
            self._proofs.popitem(last=False)

    def telemetry(self, proof: Proof | None, *, renewed: bool = False) -> dict[str, object]:
        """`prefix_splice.proof` of an answer: how its prompt's template was proven to be the server's (this
        request's own ids, or a proof `age_seconds` old, which this request `renewed` by the probe)."""
        if proof is None:
            return {"by": "server_tokenize", "this_request": True, "age_seconds": 0.0, "renewed": False}
        age = max(0.0, self._clock() - proof.proven_at)
        return {"by": "server_tokenize", "this_request": False, "age_seconds": round(age, 3), "renewed": renewed}


Post = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""POST `path` with a JSON body to the vLLM URL the conversation is on; returns the httpx response."""


PROBE_MESSAGES = ({"role": "user", "content": "ngt template probe: 1 + 1 = 2?"},)
"""A conversation every chat template renders: the server's ids for it, with a scope's tools and arguments, are
asked again on a new connection to renew a proof for a few dozen ids instead of a history."""


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
