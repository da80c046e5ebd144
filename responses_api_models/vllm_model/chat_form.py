"""The chat body of a `/v1/responses` call: its items converted, or the kept history's messages and the new items'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.contract.conversion import responses_to_chat_request
from nemo_gym_tok.contract.model_history import TOKEN_FIELDS
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types import ResponseItem, ResponsesRequest
from nemo_gym_tok.types.tokens import bundle_of
from responses_api_models.vllm_model.calls import parse_body
from responses_api_models.vllm_model.response_chain import ChainedCall


@dataclass(frozen=True)
class ChatForm:
    """A Responses call as a chat body, and how many of its leading messages were validated by an earlier call."""

    request: ResponsesRequest
    """The request as validated: on the kept path its `input` is the new items only."""
    body: dict[str, Any]
    checked: int


def chat_form(call: ChainedCall) -> ChatForm:
    """`call` as a chat body. A call that continues a kept response with new items that are not the model's (tool
    results, a user turn) takes the kept chat messages as they are and converts, validates only its new items: the
    kept ones were validated when they were sent, and the bundle the prefix comes from was the adapter's own answer.
    Any other call converts its whole input."""
    own = {key: value for key, value in call.body.items() if key not in ("input", "instructions")}
    if call.kept_chat is None:
        if call.previous is not None:  # the caller's own items first, so that a 400 names them as it sent them
            parse_body(ResponsesRequest, {**own, "input": call.new_items})
        request = parse_body(ResponsesRequest, call.body)
        return ChatForm(request, _converted(request), 0)
    request = parse_body(ResponsesRequest, {**own, "input": call.new_items})
    body = _converted(request)
    body["messages"] = [*call.kept_chat, *body["messages"]]
    return ChatForm(request, body, len(call.kept_chat))


def kept_chat_messages(
    call: ChainedCall, sent: list[dict[str, Any]], output: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """The chat messages of `call`'s history once answered with `output`, made from the messages `sent` to vLLM
    without converting the history again; None where they cannot be (the next call then converts in full).

    `sent` holds the history's bundles as ModelHistory puts them back (a continued call, or a call whose input had
    no token fields) and ends on items that are not the model's: then the earlier latest bundle closes nothing the
    next call depends on (a tool result or user turn follows it), so it is dropped, and the answer's items become one
    assistant message with their bundle, as converting the whole history would give."""
    if not call.sent_as_kept:
        return None
    messages = list(sent)
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("prompt_token_ids") is not None:
            messages[index] = {k: v for k, v in messages[index].items() if k not in TOKEN_FIELDS}
            break
    if output:
        items = [
            ResponseItem.model_validate({k: v for k, v in item.items() if k not in TOKEN_FIELDS}) for item in output
        ]
        answer = responses_to_chat_request(ResponsesRequest(input=items))["messages"]
        if len(answer) != 1:  # one model call's items make one assistant message
            return None
        answer[0].update(bundle_of(output[-1]))
        messages += answer
    return messages


def _converted(request: ResponsesRequest) -> dict[str, Any]:
    try:
        return responses_to_chat_request(request)
    except ValueError as exc:
        param = getattr(exc, "param", "input")  # ConversionError names the item and part
        message = str(exc) if param != "input" else f"input: {exc}"
        raise ApiError(400, message, param=param) from None
