"""Chat Completions request and message models that declare the token fields and keep every unknown field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from nemo_gym_tok.types.tokens import TokenBundleMixin, TokenIds


class ChatMessage(TokenBundleMixin):
    """One chat message; an assistant message may carry the bundle of the call that produced it."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Any = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _accept_vllm_reasoning(cls, data: Any) -> Any:
        # vLLM names the field `reasoning`; the contract's name is `reasoning_content`.
        if isinstance(data, dict) and "reasoning" in data and data.get("reasoning_content") is None:
            data = {**data, "reasoning_content": data["reasoning"]}
            del data["reasoning"]
        return data

    @model_validator(mode="after")
    def _bundle_only_on_assistant(self) -> ChatMessage:
        if self.has_bundle and self.role != "assistant":
            raise ValueError(f"a token bundle belongs on an assistant message, not on role {self.role!r}")
        return self


class ChatCompletionRequest(BaseModel):
    """What callers send to the adapter's `/v1/chat/completions`; unknown fields are kept and forwarded."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage]
    required_prefix_token_ids: TokenIds | None = None
    n: int | None = None
    stream: bool | None = None
