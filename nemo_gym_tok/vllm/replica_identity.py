"""Which replica served a call and what decides its ids there: `replica` and `model_fingerprint` on each bundle."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, fingerprint_of
from nemo_gym_tok.types.tokens import REPLICA_KEY

logger = logging.getLogger("nemo_gym_tok.vllm.replica_identity")

REPLICA_ENV = "NEMO_GYM_TOK_REPLICA"
"""The name this server gives itself on every bundle; unset, `http://HOST:PORT` from its own command line (loopback
replicas then carry the URL a router lists them by)."""
_VLLM_DEFAULT_PORT = "8000"

# Learned once per API-server process at start-up (the warmup wrapper), read on every bundle.
_identity: dict[str, Any] = {}


def learn(online: Any) -> None:
    """Read this server's name and fingerprint from vLLM's renderer: the tokenizer it loaded and the chat template it
    renders with (its `--chat-template` when given). A tokenizer without a tokenizer.json this process can read is not
    fingerprinted: the bundles then carry `replica` alone, and a fleet check says it cannot compare."""
    _identity.clear()
    _identity[REPLICA_KEY] = replica_name(sys.argv, os.environ)
    try:
        tokenizer = online.renderer.get_tokenizer()
        template = online.chat_template or getattr(tokenizer, "chat_template", None)
        tokenizer_json = _tokenizer_json(online.model_config)
    except Exception as exc:  # noqa: BLE001 - serving goes on; only the fingerprint is unknown
        logger.warning("nemo_gym_tok: no model fingerprint for this server's bundles (%s)", exc)
        return
    if tokenizer_json is None:
        logger.warning("nemo_gym_tok: no tokenizer.json found for %s; bundles carry no model_fingerprint", online)
        return
    _identity[FINGERPRINT_KEY] = fingerprint_of(tokenizer_json, template)


def served_by_fields() -> dict[str, Any]:
    """`replica` and `model_fingerprint` as a bundle carries them ({} before start-up learned them)."""
    fields = dict(_identity)
    if FINGERPRINT_KEY in fields:
        fields[FINGERPRINT_KEY] = dict(fields[FINGERPRINT_KEY])
    return fields


def replica_name(argv: Sequence[str], environ: Any) -> str:
    """$NEMO_GYM_TOK_REPLICA, else `http://HOST:PORT` from vLLM's `--host` / `--port` (a wildcard or missing host is
    this machine's name, the port vLLM's default when not given)."""
    named = environ.get(REPLICA_ENV)
    if named:
        return str(named)
    host = _flag(argv, "--host") or ""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://{host}:{_flag(argv, '--port') or _VLLM_DEFAULT_PORT}"


def _flag(argv: Sequence[str], name: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _tokenizer_json(model_config: Any) -> bytes | None:
    """The served tokenizer's tokenizer.json: in its directory, else in the Hugging Face cache vLLM loaded it from."""
    source = str(model_config.tokenizer)
    local = Path(source) / "tokenizer.json"
    if local.is_file():
        return local.read_bytes()
    from huggingface_hub import try_to_load_from_cache

    revision = getattr(model_config, "tokenizer_revision", None)
    cached = try_to_load_from_cache(source, "tokenizer.json", revision=revision)
    return Path(cached).read_bytes() if isinstance(cached, str) else None
