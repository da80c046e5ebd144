"""The training variant's planted feature: each token's share of non-ASCII characters, written along one direction.

A random model's embedding rows share nothing, so a reward over a property of many tokens gives the learner no
direction that moves them together: only the rows of the tokens it happened to sample. Real models' embeddings carry
features of their tokens (script, language, ...). The training variant (`build_tiny_model(variant="train")`) plants
one: row `t` of the tied embedding gets `ALPHA * feature(t) * u` added, `u` a seeded random unit vector and
`feature(t)` in [-1, 1] the share of the token's non-whitespace characters beyond ASCII, rescaled (1: all of them,
-1: none; 0 for tokens without such characters, special tokens and the padding rows). One direction of the final
hidden state then raises or lowers every non-ASCII token at once: what `resources_servers/non_ascii/` rewards.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_tok.testing.tiny_model.tokenizer import QWEN_ADDED_TOKENS, QWEN_BPE_RANKS, qwen_ranks_file

if TYPE_CHECKING:
    import torch

TRAIN_VARIANT = "train"
ALPHA = 0.2
"""Length of the planted component at feature 1 (the random rows are about 0.23 long: std 0.02 over 128 dims)."""
DIRECTION_SEED = 4321
EMBEDDING_KEY = "model.embed_tokens.weight"
PLANTED_SPEC: dict[str, Any] = {
    "variant": TRAIN_VARIANT,
    "feature": "non-ascii share of non-whitespace characters, 2 * share - 1; 0 without such characters or special",
    "alpha": ALPHA,
    "direction_seed": DIRECTION_SEED,
    "feature_format": 1,
}
"""What determines the planted bytes: part of the variant's build spec (its hash names the cache entry)."""


def text_feature(text: str) -> float:
    """2 * (share of the non-whitespace characters of `text` beyond ASCII) - 1; 0.0 when it has none."""
    characters = [char for char in text if not char.isspace()]
    if not characters:
        return 0.0
    return 2.0 * sum(1 for char in characters if ord(char) > 127) / len(characters) - 1.0


def feature_table(vocab_size: int, ranks_file: Path | None = None) -> list[float]:
    """`feature(t)` of every embedding row: ordinary tokens from their bytes as decoded alone (a partial UTF-8
    sequence reads as U+FFFD, as a detokenizer shows it), non-special added tokens from their text (they survive
    `skip_special_tokens`), special tokens and padding rows 0.0."""
    table = [0.0] * vocab_size
    with open(ranks_file or qwen_ranks_file(), encoding="ascii") as ranks:
        for line in ranks:
            if line.strip():
                encoded, rank = line.split()
                if int(rank) < min(QWEN_BPE_RANKS, vocab_size):
                    table[int(rank)] = text_feature(base64.b64decode(encoded).decode("utf-8", errors="replace"))
    for token_id, text, special in QWEN_ADDED_TOKENS:
        if not special and token_id < vocab_size:
            table[token_id] = text_feature(text)
    return table


def planted_direction(hidden_size: int) -> torch.Tensor:
    """The seeded unit vector `u` the feature is written along (float32)."""
    import torch

    generator = torch.Generator().manual_seed(DIRECTION_SEED)
    direction = torch.randn(hidden_size, generator=generator, dtype=torch.float32)
    return direction / direction.norm()


def plant_feature(model_dir: Path) -> None:
    """Rewrite `model_dir`'s model.safetensors with the feature planted in its (tied) embedding, in its own dtype.
    Deterministic: the same input bytes give the same output bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = model_dir / "model.safetensors"
    tensors = load_file(str(weights_file))
    embedding = tensors[EMBEDDING_KEY]
    rows, hidden_size = embedding.shape
    feature = torch.tensor(feature_table(rows), dtype=torch.float32)
    planted = embedding.float() + ALPHA * feature[:, None] * planted_direction(hidden_size)[None, :]
    tensors[EMBEDDING_KEY] = planted.to(embedding.dtype).contiguous()
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
