"""A trainer's current weights as a Hugging Face directory a vLLM server can reload: weights, config, tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

SIDE_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
    "generation_config",
)
"""Files of the source model directory a checkpoint needs beside what `save_pretrained` writes for the model."""


def save_checkpoint(model: Any, source_dir: str | Path, dest: str | Path) -> Path:
    """`model.save_pretrained(dest)` (safetensors, in the model's dtype) plus the source model directory's tokenizer,
    chat template and generation config where the model did not write them, so `dest` is a model directory on its
    own. `dest` must not exist yet."""
    source, target = Path(source_dir), Path(dest)
    if target.exists():
        raise FileExistsError(f"{target} exists: each step's checkpoint goes to a new directory")
    model.save_pretrained(str(target), safe_serialization=True)
    for path in source.iterdir():
        if path.is_file() and path.name.startswith(SIDE_FILE_PREFIXES) and not (target / path.name).exists():
            shutil.copy(path, target / path.name)
    for path in target.iterdir():
        path.chmod(0o644)  # a server running as another user must be able to read them
    return target
