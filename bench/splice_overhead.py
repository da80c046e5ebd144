"""What the prefix splice costs: the same histories sent with and without a bundle, side by side on one server.

    .venv/bin/python bench/splice_overhead.py                 # starts a hooked vLLM on the tiny model (~50 s)
    .venv/bin/python bench/splice_overhead.py --vllm-url URL  # or uses one already serving it as tiny-qwen3

Per history size it reports the median latency of `/tokenize` and of a 1-token chat completion, stock (no bundle:
vLLM templates the text) and spliced (bundle on the last assistant message: the hook renders the history a second
time and splices), and the ratio spliced / stock. Requests alternate between the two kinds, so drift in machine
load hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx
from transformers import AutoTokenizer

from nemo_gym_tok.tiny_model import build_tiny_model
from nemo_gym_tok.vllm.server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer

MODEL = "tiny-qwen3"
GENERATED_PER_TURN = 64


def history(http: httpx.Client, tokenizer: Any, turns: int, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(stock messages, bundled messages) of `turns` user/assistant pairs and a final user message."""
    stock: list[dict] = []
    bundled: list[dict] = []
    for turn in range(turns):
        user = {"role": "user", "content": f"Question {turn}: what comes next in the plan?"}
        stock.append(user)
        bundled.append(user)
        generation = [rng.randrange(1000, 150000) for _ in range(GENERATED_PER_TURN)]
        text = tokenizer.decode(generation)
        stock.append({"role": "assistant", "content": text})
        assistant = {"role": "assistant", "content": text}
        if turn == turns - 1:  # the hook uses the last bundle only
            prompt = http.post("/tokenize", json={"model": MODEL, "messages": bundled[:-1] + [user],
                                                  "add_generation_prompt": True}).json()["tokens"]
            assistant |= {"prompt_token_ids": prompt, "generation_token_ids": generation,
                          "generation_log_probs": [0.0] * len(generation)}
        bundled.append(assistant)
    closing = {"role": "user", "content": "Go on."}
    return stock + [closing], bundled + [closing]


def timed(http: httpx.Client, path: str, body: dict) -> float:
    started = time.perf_counter()
    answer = http.post(path, json=body)
    elapsed = time.perf_counter() - started
    answer.raise_for_status()
    return elapsed * 1000


def measure(http: httpx.Client, stock: list[dict], bundled: list[dict], repeats: int) -> dict[str, tuple[float, float]]:
    results: dict[str, tuple[float, float]] = {}
    for name, path, extra in (("tokenize", "/tokenize", {"add_generation_prompt": True}),
                              ("chat, 1 token", "/v1/chat/completions", {"max_tokens": 1, "seed": 0})):
        stock_ms, spliced_ms = [], []
        for _ in range(repeats):
            stock_ms.append(timed(http, path, {"model": MODEL, "messages": stock, **extra}))
            spliced_ms.append(timed(http, path, {"model": MODEL, "messages": bundled, **extra}))
        results[name] = (statistics.median(stock_ms), statistics.median(spliced_ms))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-url", help=f"a hooked vLLM serving the tiny model as {MODEL!r}")
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 8, 32], help="assistant turns per history")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model_dir = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = None
    url = args.vllm_url
    if not url:
        server = VLLMServer(model_dir, served_model_name=MODEL, extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
                            env=TEST_BED_ENV).start()
        url = server.base_url
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            rng = random.Random(0)
            print(f"{'turns':>5} {'prompt ids':>10}  {'request':<14} {'stock ms':>9} {'spliced ms':>10} {'ratio':>6}")
            for turns in args.turns:
                stock, bundled = history(http, tokenizer, turns, rng)
                size = len(http.post("/tokenize", json={"model": MODEL, "messages": bundled,
                                                        "add_generation_prompt": True}).json()["tokens"])
                timed(http, "/v1/chat/completions", {"model": MODEL, "messages": bundled, "max_tokens": 1})  # warm-up
                for name, (stock_ms, spliced_ms) in measure(http, stock, bundled, args.repeats).items():
                    print(f"{turns:>5} {size:>10}  {name:<14} {stock_ms:>9.1f} {spliced_ms:>10.1f} "
                          f"{spliced_ms / stock_ms:>6.2f}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
