"""One rule for a vLLM key (nemo_gym_tok/common/keys.py): None, "" and the OpenAI SDK's "EMPTY" send no header."""

from __future__ import annotations

import pytest

from nemo_gym_tok.common.keys import effective_key, key_headers


@pytest.mark.parametrize("key", [None, "", "EMPTY", 42])
def test_no_key_sends_no_header(key: object) -> None:
    assert effective_key(key) is None and key_headers(key) == {}


def test_a_key_is_sent_as_a_bearer_token() -> None:
    assert effective_key("k-1") == "k-1"
    assert key_headers("k-1") == {"Authorization": "Bearer k-1"}
