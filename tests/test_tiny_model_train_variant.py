"""The tiny model's training variant: the default's weights with one feature planted along one embedding direction,
cached apart; the default build's spec (and so its bytes) untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model import (
    IM_END_ID,
    THINK_START_ID,
    TRAIN_VARIANT,
    VOCAB_SIZE,
    build_tiny_model,
    default_tiny_model_dir,
    feature_table,
    is_complete,
    spec_hash,
    text_feature,
)
from nemo_gym_tok.testing.tiny_model.build import build_spec
from nemo_gym_tok.testing.tiny_model.planted import ALPHA, EMBEDDING_KEY, planted_direction


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("train") / "model", variant=TRAIN_VARIANT)


def test_the_default_spec_has_no_planted_feature_and_the_variant_its_own_cache_entry() -> None:
    assert "planted" not in build_spec() and build_spec(variant=TRAIN_VARIANT)["planted"]["alpha"] == ALPHA
    assert spec_hash() != spec_hash(variant=TRAIN_VARIANT)
    assert default_tiny_model_dir(variant=TRAIN_VARIANT).name.startswith("qwen3-tiny-train-")
    assert default_tiny_model_dir().name == f"qwen3-tiny-{spec_hash()}"
    with pytest.raises(ValueError, match="variant"):
        spec_hash(variant="other")


def test_the_variant_is_complete_only_as_itself(variant: Path, tiny_model_dir: Path) -> None:
    assert is_complete(variant, variant=TRAIN_VARIANT) and not is_complete(variant)
    assert not is_complete(tiny_model_dir, variant=TRAIN_VARIANT)


@pytest.mark.parametrize(
    ("text", "feature"), [("abc", -1.0), (" 海", 1.0), ("é!", 0.0), ("  ", 0.0), ("\ufffd", 1.0), ("", 0.0)]
)
def test_the_feature_is_the_rescaled_share_beyond_ascii(text: str, feature: float) -> None:
    assert text_feature(text) == feature


def test_the_feature_table_reads_every_token() -> None:
    table = feature_table(VOCAB_SIZE)
    assert len(table) == VOCAB_SIZE
    assert table[64] == -1.0  # "a"
    assert table[IM_END_ID] == 0.0 and table[VOCAB_SIZE - 1] == 0.0  # special, padding row
    assert table[THINK_START_ID] == -1.0  # survives skip_special_tokens as "<think>"
    share = sum(1 for value in table if value > 0) / VOCAB_SIZE
    assert 0.3 < share < 0.4  # about a third of Qwen's tokens are mostly beyond ASCII


def test_only_the_embedding_differs_by_the_planted_component(variant: Path, tiny_model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    default, planted = load_file(tiny_model_dir / "model.safetensors"), load_file(variant / "model.safetensors")
    assert default.keys() == planted.keys()
    for name in default:
        if name != EMBEDDING_KEY:
            assert torch.equal(default[name], planted[name]), name
    difference = planted[EMBEDDING_KEY].float() - default[EMBEDDING_KEY].float()
    direction = planted_direction(difference.shape[1])
    feature = torch.tensor(feature_table(difference.shape[0]))
    expected = ALPHA * feature[:, None] * direction[None, :]
    assert (difference - expected).abs().max() < 0.01  # bf16 rounding of a 0.1-long component plus the row
    along = difference @ direction
    assert torch.corrcoef(torch.stack([along, feature]))[0, 1] > 0.99
