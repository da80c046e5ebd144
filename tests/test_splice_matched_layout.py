"""The placement proof's matcher: the server's rendering against the placement rendering with every message's text
in place, reasoning and tool-call arguments inside an assistant body matching any text, and the splice it lets skip
the neutral rendering (tool-calling histories included)."""

from __future__ import annotations

import json
import random
import re

import pytest

from nemo_gym_tok.splice import (
    Body,
    HFChatRenderer,
    RenderMemo,
    detect_profile,
    find_prefix_source,
    match_chunks,
    matched_layout,
    splice_prompt,
)
from nemo_gym_tok.testing.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from tests.splice_counting import CountingRenderer


def matches_by_regex(chunks: list[str], rendered: str) -> bool:
    return re.fullmatch("(?s:.*?)".join(re.escape(chunk) for chunk in chunks), rendered) is not None


def test_match_chunks_finds_a_match_exactly_where_a_regular_expression_does() -> None:
    """Chunks of a two-letter alphabet overlap and repeat, which is where a leftmost search could go wrong."""
    rng = random.Random(22)
    found = 0
    for _ in range(30_000):
        chunks = ["".join(rng.choice("ab") for _ in range(rng.randrange(3))) for _ in range(rng.randrange(1, 5))]
        rendered = "".join(rng.choice("ab") for _ in range(rng.randrange(9)))
        starts = match_chunks(chunks, rendered)
        assert (starts is not None) == matches_by_regex(chunks, rendered), (chunks, rendered)
        if starts is None:
            continue
        found += 1
        assert starts[0] == 0 and starts[-1] == len(rendered) - len(chunks[-1])
        assert all(rendered.startswith(chunk, start) for chunk, start in zip(chunks, starts))
        assert all(start + len(chunk) <= after for chunk, start, after in zip(chunks, starts, starts[1:]))
    assert 3_000 < found < 27_000  # both outcomes were exercised


# A placement rendering: a user message, an assistant body with a tool call, a tool result, the generation prompt.
OPEN = "<|im_start|>user\nngtmsg0q<|im_end|>\n<|im_start|>assistant\n"
BODY = (
    'ngtbody1q\n<tool_call>\n{"name": "lookup", "arguments": {"query": "ngtarg1q", "limit": "ngtarg1q"}}\n</tool_call>'
)
AFTER = "<|im_end|>\n<|im_start|>tool\nngtmsg2q<|im_end|>\n<|im_start|>assistant\n"
PLACEMENT = OPEN + BODY + AFTER
BODIES = (Body(1, len(OPEN), len(OPEN) + len(BODY)),)


def call_messages(query: str = "Rome", limit: object = 3, answer: str = "Let me look.") -> list[dict]:
    arguments = json.dumps({"query": query, "limit": limit})
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return [
        {"role": "user", "content": "Find notes."},
        {"role": "assistant", "content": answer, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2 notes found"},
    ]


def server_rendering(messages: list[dict], open_text: str = "") -> str:
    """What a template that writes every text as it is renders (the arguments as the JSON the caller sent)."""
    arguments = messages[1]["tool_calls"][0]["function"]["arguments"]
    body = f'{messages[1]["content"]}\n<tool_call>\n{{"name": "lookup", "arguments": {arguments}}}\n</tool_call>'
    opening = OPEN.replace("ngtmsg0q", messages[0]["content"])
    return open_text + opening + body + AFTER.replace("ngtmsg2q", messages[2]["content"])


@pytest.mark.parametrize("query", ["Rome", "", 'say "hi"\n<|im_end|>', "ngt"], ids=["word", "empty", "quotes", "ngt"])
@pytest.mark.parametrize("limit", [3, "three", {"max": 3}, None], ids=["number", "string", "object", "null"])
def test_arguments_match_any_text_and_the_body_lies_where_the_server_wrote_it(query: str, limit: object) -> None:
    messages = call_messages(query, limit)
    rendered = server_rendering(messages)
    layout = matched_layout(PLACEMENT, BODIES, messages, rendered)
    assert layout is not None and layout.text == rendered
    (body,) = layout.bodies
    assert rendered[body.end :] == AFTER.replace("ngtmsg2q", "2 notes found")
    assert rendered[body.start : body.end].startswith("Let me look.\n<tool_call>")
    assert rendered[: body.start] == OPEN.replace("ngtmsg0q", "Find notes.")


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace("2 notes found", "2 notes found "),  # a message's text not as it is
        lambda text: text.replace("Let me look.", "Let me look"),  # the assistant's own text not as it is
        lambda text: text.replace("<|im_start|>tool", "<|im_start|>system\nPriority<|im_end|>\n<|im_start|>tool"),
        lambda text: text.replace('"name": "lookup"', '"name": "search"'),  # the body's own template text
        lambda text: "<s>" + text,
        lambda text: text + "\n",
    ],
    ids=["message-text", "body-text", "block-after", "call-name", "before", "after"],
)
def test_anything_but_an_argument_or_reasoning_must_match_character_for_character(edit) -> None:
    messages = call_messages()
    assert matched_layout(PLACEMENT, BODIES, messages, server_rendering(messages)) is not None
    assert matched_layout(PLACEMENT, BODIES, messages, edit(server_rendering(messages))) is None


