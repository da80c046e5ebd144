"""Builds (offline, deterministically) and caches the random-weight Qwen3 model directory vLLM serves in tests."""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_tok.testing.tiny_model._cache import (
    MARKER_FILE,
    build_cached,
    cache_root,
    file_sha256,
    hash_spec,
    write_marker,
)
from nemo_gym_tok.testing.tiny_model._cache import (
    is_complete as _is_complete,
)
from nemo_gym_tok.testing.tiny_model.planted import PLANTED_SPEC, TRAIN_VARIANT, plant_feature
from nemo_gym_tok.testing.tiny_model.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    MODEL_MAX_LENGTH,
    QWEN_ADDED_TOKENS,
    QWEN_PAT_STR,
    build_tokenizer,
    chat_template,
    qwen_ranks_file,
    save_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "BUILD_FORMAT",
    "MARKER_FILE",
    "MODEL_CONFIG",
    "REQUIRED_FILES",
    "SEED",
    "VARIANTS",
    "VOCAB_SIZE",
    "build_spec",
    "build_tiny_model",
    "cache_root",
    "default_tiny_model_dir",
    "is_complete",
    "model_config_for",
    "spec_hash",
    "write_random_qwen3",
]

logger = logging.getLogger(__name__)

VOCAB_SIZE = 151936  # Qwen's embedding rows: 151,669 used ids padded up, like the real checkpoints
SEED = 1234
VARIANTS = (None, TRAIN_VARIANT)
"""None: the default model. "train": the same weights with one feature planted in the embedding, for learning tests
(nemo_gym_tok.testing.tiny_model.planted); a separate cache entry, the default's bytes unchanged."""

# Bump when the build code changes what it writes, so stale cache entries are not reused.
BUILD_FORMAT = 1

# Small enough to build in seconds and serve on 2 CPU cores; head_dim 64 because vLLM's CPU attention
# rejects small head sizes such as 16.
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)


def model_config_for(max_position_embeddings: int | None = None) -> dict[str, Any]:
    """`MODEL_CONFIG`, with another position limit when `max_position_embeddings` is given (rope and the rest as is)."""
    if max_position_embeddings is None or max_position_embeddings == MODEL_MAX_LENGTH:
        return MODEL_CONFIG
    if type(max_position_embeddings) is not int or max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be a positive int, got {max_position_embeddings!r}")
    return {**MODEL_CONFIG, "max_position_embeddings": max_position_embeddings}


def _limit(max_position_embeddings: int | None) -> int | None:
    """None for the default position limit (one cache entry, one spec, whichever way it is asked for)."""
    model_config_for(max_position_embeddings)  # validates
    return None if max_position_embeddings in (None, MODEL_MAX_LENGTH) else max_position_embeddings


def _variant(variant: str | None) -> str | None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


@lru_cache(maxsize=8)
def build_spec(max_position_embeddings: int | None = None, variant: str | None = None) -> dict[str, Any]:
    """Everything that determines the build's bytes; its hash names the cache dir, so any change rebuilds.

    `max_position_embeddings` (default: the test build's 8192) raises the model's position limit, and the
    tokenizer's `model_max_length` with it: a separate build (e.g. 32768 for the long-context benchmarks in bench/),
    otherwise the same weights' shapes, seed, tokenizer and template. The default spec is unchanged by the option.
    `variant` "train" adds the planted feature's spec (`PLANTED_SPEC`); the default (None) has no such key.
    """
    spec = {
        "build_format": BUILD_FORMAT,
        "seed": SEED,
        "model_config": model_config_for(_limit(max_position_embeddings)),
        "added_tokens": [list(t) for t in QWEN_ADDED_TOKENS],
        "ranks_sha256": file_sha256(qwen_ranks_file()),
        "pattern": QWEN_PAT_STR,
        "chat_template_sha256": hashlib.sha256(chat_template().encode("utf-8")).hexdigest(),
    }
    if _variant(variant) is not None:
        spec["planted"] = PLANTED_SPEC
    return spec


