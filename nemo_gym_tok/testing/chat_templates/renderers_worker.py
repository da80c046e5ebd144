"""Runs inside .venv-renderers: answers render and bridge requests with Prime Intellect's `renderers` (JSON lines).

Run by path (`.venv-renderers/bin/python renderers_worker.py`), never imported: that venv holds `renderers` and
transformers only, not this project (renderers' openai-harmony would overwrite the module vLLM's oss-harmony owns).
Each stdin line is one job: {"tokenizer_dir", "renderer", "config", "renders": [...], "bridges": [...]}; each stdout
line answers it with {"renders": [...], "bridges": [...]} or {"error": "..."}. A render answers its ids or an error;
a bridge answers `bridge_to_next_turn`'s ids, null when renderers declines to bridge, or an error.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

_LOADED: dict[str, Any] = {}


def _tokenizer(tokenizer_dir: str) -> Any:
    """The tokenizer saved in `tokenizer_dir`, loaded once: the driver sends several jobs per template (over a second
    each to load a 150k vocabulary), and only the last template's is kept."""
    from transformers import PreTrainedTokenizerFast

    if tokenizer_dir not in _LOADED:
        _LOADED.clear()
        _LOADED[tokenizer_dir] = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    return _LOADED[tokenizer_dir]


def _renderer(tokenizer_dir: str, name: str, config: dict[str, Any]) -> Any:
    from renderers import create_renderer
    from renderers.configs import config_from_name

    tokenizer = _tokenizer(tokenizer_dir)
    typed = config_from_name(name)
    if config:
        typed = typed.model_copy(update=config)
    return create_renderer(tokenizer, typed)


def _failure(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def _job(job: dict[str, Any]) -> dict[str, Any]:
    renderer = _renderer(job["tokenizer_dir"], job["renderer"], job.get("config") or {})
    renders: list[Any] = []
    for item in job.get("renders", []):
        try:
            renders.append(renderer.render_ids(item["messages"], tools=item.get("tools"), add_generation_prompt=True))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which counts it
            renders.append(_failure(exc))
    bridges: list[Any] = []
    for item in job.get("bridges", []):
        try:
            bridged = renderer.bridge_to_next_turn(
                item["prompt"], item["completion"], item["new_messages"], tools=item.get("tools")
            )
            bridges.append(None if bridged is None else list(bridged.token_ids))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which counts it
            bridges.append(_failure(exc))
    return {"renders": renders, "bridges": bridges}


def main() -> None:
    for line in sys.stdin:
        try:
            answer = _job(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - the renderer could not be built: the driver says why
            answer = {"error": f"{type(exc).__name__}: {exc}"[:400], "trace": traceback.format_exc()[-2000:]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
