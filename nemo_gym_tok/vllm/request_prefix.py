"""A chat request's token prefix as the hook reads it, and a refused splice as vLLM's own 400."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from nemo_gym_tok.contract.router_marks import came_through_vllm_router
from nemo_gym_tok.splice import NEW_SEGMENT_KEY, PREFIX_KEY, PrefixSource, SpliceError, check_in_vocabulary
from nemo_gym_tok.splice_host import SpliceRequest, read_splice_request

ROUTER_STRIPPED_HISTORY = (
    "this request came through vllm-router, which drops every field it does not know from chat messages (the token "
    "bundle's prompt_token_ids, generation_token_ids and generation_log_probs, and reasoning_content): its assistant "
    f"turns cannot be proven to be the model's own ids. Send the previous call's prompt and generated ids as the "
    f"top-level {PREFIX_KEY} (the router keeps top-level fields) and reasoning as `reasoning`, or "
    f"{NEW_SEGMENT_KEY}: true to take the template's ids on purpose (docs/clients.md, through a router)"
)


@contextlib.contextmanager
def as_400() -> Iterator[None]:
    """A SpliceError inside becomes vLLM's own 400 (OpenAI error body, param required_prefix_token_ids), counted."""
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.vllm import metrics

    try:
        yield
    except SpliceError as exc:
        metrics.rejected()
        raise VLLMValidationError(str(exc), parameter=PREFIX_KEY) from None


def read_request(online: Any, request: Any, messages: list[Any], *, vocabulary: bool = True) -> SpliceRequest:
    """What the request asks of the splice (its validated prefix, a new token segment); a history a router stripped
    of its bundles is refused. `vocabulary=False` leaves the ids' check against the vocabulary to the caller
    (`check_vocabulary`): a next turn's prompt ids proven to be a prompt this server spliced need none."""
    asked = read_splice_request(
        messages,
        getattr(request, PREFIX_KEY, None),
        getattr(request, NEW_SEGMENT_KEY, None),
        online.model_config.get_vocab_size() if vocabulary else None,
    )
    if asked.source is None and not asked.new_segment:
        refuse_history_a_router_stripped(request, messages)
    return asked


def check_vocabulary(online: Any, source: PrefixSource | None, start: int = 0) -> None:
    """The prefix's ids from `start` on are in the served model's vocabulary (SpliceError naming the first that is
    not, where the caller sent it)."""
    if source is not None:
        check_in_vocabulary(source, online.model_config.get_vocab_size(), start)


def refuse_history_a_router_stripped(request: Any, messages: list[Any]) -> None:
    """vllm-router re-serializes chat messages and drops every field it does not know, the token bundle among them.
    A request that came through it (its own default fields say so), asks for token ids (`return_token_ids`, or
    `logprobs`, which the hook answers with a bundle) and holds an assistant turn,
    but carries no prefix, may have lost its bundles on the way: its history would be re-tokenized from text, the
    drift this project exists to prevent. Refused with what survives the router instead."""
    if not came_through_vllm_router((getattr(request, "model_extra", None) or {}).keys()):
        return
    if not (getattr(request, "return_token_ids", False) or getattr(request, "logprobs", False)):
        return  # asks for no ids (the hook answers a bundle to `logprobs`): no claim to prove
    if not any(_role(message) == "assistant" for message in messages):
        return
    raise SpliceError(ROUTER_STRIPPED_HISTORY)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


@functools.lru_cache(maxsize=4)
def signature_of(function: Any) -> inspect.Signature:
    """`function`'s signature, read once (the wrappers bind vLLM's arguments by name on every request)."""
    return inspect.signature(function)
