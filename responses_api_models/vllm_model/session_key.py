"""The conversation a call belongs to: the key vllm-router's consistent hash keeps one conversation's calls on one
replica with (sent as its `x-session-id` header), so each turn finds the previous turns in that replica's prefix
cache."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from nemo_gym_tok.servers.client import SESSION_HEADER
from responses_api_models.vllm_model.rollout_paths import rollout_of

DERIVED_KEY_PREFIX = "opening:"
ROLLOUT_KEY_PREFIX = "rollout:"


def conversation_key(request: Request, body: Mapping[str, Any]) -> str:
    """The `x-session-id` header when given, else the rollout id of a NeMo Gym rollout path, else a hash of what every
    turn of one conversation repeats.

    A derived key hashes the model, the Responses `instructions` and the opening messages (every message up to and
    including the first user message, role and content only): a conversation's later turns resend them unchanged,
    so they stay on one URL (prefix cache), while one client's different conversations get different keys. `body`
    is the request's JSON object as received (Chat Completions `messages` or Responses `input`).
    """
    session = request.headers.get(SESSION_HEADER)
    if session:
        return session
    rollout = rollout_of(request)
    if rollout is not None:  # NeMo Gym's /ng-rollout/<id>/... paths: one rollout is one conversation
        return ROLLOUT_KEY_PREFIX + rollout.rollout_id
    material = {"model": body.get("model"), "instructions": body.get("instructions"), "opening": _opening(body)}
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return DERIVED_KEY_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:32]


def _opening(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, str):  # Responses `input: "text"` is one user message
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list):
        return [messages]
    # Role and content only: a Responses client may resend a message item with `type` or `id` added. Read up to the
    # first user message, not the whole history.
    opening: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            opening.append(message)
            continue
        opening.append({"role": message.get("role"), "content": message.get("content")})
        if message.get("role") == "user":
            break
    return opening
