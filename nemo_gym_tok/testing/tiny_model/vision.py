"""Builds (offline, deterministically) and caches a tiny random-weight vision-language model vLLM's CPU build serves."""

# The family is PaddleOCR-VL (transformers' `paddleocr_vl`, vLLM's PaddleOCRVLForConditionalGeneration): a SigLIP
# NaViT vision tower whose number of image tokens follows the image's size (Qwen2-VL's scheme: the image is resized to
# a multiple of 28 px, each 28x28 px becomes one merged patch, and the one image placeholder of the prompt expands to
# as many copies of itself), an MLP projector, and an Ernie-4.5 text stack with 3-axis M-RoPE. Qwen2-VL itself is not
# servable here: vLLM's qwen2_vl module imports transformers' torchvision image processor, and transformers' Qwen2-VL
# processor cannot be built without a video processor, which needs torchvision (the set-up removes it: it does not
# import beside the CPU torch). PaddleOCR-VL's vLLM module and its processor (image processor and tokenizer only, PIL
# backend) need neither.
#
# The text stack has the shapes of the embedded text model (build.MODEL_CONFIG); the tokenizer is that model's (Qwen's
# real tokenizer) with `<|image_pad|>` named as the processor's image token; the vision markers are Qwen's own
# <|vision_start|> <|image_pad|> <|vision_end|>, and the chat template is ours (vision_chat_template.jinja).

from __future__ import annotations

import hashlib
import importlib.resources
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.testing.tiny_model._cache import (
    MARKER_FILE,
    build_cached,
    cache_root,
    file_sha256,
    hash_spec,
    write_marker,
)
from nemo_gym_tok.testing.tiny_model._cache import is_complete as _is_complete
from nemo_gym_tok.testing.tiny_model.build import MODEL_CONFIG, SEED
from nemo_gym_tok.testing.tiny_model.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    QWEN_ADDED_TOKENS,
    QWEN_PAT_STR,
    build_tokenizer,
    qwen_ranks_file,
    save_tokenizer,
)

__all__ = [
    "ARCHITECTURE",
    "IMAGE_PAD_ID",
    "IMAGE_PROCESSOR_SETTINGS",
    "IMAGE_TOKEN",
    "MERGED_PATCH_PIXELS",
    "REQUIRED_FILES",
    "TEXT_CONFIG",
    "VIDEO_PAD_ID",
    "VISION_CONFIG",
    "VISION_END_ID",
    "VISION_START_ID",
    "VLM_BUILD_FORMAT",
    "build_spec",
    "build_tiny_vlm",
    "default_tiny_vlm_dir",
    "image_pad_count",
    "is_complete",
    "model_config",
    "spec_hash",
    "vision_chat_template",
]

ARCHITECTURE = "PaddleOCRVLForConditionalGeneration"

# Bump when this module changes what it writes, so stale cache entries are not reused.
VLM_BUILD_FORMAT = 1


def _added_id(text: str) -> int:
    """Qwen's id of added token `text` (from the table the tokenizer is built from, so the two cannot disagree)."""
    ids = [token_id for token_id, token_text, _ in QWEN_ADDED_TOKENS if token_text == text]
    if len(ids) != 1:
        raise KeyError(f"{text!r} is not one of Qwen's added tokens")
    return ids[0]


IMAGE_TOKEN = "<|image_pad|>"
VISION_START_ID = _added_id("<|vision_start|>")
VISION_END_ID = _added_id("<|vision_end|>")
IMAGE_PAD_ID = _added_id(IMAGE_TOKEN)
VIDEO_PAD_ID = _added_id("<|video_pad|>")
NAMED_TOKENS = {"image_token": IMAGE_TOKEN}
"""Named on the tokenizer (`tokenizer.image_token`), where transformers' PaddleOCR-VL processor looks for it."""

