"""When the adapter's copy of the chat template last rendered a request exactly as a vLLM server did, per scope.

A proof is one request whose prompt the server's `/tokenize` and the adapter's local tokenizer and template turned
into the same ids. It holds for later requests to the same server process with the same template scope (the
request's own chat template, its template arguments and its tools: everything but the messages that the template
sees), so those splice without a round trip. It is dropped, and the next request proves again, when

- the adapter opened a new connection to that server since the proof, or a call to it failed: a restarted server,
  which may serve another template, can only be reached over a new connection (VLLMUpstream counts both);
- it is older than `max_age_seconds`, a bound for what no connection shows (a proxy in front of several servers).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Proof:
    """When a scope was proven on a server, and on which of its connection epochs (see VLLMUpstream.epoch)."""

    proven_at: float
    epoch: int


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
        """Requests that proved a scope (each cost one /tokenize)."""

    def current(self, server: str, scope: str, epoch: int) -> Proof | None:
        """The proof that still holds for `scope` on `server` at connection epoch `epoch`, else None."""
        proof = self._proofs.get((server, scope))
        if proof is None:
            return None
        if proof.epoch != epoch or self._clock() - proof.proven_at > self.max_age_seconds:
            del self._proofs[(server, scope)]
            return None
        self._proofs.move_to_end((server, scope))
        return proof

    def record(self, server: str, scope: str, epoch: int) -> None:
        """`scope` was just proven on `server`, whose connection epoch (read after the proving call) is `epoch`."""
        self.proven += 1
        self._proofs[(server, scope)] = Proof(self._clock(), epoch)
        self._proofs.move_to_end((server, scope))
        while len(self._proofs) > self._max_entries:
            self._proofs.popitem(last=False)

    def telemetry(self, proof: Proof | None) -> dict[str, object]:
        """`prefix_splice.proof` of an answer: how its prompt's template was proven to be the server's."""
        if proof is None:
            return {"by": "server_tokenize", "this_request": True, "age_seconds": 0.0}
        age = max(0.0, self._clock() - proof.proven_at)
        return {"by": "server_tokenize", "this_request": False, "age_seconds": round(age, 3)}
