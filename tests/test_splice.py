"""The prefix splice, tested directly on the tiny model's real tokenizer and template: a named case per situation."""

from __future__ import annotations

import json
import random

import pytest

from nemo_gym_tok.splice import (
    Header,
    HFChatRenderer,
    InvalidTokenIdsError,
    StalePrefixError,
    StructureMismatchError,
    check_in_vocabulary,
    check_starts_with,
    check_token_ids,
    detect_profile,
    find_prefix_source,
    splice_prompt,
)
from nemo_gym_tok.testing.chat_templates.oracle_episodes import TOOL, EpisodeSettings, check_splice, play_episode
from nemo_gym_tok.testing.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer) -> HFChatRenderer:
    return HFChatRenderer(tokenizer, extra_end_token_ids=[ENDOFTEXT_ID])


@pytest.fixture(scope="module")
def profile(renderer):
    return detect_profile(renderer)


def prompt_ids(renderer: HFChatRenderer, messages: list[dict]) -> list[int]:
    return renderer.encode(renderer.render(messages, add_generation_prompt=True))


def drifting(renderer: HFChatRenderer, text: str) -> list[int]:
    """Ids for `text` one character at a time: what the template's re-tokenization will not reproduce."""
    return [token for character in text for token in renderer.encode(character)]


def bundled(prompt: list[int], generation: list[int], **message) -> dict:
    return {
        "role": "assistant",
        **message,
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }


