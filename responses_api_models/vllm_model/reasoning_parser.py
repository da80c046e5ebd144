"""NeMo Gym's `uses_reasoning_parser: false`: an answer with reasoning apart from its content is refused."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.servers.api_errors import ApiError


def refuse_parsed_reasoning(result: dict[str, Any], url: str) -> None:
    """ApiError (502) when a message of `result` carries reasoning apart from its content: the server runs a
    reasoning parser where the config says it runs none, so its text is not split the way the config expects."""
    for choice in result.get("choices") or []:
        message = choice.get("message") or {}
        if message.get("reasoning_content") or message.get("reasoning"):
            raise ApiError(
                502,
                f"the vLLM server at {url} answered with reasoning apart from the content, so it runs a reasoning "
                "parser, and this adapter's config says it runs none (uses_reasoning_parser: false). Start vLLM "
                "without --reasoning-parser, or set uses_reasoning_parser: true",
                error_type="reasoning_parser_mismatch",
            )