# The text model's shapes. Its rotary embedding is M-RoPE over 3 axes (time, height, width), as PaddleOCR-VL's: the
# real model splits its 64 rotary frequencies 16/24/24; with head_dim 64 there are 32, split alike 8/12/12.
TEXT_CONFIG: dict[str, Any] = {
    **{key: MODEL_CONFIG[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
    **{key: MODEL_CONFIG[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act")},
    **{key: MODEL_CONFIG[key] for key in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [8, 12, 12]},
    "use_bias": False,
    "bos_token_id": None,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

# One encoder layer, two heads of 64 (vLLM's CPU attention wants head sizes like 64), PaddleOCR-VL's 14 px patches
# merged 2x2. `image_size` only sizes the learned position table (8x8 patches); other grids interpolate it, as the real
# model does from its 27x27.
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 112,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}

MERGED_PATCH_PIXELS = VISION_CONFIG["patch_size"] * VISION_CONFIG["spatial_merge_size"]
"""Side of the square of pixels one image token stands for (28)."""

# transformers' PaddleOCR-VL image processor with its own defaults (bicubic resize, CLIP mean/std, 14 px patches,
# merge 2, temporal patch 1) except the pixel budget: at least 56x56 and at most 112x112 pixels after resizing, so an
# image expands to 4..16 pads (transformers' defaults: 384x384..1536x1536 pixels, 188..3009 pads).
IMAGE_PROCESSOR_SETTINGS: dict[str, Any] = {
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": VISION_CONFIG["patch_size"],
    "merge_size": VISION_CONFIG["spatial_merge_size"],
    "temporal_patch_size": 1,
}
PROCESSOR_CLASS = "PaddleOCRVLProcessor"

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)


def model_config() -> dict[str, Any]:
    """Keyword arguments of transformers' `PaddleOCRVLConfig` for the tiny model."""
    return {
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": TEXT_CONFIG["tie_word_embeddings"],
    }


@lru_cache(maxsize=1)
def vision_chat_template() -> str:
    """Text of our chat template for the vision model (nemo_gym_tok/testing/tiny_model/vision_chat_template.jinja)."""
    return (importlib.resources.files(__package__) / "vision_chat_template.jinja").read_text(encoding="utf-8")


def image_pad_count(width: int, height: int) -> int:
    """How many `<|image_pad|>` ids one image of `width` x `height` pixels expands to (transformers' smart resize:
    each side rounded to a multiple of 28 px, then scaled into the pixel budget keeping the aspect ratio)."""
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import smart_resize

    factor = MERGED_PATCH_PIXELS
    resized_height, resized_width = smart_resize(
        height,
        width,
        factor=factor,
        min_pixels=IMAGE_PROCESSOR_SETTINGS["min_pixels"],
        max_pixels=IMAGE_PROCESSOR_SETTINGS["max_pixels"],
    )
    return (resized_height // factor) * (resized_width // factor)


@lru_cache(maxsize=1)
def build_spec() -> dict[str, Any]:
    """Everything that determines the build's bytes; its hash names the cache dir, so any change rebuilds."""
    return {
        "vlm_build_format": VLM_BUILD_FORMAT,
        "architecture": ARCHITECTURE,
        "seed": SEED,
        "model_config": model_config(),
        "image_processor": IMAGE_PROCESSOR_SETTINGS,
        "processor_class": PROCESSOR_CLASS,
        "named_tokens": NAMED_TOKENS,
        "added_tokens": [list(t) for t in QWEN_ADDED_TOKENS],
        "ranks_sha256": file_sha256(qwen_ranks_file()),
        "pattern": QWEN_PAT_STR,
        "chat_template_sha256": hashlib.sha256(vision_chat_template().encode("utf-8")).hexdigest(),
    }


def spec_hash() -> str:
    """Short, stable hash of `build_spec()`."""
    return hash_spec(build_spec())


def default_tiny_vlm_dir() -> Path:
    """Cache location of the current build spec (it may not be built yet)."""
    return cache_root() / f"paddleocr-vl-tiny-{spec_hash()}"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds a finished build of the current spec."""
    return _is_complete(directory, spec_hash(), REQUIRED_FILES)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_build(out: Path) -> None:
    """Write weights, configs, tokenizer and image-processor settings into `out` (an existing empty directory)."""
    import torch
    from transformers import (
        GenerationConfig,
        PaddleOCRVLConfig,
        PaddleOCRVLForConditionalGeneration,
        PaddleOCRVLImageProcessorPil,
    )

    config = PaddleOCRVLConfig(**model_config())
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = PaddleOCRVLForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    # Only <|im_end|> ends a turn, as in the text model.
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID)
    # transformers writes the original checkpoint's names (model.*, visual.*, mlp_AR.*), the ones vLLM loads.
    model.save_pretrained(str(out), safe_serialization=True)

    tokenizer = build_tokenizer(named_tokens=NAMED_TOKENS)
    tokenizer.chat_template = vision_chat_template()
    save_tokenizer(tokenizer, out, vision_chat_template())

    # The PIL backend is the one transformers picks without torchvision; its saved settings name the processor type
    # both backends share (PaddleOCRVLImageProcessor). The processor class makes AutoProcessor's choice explicit.
    image_processor = PaddleOCRVLImageProcessorPil(**IMAGE_PROCESSOR_SETTINGS)
    settings = loads_exact(image_processor.to_json_string())
    settings["processor_class"] = PROCESSOR_CLASS
    _write_json(out / "preprocessor_config.json", settings)

    write_marker(out, spec_hash(), build_spec())


def build_tiny_vlm(dest: Path | None = None, *, force: bool = False) -> Path:
    """Return a directory holding the tiny vision-language model, building it if needed (a few seconds).

    `dest` None means the cache (`default_tiny_vlm_dir()`). Cached and installed like `build_tiny_model`: a complete
    build of the current spec is reused unless `force`; builds are written to a temp dir next to `dest` and renamed
    into place. Same spec -> byte-identical files. Raises FileExistsError if `dest` is a non-empty directory that is
    not one of our builds.
    """
    target = Path(dest).expanduser().absolute() if dest is not None else default_tiny_vlm_dir()
    return build_cached(
        target, force=force, complete=is_complete, write=_write_build, what="tiny vision-language model"
    )


if __name__ == "__main__":  # python -m nemo_gym_tok.testing.tiny_model.vision [DIR]
    import sys
    import time

    start = time.perf_counter()
    path = build_tiny_vlm(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"{path} ({time.perf_counter() - start:.1f} s)")
