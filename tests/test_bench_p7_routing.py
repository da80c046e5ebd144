"""bench/p7_routing.py's pure parts: counters summed over replicas, call spread, ceiling, rounds, the target's ratio."""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from benchkit.figures import Figure  # noqa: E402
from benchkit.metrics import Metrics  # noqa: E402
from benchkit.server import BenchError  # noqa: E402
from p7_routing import (  # noqa: E402
    add_tables,
    block_size,
    fleet_work,
    merged,
    own_history_ceiling,
    readings,
    runs_plan,
    spread,
)

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
ENGINE = frozenset({("engine", "0"), ("model_name", "tiny-qwen3")})


def metrics(hits: float, queries: float, calls: float, prompt: float = 0.0) -> Metrics:
    """A replica's /metrics as `benchkit.metrics.scrape` keys them: the counters P7 reads."""
    return {
        ("vllm:prefix_cache_hits_total", ENGINE): hits,
        ("vllm:prefix_cache_queries_total", ENGINE): queries,
        ("vllm:prompt_tokens_total", ENGINE): prompt,
        ("vllm:generation_tokens_total", ENGINE): 0.0,
        ("http_requests_total", frozenset({("handler", "/v1/chat/completions"), ("method", "POST")})): calls,
        ("vllm:cache_config_info", frozenset({("block_size", "128"), ("enable_prefix_caching", "True")})): 1.0,
    }


def record(*replicas: str) -> dict[str, Any]:
    """A rollout record whose model calls went to `replicas`, in order (a message item without a bundle between)."""
    output: list[dict[str, Any]] = [{"type": "message", "role": "user"}]
    for replica in replicas:
        output.append({"generation_token_ids": [1, 2], "replica": replica})
        output.append({"type": "message", "role": "user"})
    return {"response": {"output": output}}


def test_the_hit_rate_is_summed_over_the_replicas_deltas_not_averaged() -> None:
    before = {A: metrics(100, 1000, 10), B: metrics(0, 0, 0)}
    after = {A: metrics(900, 2000, 14), B: metrics(100, 1000, 4)}
    work = fleet_work(before, after)
    assert work["cache_hits"] == 900 and work["cache_queries"] == 2000  # (800 + 100) / (1000 + 1000)
    assert work["cache_hit"] == pytest.approx(0.45)  # not the mean of 0.8 and 0.1
    assert work["calls"] == 8


def test_no_queries_is_no_hit_rate() -> None:
    assert math.isnan(fleet_work({A: metrics(0, 0, 0)}, {A: metrics(0, 0, 0)})["cache_hit"])


def test_the_block_size_comes_from_the_cache_config() -> None:
    assert block_size(metrics(0, 0, 0)) == 128
    assert block_size({}) is None


def test_spread_counts_calls_first_calls_and_rollouts_kept_on_one_replica() -> None:
    where = spread([record(A, A, A, A), record(B, B), record(A, B, A), {"response": {"output": []}}])
    assert where["turns"] == Counter({A: 6, B: 3})
    assert where["sessions"] == Counter({A: 2, B: 1})  # where each rollout's first call went
    assert where["one_replica"] == 2


def test_the_ceiling_is_the_previous_calls_full_blocks_short_of_the_calls_last_prompt_id() -> None:
    # 460 prompt + 64 generated: 523 ids went through the model, 4 full blocks; the next prompt (540) can use them.
    assert own_history_ceiling([(460, 64), (540, 64)], 128) == 512
    # The first call finds nothing, and a prompt of exactly 4 blocks keeps its last block to compute: 3 blocks.
    assert own_history_ceiling([(400, 200), (512, 1)], 128) == 384
    assert own_history_ceiling([(460, 64)], 128) == 0
    assert own_history_ceiling([(460, 64), (540, 64), (620, 64), (700, 64)], 128) == 512 + 512 + 640


