"""Records calls made on NeMo Gym's training-capture paths in its token file store's layout, for its collector.

NeMo Gym 0.7.0 (`token_id_capture: {enabled: true, dir: D}`, `token_id_capture: true` on the agent) sends each model
call of rollout R to `/ng-rollout/R/training-token-capture/v1/...`. Its own model server appends one record per call
to `D/R.tokens.jsonl`; its collector freezes that file when the rollout ends and, where the rollout's output carries
no token ids, rebuilds the output from the records. This module writes the same records (schema 1) for the adapter:
the call's ids and log probs, its output items without them, the id of the answer the client got, and the parent
call whose prompt + generation ids this call's prompt starts with (the adapter knows it exactly: the required prefix
it enforced), so the collector's chain builder links the calls without guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

RECORD_SCHEMA_VERSION = 1
TOKEN_FIELDS = (*BUNDLE_FIELDS, "routed_experts")
# NeMo Gym's digest of an id sequence: sha256 over a domain tag, a version byte, the length and the ids, big-endian.
_DIGEST_DOMAIN = b"nemo-gym-tokens"
_DIGEST_VERSION = 1


def sequence_digest(ids: list[int]) -> str:
    """The digest NeMo Gym's chain builder checks a claimed parent with (its `compute_digest`)."""
    if not ids:
        return hashlib.sha256(_DIGEST_DOMAIN).hexdigest()
    packed = struct.pack(f">BQ{len(ids)}Q", _DIGEST_VERSION, len(ids), *ids)
    return hashlib.sha256(_DIGEST_DOMAIN + packed).hexdigest()


def output_items(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's output items as NeMo Gym records them: Responses `output`, or each chat choice's message."""
    if isinstance(answer.get("output"), list):
        return [item for item in answer["output"] if isinstance(item, dict)]
    return [{"type": "message", "role": "assistant", **choice["message"]} for choice in answer.get("choices") or []]


def continues_history(chat_body: dict[str, Any]) -> bool:
    """Whether the request carries an earlier model turn (so a record without a known parent is not a root)."""
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in chat_body.get("messages") or [])


class NeMoGymTokenStore:
    """Appends capture records under `root` as NeMo Gym's file store lays them out (one JSONL per rollout, guarded
    by its lock file), and marks a rollout incomplete the way it does, so its collector masks that sample."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, rollout_id: str, suffix: str) -> Path:
        return self.root / f"{rollout_id}.tokens{suffix}"

    async def record(
        self, rollout_id: str, answer: dict[str, Any], *, chat_body: dict[str, Any], required_prefix: list[int] | None
    ) -> str:
        """Append the record of one served `answer` (Responses or chat, bundle on one item); its model call id.

        No bundle on the answer (a context overflow ends the turn empty): the rollout is marked incomplete instead,
        as NeMo Gym does for a call without ids. A rollout NeMo Gym already froze (collected): 409."""
        try:
            return await asyncio.to_thread(self._record, rollout_id, answer, chat_body, required_prefix)
        except OSError as exc:
            raise ApiError(
                500, f"training-token capture could not write to {self.root}: {exc}", error_type="capture_write_failed"
            ) from None

    def _record(
        self, rollout_id: str, answer: dict[str, Any], chat_body: dict[str, Any], required_prefix: list[int] | None
    ) -> str:
        call_id = uuid.uuid4().hex
        items = output_items(answer)
        bearing = [index for index, item in enumerate(items) if item.get("generation_token_ids") is not None]
        with self._locked(rollout_id):
            state = self._state(rollout_id)
            if state.get("frozen") or state.get("retired"):
                raise ApiError(
                    409,
                    f"rollout {rollout_id}: NeMo Gym has already collected this rollout's capture (frozen), so "
                    "no call can be added to it; start a new rollout id",
                    param="path",
                )
            if len(bearing) != 1:
                self._mark_incomplete(rollout_id, call_id, state)
                return call_id
            bundle = items[bearing[0]]
            prompt, generation = list(bundle["prompt_token_ids"]), list(bundle["generation_token_ids"])
            parent, resolution, reason = self._parent(rollout_id, required_prefix, continues_history(chat_body))
            record = {
                "schema_version": RECORD_SCHEMA_VERSION,
                "rollout_id": rollout_id,
                "model_call_id": call_id,
                "model": str(answer.get("model") or ""),
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": list(bundle["generation_log_probs"]),
                "routed_experts": bundle.get("routed_experts"),
                "output_items": [{k: v for k, v in item.items() if k not in TOKEN_FIELDS} for item in items],
                "token_item_index": bearing[0],
                "response_id": str(answer.get("id") or "") or None,
                "created_at": time.time(),
                "parent_call_id": parent,
                "cum_len": len(prompt) + len(generation),
                "digest": sequence_digest(prompt + generation),
                "parent_resolution": resolution,
                "parent_resolution_reason": reason,
                "prompt_is_delta": False,
                # The adapter enforced the required prefix on the generation-time prompt ids (or refused the call).
                "prefix_requested": required_prefix is not None,
                "prefix_supplied": required_prefix is not None,
            }
            with self._path(rollout_id, ".jsonl").open("ab") as handle:
                handle.write(orjson.dumps(record, option=orjson.OPT_SORT_KEYS) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
        return call_id

    def _parent(self, rollout_id: str, prefix: list[int] | None, continues: bool) -> tuple[str | None, str, str]:
        """(parent call id, NeMo Gym's resolution status, reason): the recorded call whose whole sequence is the
        prefix this call was held to; none known for a continuation is `unresolved` (NeMo Gym then masks it)."""
        if prefix is None:
            return (None, "unresolved", "history_without_token_ids") if continues else (None, "root", "first_call")
        digest = sequence_digest(prefix)
        matches = [
            entry["model_call_id"]
            for entry in self._entries(rollout_id)
            if entry.get("digest") == digest and entry.get("cum_len") == len(prefix)
        ]
        if len(matches) == 1:
            return matches[0], "resolved", "required_prefix"
        return None, "unresolved", "prefix_matches_no_recorded_call" if not matches else "prefix_matches_several_calls"

    def _entries(self, rollout_id: str) -> Iterator[dict[str, Any]]:
        path = self._path(rollout_id, ".jsonl")
        if not path.exists():
            return
        yield from read_jsonl(path)

    def _state(self, rollout_id: str) -> dict[str, Any]:
        path = self._path(rollout_id, ".state.json")
        return loads_exact(path.read_bytes()) if path.exists() else {}

    def _mark_incomplete(self, rollout_id: str, call_id: str, state: dict[str, Any]) -> None:
        # NeMo Gym reads the flag from the state file; the entry index in it is rebuilt from the JSONL by its reader.
        state = {"frozen": False, "retired": False, "snapshot_id": "", "version": 0, **state, "incomplete": True}
        state["version"] = int(state["version"]) + 1
        temporary = self._path(rollout_id, f".state.{uuid.uuid4().hex}.tmp")
        temporary.write_bytes(orjson.dumps(state, option=orjson.OPT_SORT_KEYS))
        os.replace(temporary, self._path(rollout_id, ".state.json"))
        with self._path(rollout_id, ".incomplete").open("a") as handle:
            handle.write(call_id + "\n")

    @contextlib.contextmanager
    def _locked(self, rollout_id: str) -> Iterator[None]:
        with self._path(rollout_id, ".lock").open("a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
