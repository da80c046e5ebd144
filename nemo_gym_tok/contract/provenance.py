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


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
"""The files a Hugging Face tokenizer is loaded from: its vocabulary and merges, its added and special tokens and their
flags (tokenizer_config.json, which often holds the chat template too). A byte changed in any may change the ids."""

FINGERPRINT_PARTS = (
    ("tokenizer_sha256", "the tokenizer's files"),
    ("chat_template_sha256", "the chat template"),
    ("chat_template_kwargs_sha256", "the server's default chat template kwargs"),
)
"""A fingerprint's parts, each what it covers in words: everything that decides the rendered prompt and its ids."""


def tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The TOKENIZER_FILES a directory holds, by name."""
    root = Path(model_dir)
    return {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}


def model_fingerprint(model_dir: str | Path, template_kwargs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The fingerprint of a model directory's tokenizer files and chat template, rendered with `template_kwargs` (a
    server's --default-chat-template-kwargs; none for a directory alone). Raises OSError when the directory holds no
    tokenizer file."""
    files = tokenizer_files(model_dir)
    if not files:
        raise OSError(f"{model_dir} holds none of the tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return fingerprint_of(files, chat_template_text(model_dir), template_kwargs)


def fingerprint_of(
    files: Mapping[str, bytes],
    chat_template: str | dict[str, Any] | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """sha256 of the tokenizer's files (each named), of the chat template's text and of the default template kwargs,
    and one `sha256` over the three (what checks compare): what `model_fingerprint` reads from a directory, and what
    the vLLM hook computes from the tokenizer, template and kwargs the server actually serves (a `--chat-template`
    override included), so the two compare. A tokenizer's named templates (a dict) are hashed as sorted JSON, as
    tokenizer_config.json holds them."""
    if isinstance(chat_template, dict):
        chat_template = json.dumps(chat_template, sort_keys=True)
    tokenizer = hashlib.sha256()
    for name in sorted(files):
        tokenizer.update(f"{name}\0{len(files[name])}\0".encode())
        tokenizer.update(files[name])
    template = hashlib.sha256((chat_template or "").encode("utf-8")).hexdigest()
    kwargs_text = json.dumps(dict(template_kwargs or {}), sort_keys=True, separators=(",", ":"), default=repr)
    kwargs = hashlib.sha256(kwargs_text.encode("utf-8")).hexdigest()
    parts = {"tokenizer_sha256": tokenizer.hexdigest(), "chat_template_sha256": template}
    parts["chat_template_kwargs_sha256"] = kwargs
    combined = hashlib.sha256(":".join(parts[key] for key, _ in FINGERPRINT_PARTS).encode("ascii")).hexdigest()
    return {"sha256": combined, **parts}


def fingerprint_difference(expected: Mapping[str, str], found: Mapping[str, str]) -> str:
    """What differs between two fingerprints, in words ("the chat template", "the tokenizer's files", ...)."""
    parts = [what for key, what in FINGERPRINT_PARTS if expected.get(key) != found.get(key)]
    return " and ".join(parts) or "the combined sha256"


def record_fingerprints(record: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The distinct (tokenizer_sha256, chat_template_sha256) of a rollout record's model calls: what a model directory
    can be held to (a server's default template kwargs are not in the directory). Empty for older records: those
    written before the fingerprint existed, or before it covered every tokenizer file (another recipe)."""
    output = (record.get("response") or {}).get("output") or []
    found = set()
    for item in output:
        fingerprint = item.get(FINGERPRINT_KEY) if isinstance(item, dict) else None
        if isinstance(fingerprint, dict) and all(isinstance(fingerprint.get(key), str) for key, _ in FINGERPRINT_PARTS):
            found.add((fingerprint["tokenizer_sha256"], fingerprint["chat_template_sha256"]))
    return found
