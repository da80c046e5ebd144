"""vLLM's Prometheus /metrics, scraped and compared: the hook's preprocessing timer, requests, engine work."""

from __future__ import annotations

import re

import httpx

from benchkit.timing import ratio

PREPROCESS_METRIC = "nemo_gym_tok_preprocess_seconds"
"""The hook's server-side timer (a histogram labelled `path`: spliced, template, token_in, new_segment, refused)."""

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, http: httpx.Client | None = None) -> Metrics:
    """Every sample of the server's Prometheus `/metrics`, keyed by (name, labels)."""
    text = (http.get(f"{url}/metrics") if http else httpx.get(f"{url}/metrics", timeout=30)).text
    samples: Metrics = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
        except ValueError:
            continue
    return samples


def has_preprocess_timer(metrics: Metrics) -> bool:
    return any(name.startswith(PREPROCESS_METRIC) for name, _ in metrics)


def preprocess_delta(before: Metrics, after: Metrics) -> tuple[int, float, list[str]] | None:
    """The hook's timer between two scrapes: (requests timed, seconds spent, the `path` labels that grew). None when
    the server has no such timer (a hook without it, or a stock server)."""
    if not has_preprocess_timer(after):
        return None
    done, spent, paths = 0.0, 0.0, []
    for (name, labels), count in after.items():
        if name != f"{PREPROCESS_METRIC}_count":
            continue
        grew = count - before.get((name, labels), 0.0)
        if grew > 0:
            done += grew
            key = (f"{PREPROCESS_METRIC}_sum", labels)
            spent += after.get(key, 0.0) - before.get(key, 0.0)
            paths.append(dict(labels).get("path", ""))
    return int(round(done)), spent, sorted(paths)


def http_requests(before: Metrics, after: Metrics) -> dict[str, int]:
    """HTTP requests the server answered between two scrapes, per handler (vLLM's own `http_requests_total`; it leaves
    out /metrics, /health and the like)."""
    counts: dict[str, int] = {}
    for (name, labels), value in after.items():
        if name == "http_requests_total":
            handler = dict(labels).get("handler", "?")
            done = int(round(value - before.get((name, labels), 0.0)))
            if done:
                counts[handler] = counts.get(handler, 0) + done
    return counts


def counter_delta(before: Metrics, after: Metrics, name: str) -> float:
    """A counter's growth between two scrapes, summed over its label sets."""
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key[0] == name)


def engine_work(before: Metrics, after: Metrics) -> dict[str, float]:
    """What vLLM's engine did between two scrapes: prompt and generated tokens, prefix-cache hit share."""
    queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
    hits = counter_delta(before, after, "vllm:prefix_cache_hits_total")
    return {
        "prompt_tokens": counter_delta(before, after, "vllm:prompt_tokens_total"),
        "generation_tokens": counter_delta(before, after, "vllm:generation_tokens_total"),
        "cache_hit": ratio(hits, queries),
        "cache_hits": hits,
        "cache_queries": queries,
    }
