"""What constrained a model call's decoding (`constrained_by`) and which of its tokens the grammar forced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CONSTRAINED_BY_KEY = "constrained_by"
FORCED_MASK_KEY = "generation_forced_mask"

TOOL_CHOICE_REQUIRED = "tool_choice:required"
TOOL_CHOICE_NAMED = "tool_choice:named"
STRUCTURED_OUTPUTS = "structured_outputs"
STRICT_TOOLS = "strict_tools"
RESPONSE_FORMAT_PREFIX = "response_format:"
"""Followed by the format's type: `response_format:json_schema`, `response_format:json_object`, ..."""

# The StructuredOutputsParams fields that each select a grammar; the others (whitespace options) only tune one.
_GRAMMAR_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def constrained_by(request: Mapping[str, Any] | Any) -> list[str]:
    """The request fields that put a grammar over this call's sampling, as labels; [] for a free call.

    `request` is a chat completions body (a dict, as the adapter forwards it) or vLLM's parsed request object (as
    the hook sees it). Rules, following what vLLM 0.30+ does with them:
    - `tool_choice` "required" or a named function (with tools): the tool-call schema replaces every other
      constraint, so it is the only label;
    - otherwise each of `response_format` (any type but "text"), `tools` with `strict: true` (unless tool_choice is
      "none") and `structured_outputs` (one of its grammar fields set) adds its label.
    vLLM's tool parser may rewrite the request before the hook sees it: it moves a forced tool choice's schema, or a
    strict tool's structural tag (with any response_format folded in), into `structured_outputs`. So that field is
    labelled only when no tool label accounts for it; one it holds for a reason of the server's own (its
    --tool-strict-level) is still labelled, which is the point: some grammar was in force.
    """
    tools = _get(request, "tools") or []
    tool_choice = _get(request, "tool_choice")
    if tools and tool_choice == "required":
        return [TOOL_CHOICE_REQUIRED]
    if tools and tool_choice is not None and not isinstance(tool_choice, str):  # {"type": "function", ...}
        return [TOOL_CHOICE_NAMED]
    labels: list[str] = []
    response_format = _get(request, "response_format")
    format_type = _get(response_format, "type") if response_format is not None else None
    if format_type is not None and format_type != "text":
        labels.append(f"{RESPONSE_FORMAT_PREFIX}{format_type}")
    strict = tool_choice != "none" and any(_is_strict(tool) for tool in tools)
    if strict:
        labels.append(STRICT_TOOLS)
    structured = _get(request, "structured_outputs")
    if (
        structured is not None
        and not strict
        and any(_get(structured, name) not in (None, False) for name in _GRAMMAR_FIELDS)
    ):
        labels.append(STRUCTURED_OUTPUTS)
    return labels


def forced_mask(labels: Sequence[str] | None, log_probs: Sequence[float]) -> list[int]:
    """1 for each generated token the grammar forced, 0 elsewhere: one entry per log prob.

    Under a grammar vLLM reports log probs of the masked distribution, so a token that was the grammar's only choice
    shows exactly 0.0. A turn is judged by its labels: a free turn (no labels) is all 0 even where the model itself
    put all its mass on one token. Limits: in a constrained turn a token the model alone was sure of (0.0 in its own
    float precision) is counted as forced too, and a token the grammar narrowed to several choices is not counted
    (its log prob is still of the masked distribution; the turn's labels say so).
    """
    if not labels:
        return [0] * len(log_probs)
    return [1 if log_prob == 0.0 else 0 for log_prob in log_probs]


def valid_fields(labels: Any, mask: Any, generation_length: int) -> bool:
    """Whether `labels` and `mask` (as found on a message) are well-formed constraint fields for a generation of
    `generation_length` ids: a list of strings, and a list of 0/1 of that length."""
    return (
        isinstance(labels, list)
        and all(isinstance(label, str) for label in labels)
        and isinstance(mask, list)
        and len(mask) == generation_length
        and all(type(flag) is int and flag in (0, 1) for flag in mask)
    )


def _is_strict(tool: Any) -> bool:
    # Chat tools carry `strict` on their function; Responses-style tools at the top level.
    function = _get(tool, "function")
    return _get(tool, "strict") is True or (function is not None and _get(function, "strict") is True)


def _get(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)
