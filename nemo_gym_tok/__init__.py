"""nemo_gym_tok: a NeMo-Gym-style RL gym whose every layer keeps token ids exact from turn to turn.

The public API is re-exported here and imported on first use, so `ngt` and the vLLM plugin stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # configs and servers
    "load_config": "nemo_gym_tok.config",
    "ConfigError": "nemo_gym_tok.config",
    "Gym": "nemo_gym_tok.servers.launcher",
    "ResourcesServer": "nemo_gym_tok.servers.base",
    "BaseServerConfig": "nemo_gym_tok.servers.base",
    "EpisodeStore": "nemo_gym_tok.servers.episode_store",
    "ApiError": "nemo_gym_tok.servers.api_errors",
    "ServerClient": "nemo_gym_tok.servers.client",
    # rollouts and training data
    "collect": "nemo_gym_tok.collect",
    "rollout_to_training_sequence": "nemo_gym_tok.records.training",
    "rollout_to_training_sequences": "nemo_gym_tok.records.training",
    "TrainingSequence": "nemo_gym_tok.records.training",
    "bundled_turns": "nemo_gym_tok.records.contiguity",
    "check_contiguous": "nemo_gym_tok.records.contiguity",
    "NotContiguousError": "nemo_gym_tok.records.contiguity",
    # the token contract and its algorithms
    "ChatCompletionRequest": "nemo_gym_tok.types",
    "ResponsesRequest": "nemo_gym_tok.types",
    "splice_prompt": "nemo_gym_tok.splice",
    "detect_profile": "nemo_gym_tok.splice",
    "HFChatRenderer": "nemo_gym_tok.splice",
    "resolve_bundle": "nemo_gym_tok.contract.token_sources",
    # the embedded model and vLLM
    "build_tiny_model": "nemo_gym_tok.testing.tiny_model",
    "VLLMServer": "nemo_gym_tok.vllm_server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_gym_tok' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
