"""Puts the exact token bundle on each returned message and checks that the prompt starts with the required prefix."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from nemo_gym_tok.contract.constrained import (
    CONSTRAINED_BY_KEY,
    FORCED_MASK_KEY,
    constrained_by,
    forced_mask,
    valid_fields,
)
from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, SAMPLING_KEY, effective_sampling
from nemo_gym_tok.contract.token_sources import (
    PartialBundle,
    PrefixMismatchError,
    TokenSource,
    TokenSourceError,
    check_prefix,
    logprobs_bundle,
    resolve_bundle,
)
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, REPLICA_KEY, WEIGHT_VERSION_KEY, WEIGHT_VERSION_SPANS_KEY

# Fields of a chat request that change the rendered prompt: the /tokenize fallback gets exactly these.
PROMPT_AFFECTING_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "required_prefix_token_ids",
    "start_token_segment",
)
# Chat fields /tokenize does not take; what vLLM's chat path makes of them is translated or refused.
_UNRENDERABLE_ON_TOKENIZE = ("truncate_prompt_tokens",)

Tokenize = Callable[[dict[str, Any]], Awaitable[list[int]]]


def capture_request_fields(body: dict[str, Any], *, use_return_token_ids: bool) -> dict[str, Any]:
    """The fields that make vLLM report this call's ids and log probs (caller's own top_logprobs kept)."""
    fields: dict[str, Any] = {
        "logprobs": True,
        "top_logprobs": body.get("top_logprobs") or 0,
        "return_tokens_as_token_ids": True,
    }
    if use_return_token_ids:
        fields["return_token_ids"] = True
    return fields


def tokenize_request(body: dict[str, Any], *, exclude_tools_when_tool_choice_none: bool = False) -> dict[str, Any]:
    """The /tokenize body that renders the same prompt as the generation request `body`.

    vLLM's /tokenize has no `reasoning_effort` and no `tool_choice`: the effort goes into `chat_template_kwargs` as
    vLLM's chat path puts it there (with `enable_thinking` unless the caller set it), and tools are left out under
    `tool_choice: "none"` where the server does so (`--exclude-tools-when-tool-choice-none`). A field that changes
    the prompt but cannot be expressed (`truncate_prompt_tokens`) is refused: the ids would not be the prompt's.
    """
    for field in _UNRENDERABLE_ON_TOKENIZE:
        if body.get(field) is not None:
            raise ApiError(
                400,
                f"{field} cannot be combined with token capture through the /tokenize fallback (vLLM's /tokenize "
                "cannot apply it, so the ids would not be the prompt's); drop it or use vLLM's return_token_ids",
                param=field,
            )
    request = {key: body[key] for key in PROMPT_AFFECTING_FIELDS if key in body}
    effort = body.get("reasoning_effort")
    if effort not in (None, "auto"):
        template_kwargs = dict(body.get("chat_template_kwargs") or {})
        if "enable_thinking" not in template_kwargs:
            template_kwargs["enable_thinking"] = effort != "none"
        template_kwargs["reasoning_effort"] = effort
        request["chat_template_kwargs"] = template_kwargs
    if exclude_tools_when_tool_choice_none and body.get("tool_choice") == "none":
        request.pop("tools", None)
    return request


def token_in_prompt(generation_body: dict[str, Any]) -> list[int] | None:
    """The prompt ids the call sent as token-in (`kv_transfer_params.prompt_token_ids`: the adapter's own splice):
    exactly what generation used, so the /tokenize fallback answers them instead of re-rendering the history."""
    params = generation_body.get("kv_transfer_params")
    ids = params.get("prompt_token_ids") if isinstance(params, dict) else None
    return list(ids) if isinstance(ids, list) and ids else None


async def attach_bundles(
    result: dict[str, Any],
    *,
    generation_body: dict[str, Any],
    required_prefix: list[int] | None,
    return_bundle: bool,
    tokenize: Tokenize,
    upstream_url: str,
    server: str | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
) -> None:
    """Resolve each choice's bundle from vLLM's sources, check the prefix, and (if asked) put it on the message.
    `server` names who served the call in the refusal of an unspliced prefix (behind_router.server_label; by
    default the vLLM server at `upstream_url`)."""
    tokenized: list[int] | None = None
    for choice in result.get("choices", []):
        message = choice.setdefault("message", {})
        # Precedence order: the hook's bundle, vLLM's return_token_ids, /tokenize (only when nothing else has
        # prompt ids), then logprobs for generation ids and log probs.
        present = _distinct_sources(_message_source(message), _returned_source(result, choice))
        if all(source.prompt_token_ids is None for source in present):
            if tokenized is None:
                tokenized = token_in_prompt(generation_body) or await tokenize(
                    tokenize_request(
                        generation_body, exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none
                    )
                )
            present.append(PartialBundle(TokenSource.TOKENIZE, prompt_token_ids=tokenized))
        try:
            from_logprobs = logprobs_bundle(choice.get("logprobs"))
            bundle = resolve_bundle([*present, from_logprobs] if from_logprobs else present)
        except TokenSourceError as exc:
            raise ApiError(502, f"vLLM at {upstream_url} reported inconsistent token ids: {exc}") from None
        telemetry = result.get("prefix_splice") if isinstance(result.get("prefix_splice"), dict) else None
        check_required_prefix(
            bundle.prompt_token_ids, required_prefix, telemetry, server=server or f"the vLLM server at {upstream_url}"
        )
        if return_bundle:
            # The hook's weight_version and weight_version_spans stay on the message it put them on; the adapter's
            # WeightVersionReads.settle keeps them where the hook's bundle won, and decides them otherwise.
            message.update(bundle.as_fields())
            message["token_source"] = bundle.source.value
            if isinstance(result.get("prefix_splice"), dict):
                message["prefix_splice"] = result["prefix_splice"]
            message.update(_constraint_fields(message, bundle.generation_log_probs, generation_body))


def _constraint_fields(
    message: dict[str, Any], log_probs: list[float], generation_body: dict[str, Any]
) -> dict[str, Any]:
    """`constrained_by` and `generation_forced_mask` for the bundle: the hook's, when it sent well-formed ones for
    these ids (it saw the request after vLLM's tool parser, so it also knows grammars vLLM added itself), else
    derived from the body the adapter sent vLLM (a stock vLLM, or the adapter's own splice)."""
    labels, mask = message.get(CONSTRAINED_BY_KEY), message.get(FORCED_MASK_KEY)
    if not valid_fields(labels, mask, len(log_probs)):
        labels = constrained_by(generation_body)
        mask = forced_mask(labels, log_probs)
    return {CONSTRAINED_BY_KEY: labels, FORCED_MASK_KEY: mask}


def attach_provenance(
    result: dict[str, Any],
    generation_body: dict[str, Any],
    defaults: dict[str, Any] | None,
    fingerprint: dict[str, str] | None,
) -> None:
    """Put `sampling` (the effective parameters of the body sent to vLLM) and, when known, `model_fingerprint` on
    each bundled message: what a trainer checks before trusting the log probs."""
    sampling = effective_sampling(generation_body, defaults)
    for choice in result.get("choices", []):
        message = choice.get("message")
        if isinstance(message, dict) and message.get("generation_token_ids") is not None:
            message[SAMPLING_KEY] = dict(sampling)
            if fingerprint is not None and message.get(FINGERPRINT_KEY) is None:
                # A hooked server's own fingerprint (what it actually served) wins over the adapter's read of the
                # model directory.
                message[FINGERPRINT_KEY] = dict(fingerprint)


def check_required_prefix(
    prompt_ids: list[int], required_prefix: list[int] | None, telemetry: dict[str, Any] | None, *, server: str
) -> None:
    """Raise the 502 `prefix_not_spliced` unless the prompt vLLM used starts with the required prefix (no prefix, or
    a new token segment, checks nothing). `telemetry` is the call's `prefix_splice`, if any."""
    telemetry = telemetry or {}
    if required_prefix is None or telemetry.get("new_segment"):
        return
    # The hook may give the model's final end token way to the template's closing (GPT-OSS <|return|>).
    expected = required_prefix[:-1] if telemetry.get("end_token_replaced") else required_prefix
    if prompt_ids[: len(expected)] == expected:
        return  # compared at C speed; check_prefix walks id by id in Python, so it runs only to say where they differ
    try:
        check_prefix(prompt_ids, expected)
    except PrefixMismatchError as exc:
        raise ApiError(
            502,
            f"{server} is not splicing the required prefix into the prompt ({exc}). "
            "Its template re-tokenized the history, so these ids would drift from what the model produced. "
            "Serve with `ngt vllm-serve` (or set NEMO_GYM_TOK_PREFIX_SPLICE=1 with the plugin installed).",
            error_type="prefix_not_spliced",
        ) from None


def _message_source(message: dict[str, Any]) -> PartialBundle | None:
    # The lists of vLLM's parsed answer, not copies: resolve_bundle copies what it picks.
    if not all(message.get(field) is not None for field in BUNDLE_FIELDS):
        return None
    return PartialBundle(TokenSource.MESSAGE, *(message[field] for field in BUNDLE_FIELDS))


def _returned_source(result: dict[str, Any], choice: dict[str, Any]) -> PartialBundle | None:
    prompt, generation = result.get("prompt_token_ids"), choice.get("token_ids")
    if prompt is None or generation is None:
        return None
    return PartialBundle(TokenSource.RETURN_TOKEN_IDS, prompt_token_ids=prompt, generation_token_ids=generation)


def _distinct_sources(first: PartialBundle | None, later: PartialBundle | None) -> list[PartialBundle]:
    """The sources present, `later` without the id lists that equal `first`'s. The hook's bundle and vLLM's
    return_token_ids carry the same prompt ids; comparing them with `==` (C speed) spares resolve_bundle's Python
    walk over thousands of ids. Lists that differ stay, so resolve_bundle still refuses them, naming the position."""
    if first is None or later is None:
        return [source for source in (first, later) if source is not None]
    agreeing = {
        field: None
        for field in ("prompt_token_ids", "generation_token_ids")
        if getattr(later, field) is not None and getattr(later, field) == getattr(first, field)
    }
    return [first, replace(later, **agreeing) if agreeing else later]


def drop_unrequested(result: dict[str, Any], caller_body: dict[str, Any], *, bundle_returned: bool) -> None:
    """Remove what the adapter asked vLLM for only for its own checks, so the caller gets what it asked for."""
    if not caller_body.get("return_token_ids"):
        result.pop("prompt_token_ids", None)
    for choice in result.get("choices", []):
        if not caller_body.get("return_token_ids"):
            choice.pop("token_ids", None)
        if not caller_body.get("logprobs"):
            choice.pop("logprobs", None)
        if not bundle_returned:
            # the hook adds these with a bundle
            for field in (
                *BUNDLE_FIELDS,
                CONSTRAINED_BY_KEY,
                FORCED_MASK_KEY,
                WEIGHT_VERSION_KEY,
                WEIGHT_VERSION_SPANS_KEY,
                REPLICA_KEY,
                FINGERPRINT_KEY,
            ):
                choice.get("message", {}).pop(field, None)
