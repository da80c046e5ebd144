"""Tests of the tiny model build: config, determinism, cache behaviour, CLI, and loading with transformers."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from nemo_gym_tok.cli import tiny_model as tiny_model_cli
from nemo_gym_tok.testing.tiny_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    VOCAB_SIZE,
    build_tiny_model,
    default_tiny_model_dir,
    is_complete,
    spec_hash,
)
from nemo_gym_tok.testing.tiny_model.build import MARKER_FILE


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build in a private tmp dir (not the user's cache), shared by this module."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_build_is_complete_and_has_the_expected_files(built: Path) -> None:
    assert is_complete(built)
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", MARKER_FILE} <= names
    # Nothing of the temp build is left next to it.
    assert [p.name for p in built.parent.iterdir()] == [built.name]


def test_model_config(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["model_type"] == "qwen3"
    expected = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "bos_token_id": None,
    }
    assert {k: config.get(k) for k in expected} == expected


def test_generation_config_eos_is_only_im_end(built: Path) -> None:
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == IM_END_ID
    assert generation.get("pad_token_id") == ENDOFTEXT_ID


def test_tokenizer_config_carries_chat_template_and_eos(built: Path) -> None:
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config.get("bos_token") is None
    assert "<|im_start|>" in config["chat_template"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_second_build_is_byte_identical(built: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "again")
    assert (other / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", MARKER_FILE):
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_same_dest_is_a_cache_hit(built: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    start = time.monotonic()
    assert build_tiny_model(built) == built
    assert time.monotonic() - start < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_incomplete_dir_with_our_marker_is_rebuilt(built: Path, tmp_path: Path) -> None:
    # A dir that has our marker but lacks a file is not complete (say, a file was deleted by hand).
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MARKER_FILE).write_text((built / MARKER_FILE).read_text())
    assert not is_complete(broken)
    assert build_tiny_model(broken) == broken
    assert is_complete(broken)
    assert (broken / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()


def test_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_default_dir_uses_ngt_cache_dir_and_spec_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NGT_CACHE_DIR", str(tmp_path))
    assert default_tiny_model_dir() == tmp_path / f"qwen3-tiny-{spec_hash()}"
    monkeypatch.delenv("NGT_CACHE_DIR")
    assert default_tiny_model_dir() == Path.home() / ".cache" / "nemo_gym_tok" / f"qwen3-tiny-{spec_hash()}"


def test_cli_prints_directory(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="ngt")
    tiny_model_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tiny-model", str(built)])
    assert args.force is False
    assert args.func(args) == 0
    assert capsys.readouterr().out == f"{built}\n"


def test_cli_reports_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.txt").write_text("x")
    parser = argparse.ArgumentParser(prog="ngt")
    tiny_model_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tiny-model", str(tmp_path), "--force"])
    assert args.func(args) == 1
    assert "refusing" in capsys.readouterr().err


def test_loads_with_transformers(built: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == ENDOFTEXT_ID
    assert tokenizer.backend_tokenizer.normalizer is None  # tiktoken semantics: no NFC rewriting of input
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )

    model = AutoModelForCausalLM.from_pretrained(built)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.generation_config.eos_token_id == IM_END_ID
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits
    assert logits.shape == (1, len(ids), VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_position_limit_option_is_a_separate_build(
    built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # bench/ serves a 32768-position build; the default (test) build, its spec and its cache entry stay as they are.
    monkeypatch.setenv("NGT_CACHE_DIR", str(tmp_path / "cache"))
    assert spec_hash(8192) == spec_hash() and default_tiny_model_dir(8192) == default_tiny_model_dir()
    assert spec_hash(32768) != spec_hash()
    assert default_tiny_model_dir(32768).name.startswith("qwen3-tiny-ctx32768-")
    assert default_tiny_model_dir(32768) != default_tiny_model_dir()
    long = build_tiny_model(max_position_embeddings=32768)
    assert long == default_tiny_model_dir(32768)
    assert is_complete(long, 32768) and not is_complete(long) and not is_complete(built, 32768)
    config = json.loads((long / "config.json").read_text())
    default = json.loads((built / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768
    assert {k: v for k, v in config.items() if k != "max_position_embeddings"} == {
        k: v for k, v in default.items() if k != "max_position_embeddings"
    }  # rope and shapes untouched
    assert json.loads((long / "tokenizer_config.json").read_text())["model_max_length"] == 32768
    assert (long / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not default_tiny_model_dir().exists()  # asking for the long build built nothing else
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "bad", max_position_embeddings=0)
