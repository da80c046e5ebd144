"""When the adapter's copy of the chat template last rendered a request exactly as a vLLM server did, per scope.

A proof is one request whose prompt the server's `/tokenize` and the adapter's local tokenizer and template turned
into the same ids. It holds for later requests to the same server process with the same template scope (the
request's own chat template, its template arguments and its tools: everything but the messages that the template
sees), so those splice without a round trip. The proof also keeps the server's ids for a short probe conversation of
the scope. When the adapter opened a new connection to that server since the proof, or a call to it failed (a
restarted server, which may serve another template, can only be reached over a new connection: VLLMUpstream counts
both), the probe is asked again: the same ids renew the proof at the cost of a few dozen ids, other ids send the
next request down the full proof. A proof older than `max_age_seconds` is dropped: the bound for what no connection
shows (a proxy in front of several servers).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


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
