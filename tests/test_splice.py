"""The prefix splice, tested directly: properties over generated conversations and a named case per situation."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nemo_gym_tok.splice import (
    BoundaryNotFoundError,
    InvalidTokenIdsError,
    StalePrefixError,
    check_starts_with,
    check_token_ids,
    find_prefix_source,
    splice_prefix,
)

END = 0  # the template's turn terminator (<|im_end|>)
NL = 1  # text the template puts after a terminator
OTHER_STOP = 2  # another stop token (<|endoftext|>)
content = st.lists(st.integers(min_value=3, max_value=60), max_size=8)


def flat(turns: list[list[int]]) -> list[int]:
    return [token for turn in turns for token in turn]


@st.composite
def conversations(draw):
    """Model ids and template ids for: prior turns, the assistant turn the prefix ends with, then what follows."""
    after = draw(st.sampled_from([[NL], [], [NL, NL]]))
    prior_model = [draw(content) + [END] + after for _ in range(draw(st.integers(0, 4)))]
    # The template re-renders each prior turn either identically or differently (retokenization drift).
    prior_template = [turn if draw(st.booleans()) else draw(content) + [END] + after for turn in prior_model]
    header, generation = draw(content.filter(bool)), draw(content)  # an assistant turn has a header
    ended = draw(st.booleans())
    assistant_template = header + generation if draw(st.booleans()) else draw(content)
    following = [draw(content) + [END] + after for _ in range(draw(st.integers(0, 3)))]
    generation_prompt = draw(content)
    prefix = flat(prior_model) + header + generation + ([END] if ended else [])
    history = flat(prior_template) + assistant_template + [END] + after
    full = history + flat(following) + generation_prompt
    return prefix, history, full, ended


@given(conversations())
def test_spliced_prompt_starts_with_the_prefix_and_ends_with_the_template_tail(case) -> None:
    prefix, history, full, ended = case
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    kept = prefix[:-1] if ended else prefix
    assert result.prompt_token_ids[: len(prefix)] == prefix  # turn N+1 starts with turn N's prompt + generation
    assert result.prompt_token_ids[len(kept):] == full[result.boundary:]
    assert full[result.boundary] == END
    assert result.template_differed == (full[: result.boundary] != kept)
    assert 0 <= result.replaced_tokens <= result.boundary
    if not result.template_differed:
        assert result.replaced_tokens == 0


@given(conversations(), st.integers(min_value=1, max_value=3))
def test_extra_terminators_make_the_prefix_stale(case, extra: int) -> None:
    prefix, history, full, _ = case
    with pytest.raises(StalePrefixError, match="stale prefix"):
        splice_prefix(terminator_id=END, model_prefix=[END] * extra + prefix, template_history=history, template_full=full)


@given(conversations())
def test_missing_turns_make_the_prefix_stale(case) -> None:
    prefix, history, full, _ = case
    turns = history.count(END)
    assume(turns >= 2)
    cut = [i for i, token in enumerate(prefix) if token == END][0]  # drop the first turn's terminator and beyond
    shortened = prefix[:cut]
    assume(shortened.count(END) < turns - 1)
    with pytest.raises(StalePrefixError):
        splice_prefix(terminator_id=END, model_prefix=shortened, template_history=history, template_full=full)


def test_identical_rendering_is_applied_without_difference() -> None:
    prefix = [5, 6, END, NL, 7, 8, 9, END]
    history = [5, 6, END, NL, 7, 8, 9, END, NL]
    full = history + [10, 11, END, NL, 12]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == full
    assert result.telemetry() == {"applied": True, "template_differed": False, "replaced_tokens": 0}


def test_retokenized_history_is_replaced_by_the_model_ids() -> None:
    prefix = [5, END, NL, 7, 30, 31, 32, END]  # the model generated 30 31 32
    history = [5, END, NL, 7, 40, 41, END, NL]  # the template re-tokenized its text as 40 41
    full = history + [10, END, NL, 12]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == [5, END, NL, 7, 30, 31, 32, END, NL, 10, END, NL, 12]
    assert result.template_differed and result.replaced_tokens == 2


def test_turn_cut_by_max_tokens_gets_the_template_terminator() -> None:
    prefix = [5, END, NL, 7, 30, 31]  # no terminator: max_tokens
    history = [5, END, NL, 7, 30, 31, END, NL]
    full = history + [10, END, NL, 12]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == [5, END, NL, 7, 30, 31, END, NL, 10, END, NL, 12]
    assert not result.template_differed


def test_another_stop_token_is_kept() -> None:
    prefix = [5, END, NL, 7, 30, OTHER_STOP]  # stopped on <|endoftext|>, which is not the turn terminator
    history = [5, END, NL, 7, 30, END, NL]
    full = history + [10]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == [5, END, NL, 7, 30, OTHER_STOP, END, NL, 10]
    assert result.template_differed and result.replaced_tokens == 0  # the template had fewer ids, none wrong


def test_template_that_drops_earlier_reasoning() -> None:
    # The model's turn had <think>r</think> (ids 50 51 52); rendered after a newer user turn the template drops it.
    prefix = [5, END, NL, 7, 50, 51, 52, 30, END]
    history = [5, END, NL, 7, 50, 51, 52, 30, END, NL]  # the assistant turn is last here: reasoning kept
    full = [5, END, NL, 7, 30, END, NL, 10, END, NL, 12]  # ...but dropped in the full prompt
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == [5, END, NL, 7, 50, 51, 52, 30, END, NL, 10, END, NL, 12]
    assert result.replaced_tokens == 1


def test_several_assistant_turns_prefix_from_the_middle_one() -> None:
    turn = lambda *ids: [*ids, END, NL]  # noqa: E731
    prefix = turn(5) + turn(7, 20) + turn(8) + [7, 21, 22, END]
    history = turn(5) + turn(7, 20) + turn(8) + turn(7, 23)
    full = history + turn(9) + turn(7, 24) + turn(10) + [7]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == prefix + [NL] + turn(9) + turn(7, 24) + turn(10) + [7]


def test_tool_call_turn_followed_by_tool_results() -> None:
    TOOL_CALL, TOOL_CALL_END, RESPONSE, RESPONSE_END = 55, 56, 57, 58
    prefix = [5, END, NL, 7, TOOL_CALL, 30, 31, TOOL_CALL_END, END]
    history = [5, END, NL, 7, TOOL_CALL, 30, 32, 33, TOOL_CALL_END, END, NL]  # arguments re-serialized
    full = history + [8, RESPONSE, 40, RESPONSE_END, END, NL, 7]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == prefix + [NL, 8, RESPONSE, 40, RESPONSE_END, END, NL, 7]
    assert result.replaced_tokens == 3


def test_text_after_the_terminator_comes_from_the_template() -> None:
    prefix = [5, END]
    history = [5, END, NL, NL]
    full = history + [9]
    result = splice_prefix(terminator_id=END, model_prefix=prefix, template_history=history, template_full=full)
    assert result.prompt_token_ids == [5, END, NL, NL, 9]


def test_tokens_after_the_final_terminator_are_stale() -> None:
    with pytest.raises(StalePrefixError, match="holds 1 turn terminators and does not end on one"):
        splice_prefix(terminator_id=END, model_prefix=[5, END, NL], template_history=[5, END, NL], template_full=[5, END, NL, 9])


def test_boundary_not_found_says_why_with_decoded_context() -> None:
    decode = lambda ids: " ".join(f"<{i}>" for i in ids)  # noqa: E731
    with pytest.raises(BoundaryNotFoundError, match=r"renders only 1 turn terminators, fewer than the 2 .*prompt ends with '<5> <0> <9>'"):
        splice_prefix(terminator_id=END, model_prefix=[5, END, 6, END], template_history=[5, END, 6, END],
                      template_full=[5, END, 9], decode=decode)


def test_history_without_terminator() -> None:
    with pytest.raises(BoundaryNotFoundError, match="no turn terminator"):
        splice_prefix(terminator_id=END, model_prefix=[5], template_history=[5, 6], template_full=[5, 6, 7])


BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_prefix_source_is_the_last_bundled_message() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "prompt_token_ids": [9], "generation_token_ids": [8], "generation_log_probs": [0.0]},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", **BUNDLE},
        {"role": "user", "content": "e"},
    ]
    source = find_prefix_source(messages)
    assert source is not None and (source.prefix, source.message_index, source.explicit) == ([1, 2, 3], 3, False)


def test_explicit_prefix_wins_and_belongs_to_the_last_assistant_message() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", **BUNDLE}, {"role": "tool", "content": "r"}]
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
        ([{"role": "assistant", "prompt_token_ids": [1]}], None, r"messages\[0\]: token bundle is all or none; generation_token_ids, generation_log_probs missing"),
        ([{"role": "user", **BUNDLE}], None, "belongs on an assistant message"),
        ([{"role": "assistant", **{**BUNDLE, "prompt_token_ids": [1, "2"]}}], None, r"messages\[0\].prompt_token_ids\[1\] must be an int"),
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
