"""Responses API request, item and response models; the last item of each model call carries its bundle."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym_tok.types.tokens import TokenBundleMixin, TokenIds

ASSISTANT_ITEM_TYPES = ("reasoning", "function_call")


class ResponseItem(TokenBundleMixin):
    """One input or output item. Typed loosely on purpose: every field a caller sends is kept as it came."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: Any = None
    # function_call / function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Any = None
    # reasoning
    summary: list[Any] | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> ResponseItem:
        if self.type == "message" and not self.role:
            raise ValueError("a message item needs a role")
        if self.type == "function_call" and (self.call_id is None or self.name is None or self.arguments is None):
            raise ValueError("a function_call item needs call_id, name and arguments")
        if self.type == "function_call_output" and self.call_id is None:
            raise ValueError("a function_call_output item needs call_id")
        return self

    @property
    def is_model_output(self) -> bool:
        """Items a model call produces: reasoning, function calls, and assistant messages."""
        return self.type in ASSISTANT_ITEM_TYPES or (self.type == "message" and self.role == "assistant")


PREVIOUS_KEY = "previous_response_id"
"""The Responses field naming the answer a call continues: the server holds its history, the caller sends the rest."""
PREVIOUS_NOT_FOUND = "previous_response_not_found"
"""`error.type` of the 400 for a previous response the server does not hold: send the whole input instead."""


class ResponsesRequest(BaseModel):
    """What callers send to `/v1/responses`; unknown fields are kept and forwarded."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[ResponseItem]
    instructions: str | None = None
    required_prefix_token_ids: TokenIds | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    """The answer this call continues (its history kept by the server): `input` then holds the new items only."""
    store: bool | None = None
    """False: the server does not keep this call's answer for a later `previous_response_id` (default: it does)."""

    def input_items(self) -> list[ResponseItem]:
        if isinstance(self.input, str):
            return [ResponseItem(type="message", role="user", content=self.input)]
        return list(self.input)


class InputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails | None = None
    output_tokens_details: OutputTokensDetails | None = None


class Response(BaseModel):
    """A Responses API response object; `output` holds this call's items (an episode's, in a rollout record)."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    model: str = ""
    status: str = "completed"
    incomplete_details: dict[str, Any] | None = None
    output: list[ResponseItem] = []
    usage: ResponseUsage | None = None
    # The request echo OpenAI's Response always carries (the adapter fills it; unset in episode records).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
