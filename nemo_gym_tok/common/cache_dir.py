"""Where this package keeps what it builds or downloads once: built test models, cached vLLM wheels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "NGT_CACHE_DIR"


def cache_root() -> Path:
    """`$NGT_CACHE_DIR` if set, else `~/.cache/nemo_gym_tok`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "nemo_gym_tok"