@pytest.fixture
def two_turns(renderer):
    """system, user, assistant (drifting ids, ended on <|im_end|>), user."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    prompt = prompt_ids(renderer, messages)
    generation = drifting(renderer, "In France.") + [IM_END_ID]
    messages += [bundled(prompt, generation, content="In France."), {"role": "user", "content": "And Rome?"}]
    return messages


def run(renderer, profile, messages, prefix=None, **options):
    source = find_prefix_source(messages, prefix)
    text = renderer.render(messages, add_generation_prompt=True)
    return source, splice_prompt(renderer, profile, messages, source, template_text=text, **options).result()


def test_profile_of_the_tiny_template(profile) -> None:
    assert profile.closers == {"<|im_end|>"}
    assert (
        profile.assistant_header
        == Header("assistant\n", anchors=frozenset({"<|im_start|>"}))
        == profile.header_after_tool
    )
    assert profile.replaced_end_tokens == frozenset()


def test_drifted_history_is_replaced_by_the_model_ids(renderer, profile, two_turns) -> None:
    source, result = run(renderer, profile, two_turns)
    assert result.prompt_token_ids[: len(source.prefix)] == source.prefix
    check_splice(renderer, profile, two_turns, source, result.prompt_token_ids, result.kept_prefix_length)
    telemetry = result.telemetry()
    assert telemetry["applied"] and telemetry["template_differed"] and telemetry["replaced_tokens"] > 0
    assert telemetry["repaired_turns"] == [{"message_index": 2, "replaced_tokens": telemetry["replaced_tokens"]}]


def test_explicit_prefix_gives_the_same_prompt_as_the_bundle(renderer, profile, two_turns) -> None:
    source, from_bundle = run(renderer, profile, two_turns)
    plain = [{k: v for k, v in m.items() if not k.endswith(("_ids", "_probs"))} for m in two_turns]
    _, explicit = run(renderer, profile, plain, prefix=source.prefix)
    assert explicit.prompt_token_ids == from_bundle.prompt_token_ids


def test_turn_cut_by_max_tokens_gets_the_template_closing(renderer, profile, two_turns) -> None:
    two_turns[2]["generation_token_ids"] = two_turns[2]["generation_token_ids"][:-1]
    source, result = run(renderer, profile, two_turns)
    assert result.kept_prefix_length == len(source.prefix)
    assert result.prompt_token_ids[len(source.prefix)] == IM_END_ID


def test_another_stop_token_is_kept(renderer, profile, two_turns) -> None:
    two_turns[2]["generation_token_ids"][-1] = ENDOFTEXT_ID
    source, result = run(renderer, profile, two_turns)
    assert result.prompt_token_ids[: len(source.prefix) + 1] == source.prefix + [IM_END_ID]


def test_terminator_spelled_as_text_in_model_output_is_spliced(renderer, profile) -> None:
    # Code written through a tool call: its text spells <|im_end|>, which the template would re-tokenize to the id.
    messages = [{"role": "user", "content": "Write the stop marker."}]
    prompt = prompt_ids(renderer, messages)
    text = 'print("<|im_end|>")'
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"word": text})}}
    generation = drifting(renderer, text) + [IM_END_ID]
    messages += [
        bundled(prompt, generation, content=text, tool_calls=[call]),
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    source, result = run(renderer, profile, messages)
    assert IM_END_ID not in generation[:-1]
    assert result.prompt_token_ids[: len(source.prefix)] == source.prefix


def test_template_that_drops_earlier_reasoning(renderer, profile) -> None:
    messages = [{"role": "user", "content": "Think first."}]
    prompt = prompt_ids(renderer, messages)
    generation = drifting(renderer, "<think>\nhm\n</think>\n\nYes.") + [IM_END_ID]
    messages += [
        bundled(prompt, generation, content="Yes.", reasoning_content="hm"),
        {"role": "user", "content": "Sure?"},
    ]
    source, result = run(renderer, profile, messages)
    assert "hm" not in renderer.render(messages, add_generation_prompt=True)  # the template dropped it...
    assert result.prompt_token_ids[: len(source.prefix)] == source.prefix  # ...the model's ids keep it


def test_edited_system_prompt_is_refused_naming_messages_0(renderer, profile, two_turns) -> None:
    two_turns[0]["content"] = "Be verbose."
    with pytest.raises(StructureMismatchError, match=r"renders for messages\[0\] \(template: ' verbose\.") as caught:
        run(renderer, profile, two_turns)
    assert caught.value.message_index == 0


def test_edited_user_turn_is_refused_naming_it(renderer, profile, two_turns) -> None:
    two_turns[1]["content"] = "Where is Lyon?"
    with pytest.raises(StructureMismatchError, match=r"messages\[1\]"):
        run(renderer, profile, two_turns)


def test_tools_added_mid_episode_are_refused(tokenizer, profile, two_turns) -> None:
    with_tools = HFChatRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=[ENDOFTEXT_ID])
    with pytest.raises(StructureMismatchError, match=r"messages\[0\]"):
        run(with_tools, profile, two_turns)


def test_prefix_from_another_conversation_is_refused(renderer, profile, two_turns) -> None:
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Oslo?"}]
    foreign = prompt_ids(renderer, other) + drifting(renderer, "In Norway.") + [IM_END_ID]
    with pytest.raises(StructureMismatchError, match=r"messages\[1\]"):
        run(renderer, profile, two_turns, prefix=foreign)


def test_empty_prefix_with_an_assistant_turn_is_refused(renderer, profile, two_turns) -> None:
    with pytest.raises(StalePrefixError, match="is empty, but messages\\[2\\] is an assistant turn"):
        run(renderer, profile, two_turns, prefix=[])
    two_turns[2].update(prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[])
    with pytest.raises(StalePrefixError, match="is empty"):
        run(renderer, profile, two_turns)


def test_prompt_only_prefix_is_refused(renderer, profile, two_turns) -> None:
    with pytest.raises(StalePrefixError, match="the last assistant span is empty"):
        run(renderer, profile, two_turns, prefix=two_turns[2]["prompt_token_ids"])


def test_prefix_of_a_later_turn_is_stale(renderer, profile, two_turns) -> None:
    _, result = run(renderer, profile, two_turns)
    later = result.prompt_token_ids + drifting(renderer, "In Italy.") + [IM_END_ID]
    with pytest.raises(StalePrefixError, match="stale prefix: .* holds the turn end '<\\|im_end\\|>'"):
        run(renderer, profile, two_turns, prefix=later)


def test_bundle_whose_prompt_length_does_not_fit_is_refused(renderer, profile, two_turns) -> None:
    bundle = two_turns[2]
    bundle["generation_token_ids"] = bundle["prompt_token_ids"][-2:] + bundle["generation_token_ids"]
    bundle["prompt_token_ids"] = bundle["prompt_token_ids"][:-2]
    bundle["generation_log_probs"] = [0.0] * len(bundle["generation_token_ids"])
    with pytest.raises(StructureMismatchError, match="prompt_token_ids holds"):
        run(renderer, profile, two_turns)


def test_truncation_that_would_cut_the_prefix_is_refused(renderer, profile, two_turns) -> None:
    source, result = run(renderer, profile, two_turns)
    run(renderer, profile, two_turns, truncate_prompt_tokens=len(result.prompt_token_ids))  # keeps every id: fine
    with pytest.raises(StalePrefixError, match="truncate_prompt_tokens=10 would cut the first"):
        run(renderer, profile, two_turns, truncate_prompt_tokens=10)


def test_continue_final_message_continues_a_cut_turn_and_refuses_an_ended_one(renderer, profile, two_turns) -> None:
    messages = two_turns[:3]
    messages[2]["generation_token_ids"] = messages[2]["generation_token_ids"][:-1]
    source = find_prefix_source(messages)
    result = splice_prompt(
        renderer, profile, messages, source, add_generation_prompt=False, continue_final_message=True
    ).result()
    assert result.prompt_token_ids == source.prefix
    messages[2]["generation_token_ids"].append(IM_END_ID)
    with pytest.raises(StalePrefixError, match="that turn is over"):
        splice_prompt(
            renderer,
            profile,
            messages,
            find_prefix_source(messages),
            add_generation_prompt=False,
            continue_final_message=True,
        ).result()


@pytest.mark.parametrize("seed", range(40))
def test_random_episodes_are_exact(renderer, profile, tokenizer, seed: int) -> None:
    """Drift-prone episodes with tools, reasoning and spelled-out special tokens: every splice passes the oracle."""
    settings = EpisodeSettings(turns=5, tools=seed % 2 == 0, reasoning=seed % 3 == 0)
    with_tools = (
        HFChatRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=[ENDOFTEXT_ID]) if settings.tools else renderer
    )
    episode = play_episode(with_tools, profile, random.Random(seed), settings)
    assert len(episode.telemetry) == 5


BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_prefix_source_is_the_last_bundled_message() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "b",
            "prompt_token_ids": [9],
            "generation_token_ids": [8],
            "generation_log_probs": [0.0],
        },
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", **BUNDLE},
        {"role": "user", "content": "e"},
    ]
    source = find_prefix_source(messages)
    assert source is not None and (source.prefix, source.message_index, source.explicit) == ([1, 2, 3], 3, False)
    assert source.prompt_length == 2


def test_explicit_prefix_wins_and_belongs_to_the_last_assistant_message() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", **BUNDLE},
        {"role": "tool", "content": "r"},
    ]
    source = find_prefix_source(messages, [4, 5])
    assert source is not None and (source.prefix, source.message_index, source.explicit) == ([4, 5], 1, True)
    assert find_prefix_source([{"role": "user", "content": "a"}]) is None
    first_turn = find_prefix_source([{"role": "user", "content": "a"}], [7])
    assert first_turn is not None and first_turn.message_index == -1


def test_first_turn_prefix_is_only_checked() -> None:
    check_starts_with([1, 2, 3], [1, 2])
    with pytest.raises(StalePrefixError, match="position 1 is 3, the prefix says 2"):
        check_starts_with([1, 3], [1, 2])
    with pytest.raises(StalePrefixError, match="position 2 is end of prompt"):
        check_starts_with([1, 2], [1, 2, 3])


@pytest.mark.parametrize(
    "messages, prefix, message",
    [
        (
            [{"role": "assistant", "prompt_token_ids": [1]}],
            None,
            r"messages\[0\]: token bundle is all or none; generation_token_ids, generation_log_probs missing",
        ),
        ([{"role": "user", **BUNDLE}], None, "belongs on an assistant message"),
        (
            [{"role": "assistant", **{**BUNDLE, "prompt_token_ids": [1, "2"]}}],
            None,
            r"messages\[0\].prompt_token_ids\[1\] must be an int",
        ),
        ([{"role": "assistant"}], "1,2", "required_prefix_token_ids must be a list"),
    ],
)
def test_prefix_source_errors(messages, prefix, message) -> None:
    with pytest.raises(InvalidTokenIdsError, match=message):
        find_prefix_source(messages, prefix)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([1, True], r"f\[1\] must be an int token id, got True"),
        ([1.0], r"f\[0\] must be an int token id, got 1.0"),
        (["3"], r"f\[0\] must be an int token id, got '3'"),
        ([-1], r"f\[0\] must be non-negative"),
        ([5, 100], r"f\[1\] = 100 is out of vocabulary \(size 100\)"),
        ({"a": 1}, "f must be a list of token ids, got dict"),
    ],
)
def test_check_token_ids(ids, message) -> None:
    with pytest.raises(InvalidTokenIdsError, match=message):
        check_token_ids(ids, "f", vocab_size=100)
    assert check_token_ids([0, 99], "f", vocab_size=100) == [0, 99]


def test_types_checked_ids_are_still_held_to_the_vocabulary() -> None:
    # The adapter's request model validated the lists already: only the vocabulary bound is left, and it still holds.
    bundled = [
        {"role": "assistant", "prompt_token_ids": [1, 2], "generation_token_ids": [150], "generation_log_probs": [0.0]}
    ]
    with pytest.raises(InvalidTokenIdsError, match=r"messages\[0\].generation_token_ids\[0\] = 150 is out of vocab"):
        find_prefix_source(bundled, None, 100, types_checked=True)
    with pytest.raises(InvalidTokenIdsError, match=r"required_prefix_token_ids\[1\] = 100 is out of vocabulary"):
        find_prefix_source(bundled, [1, 100], 100, types_checked=True)
    source = find_prefix_source(bundled, None, 151, types_checked=True)
    assert source is not None and source.prefix == [1, 2, 150] and source.prompt_length == 2


def test_a_prefix_found_before_the_vocabulary_is_checked_against_it_where_it_was_sent() -> None:
    # The adapter finds the prefix once, at validation, before its local template (and vocabulary) is loaded.
    bundled = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "prompt_token_ids": [1, 120],
            "generation_token_ids": [150],
            "generation_log_probs": [0.0],
        },
    ]
    source = find_prefix_source(bundled, None, None, types_checked=True)
    assert source is not None
    with pytest.raises(InvalidTokenIdsError, match=r"messages\[1\].prompt_token_ids\[1\] = 120 is out of vocab"):
        check_in_vocabulary(source, 100)
    with pytest.raises(InvalidTokenIdsError, match=r"messages\[1\].generation_token_ids\[0\] = 150 is out of vocab"):
        check_in_vocabulary(source, 140)
    explicit = find_prefix_source(bundled, [3, 200], None, types_checked=True)
    assert explicit is not None
    with pytest.raises(InvalidTokenIdsError, match=r"required_prefix_token_ids\[1\] = 200 is out of vocabulary"):
        check_in_vocabulary(explicit, 151)
    check_in_vocabulary(source, 151)
    check_in_vocabulary(source, None)


TEXT_CLOSED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}### User: {{ m.content }}\n{% else %}### Assistant: "
    "{{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Assistant: {% endif %}"
)


def test_turns_closed_by_text_keep_the_model_end_token(tokenizer) -> None:
    renderer = HFChatRenderer(tokenizer, chat_template=TEXT_CLOSED_TEMPLATE, extra_end_token_ids=[ENDOFTEXT_ID])
    profile = detect_profile(renderer)
    assert profile.closed_by_text and not profile.closers
    messages = [{"role": "user", "content": "Where is Paris?"}]
    prompt = prompt_ids(renderer, messages)
    generation = drifting(renderer, "In France.") + [IM_END_ID]
    messages += [bundled(prompt, generation, content="In France."), {"role": "user", "content": "And Rome?"}]
    source, result = run(renderer, profile, messages)
    assert result.prompt_token_ids[: len(source.prefix)] == source.prefix  # the model's end token is kept
    assert renderer.decode(result.prompt_token_ids[len(source.prefix) :]) == "\n### User: And Rome?\n### Assistant: "
    messages[0]["content"] = "Where is Lyon?"
    with pytest.raises(StructureMismatchError, match=r"messages\[0\]"):
        run(renderer, profile, messages)


# The role header follows the user's text (no special token before it), and the generation prompt opens a reasoning
# block that the history renders only for turns with reasoning: ERNIE 4.5's shape.
REASONING_AFTER_TEXT_HEADER_TEMPLATE = (
    "<|endoftext|>{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}{% elif m.role == 'system' %}"
    "{{ m.content + '\\n' }}{% else %}{{ '\\nAssistant: ' }}{% if m.reasoning_content %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}{{ m.content }}<|im_end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\\nAssistant: <think>' }}{% endif %}"
)


@pytest.mark.parametrize("seed", range(6))
def test_header_after_message_text_is_the_role_header_not_the_reasoning_block(tokenizer, seed: int) -> None:
    renderer = HFChatRenderer(
        tokenizer, chat_template=REASONING_AFTER_TEXT_HEADER_TEMPLATE, extra_end_token_ids=[ENDOFTEXT_ID]
    )
    profile = detect_profile(renderer)
    assert profile.assistant_header == Header(
        "\nAssistant: ", follows_special=False, anchors=profile.assistant_header.anchors
    )
    settings = EpisodeSettings(turns=4, reasoning=seed % 2 == 0, system=seed % 3 != 0)
    episode = play_episode(renderer, profile, random.Random(seed), settings)  # every splice judged by the oracle
    assert len(episode.telemetry) == 4
