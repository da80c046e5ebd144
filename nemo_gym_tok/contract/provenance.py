"""What a trainer needs to trust a call's log probs: effective sampling parameters and the tokenizer's fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact

SAMPLING_KEY = "sampling"
FINGERPRINT_KEY = "model_fingerprint"

LOGPROBS_MODE = "raw_logprobs"
"""vLLM 0.32's `--logprobs-mode` default: log probs of the model's distribution before temperature, penalties and
top-k/top-p (a grammar's mask still applies: see constrained_by). The server's flag is not visible to the adapter."""

# vLLM's ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS: what applies when neither the request nor the model's
# generation_config.json sets a parameter.
VLLM_DEFAULTS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
# The generation_config.json keys vLLM (ModelConfig.get_diff_sampling_param, --generation-config auto) reads as
# server defaults; max_new_tokens becomes max_tokens.
_GENERATION_CONFIG_KEYS = (*VLLM_DEFAULTS, "max_new_tokens")


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults vLLM takes from `model_dir`'s generation_config.json ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = loads_exact(path.read_text(encoding="utf-8"))
    defaults = {key: config[key] for key in _GENERATION_CONFIG_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def effective_sampling(body: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """The parameters vLLM sampled with for chat body `body`: request, else model default, else vLLM's default.

    `defaults` is generation_defaults() of the served model, None when the adapter could not read it (then
    `generation_config` is false and the values are the request's and vLLM's own). `max_tokens` None means vLLM's
    limit was the remaining context.
    """
    model = dict(defaults or {})
    sampling = {
        name: body[name] if body.get(name) is not None else model.get(name, default)
        for name, default in VLLM_DEFAULTS.items()
    }
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    sampling["max_tokens"] = requested if requested is not None else model.get("max_tokens")
    sampling["seed"] = body.get("seed")
    sampling["logprobs_mode"] = LOGPROBS_MODE
    sampling["generation_config"] = defaults is not None
    return sampling


def chat_template_text(model_dir: str | Path) -> str | None:
    """The chat template a tokenizer directory ships: chat_template.jinja, else tokenizer_config.json's."""
    root = Path(model_dir)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        template = loads_exact(config_path.read_text(encoding="utf-8")).get("chat_template")
        if template is not None:
            return template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return None


def model_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """sha256 of tokenizer.json and of the chat template text, and one `sha256` over both (what checks compare).

    Raises OSError when `model_dir` has no tokenizer.json (a tokenizer of another format is not fingerprinted).
    """
    return fingerprint_of((Path(model_dir) / "tokenizer.json").read_bytes(), chat_template_text(model_dir))


def fingerprint_of(tokenizer_json: bytes, chat_template: str | dict[str, Any] | None) -> dict[str, str]:
    """The fingerprint of a tokenizer.json's bytes and a chat template's text: what `model_fingerprint` reads from a
    directory, and what the vLLM hook computes from the tokenizer and template the server actually serves (a
    `--chat-template` override included), so the two compare. A tokenizer's named templates (a dict) are hashed as
    sorted JSON, as tokenizer_config.json holds them."""
    if isinstance(chat_template, dict):
        chat_template = json.dumps(chat_template, sort_keys=True)
    tokenizer = hashlib.sha256(tokenizer_json).hexdigest()
    template = hashlib.sha256((chat_template or "").encode("utf-8")).hexdigest()
    combined = hashlib.sha256(f"{tokenizer}:{template}".encode("ascii")).hexdigest()
    return {"sha256": combined, "tokenizer_sha256": tokenizer, "chat_template_sha256": template}


def fingerprint_difference(expected: Mapping[str, str], found: Mapping[str, str]) -> str:
    """What differs between two fingerprints, in words ("the chat template", "the tokenizer", or both)."""
    parts = [
        what
        for key, what in (("tokenizer_sha256", "the tokenizer"), ("chat_template_sha256", "the chat template"))
        if expected.get(key) != found.get(key)
    ]
    return " and ".join(parts) or "the combined sha256"


def record_fingerprints(record: Mapping[str, Any]) -> set[str]:
    """The distinct `model_fingerprint.sha256` of a rollout record's model calls (empty for older records)."""
    output = (record.get("response") or {}).get("output") or []
    return {
        item[FINGERPRINT_KEY]["sha256"]
        for item in output
        if isinstance(item, dict)
        and isinstance(item.get(FINGERPRINT_KEY), dict)
        and item[FINGERPRINT_KEY].get("sha256")
    }
