"""Tests that the tiny model's tokenizer is Qwen's: same ids as tiktoken on text, Qwen's added tokens at Qwen's ids."""

from __future__ import annotations

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

from nemo_gym_tok.testing.tiny_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    QWEN_ADDED_TOKENS,
    QWEN_PAT_STR,
    THINK_END_ID,
    THINK_START_ID,
    TOOL_CALL_END_ID,
    TOOL_CALL_START_ID,
    TOOL_RESPONSE_END_ID,
    TOOL_RESPONSE_START_ID,
    build_tokenizer,
    qwen_ranks_file,
)

ORDINARY_TEXTS = [
    "Hello world, how are you? 12345",
    "The quick brown fox jumps over the lazy dog.\n",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\nprint(add(2, 3))",
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}',
    "Grüße aus Köln — naïve café, 東京タワー, 안녕하세요, Привет мир, مرحبا",
    "emoji 🙂🚀👩‍💻 and flags 🇨🇭",
    "numbers 3.14159 1e-10 -42 1,000,000 0x1F 2024-06-01T12:00:00Z",
    "whitespace    runs\t\ttabs\n\n\n\nnewlines   \r\n trailing   ",
    "   leading spaces and a lone\u00a0nbsp",
    "I'm sure they'll say it's what we'd've DONE'S",
    "e\u0301 decomposed vs \u00e9 composed",
    "",
    "a",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    """tiktoken over the same ranks file and regex: the ground truth for ordinary text."""
    return tiktoken.Encoding(
        name="qwen-reference",
        pat_str=QWEN_PAT_STR,
        mergeable_ranks=load_tiktoken_bpe(str(qwen_ranks_file())),
        special_tokens={text: token_id for token_id, text, _ in QWEN_ADDED_TOKENS},
    )


@pytest.mark.parametrize("text", ORDINARY_TEXTS)
def test_ordinary_text_matches_tiktoken(tokenizer, reference, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode_ordinary(text)
    assert tokenizer.decode(ids) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_arbitrary_text_matches_tiktoken(tokenizer, reference, text: str) -> None:
    # Added-token strings inside text are matched as tokens by both sides only when allowed; keep them out here.
    if any(t in text for _, t, _ in QWEN_ADDED_TOKENS):
        return
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode_ordinary(text)


def test_vocab_size_and_added_token_ids(tokenizer) -> None:
    assert len(tokenizer) == 151669
    for token_id, text, _ in QWEN_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(text) == token_id
        assert tokenizer.convert_ids_to_tokens(token_id) == text
    named = {
        "<|endoftext|>": ENDOFTEXT_ID,
        "<|im_start|>": IM_START_ID,
        "<|im_end|>": IM_END_ID,
        "<tool_call>": TOOL_CALL_START_ID,
        "</tool_call>": TOOL_CALL_END_ID,
        "<tool_response>": TOOL_RESPONSE_START_ID,
        "</tool_response>": TOOL_RESPONSE_END_ID,
        "<think>": THINK_START_ID,
        "</think>": THINK_END_ID,
    }
    assert named == {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
        "<think>": 151667,
        "</think>": 151668,
    }
    assert [t[0] for t in QWEN_ADDED_TOKENS] == list(range(151643, 151669))


def test_eos_pad_and_no_bos(tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == ENDOFTEXT_ID
    assert tokenizer.bos_token is None
    # No BOS/EOS is inserted around plain text.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_added_tokens_in_text_encode_to_their_ids(tokenizer, reference) -> None:
    text = "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, allowed_special="all")
    for token_id in (IM_START_ID, IM_END_ID, THINK_START_ID, THINK_END_ID, TOOL_CALL_START_ID, TOOL_CALL_END_ID):
        assert token_id in ids


def test_skip_special_tokens_keeps_markup_tokens(tokenizer) -> None:
    ids = tokenizer.encode("<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert tokenizer.decode(ids) == "<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
