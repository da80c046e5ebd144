"""The proof of a weight push: a replica's served prompt log probs of fixed ids against the trainer's own."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nemo_gym_tok.common.net import shared_ssl_context
from nemo_gym_tok.weights.replica import Replica, ReplicaError, server_roots, try_each

PROBE_TOKEN_IDS: tuple[int, ...] = (
    # Qwen's ids of "The same short text is read on every server after each push, so that a server which kept some of
    # its old weights shows it in the numbers at once.": ordinary text, no special token, every id below 15,000 (inside
    # most vocabularies; to a model with another tokenizer they are simply 32 fixed ids). 32 rather than more: vLLM's
    # prompt log probs cost about 1.2 ms per position on 2 cores (a 151,936-word vocabulary), and the probe is held to
    # 1% of a training step.
    785, 1852, 2805, 1467, 374, 1349, 389, 1449, 3538, 1283, 1817, 4484, 11, 773, 429, 264,
    3538, 892, 8604, 1045, 315, 1181, 2310, 14324, 4933, 432, 304, 279, 5109, 518, 3055, 13,
)  # fmt: skip
DEFAULT_MAX_MEAN_GAP = 0.01
"""Nats per token, mean over the probe: a correct push measured 0.0014 on the tiny model served in bfloat16 against
a float32 recompute, every planted fault 0.05 or more (docs/training.md, "Every push proven")."""


@dataclass(frozen=True)
class WeightProbe:
    """What the weights being pushed must serve: `expected_log_probs[i]` is log p(token_ids[i+1] | token_ids[:i+1])
    as the trainer computes it with those weights (float32), and `max_mean_gap` the largest mean |served - expected|
    in nats a replica may show and still count as serving them."""

    token_ids: tuple[int, ...]
    expected_log_probs: tuple[float, ...]
    max_mean_gap: float = DEFAULT_MAX_MEAN_GAP

    def __post_init__(self) -> None:
        # Frozen, yet lists are accepted: stored as tuples so a probe can be shared between threads and pushes.
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "expected_log_probs", tuple(self.expected_log_probs))
        if len(self.token_ids) < 2:
            raise ValueError(f"a weight probe needs at least 2 token ids, got {len(self.token_ids)}")
        bad_ids = [i for i in self.token_ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad_ids:
            raise ValueError(f"token_ids must be non-negative ints, got {bad_ids[:5]!r}")
        if len(self.expected_log_probs) != len(self.token_ids) - 1:
            raise ValueError(
                f"expected_log_probs must hold one value per token after the first: {len(self.token_ids) - 1} for "
                f"{len(self.token_ids)} token ids, got {len(self.expected_log_probs)}"
            )
        wrong = [
            (index, value)
            for index, value in enumerate(self.expected_log_probs)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value > 0
        ]
        if wrong:
            index, value = wrong[0]
            raise ValueError(
                f"expected_log_probs must be finite log probs (at most 0): position {index} is {value!r}"
                + (f" and {len(wrong) - 1} more" if len(wrong) > 1 else "")
            )
        if not (
            isinstance(self.max_mean_gap, int | float) and math.isfinite(self.max_mean_gap) and self.max_mean_gap > 0
        ):
            raise ValueError(f"max_mean_gap must be a positive number of nats, got {self.max_mean_gap!r}")

    def compare(self, url: str, served: Sequence[float], seconds: float) -> ProbeResult:
        """The gaps between what the server at `url` served and what was expected."""
        if len(served) != len(self.expected_log_probs):
            raise ValueError(f"{url} served {len(served)} log probs for {len(self.expected_log_probs)} positions")
        gaps = [abs(float(a) - b) for a, b in zip(served, self.expected_log_probs, strict=True)]
        # A NaN served is no match: counted as an infinite gap, since NaN compares false with any bound.
        gaps = [math.inf if math.isnan(gap) else gap for gap in gaps]
        return ProbeResult(url, sum(gaps) / len(gaps), max(gaps), seconds)


@dataclass(frozen=True)
class ProbeResult:
    """One replica's answer to a probe: the mean and largest |served - expected| log prob in nats, and the seconds the
    call took (the probe's cost)."""

    url: str
    mean_gap: float
    max_gap: float
    seconds: float

    def ok(self, bound: float) -> bool:
        """The replica serves the expected weights: its mean gap is within `bound` nats."""
        return self.mean_gap <= bound

    def format(self) -> str:
        return f"{self.url}: {self.mean_gap:.4f} nats mean ({self.max_gap:.4f} max) in {self.seconds * 1000:.0f} ms"


class WeightProbeError(RuntimeError):
    """Some replica does not serve the weights a probe describes, or the version it should. `replicas` names them;
    `results` holds every replica's probe that could be asked."""

    def __init__(self, message: str, replicas: Sequence[str], results: Sequence[ProbeResult] = ()) -> None:
        super().__init__(message)
        self.replicas = tuple(replicas)
        self.results = tuple(results)


def probe_replica(replica: Replica, probe: WeightProbe, model: str | None = None) -> ProbeResult:
    """Ask one replica for its prompt log probs of the probe's ids (as served model `model`, default: the first
    model it lists) and compare them with the expected ones. A failed call raises ReplicaError."""
    served_model = model or replica.served_model()
    started = time.perf_counter()
    served = replica.prompt_log_probs(probe.token_ids, served_model)
    return probe.compare(replica.url, served, time.perf_counter() - started)


def describe_failures(failing: Sequence[ProbeResult], errors: Sequence[ReplicaError], bound: float) -> str:
    """One line per replica that failed a probe: its gaps against the bound, or why it could not be asked."""
    lines = [
        f"{result.url} serves log probs {result.mean_gap:.4f} nats mean ({result.max_gap:.4f} max) off the expected "
        f"weights' (bound {bound:g})"
        for result in failing
    ]
    return "; ".join([*lines, *(f"probe not answered: {error}" for error in errors)])


def verify_replicas(
    urls: Sequence[str],
    probe: WeightProbe,
    *,
    version: str,
    api_key: str | None = None,
    http: httpx.Client | None = None,
    timeout: float = 60.0,
) -> list[ProbeResult]:
    """Check, without changing anything, that every vLLM server in `urls` serves weight version `version` and the
    weights `probe` describes; their probe results, in order. A WeightProbeError names each server that does not (a
    server restarted since the push serves its start-up weights, labelled `default`), with its label and gaps.
    A URL where vllm-router answers stands for every worker it lists."""
    if not urls:
        raise ValueError("no vLLM server to verify: name at least one URL")
    own = None if http is not None else httpx.Client(timeout=timeout, verify=shared_ssl_context())
    with own if own is not None else contextlib.nullcontext(http) as client:
        replicas = [Replica(url, client, api_key) for url in server_roots(urls, client)]
        results: dict[str, ProbeResult] = {}
        labels: dict[str, str] = {}

        def check(replica: Replica) -> None:
            labels[replica.url] = replica.weight_version()
            results[replica.url] = probe_replica(replica, probe)

        errors = try_each(replicas, check)
    ordered = [results[replica.url] for replica in replicas if replica.url in results]
    wrong_label = [url for url, label in labels.items() if label != version]
    failing = [result for result in ordered if not result.ok(probe.max_mean_gap)]
    named = list(dict.fromkeys([*wrong_label, *(r.url for r in failing), *(e.url for e in errors)]))
    if not named:
        return ordered
    parts = [f"{url} serves weight version {labels[url]!r}, not {version!r}" for url in wrong_label]
    if failing or errors:
        parts.append(describe_failures(failing, errors, probe.max_mean_gap))
    raise WeightProbeError(
        f"{len(named)} of {len(replicas)} server(s) not proven on version {version!r}: " + "; ".join(parts),
        named,
        ordered,
    )


def expected_log_probs(model: Any, token_ids: Sequence[int] = PROBE_TOKEN_IDS) -> tuple[float, ...]:
    """log p(token_ids[i+1] | token_ids[:i+1]) under a transformers causal LM as it is now (no gradient, its own
    device, log softmax in float32): what a trainer holding those weights computes."""
    import torch

    vocabulary = model.get_input_embeddings().weight.shape[0]
    if max(token_ids) >= vocabulary:
        raise ValueError(f"probe token id {max(token_ids)} is outside the model's vocabulary of {vocabulary}")
    training = model.training
    model.eval()  # no dropout in the probe; the trainer's mode is given back below
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(torch.tensor([list(token_ids)], device=device)).logits[0].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(list(token_ids[1:]), device=device)
            picked = log_probs[torch.arange(len(token_ids) - 1, device=device), targets]
    finally:
        model.train(training)
    return tuple(float(value) for value in picked.cpu().tolist())


def probe_from_checkpoint(
    checkpoint_dir: str | Path,
    token_ids: Sequence[int] = PROBE_TOKEN_IDS,
    max_mean_gap: float = DEFAULT_MAX_MEAN_GAP,
) -> WeightProbe:
    """The probe of a checkpoint directory (what `save_pretrained` wrote), loaded with transformers in float32 on the
    CPU; torch and transformers are imported here only."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    return WeightProbe(tuple(token_ids), expected_log_probs(model, token_ids), max_mean_gap)
