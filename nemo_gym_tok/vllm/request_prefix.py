"""A chat request's token prefix as the splice reads it, and a refused splice as vLLM's own 400."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from nemo_gym_tok.splice import NEW_SEGMENT_KEY, PREFIX_KEY, PrefixSource, SpliceError, find_prefix_source

_NEW_SEGMENT = {"applied": False, "template_differed": False, "replaced_tokens": 0, "new_segment": True}


@contextlib.contextmanager
def _as_400() -> Iterator[None]:
    """A SpliceError inside becomes vLLM's own 400 (OpenAI error body, param required_prefix_token_ids), counted."""
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.vllm import metrics

    try:
        yield
    except SpliceError as exc:
        metrics.rejected()
        raise VLLMValidationError(str(exc), parameter=PREFIX_KEY) from None


def _read_prefix(online: Any, request: Any, messages: list[Any]) -> tuple[PrefixSource | None, bool]:
    """The request's prefix (validated ids) and whether it asks for a new token segment."""
    source = find_prefix_source(messages, getattr(request, PREFIX_KEY, None), online.model_config.get_vocab_size())
    return source, _new_segment_requested(request)


@functools.lru_cache(maxsize=4)
def _signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def _new_segment_requested(request: Any) -> bool:
    value = getattr(request, NEW_SEGMENT_KEY, None)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpliceError(f"{NEW_SEGMENT_KEY} must be true or false, got {value!r}")
    return value
