"""The row as the simple agent reads it, the row field a refusal blames, and the rollout record it returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_gym_tok.records.rollout_record import RECORD_SCHEMA_VERSION, SCHEMA_VERSION_KEY
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import PREFIX_KEY

ROW_PARAMS_KEY = "responses_create_params"

RowParam = Callable[[str | None], str | None]
"""Maps the field a server's 4xx names (error.param) to the row field it came from; None: not the row's fault."""


def episode_request(row: dict[str, Any], overrides: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The episode's first input items and every other Responses field of its model calls (`overrides` on top)."""
    params = row.get(ROW_PARAMS_KEY)
    if not isinstance(params, dict) or "input" not in params:
        raise ApiError(
            400,
            f"the row needs {ROW_PARAMS_KEY} with an `input` (the episode's first messages)",
            param=ROW_PARAMS_KEY,
        )
    first_input = _as_items(params["input"])
    return first_input, {k: v for k, v in params.items() if k != "input"} | overrides


def offered_tool_names(tools: Any) -> set[str]:
    """Names of the function tools the row offers, or a 400 naming the malformed tool field."""
    where = f"{ROW_PARAMS_KEY}.tools"
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise ApiError(400, f"{where} must be a list of tool objects, got {type(tools).__name__}", param=where)
    names: set[str] = set()
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(
                400, f"{where}[{index}] must be a tool object, got {type(tool).__name__}", param=f"{where}[{index}]"
            )
        if "function" in tool and "name" not in tool:  # chat-style {"type": "function", "function": {"name": ...}}
            function = tool["function"]
            if not isinstance(function, dict):
                raise ApiError(400, f"{where}[{index}].function must be an object", param=f"{where}[{index}].function")
            name, field = function.get("name"), f"{where}[{index}].function.name"
        else:
            name, field = tool.get("name"), f"{where}[{index}].name"
        if (tool.get("type", "function") == "function" or name is not None) and not isinstance(name, str):
            raise ApiError(400, f"{field}: a function tool needs a name, as a string", param=field)
        if isinstance(name, str):
            names.add(name)
    return names


def same_field(param: str | None) -> str | None:
    """seed_session's body is the row itself: the environment's field is the row's ("": it named none)."""
    return param or ""


def model_row_field(param: str | None) -> str:
    """The row field behind a field of the first model call's body (the row's responses_create_params)."""
    if param is None:
        return ROW_PARAMS_KEY
    if param.split(".")[0].split("[")[0] == PREFIX_KEY:  # `required_prefix_token_ids[9]` too
        return param  # a top-level row field, copied onto the first call
    if param.startswith("messages"):
        return f"{ROW_PARAMS_KEY}.input"  # vLLM names its chat messages; the row's are its input items
    param = "max_output_tokens" if param == "max_tokens" else param
    return f"{ROW_PARAMS_KEY}.{param}"


def verify_row_field(param: str | None) -> str | None:
    """verify's body is the row plus the episode the agent built: a refused `response` is the agent's fault."""
    if param is not None and param.split(".")[0].split("[")[0] == "response":
        return None
    return same_field(param)


def rollout_record(row: dict[str, Any], response: dict[str, Any], verdict: dict[str, Any]) -> dict[str, Any]:
    """The record (schema_version 2): the row's fields, the episode as `response`, the verifier's fields."""
    record = {SCHEMA_VERSION_KEY: RECORD_SCHEMA_VERSION, **row, "response": response, **verdict}
    record[SCHEMA_VERSION_KEY] = RECORD_SCHEMA_VERSION  # ours, even over a row or verifier field of that name
    return record


def _as_items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return list(value)
    raise ApiError(400, f"{ROW_PARAMS_KEY}.input must be a string or a list of items", param=f"{ROW_PARAMS_KEY}.input")
