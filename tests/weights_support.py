"""Test harness for weight pushes: checkpoints derived from the tiny model, and log probs served vs recomputed."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import httpx

from nemo_gym_tok.testing.tiny_model.build import MARKER_FILE

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# A fixed sequence of ordinary ids (no special tokens) whose prompt log probs are compared: 48 ids as in the issue.
PROBE_IDS = tuple(range(1000, 1048))
MODEL_FILES = ("config.json", "model.safetensors")


def copy_model_dir(source: Path, dest: Path) -> Path:
    """A plain copy of a model directory (without the cache's build marker) that a server can be started from."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(MARKER_FILE, "*.lock"))
    return dest


def _copy_side_files(source: Path, dest: Path) -> None:
    """Tokenizer and generation config: what `save_pretrained` of a model alone does not write."""
    for path in source.iterdir():
        if path.is_file() and path.name not in (*MODEL_FILES, MARKER_FILE) and path.suffix != ".lock":
            shutil.copy(path, dest / path.name)


def perturbed_checkpoint(source: Path, dest: Path, *, seed: int, scale: float = 0.3, untie: bool = False) -> Path:
    """Every weight of `source` plus seeded noise (`scale` x each tensor's std), saved in float32 to `dest`; with
    `untie`, the output layer becomes a separate copy of the embedding (an untied model) before the noise."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if untie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if scale:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.float().std() * scale)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    _copy_side_files(source, dest)
    return dest


def recomputed_log_probs(model_dir: Path, ids: Sequence[int] = PROBE_IDS) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) by transformers in float32 on the CPU: what a trainer holding those weights gets."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].float(), dim=-1)
    return [log_probs[index, ids[index + 1]].item() for index in range(len(ids) - 1)]


def served_log_probs(
    base_url: str, model: str, ids: Sequence[int] = PROBE_IDS, api_key: str | None = None
) -> list[float]:
    """The same log probs as the vLLM server at `base_url` computes them (its prompt log probs)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    positions = response.json()["choices"][0]["prompt_logprobs"]
    return [float(positions[index + 1][str(ids[index + 1])]["logprob"]) for index in range(len(ids) - 1)]


def mean_and_max_gap(served: Sequence[float], recomputed: Sequence[float]) -> tuple[float, float]:
    gaps = [abs(a - b) for a, b in zip(served, recomputed, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)


def weight_version(base_url: str) -> str:
    """vLLM's current weight version label (its `/weight_info`, served with VLLM_SERVER_DEV_MODE=1)."""
    answer = httpx.get(f"{base_url}/weight_info", timeout=30)
    assert answer.status_code == 200, "the test servers run with VLLM_SERVER_DEV_MODE=1 (conftest.py)"
    return str(answer.json()["weight_version"])


def set_weight_version(base_url: str, version: str) -> None:
    """Set vLLM's label alone (its `/update_weight_version`), without a weight push."""
    answer = httpx.post(f"{base_url}/update_weight_version", json={"new_version": version}, timeout=30)
    assert answer.status_code == 200, answer.text


def pause_keeping_requests(base_url: str) -> None:
    """Freeze the engine with its calls in it (vLLM's `/pause?mode=keep`), as a push does."""
    answer = httpx.post(f"{base_url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60)
    assert answer.status_code == 200, answer.text


def resume(base_url: str) -> None:
    answer = httpx.post(f"{base_url}/resume", timeout=60)
    assert answer.status_code == 200, answer.text


def checkpoint_without(source: Path, dest: Path, tensor: str) -> Path:
    """A copy of the checkpoint `source` whose weights file lacks `tensor`: vLLM's reload loads every other tensor and
    only logs the missing one."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    del weights[tensor]
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


MATCH_NATS = 0.01
"""Served log probs equal the trainer's weights to this, nats mean (float32 recompute against the server)."""


def assert_serves(
    base_url: str, checkpoint: Path, api_key: str | None = None, model: str = "tiny-qwen3"
) -> list[float]:
    """The served log probs of the fixed probe text, asserted within MATCH_NATS of `checkpoint`'s own; returned."""
    served = served_log_probs(base_url, model, api_key=api_key)
    mean, largest = mean_and_max_gap(served, recomputed_log_probs(checkpoint))
    print(f"served vs {checkpoint.name} recomputed (float32): {mean:.4f} nats mean, {largest:.4f} max")
    assert mean < MATCH_NATS, f"{base_url} serves log probs {mean:.4f} nats mean ({largest:.4f} max) off {checkpoint}"
    return served
