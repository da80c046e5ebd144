"""bench/benchkit/chained.py: P1b's history, sent as Responses items, is the chat history its token-in baseline gets."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from benchkit.chained import responses_fields, responses_input  # noqa: E402
from benchkit.episode import LOOKUP_TOOL  # noqa: E402

from nemo_gym_tok.contract.conversion import items_to_chat_messages  # noqa: E402
from nemo_gym_tok.types.responses import ResponseItem  # noqa: E402

HISTORY = [
    {"role": "user", "content": "Question 0"},
    {"role": "assistant", "content": " plan River", "reasoning_content": "think first"},
    {"role": "user", "content": "Question 1"},
    {
        "role": "assistant",
        "content": " look",
        "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "x"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "3 notes found"},
    {"role": "user", "content": "Question 2"},
    {
        "role": "assistant",
        "content": " done",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [0.0, -0.5],
    },
    {"role": "user", "content": "Question 3 (round 0)"},
]


def test_the_history_as_responses_items_converts_back_to_the_same_chat_messages() -> None:
    items = [ResponseItem.model_validate(item) for item in responses_input(HISTORY)]
    assert items_to_chat_messages(items) == HISTORY
    bundled = [item for item in responses_input(HISTORY) if "prompt_token_ids" in item]
    assert len(bundled) == 1 and bundled[0]["type"] == "message"


def test_the_tools_take_the_responses_form() -> None:
    fields = responses_fields({"tools": [LOOKUP_TOOL], "tool_choice": "none"})
    assert fields["tool_choice"] == "none"
    assert fields["tools"] == [{"type": "function", **LOOKUP_TOOL["function"]}]
    assert responses_fields({}) == {}
