"""Prometheus metrics of the prefix-splice hook, exported on vLLM's own `/metrics`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram

from nemo_gym_tok.splice import SpliceResult

SPLICES = Counter("nemo_gym_tok_prefix_splices", "Requests whose prompt started with a spliced model prefix")
NEW_TURN_SPLICES = Counter(
    "nemo_gym_tok_prefix_splices_new_turn",
    "Spliced requests whose history was proven by the prompt this server spliced for it and whose template text was "
    "rendered for the new messages only (nothing of the history rendered, by the hook or by vLLM)",
)
DRIFTED_TURNS = Counter(
    "nemo_gym_tok_prefix_splice_drifted_turns",
    "Spliced requests where the chat template's ids for the prefix's own assistant turn differed from the model's "
    "(repaired turns: each turn is counted on the one call that adds it to the prefix)",
)
REPLACED_TOKENS = Counter(
    "nemo_gym_tok_prefix_splice_replaced_tokens", "Template ids of repaired turns replaced by the model's own ids"
)
REJECTED = Counter(
    "nemo_gym_tok_prefix_splice_rejected", "Requests answered 400 for a malformed, out-of-vocabulary or stale prefix"
)


PREPROCESS_SECONDS = Histogram(
    "nemo_gym_tok_preprocess_seconds",
    "Wall time of vLLM's chat preprocessing (templating and tokenization, or the splice) per request, by path: "
    "spliced (a prefix spliced in), template (no prefix: vLLM's own templating, what stock vLLM does), token_in "
    "(kv_transfer_params.prompt_token_ids: no templating), new_segment (start_token_segment), refused (an error)",
    ["path"],
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0),
)
PREPROCESS_PATHS = ("spliced", "template", "token_in", "new_segment", "refused")


def preprocessed(path: str, seconds: float) -> None:
    PREPROCESS_SECONDS.labels(path=path).observe(seconds)


def spliced(new_turn: bool = False) -> None:
    SPLICES.inc()
    if new_turn:
        NEW_TURN_SPLICES.inc()


def measured(result: SpliceResult) -> None:
    """Count what the splice's measurement of the turn it adds found (see SplicedPrompt)."""
    if result.template_differed:
        DRIFTED_TURNS.inc()
        REPLACED_TOKENS.inc(result.replaced_tokens)


def rejected() -> None:
    REJECTED.inc()


STAGE_TIMES_ENV = "NEMO_GYM_TOK_STAGE_TIMES"
"""Set to 1, the hook times each stage of chat preprocessing (STAGE_SECONDS): what `bench/p9_breakdown.py` reads.
Off by default: a few microseconds a request that only a profile needs."""
STAGE_SECONDS = Histogram(
    "nemo_gym_tok_preprocess_stage_seconds",
    "Wall time of each stage of vLLM's chat preprocessing with the hook, where NEMO_GYM_TOK_STAGE_TIMES=1: prefix "
    "read (the request's prefix and its ids checked), template scope (the request's template, arguments and tools "
    "looked up), the splice's stages (history key, proof, short render, tail "
    "tokenize, prompt: a next turn spliced at the cost of its new messages), vLLM preprocessing (what vLLM's own "
    "preprocessing took: rendering and tokenizing, the full check's splice, or handing ids through its token reuse), "
    "turn measurement (the splice's telemetry of the turn it adds, while the engine generates)",
    ["stage"],
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256),
)


class StageTimer:
    """Observes the time since the previous stage ended (or since it was made) as each stage ends."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        STAGE_SECONDS.labels(stage=stage).observe(now - self.last)
        self.last = now


def stage_clock() -> Callable[[str], None]:
    """A clock for one request's stages where NEMO_GYM_TOK_STAGE_TIMES=1, else one that times nothing."""
    return StageTimer() if os.environ.get(STAGE_TIMES_ENV) == "1" else _untimed


def _untimed(stage: str) -> None:
    pass
