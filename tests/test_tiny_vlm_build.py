"""Tests of the tiny vision-language model build: config and tokenizer ids agree, image expansion, template, cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.testing.tiny_model import MODEL_CONFIG, build_tokenizer, chat_template
from nemo_gym_tok.testing.tiny_model.build import MARKER_FILE
from nemo_gym_tok.testing.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID
from nemo_gym_tok.testing.tiny_model.vision import (
    ARCHITECTURE,
    IMAGE_PAD_ID,
    IMAGE_PROCESSOR_SETTINGS,
    REQUIRED_FILES,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    build_tiny_vlm,
    default_tiny_vlm_dir,
    image_pad_count,
    is_complete,
    spec_hash,
    vision_chat_template,
)

IMAGE_MARKERS = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build in a private tmp dir (not the user's cache), shared by this module."""
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def config(built: Path) -> dict[str, Any]:
    return json.loads((built / "config.json").read_text())


@pytest.fixture(scope="module")
def processor(built: Path) -> Any:
    """transformers' processor for the build, as AutoProcessor picks it (PIL backend without torchvision)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(built))


@pytest.fixture(scope="module")
def tokenizer(processor: Any) -> Any:
    """The build's tokenizer, as transformers loads it from the directory."""
    return processor.tokenizer


@pytest.fixture(scope="module")
def text_tokenizer() -> Any:
    """The embedded text model's tokenizer."""
    return build_tokenizer()


def test_build_is_complete_with_every_file(built: Path) -> None:
    assert is_complete(built)
    assert set(REQUIRED_FILES) <= {p.name for p in built.iterdir()}
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp dir left beside it


def test_vision_token_ids_are_the_tokenizers(tokenizer: Any, config: dict[str, Any]) -> None:
    expected = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    assert {key: config[key] for key in expected} == {
        key: tokenizer.convert_tokens_to_ids(text) for key, text in expected.items()
    }
    assert (IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_START_ID, VISION_END_ID) == (151655, 151656, 151652, 151653)
    # The processor reads the image token from the tokenizer's named special tokens.
    assert (tokenizer.image_token, tokenizer.image_token_id) == ("<|image_pad|>", IMAGE_PAD_ID)
    assert config["text_config"]["vocab_size"] >= len(tokenizer)


def test_tokenizer_is_the_text_models(tokenizer: Any, text_tokenizer: Any) -> None:
    """Naming <|image_pad|> changes no id: the VLM tokenizes every text as the embedded text model does."""
    assert len(tokenizer) == len(text_tokenizer)
    for text in ("Hello, world.", f"look {IMAGE_MARKERS} here<|im_end|>\n", "<think>\nx\n</think>\n\n数学 ✓"):
        assert tokenizer.encode(text) == text_tokenizer.encode(text), text


def test_named_tokens_must_exist() -> None:
    with pytest.raises(ValueError, match="already has"):
        build_tokenizer(named_tokens={"image_token": "<|no_such_token|>"})


def test_model_config(config: dict[str, Any]) -> None:
    assert config["architectures"] == [ARCHITECTURE]
    assert config["model_type"] == "paddleocr_vl"
    text, vision = config["text_config"], config["vision_config"]
    shapes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    shapes += ("num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings")
    assert {key: text[key] for key in shapes} == {key: MODEL_CONFIG[key] for key in shapes}
    assert (text["eos_token_id"], text["pad_token_id"], text["bos_token_id"]) == (IM_END_ID, ENDOFTEXT_ID, None)
    # M-RoPE over (time, height, width) covers every rotary frequency of a head.
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert vision["hidden_size"] // vision["num_attention_heads"] == 64  # vLLM's CPU attention head size
    assert (vision["patch_size"], vision["spatial_merge_size"]) == (14, 2)


def test_generation_config_stops_on_im_end_only(built: Path) -> None:
    generation = json.loads((built / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (IM_END_ID, ENDOFTEXT_ID)


def test_preprocessor_settings(built: Path, config: dict[str, Any]) -> None:
    settings = json.loads((built / "preprocessor_config.json").read_text())
    assert settings["processor_class"] == "PaddleOCRVLProcessor"
    assert settings["image_processor_type"] == "PaddleOCRVLImageProcessor"
    assert settings["size"] == {
        "shortest_edge": IMAGE_PROCESSOR_SETTINGS["min_pixels"],
        "longest_edge": IMAGE_PROCESSOR_SETTINGS["max_pixels"],
    }
    assert settings["patch_size"] == config["vision_config"]["patch_size"]
    assert settings["merge_size"] == config["vision_config"]["spatial_merge_size"]


def test_processor_is_transformers_own_without_torchvision(processor: Any) -> None:
    assert type(processor).__name__ == "PaddleOCRVLProcessor"
    assert type(processor.image_processor).__name__ in ("PaddleOCRVLImageProcessorPil", "PaddleOCRVLImageProcessor")
    assert (processor.image_token, processor.image_token_id) == ("<|image_pad|>", IMAGE_PAD_ID)


@pytest.mark.parametrize(
    ("size", "pads"),
    [((28, 28), 4), ((56, 56), 4), ((84, 56), 6), ((84, 84), 9), ((112, 112), 16), ((300, 100), 12), ((500, 500), 16)],
)
def test_image_expands_to_pads_by_its_size(processor: Any, size: tuple[int, int], pads: int) -> None:
    from PIL import Image

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {}}]}
    ]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", size, (200, 30, 30))], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    start = ids.index(VISION_START_ID)
    assert ids[start : start + pads + 2] == [VISION_START_ID, *[IMAGE_PAD_ID] * pads, VISION_END_ID]
    assert ids.count(IMAGE_PAD_ID) == pads == image_pad_count(*size)
    grid_t, grid_h, grid_w = out["image_grid_thw"][0].tolist()
    assert grid_t * grid_h * grid_w == pads * 4


def test_template_renders_image_parts_in_place(tokenizer: Any) -> None:
    assert tokenizer.chat_template == vision_chat_template()
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}, {"type": "input_image"}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert rendered == f"<|im_start|>user\na{IMAGE_MARKERS}b{IMAGE_MARKERS}<|im_end|>\n"


def test_template_renders_text_chats_as_the_text_template(tokenizer: Any, text_tokenizer: Any) -> None:
    assert text_tokenizer.chat_template == chat_template()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "done", "reasoning_content": "why"},
        {"role": "user", "content": "again"},
    ]
    for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}):
        ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        text = text_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours == text, kwargs


def test_second_build_is_byte_identical(built: Path, tmp_path: Path) -> None:
    other = build_tiny_vlm(tmp_path / "again")
    for name in REQUIRED_FILES:
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_same_dest_is_a_cache_hit(built: Path) -> None:
    before = (built / MARKER_FILE).stat().st_mtime_ns
    assert build_tiny_vlm(built) == built
    assert (built / MARKER_FILE).stat().st_mtime_ns == before


def test_default_dir_is_named_by_the_spec_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NGT_CACHE_DIR", str(tmp_path))
    assert default_tiny_vlm_dir() == tmp_path / f"paddleocr-vl-tiny-{spec_hash()}"
