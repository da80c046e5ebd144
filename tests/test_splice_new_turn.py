"""The splice at the cost of the new turn (splice._new_turn): the same ids as the full check where it applies, the
full check wherever the template reads more of the history than the short conversation holds (planted dependences),
and only the history this server spliced before."""

from __future__ import annotations

import random
from typing import Any

import pytest

from nemo_gym_tok.splice import (
    HFChatRenderer,
    SpliceError,
    StructureMismatchError,
    detect_profile,
    find_prefix_source,
    splice_prompt,
)
from nemo_gym_tok.splice_host import SpliceHost
from nemo_gym_tok.testing.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

WORDS = "north south river stone quiet bright seven orange window ladder".split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]

# ChatML that numbers every message: the text after a turn depends on how many messages came before it.
NUMBERED = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + ' #' + loop.index|string + '\\n' -}}"
    "{{- (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# ChatML whose generation prompt counts the user turns so far: only the end of the prompt depends on the history.
COUNTED = (
    "{%- set ns = namespace(users=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{%- set ns.users = ns.users + 1 -%}{%- endif -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\nTurn ' + ns.users|string + '.\\n' -}}{%- endif -%}"
)
# ChatML whose generation prompt quotes the first user message: the stand-in of a short conversation would show.
QUOTING = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\nAbout: ' -}}"
    "{{- (messages | selectattr('role', 'equalto', 'user') | first).content + '\\n' -}}"
    "{%- endif -%}"
)


def scoped(chat_template: str | None = None, tools: Any = None) -> Any:
    inner = HFChatRenderer(
        build_tokenizer(), tools=tools, chat_template=chat_template, extra_end_token_ids=[ENDOFTEXT_ID]
    )
    return SpliceHost().scoped(inner, "test"), detect_profile(inner)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def episode(renderer: Any, profile: Any, turns: int, *, tools: bool, seed: int = 0, new_turn: bool = True):
    """Play `turns` model turns (tool calls where `tools`), each prompt spliced; yields each splice with its
    messages, after checking it against the full check of the same request on a renderer without a memo."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    for turn in range(turns):
        content = words(rng, rng.randint(3, 12))
        generation = renderer.encode(content) + ([IM_END_ID] if rng.random() < 0.7 else [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = tools and rng.random() < 0.6
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{turn}", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
            ]
        bundle = {"prompt_token_ids": prompt, "generation_token_ids": generation}
        messages.append({**message, **bundle, "generation_log_probs": [0.0] * len(generation)})
        if calls:
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": words(rng, 4)})
        else:
            messages.append({"role": "user", "content": words(rng, 5)})
        source = find_prefix_source(messages)
        spliced = splice_prompt(renderer, profile, messages, source, new_turn=new_turn)
        yield spliced, list(messages)
        prompt = spliced.prompt_token_ids
        for earlier in messages[:-2]:  # as the gym's agent sends them: only the last assistant turn keeps its bundle
            for field in BUNDLE_FIELDS:
                earlier.pop(field, None)


def full_check(renderer: Any, profile: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The same request spliced by the full check, with the template's rendering of the whole conversation."""
    inner = renderer.inner
    text = inner.render(messages, add_generation_prompt=True)
    return splice_prompt(inner, profile, messages, find_prefix_source(messages), template_text=text).prompt_token_ids


@pytest.mark.parametrize("tools", [False, True])
def test_next_turns_are_spliced_at_the_cost_of_the_new_turn_with_the_full_checks_ids(tools) -> None:
    renderer, profile = scoped(tools=TOOLS if tools else None)
    new_turns = 0
    for spliced, messages in episode(renderer, profile, 8, tools=tools):
        assert spliced.prompt_token_ids == full_check(renderer, profile, messages)
        new_turns += spliced.new_turn
    assert new_turns == 7  # every turn after the first, whose prompt the server did not splice


@pytest.mark.parametrize(("template", "history_reads"), [(NUMBERED, "message numbers"), (COUNTED, "user turns")])
def test_a_template_that_reads_the_history_takes_the_full_check(template, history_reads) -> None:
    """Planted dependences: the short conversation would give another tail, so every turn takes the full check
    and its ids are the template's own (the test fails if the fallback is removed: see the next test)."""
    renderer, profile = scoped(template)
    for spliced, messages in episode(renderer, profile, 5, tools=False):
        assert not spliced.new_turn, history_reads
        text = renderer.inner.render(messages, add_generation_prompt=True)
        assert renderer.decode(spliced.prompt_token_ids).endswith(text[text.rindex("<|im_end|>") :])


@pytest.mark.parametrize("template", [NUMBERED, COUNTED, QUOTING])
def test_the_short_conversation_of_a_planted_dependence_renders_another_tail(template) -> None:
    """Why those templates must take the full check: the short conversation (system, the message the turn answers,
    the turn, the new message) renders another text after the turn than the whole conversation does, so a splice
    that skipped the probes would be wrong."""
    renderer, profile = scoped(template)
    *_, (spliced, messages) = episode(renderer, profile, 4, tools=False)
    short = [messages[0], *messages[-3:]]  # what splice._locality keeps of a turn that answers a user message

    def after_last_turn(conversation: list[dict[str, Any]]) -> str:
        text = renderer.inner.render(conversation, add_generation_prompt=True)
        return text[text.rindex(messages[-2]["content"]) :]

    assert after_last_turn(short) != after_last_turn(messages)
    assert not spliced.new_turn


def test_a_template_quoting_an_earlier_message_after_the_turn_takes_the_full_check() -> None:
    renderer, profile = scoped(QUOTING)
    for spliced, messages in episode(renderer, profile, 4, tools=False):
        assert not spliced.new_turn
        assert spliced.prompt_token_ids == full_check(renderer, profile, messages)


def test_an_edited_earlier_message_finds_no_proven_prompt_and_is_refused() -> None:
    renderer, profile = scoped()
    played = list(episode(renderer, profile, 3, tools=False))
    _, messages = played[-1]
    edited = [dict(message) for message in messages]
    edited[1]["content"] = "Hello."  # the first user message, inside the proven prompt
    with pytest.raises(StructureMismatchError):
        splice_prompt(renderer, profile, edited, find_prefix_source(edited))


def test_a_prefix_that_is_not_the_proven_prompt_takes_the_full_check() -> None:
    renderer, profile = scoped()
    played = list(episode(renderer, profile, 3, tools=False))
    _, messages = played[-1]
    tampered = [dict(message) for message in messages]
    tampered[-2]["prompt_token_ids"] = [*tampered[-2]["prompt_token_ids"]]
    tampered[-2]["prompt_token_ids"][3] = renderer.encode(" river")[0]
    with pytest.raises(SpliceError):
        splice_prompt(renderer, profile, tampered, find_prefix_source(tampered))
