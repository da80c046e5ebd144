"""Token-source precedence, agreement and the prefix check, tested directly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_tok.contract.token_sources import (
    PartialBundle,
    PrefixMismatchError,
    TokenSource,
    TokenSourceError,
    check_prefix,
    first_difference,
    logprobs_bundle,
    resolve_bundle,
)

MESSAGE = PartialBundle(TokenSource.MESSAGE, [1, 2, 3], [4, 5], [-0.5, -1.0])
RETURNED = PartialBundle(TokenSource.RETURN_TOKEN_IDS, [1, 2, 3], [4, 5])
TOKENIZED = PartialBundle(TokenSource.TOKENIZE, [1, 2, 3])
LOGPROBS = PartialBundle(TokenSource.LOGPROBS, generation_token_ids=[4, 5], generation_log_probs=[-0.5, -1.0])


def test_first_source_wins_when_all_agree() -> None:
    resolved = resolve_bundle([MESSAGE, RETURNED, TOKENIZED, LOGPROBS])
    assert resolved.source is TokenSource.MESSAGE
    assert resolved.as_fields() == {
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -1.0],
    }


@pytest.mark.parametrize(
    "sources, expected_source",
    [([RETURNED, LOGPROBS], TokenSource.RETURN_TOKEN_IDS), ([TOKENIZED, LOGPROBS], TokenSource.TOKENIZE)],
)
def test_fields_combine_across_sources(sources, expected_source) -> None:
    resolved = resolve_bundle(sources)
    assert resolved.source is expected_source
    assert resolved.generation_log_probs == [-0.5, -1.0]


@pytest.mark.parametrize(
    "other, field, position",
    [
        (PartialBundle(TokenSource.RETURN_TOKEN_IDS, [1, 2, 9]), "prompt_token_ids", 2),
        (PartialBundle(TokenSource.TOKENIZE, [1, 2]), "prompt_token_ids", 2),
        (
            PartialBundle(TokenSource.LOGPROBS, generation_token_ids=[4, 6], generation_log_probs=[-0.5, -1.0]),
            "generation_token_ids",
            1,
        ),
        (
            PartialBundle(TokenSource.LOGPROBS, generation_token_ids=[4, 5], generation_log_probs=[-0.5, -2.0]),
            "generation_log_probs",
            1,
        ),
    ],
)
def test_disagreement_is_an_error_naming_field_sources_and_position(other, field, position) -> None:
    with pytest.raises(
        TokenSourceError, match=rf"{field} from message and from {other.source.value} disagree at position {position}"
    ):
        resolve_bundle([MESSAGE, other])


def test_log_probs_within_float_noise_agree() -> None:
    close = PartialBundle(TokenSource.LOGPROBS, generation_token_ids=[4, 5], generation_log_probs=[-0.50000001, -1.0])
    assert resolve_bundle([MESSAGE, close]).generation_log_probs == [-0.5, -1.0]


def test_missing_fields_are_named() -> None:
    with pytest.raises(TokenSourceError, match="no token source provided generation_token_ids, generation_log_probs"):
        resolve_bundle([TOKENIZED])


def test_unequal_generation_lengths_across_sources() -> None:
    with pytest.raises(TokenSourceError, match="differ in length"):
        resolve_bundle([RETURNED, PartialBundle(TokenSource.LOGPROBS, generation_log_probs=[-1.0])])


def test_logprobs_parsing() -> None:
    content = [{"token": "token_id:4", "logprob": -0.5}, {"token": "token_id:5", "logprob": -1.0}]
    assert logprobs_bundle({"content": content}) == LOGPROBS
    assert logprobs_bundle(None) is None
    with pytest.raises(TokenSourceError, match="return_tokens_as_token_ids"):
        logprobs_bundle({"content": [{"token": "hello", "logprob": 0.0}]})


ids = st.lists(st.integers(min_value=0, max_value=200_000), max_size=30)


@given(ids, ids)
def test_check_prefix_agrees_with_list_slicing(prompt: list[int], prefix: list[int]) -> None:
    starts = prompt[: len(prefix)] == prefix
    if starts:
        check_prefix(prompt, prefix)
        return
    with pytest.raises(PrefixMismatchError) as info:
        check_prefix(prompt, prefix)
    position = info.value.position
    assert prompt[:position] == prefix[:position]
    assert position >= len(prompt) or prompt[position] != prefix[position]


@given(ids, ids)
def test_first_difference_matches_definition(a: list[int], b: list[int]) -> None:
    position = first_difference(a, b)
    if a == b:
        assert position is None
    else:
        assert position is not None and a[:position] == b[:position]
        assert position == min(len(a), len(b)) or a[position] != b[position]
