"""The vLLM model adapter: `/v1/chat/completions` and `/v1/responses` in front of vLLM, token ids exact."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from nemo_gym_tok.conversion import chat_message_to_items, responses_to_chat_request
from nemo_gym_tok.servers.base import BaseServerConfig, ModelServer
from nemo_gym_tok.servers.bodies import json_object
from nemo_gym_tok.http_errors import error_message
from nemo_gym_tok.servers.errors import ApiError, validation_message
from nemo_gym_tok.types import ChatCompletionRequest, Response, ResponsesRequest, ResponseUsage
from responses_api_models.vllm_model.sessions import SESSION_COOKIE, SessionRouter, session_of
from responses_api_models.vllm_model.token_capture import attach_bundles, capture_request_fields, drop_unrequested
from responses_api_models.vllm_model.upstream import VLLMUpstream, is_context_overflow

Model = TypeVar("Model", bound=BaseModel)


class VLLMModelConfig(BaseServerConfig):
    base_url: str | list[str]
    """vLLM server URL(s), with or without `/v1`; each conversation sticks to one."""
    model: str
    """The model name vLLM serves (its --served-model-name)."""
    api_key: str = "EMPTY"
    return_token_id_information: bool = False
    """Put prompt_token_ids, generation_token_ids and generation_log_probs on every returned message."""
    use_return_token_ids: bool = True
    """Ask vLLM for `return_token_ids`; false uses the `/tokenize` fallback for prompt ids."""
    exclude_tools_when_tool_choice_none: bool = False
    """Mirror of the vLLM server's flag of that name: the /tokenize fallback then leaves tools out likewise."""
    harmony: bool = False
    """The served model is GPT-OSS: vLLM renders its chat prompts with Harmony, while /tokenize renders the Hugging Face
    template, so /tokenize is no source of its prompt ids (use_return_token_ids must stay true)."""
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields set on every request sent to vLLM, over what the caller sent (e.g. temperature: 1.0)."""
    request_timeout_seconds: float = 600.0
    max_attempts: int = 3
    """Attempts per vLLM call when vLLM is unreachable or answers 5xx."""
    retry_backoff_seconds: float = 0.5

    @field_validator("base_url")
    @classmethod
    def _at_least_one_url(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one vLLM base URL")
        return value

    @model_validator(mode="after")
    def _tokenize_cannot_render_harmony(self) -> VLLMModelConfig:
        if self.harmony and not self.use_return_token_ids:
            raise ValueError(
                "harmony: true with use_return_token_ids: false would take GPT-OSS prompt ids from /tokenize, which "
                "renders the Hugging Face template, not Harmony; set use_return_token_ids: true"
            )
        return self

    @property
    def base_urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)


class VLLMModel(ModelServer):
    config_class: ClassVar[type[BaseServerConfig]] = VLLMModelConfig
    config: VLLMModelConfig

    def setup_routes(self, app: FastAPI) -> None:
        self.router = SessionRouter(self.config.base_urls)
        self.upstream = VLLMUpstream(
            api_key=self.config.api_key,
            timeout=self.config.request_timeout_seconds,
            max_attempts=self.config.max_attempts,
            backoff_seconds=self.config.retry_backoff_seconds,
        )

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> JSONResponse:
            chat = _parse(ChatCompletionRequest, await json_object(request))
            session, is_new = session_of(request)
            result = await self.complete(chat, self.router.url_for(session))
            return _with_session_cookie(JSONResponse(result), session, is_new)

        @app.post("/v1/responses")
        async def responses(request: Request) -> JSONResponse:
            responses_request = _parse(ResponsesRequest, await json_object(request))
            if responses_request.stream:
                raise ApiError(400, "stream: true is not supported by this adapter; send stream: false", param="stream")
            try:
                chat_body = responses_to_chat_request(responses_request)
            except ValueError as exc:
                raise ApiError(400, f"input: {exc}", param="input") from None
            chat = _parse(ChatCompletionRequest, chat_body)
            session, is_new = session_of(request)
            result = await self.complete(chat, self.router.url_for(session))
            response = _chat_result_to_response(result, self.config.model)
            return _with_session_cookie(JSONResponse(response.model_dump(exclude_none=True)), session, is_new)

    async def complete(self, chat: ChatCompletionRequest, url: str) -> dict[str, Any]:
        """One chat completion against vLLM at `url`, with bundles resolved, prefix checked and errors mapped."""
        required_prefix = chat.required_prefix()
        capture = self.config.return_token_id_information
        needs_ids = capture or required_prefix is not None
        if chat.stream:
            raise ApiError(400, "stream: true is not supported by this adapter; send stream: false", param="stream")
        if needs_ids and (chat.n or 1) > 1:
            raise ApiError(400, "n > 1 is not supported with token ids (one bundle per call); send n: 1", param="n")

        caller_body = chat.model_dump(exclude_unset=True)
        body = {**caller_body, **self.config.sampling_overrides}
        body["model"] = self.config.model
        if needs_ids:
            body.update(capture_request_fields(body, use_return_token_ids=self.config.use_return_token_ids))

        response = await self.upstream.post(url, "/v1/chat/completions", body)
        if is_context_overflow(response):
            return _context_overflow_result(self.config.model, error_message(response))
        if response.status_code >= 400:
            raise ApiError(response.status_code, error_message(response), error_type="upstream_invalid_request")
        result = response.json()
        if needs_ids:
            await attach_bundles(
                result, generation_body=body, required_prefix=required_prefix, return_bundle=capture,
                tokenize=lambda tokenize_body: self._tokenize(url, tokenize_body), upstream_url=url,
                exclude_tools_when_tool_choice_none=self.config.exclude_tools_when_tool_choice_none,
            )
            drop_unrequested(result, caller_body, bundle_returned=capture)
        return result

    async def aclose(self) -> None:
        await self.upstream.aclose()
        await super().aclose()

    async def _tokenize(self, url: str, body: dict[str, Any]) -> list[int]:
        response = await self.upstream.post(url, "/tokenize", body)
        if response.status_code >= 400:
            raise ApiError(502, f"vLLM /tokenize fallback failed with HTTP {response.status_code}: {error_message(response)}")
        return list(response.json()["tokens"])


def _parse(model: type[Model], body: dict[str, Any]) -> Model:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise ApiError(400, message, param=param) from None


def _with_session_cookie(response: JSONResponse, session: str, is_new: bool) -> JSONResponse:
    if is_new:
        response.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="lax")
    return response


def _context_overflow_result(model: str, reason: str) -> dict[str, Any]:
    # A history that no longer fits ends the episode like max_tokens would; it is not the caller's error.
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": "", "context_overflow": reason},
        }],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def _chat_result_to_response(result: dict[str, Any], model: str) -> Response:
    choice = result["choices"][0]
    usage = result.get("usage") or {}
    incomplete = choice.get("finish_reason") == "length"
    return Response(
        id=f"resp_{result.get('id', uuid.uuid4().hex)}",
        model=result.get("model", model),
        status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        output=chat_message_to_items(choice["message"]),
        usage=ResponseUsage(
            input_tokens=usage.get("prompt_tokens", 0),
            output_tokens=usage.get("completion_tokens", 0),
            total_tokens=usage.get("total_tokens", 0),
        ),
    )


SERVER = VLLMModel
