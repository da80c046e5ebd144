"""NeMo Gym's per-row settings in a request's `metadata`: `chat_template_kwargs` and `extra_body`, applied as its
vllm_model applies them; its audio side channel is refused (this adapter has no audio path)."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.servers.api_errors import ApiError

TEMPLATE_KWARGS = "chat_template_kwargs"
EXTRA_BODY = "extra_body"
AUDIO_KEYS = ("audio_data", "audio_path", "audio_paths")
# What the adapter reads itself to build the call: a row's extra_body must not reshape the request under it.
STRUCTURAL_FIELDS = frozenset(
    {
        "messages",
        "input",
        "instructions",
        "stream",
        "stream_options",
        "n",
        "required_prefix_token_ids",
        "start_token_segment",
        "metadata",
    }
)


def apply_metadata(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`body` (a chat request) with NeMo Gym's metadata settings applied, and the fields `extra_body` added.

    As NeMo Gym 0.7.0's vllm_model: `metadata.chat_template_kwargs` (a JSON object, as a string since OpenAI's
    metadata values are strings; an object is taken too) is merged over the request's own `chat_template_kwargs`,
    key by key; `metadata.extra_body` (likewise) supplies top-level fields the request does not set itself (the
    request's own fields win). `metadata` itself is forwarded as sent. A malformed setting is a 400 naming it.
    """
    metadata = body.get("metadata")
    if metadata is None:
        return body, []
    if not isinstance(metadata, dict):
        raise ApiError(400, f"metadata: must be an object, got {type(metadata).__name__}", param="metadata")
    audio = [key for key in AUDIO_KEYS if metadata.get(key)]
    if audio:
        raise ApiError(
            400,
            f"metadata.{audio[0]}: NeMo Gym's audio side channel is not supported by this adapter; send the "
            "audio as a content part of the user message instead",
            param=f"metadata.{audio[0]}",
        )
    template_kwargs = _json_object(metadata, TEMPLATE_KWARGS)
    extra = _json_object(metadata, EXTRA_BODY)
    if not template_kwargs and not extra:
        return body, []
    out = dict(body)
    if template_kwargs:
        own = out.get(TEMPLATE_KWARGS)
        if own is not None and not isinstance(own, dict):
            raise ApiError(400, f"{TEMPLATE_KWARGS}: must be an object", param=TEMPLATE_KWARGS)
        out[TEMPLATE_KWARGS] = {**(own or {}), **template_kwargs}
    structural = sorted(STRUCTURAL_FIELDS & extra.keys())
    if structural:
        raise ApiError(
            400,
            f"metadata.{EXTRA_BODY}: {structural[0]!r} cannot be set per row (the adapter builds the call from "
            "it); send it at the top level of the request",
            param=f"metadata.{EXTRA_BODY}",
        )
    added = [name for name in extra if name not in out]
    for name in added:
        out[name] = extra[name]
    return out, added


def _json_object(metadata: dict[str, Any], key: str) -> dict[str, Any]:
    value = metadata.get(key)
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = loads_exact(value)
        except ValueError as exc:
            raise ApiError(
                400,
                f"metadata.{key}: not valid JSON ({exc}); give a JSON object as a string, e.g. "
                '"{\\"enable_thinking\\": false}"',
                param=f"metadata.{key}",
            ) from None
    if not isinstance(value, dict):
        raise ApiError(
            400,
            f"metadata.{key}: must be a JSON object (a string holding one), got {type(value).__name__}",
            param=f"metadata.{key}",
        )
    return value
