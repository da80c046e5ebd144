"""The family model builder: real shipped chat template, a family tokenizer, stop ids, cached like the tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_gym_tok.testing.chat_templates import entry
from nemo_gym_tok.testing.tiny_model import MODEL_CONFIG, VOCAB_SIZE
from nemo_gym_tok.testing.tiny_model.build import MARKER_FILE
from nemo_gym_tok.testing.tiny_model.family import build_family_model, family_build, family_model_dir, padded_vocab_size

TEMPLATE = "NousResearch-Meta-Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model(TEMPLATE, tmp_path_factory.mktemp("family") / "llama")


def test_configs_carry_the_family_stop_ids_and_cover_the_tokenizer(built: Path) -> None:
    plan = family_build(TEMPLATE)
    config = json.loads((built / "config.json").read_text())
    generation = json.loads((built / "generation_config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "head_dim")} == {
        k: MODEL_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "head_dim")
    }
    assert config["vocab_size"] == VOCAB_SIZE >= len(plan.tokenizer)
    stops = [plan.tokenizer.convert_ids_to_tokens(i) for i in generation["eos_token_id"]]
    assert stops == ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]
    assert generation["bos_token_id"] == plan.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")


def test_tokenizer_carries_the_real_template(built: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["chat_template"] == entry(TEMPLATE).text
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<|begin_of_text|>", "<|start_header_id|>"]


def test_rebuild_is_byte_identical_and_a_cache_hit_is_instant(built: Path, tmp_path: Path) -> None:
    other = build_family_model(TEMPLATE, tmp_path / "again")
    for path in built.iterdir():
        assert (other / path.name).read_bytes() == path.read_bytes(), path.name
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    start = time.monotonic()
    assert build_family_model(TEMPLATE, built) == built
    assert time.monotonic() - start < 5.0
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before
    assert (built / MARKER_FILE).is_file()


def test_cache_dir_is_named_by_template_and_spec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NGT_CACHE_DIR", str(tmp_path))
    qwen = "Qwen-Qwen3-0.6B@a55ee1"
    assert family_model_dir(qwen) == tmp_path / f"family-Qwen-Qwen3-0.6B_a55ee1-{family_build(qwen).spec_hash}"
    assert family_build(qwen).spec_hash != family_build(TEMPLATE).spec_hash


def test_refuses_unknown_template_and_foreign_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        build_family_model("no-such-template")
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_family_model(TEMPLATE, tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_vocab_rows_round_up() -> None:
    assert padded_vocab_size(151669) == VOCAB_SIZE
    assert padded_vocab_size(VOCAB_SIZE + 1) == VOCAB_SIZE + 128