def test_a_run_is_split_into_rounds_and_the_counts_match_the_concurrencies() -> None:
    assert runs_plan([8, 32], [48, 64], 2) == [(8, [24, 24]), (32, [32, 32])]
    assert runs_plan([8], [25], 2) == [(8, [13, 12])]  # the rollouts left over go to the first rounds
    assert runs_plan([8], [1], 3) == [(8, [1])]  # never an empty round
    with pytest.raises(BenchError, match="one count per --concurrency"):
        runs_plan([8, 32], [48], 2)
    with pytest.raises(BenchError, match="at least 1"):
        runs_plan([8], [0], 2)


def part(seconds: float, hits: int, queries: int, ceiling: int, *replicas: str) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "rollouts": len(replicas),
        "contiguous": len(replicas),
        "checked": len(replicas),
        "failures": [],
        "reset": 1,
        "api_cpu_s": 0.5,
        "ceiling": ceiling,
        "turns": Counter(replicas),
        "sessions": Counter(replicas),
        "one_replica": len(replicas),
        "prompt_tokens": queries,
        "generation_tokens": 0.0,
        "cache_hits": hits,
        "cache_queries": queries,
        "calls": 4 * len(replicas),
        "cache_hit": hits / queries,
    }


def test_rounds_add_up_to_one_run() -> None:
    run = merged([part(10.0, 90, 100, 95, A, B), part(20.0, 10, 100, 95, A)])
    assert run["seconds"] == 30.0 and run["rollouts"] == 3 and run["rounds"] == 2 and run["reset"] == 2
    assert run["cache_hit"] == pytest.approx(0.5)  # over all the queries, not the mean of the rounds' rates
    assert run["ceiling_rate"] == pytest.approx(0.95)
    assert run["sessions"] == Counter({A: 2, B: 1})


def results(ch: tuple[int, int], rr: tuple[int, int]) -> dict[str, dict[int, dict[str, Any]]]:
    """consistent_hash and round_robin runs at concurrency 8 and 32 with these hits out of 100 queries."""
    return {
        "consistent_hash": {c: merged([part(10.0, hits, 100, 70, A, B)]) for c, hits in zip((8, 32), ch)},
        "round_robin": {c: merged([part(12.0, hits, 100, 70, A, B)]) for c, hits in zip((8, 32), rr)},
    }


def test_the_target_reads_the_lowest_consistent_hash_over_round_robin_ratio() -> None:
    found = readings(results((68, 66), (45, 47)))
    reading = found["P7.hit_rate.ch/rr.min"]
    assert reading.value == pytest.approx(66 / 47) and reading.where == "concurrency 32"
    assert readings({"consistent_hash": {8: merged([part(1.0, 5, 10, 5, A)])}}) == {}  # round_robin did not run


def test_the_tables_print_both_policies_and_the_ratios() -> None:
    figure = Figure("P7", "t", "c")
    args = argparse.Namespace(calls=4, max_tokens=64, opening_ids=384, rounds=1)
    add_tables(figure, results((68, 66), (45, 47)), [A, B], args, {A: "0", B: "0"})
    runs, ratios = figure.tables
    assert [row[:2] for row in runs.rows] == [["consistent_hash", "8"], ["consistent_hash", "32"]] + [
        ["round_robin", "8"],
        ["round_robin", "32"],
    ]
    first = dict(zip(runs.headers, runs.rows[0]))
    assert first["hit rate"] == "68.0%" and first["own-history ceiling"] == "70.0%"
    assert first["rollouts per replica (A / B)"] == "1 / 1" and first["contiguous"] == "2/2"
    assert dict(zip(ratios.headers, ratios.rows[0]))["hit rate CH/RR"] == "1.511"
    assert dict(zip(ratios.headers, ratios.rows[0]))["rollouts/s CH/RR"] == "1.200"
    assert "pinned to CPU 0" in figure.notes[1]
    assert not any("NOT contiguous" in note or "no /reset_prefix_cache" in note for note in figure.notes)
