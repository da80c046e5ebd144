"""vLLM's chat answer as the adapter's Responses answer, and the answer that stands in for a history too long."""

from __future__ import annotations

import time
import uuid
from typing import Any

from nemo_gym_tok.contract.conversion import chat_message_to_items
from nemo_gym_tok.types import Response
from nemo_gym_tok.types.tokens import plain_token_ids
from responses_api_models.vllm_model.response_fields import response_usage


def context_overflow_result(model: str, reason: str) -> dict[str, Any]:
    """The chat answer for a history vLLM refused as too long: `finish_reason` length, `context_overflow` saying why.
    It ends the episode as max_tokens would; it is not the caller's error."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "", "context_overflow": reason},
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def response_body(result: dict[str, Any], model: str, echo: dict[str, Any]) -> dict[str, Any]:
    """`result` as the Responses answer's JSON body. Plain prompt ids (checked at C speed) skip the Response model,
    which would check them one by one and copy them twice, at a long history more than the rest of the answer costs:
    an empty list stands in for them while the item is validated (every other bundle rule still applies), and they
    are put back on the dump. Anything else goes through the model, which names what is wrong."""
    choice = result["choices"][0]
    message = choice.get("message")
    prompt_ids = message.get("prompt_token_ids") if isinstance(message, dict) else None
    if not plain_token_ids(prompt_ids):
        return chat_result_to_response(result, model, echo).model_dump(exclude_none=True)
    stand_in = {**result, "choices": [{**choice, "message": {**message, "prompt_token_ids": []}}]}
    body = chat_result_to_response(stand_in, model, echo).model_dump(exclude_none=True)
    body["output"][-1]["prompt_token_ids"] = prompt_ids
    return body


def chat_result_to_response(result: dict[str, Any], model: str, echo: dict[str, Any]) -> Response:
    """vLLM's chat answer `result` as a Response: its first choice's message as output items, with `echo` (the request
    echo of response_fields.request_echo)."""
    choice = result["choices"][0]
    incomplete = choice.get("finish_reason") == "length"
    return Response(
        id=f"resp_{result.get('id', uuid.uuid4().hex)}",
        model=result.get("model", model),
        status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        output=chat_message_to_items(choice["message"]),
        usage=response_usage(result.get("usage") or {}),
        **echo,
    )
