"""The tiny GPT-OSS build: real o200k tokenizer (rebuilt offline), real template, GPT-OSS stop ids, deterministic."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model import file_sha256
from nemo_gym_tok.testing.tiny_model.gpt_oss import (
    CALL_ID,
    END_ID,
    GENERATION_EOS_IDS,
    GPT_OSS_ADDED_TOKENS,
    RETURN_ID,
    START_ID,
    VOCAB_SIZE,
    build_tiny_gpt_oss,
    default_gpt_oss_dir,
    gpt_oss_chat_template,
)
from tests.gpt_oss.play import TOOL_ARGUMENT_IDS


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt_oss_model_dir))


@pytest.fixture(scope="module")
def harmony():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def test_build_is_cached_with_gpt_oss_configs(gpt_oss_model_dir: Path) -> None:
    assert gpt_oss_model_dir == default_gpt_oss_dir()
    assert build_tiny_gpt_oss() == gpt_oss_model_dir  # a finished build is reused
    config = json.loads((gpt_oss_model_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["vocab_size"] == VOCAB_SIZE
    generation = json.loads((gpt_oss_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == GENERATION_EOS_IDS == [RETURN_ID, 199999, CALL_ID]
    tokenizer_config = json.loads((gpt_oss_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == gpt_oss_chat_template()
    assert tokenizer_config["eos_token"] == "<|return|>"


def test_build_is_deterministic(gpt_oss_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_gpt_oss(tmp_path / "model")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert file_sha256(again / name) == file_sha256(gpt_oss_model_dir / name), name


def test_added_tokens_sit_at_gpt_oss_ids(tokenizer) -> None:
    assert len(GPT_OSS_ADDED_TOKENS) == 1090
    for token_id, text in GPT_OSS_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(text) == token_id
    assert tokenizer.encode("<|start|>assistant<|end|><|return|><|call|>", add_special_tokens=False) == [
        START_ID,
        173781,
        END_ID,
        RETURN_ID,
        CALL_ID,
    ]


def test_tokenizer_matches_openai_harmony(tokenizer, harmony) -> None:
    rng = random.Random(0)
    samples = [
        "Hello world, how are you? 12345",
        "  spaced\n\n\ttabs",
        "naïve 日本語 emoji🙂",
        'x=1; {"k": 2}',
        "Current date: 2025-06-28\n\nReasoning: medium",
    ]
    samples += [harmony.decode([rng.randrange(199998) for _ in range(12)]) for _ in range(50)]
    for text in samples:
        assert tokenizer.encode(text, add_special_tokens=False) == harmony.encode(text), text


def test_tool_argument_bias_ids_spell_the_arguments(harmony) -> None:
    spelled = set(harmony.encode('{"city":"Rome"}')) | set(harmony.encode('{"city": "Rome"}'))
    assert tuple(sorted(spelled)) == TOOL_ARGUMENT_IDS
