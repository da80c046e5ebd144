"""Which replica served a call and what decides its ids there: `replica` and `model_fingerprint` on each bundle."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, TOKENIZER_FILES, fingerprint_of, tokenizer_files
from nemo_gym_tok.types.tokens import REPLICA_KEY

logger = logging.getLogger("nemo_gym_tok.vllm.replica_identity")

REPLICA_ENV = "NEMO_GYM_TOK_REPLICA"
"""The name this server gives itself on every bundle; unset, `http://HOST:PORT` from its own command line (loopback
replicas then carry the URL a router lists them by)."""
_VLLM_DEFAULT_PORT = "8000"

# Learned once per API-server process at start-up (the warmup wrapper), read on every bundle.
_identity: dict[str, Any] = {}


def learn(online: Any) -> None:
    """Read this server's name and fingerprint from vLLM's renderer: the tokenizer files it loaded, the chat template
    it renders with (its `--chat-template` when given) and its default template kwargs. A tokenizer of which this
    process can read no file is not fingerprinted: the bundles then carry `replica` alone, and an adapter in front
    of a hooked fleet refuses such an answer."""
    _identity.clear()
    _identity[REPLICA_KEY] = replica_name(sys.argv, os.environ)
    try:
        tokenizer = online.renderer.get_tokenizer()
        template = online.chat_template or getattr(tokenizer, "chat_template", None)
        kwargs = getattr(online, "default_chat_template_kwargs", None) or {}
        files = _tokenizer_files(online.model_config)
    except Exception as exc:  # noqa: BLE001 - serving goes on; only the fingerprint is unknown
        logger.warning("nemo_gym_tok: no model fingerprint for this server's bundles (%s)", exc)
        return
    if not files:
        logger.warning("nemo_gym_tok: no tokenizer file found for %s; bundles carry no model_fingerprint", online)
        return
    _identity[FINGERPRINT_KEY] = fingerprint_of(files, template, kwargs)


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


def _tokenizer_files(model_config: Any) -> dict[str, bytes]:
    """The served tokenizer's files (TOKENIZER_FILES): in its directory, else in the Hugging Face cache vLLM loaded
    them from."""
    source = str(model_config.tokenizer)
    if Path(source).is_dir():
        return tokenizer_files(source)
    from huggingface_hub import try_to_load_from_cache

    revision = getattr(model_config, "tokenizer_revision", None)
    found = {}
    for name in TOKENIZER_FILES:
        cached = try_to_load_from_cache(source, name, revision=revision)
        if isinstance(cached, str):
            found[name] = Path(cached).read_bytes()
    return found
