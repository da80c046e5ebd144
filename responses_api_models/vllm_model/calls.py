"""One chat call: the caller's body validated once (ChatCall), and the body sent to vLLM (PreparedCall)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from nemo_gym_tok.servers.api_errors import ApiError, validation_message
from nemo_gym_tok.splice import SpliceError
from nemo_gym_tok.splice_host import SpliceRequest, read_splice_request
from nemo_gym_tok.types import ChatCompletionRequest
from nemo_gym_tok.types.tokens import NEW_SEGMENT_KEY, PREFIX_KEY

if TYPE_CHECKING:
    from responses_api_models.vllm_model.local_splice import TurnMeasurement

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class ChatCall:
    """A chat request validated once: the body to forward and what the adapter reads from the validated model."""

    body: dict[str, Any]
    """The caller's body as received (the same dict, id lists not copied), as the validated model reads it: see
    `forwarded_body`."""
    asked: SpliceRequest
    """The prefix (the explicit required prefix, else the last bundled assistant message's prompt + generation ids)
    and whether a new token segment is asked for: read here once, for every path of the call."""
    n: int | None
    stream: bool

    @classmethod
    def validated(cls, body: dict[str, Any], checked: int = 0) -> ChatCall:
        """`body` checked against ChatCompletionRequest (400 naming the field), once: what is forwarded is `body`
        itself, not the model dumped again (which rebuilt every message and copied every id list). The first
        `checked` messages were validated by an earlier call (a kept history) and are not again: every rule on a
        message is the message's own."""
        messages = body.get("messages")
        shown = {**body, "messages": messages[checked:]} if checked and isinstance(messages, list) else body
        chat = parse_body(ChatCompletionRequest, shown)
        forwarded = forwarded_body(body, chat)
        try:
            asked = read_splice_request(
                forwarded["messages"], body.get(PREFIX_KEY), body.get(NEW_SEGMENT_KEY), None, types_checked=True
            )
        except SpliceError as exc:
            raise ApiError(400, str(exc), param=PREFIX_KEY) from None
        return cls(forwarded, asked, chat.n, bool(chat.stream))

    @property
    def required_prefix(self) -> list[int] | None:
        return None if self.asked.source is None else self.asked.source.prefix


def forwarded_body(body: dict[str, Any], chat: ChatCompletionRequest) -> dict[str, Any]:
    """`body` as its validated model `chat` reads it, with no copy where they agree: the top-level fields the model
    declares and coerces (`"stream": "true"` is true) take the model's values, and a message's `reasoning` becomes
    `reasoning_content` as ChatMessage renames it (vLLM reads either; the adapter's local template reads the latter).
    Every other field, extra ones included, is forwarded as sent."""
    forwarded = dict(body)
    for name in ("model", "n", "stream"):
        if name in forwarded:
            forwarded[name] = getattr(chat, name)
    messages = body.get("messages")
    if isinstance(messages, list) and any(_renames_reasoning(message) for message in messages):
        forwarded["messages"] = [
            {
                **{key: value for key, value in message.items() if key != "reasoning"},
                "reasoning_content": message["reasoning"],
            }
            if _renames_reasoning(message)
            else message
            for message in messages
        ]
    return forwarded


def _renames_reasoning(message: Any) -> bool:
    return isinstance(message, dict) and "reasoning" in message and message.get("reasoning_content") is None


@dataclass
class PreparedCall:
    """One chat call as the adapter sends it to vLLM, with what it needs to finish the answer."""

    body: dict[str, Any]
    caller_body: dict[str, Any]
    required_prefix: list[int] | None
    capture: bool
    """Put the bundle on the returned message (return_token_id_information)."""
    needs_ids: bool
    """Token ids are asked of vLLM (for the bundle, or to check the required prefix)."""
    telemetry: dict[str, Any] | None
    """The adapter's own splice telemetry; None where it did not splice."""
    confirm: Callable[[], Awaitable[None]] | None = None
    """The adapter's splice: what must hold of the server once the answer is in (SplicedCall.confirm)."""
    measurement: TurnMeasurement | None = None
    """The adapter's splice: the turn's measurement, started once the body is sent and awaited before `telemetry` is
    read (SplicedCall.measurement)."""
    weight_version_read: bool = False
    """The server's weight version was read before sending (weight_versions.py): read it again after the answer."""
    weight_version_before: str | None = None
    """What that read said (None: unknown)."""


def parse_body(model: type[Model], body: dict[str, Any]) -> Model:
    """`body` as `model`, or a 400 naming the first invalid field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise ApiError(400, message, param=param) from None
