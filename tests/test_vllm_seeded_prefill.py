"""The test bed survives the request shape that killed vLLM's CPU engine: seeded prompts outgrowing a step's budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.vllm_server import TEST_BED_ARGS, VLLMServer

# With chunked prefill, vLLM 0.32's CPU engine splits a prompt across steps when the step's token budget runs out,
# and a seeded request then dies in the sampler ("CPU Generator does not use offset"), taking the engine with it.
# Two shapes reach that split: several seeded prompts arriving together whose ids exceed one step's budget, and one
# seeded prompt longer than the budget by itself (2,048 ids by default on CPU). Measured: vLLM started with the test
# bed's old flags (chunked prefill on, default budget) answers this burst with 500s and its engine is dead.
BUDGET = int(TEST_BED_ARGS[TEST_BED_ARGS.index("--max-num-batched-tokens") + 1])
CONCURRENT = 6
CONCURRENT_PROMPT_IDS = 1000
LONG_PROMPT_IDS = 3000


def prompt(length: int, offset: int) -> list[int]:
    # Plain ids of the tiny model's vocabulary, distinct per request so no prefix cache merges them.
    return [1000 + (offset * 7919 + i * 31) % 100_000 for i in range(length)]


async def complete(http: httpx.AsyncClient, server: VLLMServer, ids: list[int], seed: int) -> httpx.Response:
    body: dict[str, Any] = {
        "model": server.served_model_name,
        "prompt": ids,
        "max_tokens": 4,
        "seed": seed,
        "temperature": 1.0,
    }
    return await http.post(f"{server.base_url}/v1/completions", json=body)


def test_seeded_prompts_beyond_a_steps_budget_leave_the_engine_alive(vllm_server: VLLMServer) -> None:
    assert "--no-enable-chunked-prefill" in TEST_BED_ARGS, "the test bed must not chunk prefills on the CPU build"
    assert CONCURRENT * CONCURRENT_PROMPT_IDS > BUDGET and LONG_PROMPT_IDS < BUDGET

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, limits=pool_limits()) as http:
            calls = [complete(http, vllm_server, prompt(CONCURRENT_PROMPT_IDS, i), seed=i) for i in range(CONCURRENT)]
            calls.append(complete(http, vllm_server, prompt(LONG_PROMPT_IDS, CONCURRENT), seed=CONCURRENT))
            return await asyncio.gather(*calls)

    started = time.monotonic()
    answers = asyncio.run(burst())
    elapsed = time.monotonic() - started

    assert [answer.status_code for answer in answers] == [200] * (CONCURRENT + 1), [a.text[:300] for a in answers]
    for answer, length in zip(answers, [CONCURRENT_PROMPT_IDS] * CONCURRENT + [LONG_PROMPT_IDS]):
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] == length and usage["completion_tokens"] >= 1
    assert httpx.get(f"{vllm_server.base_url}/health", timeout=10).status_code == 200
    again = asyncio.run(_one(vllm_server))  # the engine still generates, not only answers /health
    assert again.status_code == 200, again.text
    assert vllm_server.process is None or vllm_server.process.alive, "vLLM exited"
    print(
        f"\nseeded burst: {CONCURRENT} x {CONCURRENT_PROMPT_IDS} + 1 x {LONG_PROMPT_IDS} prompt ids "
        f"(step budget {BUDGET}) answered in {elapsed:.1f}s; server healthy"
    )


async def _one(server: VLLMServer) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120, limits=pool_limits()) as http:
        return await complete(http, server, prompt(16, 99), seed=99)
