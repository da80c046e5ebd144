"""Gym configs the tests and the soak start: the demo composition with its model adapter behind a vllm-router."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
_BASE_URL_LINE = "      base_url: ${policy_base_url}\n"


def demo_config_behind_router(directory: Path, workers: Sequence[str], *, policy: str | None = None) -> Path:
    """configs/demo.yaml with its adapter's base_url replaced by a `router` over `workers` (`ngt run` starts it),
    written into `directory`; needs policy_model_name set (an override)."""
    text = DEMO_CONFIG.read_text()
    if _BASE_URL_LINE not in text:
        raise ValueError(f"{DEMO_CONFIG} no longer has the line {_BASE_URL_LINE.strip()!r} this helper replaces")
    router = f"      router:\n        worker_urls: {json.dumps(list(workers))}\n"
    if policy is not None:
        router += f"        policy: {policy}\n"
    path = directory / "demo_behind_router.yaml"
    path.write_text(text.replace(_BASE_URL_LINE, router))
    return path
