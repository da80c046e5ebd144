"""The problem this project exists for, measured on stock vLLM: re-rendered history drifts from the model's ids."""

from __future__ import annotations

import asyncio

import httpx

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.vllm_server import VLLMServer

CONVERSATIONS = 20
MIN_DRIFTING = 15  # measured: 19 of 20 at 96 generated tokens (17 at 48, 12 at 24)


async def _turn_one_then_retokenize(http: httpx.AsyncClient, model: str, seed: int) -> bool:
    """True when /tokenize of [user, assistant(text), user] does not start with turn 1's prompt+generation ids."""
    first_user = {"role": "user", "content": f"Conversation {seed}: describe a place you would like to visit."}
    turn = await http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [first_user],
            "max_tokens": 96,
            "seed": seed,
            "temperature": 1.0,
            "return_token_ids": True,
        },
    )
    turn.raise_for_status()
    body = turn.json()
    model_ids = body["prompt_token_ids"] + body["choices"][0]["token_ids"]
    history = [
        first_user,
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Why that one?"},
    ]
    retokenized = await http.post(
        "/tokenize", json={"model": model, "messages": history, "add_generation_prompt": True}
    )
    retokenized.raise_for_status()
    return retokenized.json()["tokens"][: len(model_ids)] != model_ids


async def _drift_count(server: VLLMServer) -> int:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=pool_limits()) as http:
        drifted = await asyncio.gather(
            *(_turn_one_then_retokenize(http, server.served_model_name, seed) for seed in range(CONVERSATIONS))
        )
    return sum(drifted)


def test_stock_vllm_retokenization_drifts(vllm_server: VLLMServer) -> None:
    drifting = asyncio.run(_drift_count(vllm_server))
    print(f"\nretokenization drift on stock vLLM: {drifting}/{CONVERSATIONS} two-turn conversations")
    assert drifting >= MIN_DRIFTING, f"only {drifting}/{CONVERSATIONS} drifted; the fixture no longer reproduces drift"