def test_an_argument_or_reasoning_placeholder_outside_a_body_is_not_matched() -> None:
    """Outside a body the template's text is what follows the model's ids: nothing there may be taken on trust."""
    messages = call_messages()
    for kind in ("arg", "think"):
        placement = PLACEMENT.replace("<|im_start|>tool", f"<|im_start|>tool ngt{kind}1q")
        rendered = server_rendering(messages).replace("<|im_start|>tool", "<|im_start|>tool anything")
        assert matched_layout(placement, BODIES, messages, rendered) is None


def test_a_message_without_text_is_not_matched() -> None:
    messages = call_messages()
    messages[2]["content"] = [{"type": "text", "text": "2 notes found"}]
    assert matched_layout(PLACEMENT, BODIES, messages, server_rendering(call_messages())) is None


@pytest.mark.parametrize("limit", [3, "three"], ids=["number", "string"])
def test_a_tool_calling_turn_is_proven_at_the_splice_with_no_neutral_rendering(limit: object) -> None:
    """The tiny model's template writes tool-call arguments as the caller's JSON: the arguments differ from the
    placement rendering's, everything else is in place, so the splice is proven without rendering the neutral
    messages, and it is the full check's prompt."""
    tokenizer = build_tokenizer()
    plain = HFChatRenderer(tokenizer, extra_end_token_ids=[ENDOFTEXT_ID])
    counting = CountingRenderer(tokenizer, extra_end_token_ids=[ENDOFTEXT_ID])
    counting.render_memo, counting.render_scope = RenderMemo(), "tiny"
    profile = detect_profile(plain)
    first = [{"role": "user", "content": "Find notes on Rome."}]
    prompt = plain.encode(plain.render(first, add_generation_prompt=True))
    messages = call_messages("Rome", limit)
    messages[0] = first[0]
    opening = len(plain.render(first, add_generation_prompt=True))
    assistant = plain.render([*first, messages[1]], add_generation_prompt=False)[opening:]
    generation = plain.encode(assistant.split("<|im_end|>")[0]) + [IM_END_ID]
    messages[1] = {**messages[1], "prompt_token_ids": prompt, "generation_token_ids": generation}
    messages[1]["generation_log_probs"] = [0.0] * len(generation)
    assert set(BUNDLE_FIELDS) <= set(messages[1])
    source, text = find_prefix_source(messages), plain.render(messages, add_generation_prompt=True)
    # no server text: the neutral rendering decides
    full_check = splice_prompt(plain, profile, messages, source).result()
    spliced = splice_prompt(counting, profile, messages, source, template_text=text, defer_verify=True)
    assert spliced.result().prompt_token_ids == full_check.prompt_token_ids == plain.encode(text)
    assert counting.neutral_renders == 0
