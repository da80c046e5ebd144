"""Whether the adapter's tokenizer load may ask the Hugging Face hub, decided in seconds, not after its retries."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

PROBE_SECONDS = 2.0
"""How long the hub gets to answer one HEAD before it counts as unreachable; HF_HUB_ETAG_TIMEOUT, the hub client's
own wait for file metadata, overrides it (a slow link that answers late is still the hub)."""


def probe_seconds() -> float:
    try:
        return float(os.environ["HF_HUB_ETAG_TIMEOUT"])
    except (KeyError, ValueError):
        return PROBE_SECONDS


async def hub_unreachable(source: str) -> str | None:
    """Why the hub cannot serve `source` now, or None when the normal load may go ahead: `source` is a directory (or
    no hub name at all), the hub client is offline (HF_HUB_OFFLINE: it reads its cache only, at once), or the hub
    answered the probe.

    Without this a hub id that is not cached costs about 50 s offline: huggingface_hub retries each file's metadata
    call with backoff and a 60 s timeout before transformers gives up."""
    if Path(source).is_dir():
        return None
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:  # a missing directory, not a hub name: the load's own error says so, at once
        return None
    if constants.HF_HUB_OFFLINE:
        return None
    limit = probe_seconds()
    try:
        # The thread's own timeout does not cover a name lookup that hangs; the wait here bounds it.
        return await asyncio.wait_for(asyncio.to_thread(_probe, constants.ENDPOINT, limit), limit + 1)
    except TimeoutError:
        return f"no answer within {limit + 1:g} s"


def _probe(endpoint: str, limit: float) -> str | None:
    from huggingface_hub import get_session

    try:
        # The hub client's own session, so its proxies, certificates and headers apply to the probe as to the load.
        status = get_session().head(endpoint, timeout=limit).status_code
    except Exception as exc:  # noqa: BLE001 - whatever stops the HEAD (refused, timed out, no DNS) stops the load too
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # A 5xx is what the hub client retries for a minute; anything else means the hub is there to ask.
    return f"it answered HTTP {status}" if status >= 500 else None


def offline_advice(source: str, reason: str) -> str:
    """The 502's explanation when the hub is unreachable and `source` is not in the local cache."""
    from huggingface_hub import constants

    return (
        f"the Hugging Face hub at {constants.ENDPOINT} cannot be reached ({reason}) and {source!r} is not in the local "
        f"cache ({constants.HF_HUB_CACHE}). Set vllm_model.tokenizer to the model's directory, or cache the model "
        f"where the hub is reachable (`hf download {source}`) and set HF_HUB_OFFLINE=1 to use the cache without asking "
        "the hub"
    )
