"""One fleet, one fingerprint: an answer from a replica whose tokenizer or chat template differs is refused."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, fingerprint_difference
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import REPLICA_KEY


class FleetFingerprint:
    """The fingerprint every replica behind this adapter must serve: the first one a hooked replica reported (each
    hooked answer names its replica and fingerprint, nemo_gym_tok.vllm.replica_identity). Ids sampled on another
    tokenizer or template are not the fleet's ids: mixed into a rollout they would break it silently."""

    def __init__(self) -> None:
        self.expected: dict[str, str] | None = None
        self.first_replica: str | None = None

    def check(self, result: dict[str, Any]) -> None:
        """Raise a 502 naming the replica whose answer in `result` carries another fingerprint than the fleet's."""
        for choice in result.get("choices") or []:
            message = choice.get("message") or {}
            found, replica = message.get(FINGERPRINT_KEY), message.get(REPLICA_KEY)
            if not isinstance(found, dict) or not isinstance(replica, str):
                continue  # a stock server's answer says neither: nothing to compare
            if self.expected is None:
                self.expected, self.first_replica = dict(found), replica
                continue
            if found.get("sha256") != self.expected.get("sha256"):
                raise ApiError(
                    502,
                    f"replica {replica} serves {fingerprint_difference(self.expected, found)} unlike the rest of the "
                    f"fleet (first seen on {self.first_replica}): ids it samples are not the fleet's, so its answer "
                    "is refused rather than mixed into a rollout. Serve every replica from the same model directory "
                    "and --chat-template, or take this one out of the router (`POST /remove_worker`)",
                    error_type="replica_mismatch",
                )
