"""Small OpenAI-shaped probe conversations and a non-raising renderer, to exercise every shipped chat template."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_gym_tok.common.exact_json import loads_exact

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

Message = dict[str, Any]

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}
REASONING = {
    "role": "assistant",
    "content": "Paris.",
    "reasoning_content": "The user asks for the capital of France. That is Paris.",
}
WEATHER_USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# content "" rather than None: many templates concatenate or `trim` the content and raise on None.
TOOL_CALLING = {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "clear"}'}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Probe:
    """A named conversation (plain OpenAI-shape dicts) and the tool schemas to render it with, if any."""

    name: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None

    def conversation(self, dict_arguments: bool = True) -> list[Message]:
        """A fresh deep copy of the messages; tool-call arguments as dicts (vLLM's way) unless told otherwise."""
        messages = copy.deepcopy(list(self.messages))
        return with_dict_arguments(messages) if dict_arguments else messages

    def render_kwargs(self) -> dict[str, Any]:
        """`tools=` for probes that carry tool schemas (fresh copies, since templates may mutate them)."""
        return {"tools": copy.deepcopy(list(self.tools))} if self.tools else {}


PROBES: tuple[Probe, ...] = (
    Probe("system_user", (SYSTEM, USER)),
    Probe("user_only", (USER,)),
    Probe("multi_turn", (USER, ASSISTANT, FOLLOW_UP)),
    Probe("reasoning", (USER, REASONING)),
    Probe("tool_call", (WEATHER_USER, TOOL_CALLING, TOOL_RESULT), tools=tuple(TOOLS)),
)


def probe(name: str) -> Probe:
    """The probe called `name`; KeyError if unknown."""
    for candidate in PROBES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no probe named {name!r}; have {[p.name for p in PROBES]}")


def with_dict_arguments(messages: list[Message]) -> list[Message]:
    """Parse JSON-string tool-call `arguments` into dicts in place, as vLLM does before templating.

    Most tool-aware templates iterate `arguments.items()` or apply `tojson`; the OpenAI wire format carries a
    string. Malformed JSON becomes `{}` (vLLM's behaviour, so history with a broken call still renders).
    """
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = loads_exact(arguments) if arguments else {}
                except json.JSONDecodeError:
                    function["arguments"] = {}
    return messages


def render_ok(tokenizer: PreTrainedTokenizerFast, conversation: list[Message], **kwargs: Any) -> str | Exception:
    """The template's text for `conversation` (`apply_chat_template(..., tokenize=False)`), or the exception it
    raised: templates refuse conversations in many ways (system role, alternation, id formats), and callers
    surveying hundreds of templates want the reason as data rather than a crash.
    """
    try:
        rendered = tokenizer.apply_chat_template(copy.deepcopy(conversation), tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any template failure is a result here
        return exc
    if not isinstance(rendered, str):
        return TypeError(f"apply_chat_template returned {type(rendered).__name__}, not str")
    return rendered