def spec_hash(max_position_embeddings: int | None = None, variant: str | None = None) -> str:
    """Short, stable hash of `build_spec()`."""
    return hash_spec(build_spec(_limit(max_position_embeddings), _variant(variant)))


def default_tiny_model_dir(max_position_embeddings: int | None = None, variant: str | None = None) -> Path:
    """Cache location of the current build spec (it may not be built yet); a raised position limit and the training
    variant are entries of their own."""
    limit = _limit(max_position_embeddings)
    name = "qwen3-tiny" if limit is None else f"qwen3-tiny-ctx{limit}"
    if _variant(variant) is not None:
        name += f"-{variant}"
    return cache_root() / f"{name}-{spec_hash(limit, variant)}"


def is_complete(directory: Path, max_position_embeddings: int | None = None, variant: str | None = None) -> bool:
    """True if `directory` holds a finished build of the current spec (of that position limit and variant)."""
    return _is_complete(directory, spec_hash(max_position_embeddings, variant), REQUIRED_FILES)


def write_random_qwen3(
    out: Path,
    model_config: dict[str, Any],
    *,
    seed: int,
    tokenizer: PreTrainedTokenizerFast,
    chat_template_text: str,
    eos_token_id: int | list[int],
    pad_token_id: int | None,
    bos_token_id: int | None = None,
) -> None:
    """Write a random-weight Qwen3 (bf16, seeded) with its generation config and tokenizer into `out`.

    The generation config's `eos_token_id` is what vLLM stops on; the tokenizer is saved with the chat template
    inside tokenizer_config.json. Deterministic: same arguments, byte-identical files.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**model_config)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out, chat_template_text)


def _write_build(out: Path, max_position_embeddings: int | None = None, variant: str | None = None) -> None:
    """Write model weights, configs and tokenizer into `out` (an existing empty directory)."""
    limit = _limit(max_position_embeddings)
    tokenizer = build_tokenizer()
    if limit is not None:
        tokenizer.model_max_length = limit
    # Only <|im_end|> ends a turn; listing <|endoftext|> too would let a turn end on a token the template never writes.
    write_random_qwen3(
        out,
        model_config_for(limit),
        seed=SEED,
        tokenizer=tokenizer,
        chat_template_text=chat_template(),
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        bos_token_id=None,
    )
    if variant == TRAIN_VARIANT:
        plant_feature(out)  # the same random weights, then the feature written into the embedding
    write_marker(out, spec_hash(limit, variant), build_spec(limit, variant))


def build_tiny_model(
    dest: Path | None = None,
    *,
    force: bool = False,
    max_position_embeddings: int | None = None,
    variant: str | None = None,
) -> Path:
    """Return a directory holding the tiny Qwen3 model (weights, configs, tokenizer), building it if needed.

    `dest` None means the cache (`default_tiny_model_dir(max_position_embeddings)`). A complete build of the current
    spec is returned immediately unless `force`. Builds go to a temp dir next to `dest` and are renamed into place,
    so a killed build never leaves a directory that looks complete. Same spec -> byte-identical files.
    `max_position_embeddings` (default 8192, the test build) builds a separate model with that position limit
    (bench/ serves a 32768 one with `--max-model-len 32768`). `variant="train"` builds the training variant (the same
    weights with a feature planted in the embedding: nemo_gym_tok.testing.tiny_model.planted), cached apart.
    Raises FileExistsError if `dest` is a non-empty directory that is not one of our builds.
    """
    limit, variant = _limit(max_position_embeddings), _variant(variant)
    target = Path(dest).expanduser().absolute() if dest is not None else default_tiny_model_dir(limit, variant)
    return build_cached(
        target,
        force=force,
        complete=lambda directory: is_complete(directory, limit, variant),
        write=lambda out: _write_build(out, limit, variant),
        what="tiny-model",
    )
