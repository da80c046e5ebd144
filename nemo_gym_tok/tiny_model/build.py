"""Builds (offline, deterministically) and caches the random-weight Qwen3 model directory vLLM serves in tests."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from nemo_gym_tok.tiny_model.tokenizer import (
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

logger = logging.getLogger(__name__)

VOCAB_SIZE = 151936  # Qwen's embedding rows: 151,669 used ids padded up, like the real checkpoints
SEED = 1234

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

# Written last into the temporary build dir; a directory holding it (with a matching hash) is complete.
MARKER_FILE = "ngt_tiny_model.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)

# Partial dirs of builds killed mid-way are removed once they are older than this; a live build takes seconds.
_STALE_PARTIAL_SECONDS = 3600.0


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@lru_cache(maxsize=1)
def build_spec() -> dict[str, Any]:
    """Everything that determines the build's bytes; its hash names the cache dir, so any change rebuilds."""
    return {
        "build_format": BUILD_FORMAT,
        "seed": SEED,
        "model_config": MODEL_CONFIG,
        "added_tokens": [list(t) for t in QWEN_ADDED_TOKENS],
        "ranks_sha256": _file_sha256(qwen_ranks_file()),
        "pattern": QWEN_PAT_STR,
        "chat_template_sha256": hashlib.sha256(chat_template().encode("utf-8")).hexdigest(),
    }


def spec_hash() -> str:
    """Short, stable hash of `build_spec()`."""
    canonical = json.dumps(build_spec(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def cache_root() -> Path:
    """`$NGT_CACHE_DIR` if set, else `~/.cache/nemo_gym_tok`."""
    configured = os.environ.get("NGT_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "nemo_gym_tok"


def default_tiny_model_dir() -> Path:
    """Cache location of the current build spec (it may not be built yet)."""
    return cache_root() / f"qwen3-tiny-{spec_hash()}"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds a finished build of the current spec."""
    try:
        marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("spec_hash") != spec_hash():
        return False
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def _is_replaceable(directory: Path) -> bool:
    """Only empty dirs and earlier builds of ours may be replaced; never delete a user's unrelated directory."""
    if not directory.exists():
        return True
    if not directory.is_dir():
        return False
    return (directory / MARKER_FILE).is_file() or not any(directory.iterdir())


def _write_build(out: Path) -> None:
    """Write model weights, configs and tokenizer into `out` (an existing empty directory)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**MODEL_CONFIG)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    # Only <|im_end|> ends a turn; listing <|endoftext|> too would let a turn end on a token the template never writes.
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(build_tokenizer(), out)
    for path in out.iterdir():
        # transformers writes the weights owner-only; a server running as another user must be able to read them.
        path.chmod(0o644)

    marker = {"spec_hash": spec_hash(), "spec": build_spec()}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _remove_stale_partials(dest: Path) -> None:
    """Delete leftovers of killed builds of `dest` (old temp dirs next to it)."""
    now = time.time()
    for leftover in dest.parent.glob(f".{dest.name}.partial-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_PARTIAL_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _install(built: Path, dest: Path, *, force: bool) -> None:
    """Move the finished temp dir to `dest` with renames, so `dest` is never seen half-written."""
    try:
        os.rename(built, dest)  # atomic; succeeds if dest is absent or an empty directory
        return
    except OSError:
        if not force and is_complete(dest):
            return  # a concurrent build finished first; ours is discarded by the caller
    if not _is_replaceable(dest):
        raise FileExistsError(f"{dest} exists and is not a nemo_gym_tok tiny-model build; refusing to replace it")
    aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, aside)
    try:
        os.rename(built, dest)
    except OSError:
        if not is_complete(dest):
            raise
    shutil.rmtree(aside, ignore_errors=True)


def build_tiny_model(dest: Path | None = None, *, force: bool = False) -> Path:
    """Return a directory holding the tiny Qwen3 model (weights, configs, tokenizer), building it if needed.

    `dest` None means the cache (`default_tiny_model_dir()`). A complete build of the current spec is
    returned immediately unless `force`. Builds go to a temp dir next to `dest` and are renamed into place,
    so a killed build never leaves a directory that looks complete. Same spec -> byte-identical files.
    Raises FileExistsError if `dest` is a non-empty directory that is not one of our builds.
    """
    target = Path(dest).expanduser().absolute() if dest is not None else default_tiny_model_dir()
    if not force and is_complete(target):
        return target
    if not _is_replaceable(target):
        raise FileExistsError(f"{target} exists and is not a nemo_gym_tok tiny-model build; refusing to replace it")

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    # mkdtemp makes it owner-only; a model dir is ordinary readable data (a server may run as another user).
    staging.chmod(0o755)
    logger.info("building tiny model into %s", target)
    try:
        _write_build(staging)
        _install(staging, target, force=force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
