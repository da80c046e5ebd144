"""Routes each conversation to one of the vLLM URLs: keys conversations, tracks URL health, fails over."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.client import SESSION_HEADER
from responses_api_models.vllm_model.rollout_paths import rollout_of
from responses_api_models.vllm_model.upstream import UpstreamUnavailable

MAX_REMEMBERED_CONVERSATIONS = 100_000
MAX_RECORDED_ATTEMPTS = 10_000
DERIVED_KEY_PREFIX = "opening:"
ROLLOUT_KEY_PREFIX = "rollout:"

T = TypeVar("T")
Probe = Callable[[str], Awaitable[bool]]


def conversation_key(request: Request, body: Mapping[str, Any]) -> str:
    """The `x-session-id` header when given, else the rollout id of a NeMo Gym rollout path, else a hash of what every
    turn of one conversation repeats.

    A derived key hashes the model, the Responses `instructions` and the opening messages (every message up to and
    including the first user message, role and content only): a conversation's later turns resend them unchanged,
    so they stay on one URL (prefix cache), while one client's different conversations get different keys. `body`
    is the request's JSON object as received (Chat Completions `messages` or Responses `input`).
    """
    session = request.headers.get(SESSION_HEADER)
    if session:
        return session
    rollout = rollout_of(request)
    if rollout is not None:  # NeMo Gym's /ng-rollout/<id>/... paths: one rollout is one conversation
        return ROLLOUT_KEY_PREFIX + rollout.rollout_id
    material = {"model": body.get("model"), "instructions": body.get("instructions"), "opening": _opening(body)}
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return DERIVED_KEY_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:32]


def _opening(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, str):  # Responses `input: "text"` is one user message
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list):
        return [messages]
    # Role and content only: a Responses client may resend a message item with `type` or `id` added.
    normalized = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in messages]
    for index, message in enumerate(normalized):
        if isinstance(message, dict) and message["role"] == "user":
            return normalized[: index + 1]
    return normalized


@dataclass
class Replica:
    """One vLLM URL: its health and what the router sent it."""

    url: str
    healthy: bool = True
    unhealthy_since: float | None = None
    """Clock time of the failure that made it unhealthy (None while healthy)."""
    last_error: str | None = None
    times_marked_unhealthy: int = 0
    conversations_started: int = 0
    """New conversations assigned here."""
    conversations_moved_in: int = 0
    """Conversations moved here from a failed or unhealthy URL."""
    calls: int = 0
    failed_calls: int = 0
    """Calls that failed for the URL's own reasons (unreachable, or 5xx on every attempt)."""
    in_flight: int = 0

    def report(self, now: float) -> dict[str, Any]:
        fields = dict(vars(self))
        since = fields.pop("unhealthy_since")
        fields["unhealthy_for_seconds"] = None if since is None else round(now - since, 3)
        return fields


@dataclass(frozen=True)
class Attempt:
    """One run of a call's callable against one URL: outcome "ok", "url_failed" (failed over from), or "error"
    (the request's own error, e.g. a 4xx or a prefix mismatch, passed to the caller)."""

    key: str
    url: str
    started: float
    ended: float
    outcome: str


class SessionRouter:
    """Sends each conversation to one vLLM URL and keeps it there while that URL is healthy.

    New conversations go round-robin over the healthy URLs. A call that fails for the URL's reasons (raises
    UpstreamUnavailable) marks the URL unhealthy and runs again on another healthy URL, where the conversation then
    stays: each request carries its exact token ids, so any replica can serve any turn (only the prefix cache is
    lost). Unhealthy URLs are probed every `health_check_interval` seconds and rejoin when the probe succeeds. With
    a single URL there is nowhere else to go, so it is always tried (the upstream's retries and errors unchanged).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        probe: Probe | None = None,
        health_check_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("at least one vLLM base URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"the vLLM base URLs must differ: {urls}")
        if health_check_interval <= 0:
            raise ValueError("health_check_interval must be > 0")
        self.urls = list(urls)
        self.replicas = {url: Replica(url) for url in self.urls}
        self.health_check_interval = health_check_interval
        self.attempts: deque[Attempt] = deque(maxlen=MAX_RECORDED_ATTEMPTS)
        """The latest attempts, oldest first: where each conversation's calls went."""
        self._probe = probe
        self._clock = clock
        self._cursor = 0
        self._assigned: OrderedDict[str, str] = OrderedDict()
        self._prober: asyncio.Task[None] | None = None

    def key_for(self, request: Request, body: Mapping[str, Any]) -> str:
        """The conversation key of a request (see `conversation_key`)."""
        return conversation_key(request, body)

    def url_of(self, key: str) -> str | None:
        """The URL the conversation is remembered on, if any (no assignment made)."""
        return self._assigned.get(key)

    async def call(self, key: str, attempt: Callable[[str], Awaitable[T]]) -> T:
        """`await attempt(url)` on the conversation's URL; on UpstreamUnavailable, mark that URL unhealthy and run
        it again on another healthy URL, each URL at most once. Everything `attempt` does for one try (e.g.
        /tokenize then /v1/chat/completions) goes to the same URL. No healthy URL left: ApiError 503 naming them."""
        failures: dict[str, UpstreamUnavailable] = {}
        while (url := self._route(key, exclude=failures.keys())) is not None:
            replica = self.replicas[url]
            replica.calls += 1
            replica.in_flight += 1
            started, outcome = self._clock(), "error"
            try:
                result = await attempt(url)
                outcome = "ok"
                return result
            except UpstreamUnavailable as exc:
                outcome = "url_failed"
                replica.failed_calls += 1
                self.mark_unhealthy(url, exc.message)
                failures[url] = exc
            finally:
                replica.in_flight -= 1
                self.attempts.append(Attempt(key, url, started, self._clock(), outcome))
        if len(self.urls) == 1:
            raise failures[self.urls[0]]  # a single URL keeps the upstream's own 503 / 502
        raise ApiError(503, self._none_healthy_message(failures))

    def mark_unhealthy(self, url: str, reason: str) -> None:
        """Take `url` out of routing until a probe finds it healthy; starts the background probe if needed."""
        replica = self.replicas[url]
        replica.last_error = reason
        if replica.healthy:
            replica.healthy = False
            replica.unhealthy_since = self._clock()
            replica.times_marked_unhealthy += 1
        self._ensure_prober()

    def mark_healthy(self, url: str) -> None:
        replica = self.replicas[url]
        replica.healthy = True
        replica.unhealthy_since = None

    async def probe_unhealthy(self) -> None:
        """Probe every unhealthy URL once (concurrently); those that answer healthy rejoin."""
        if self._probe is None:
            return
        unhealthy = [url for url in self.urls if not self.replicas[url].healthy]
        results = await asyncio.gather(*(self._safe_probe(url) for url in unhealthy))
        for url, healthy in zip(unhealthy, results):
            if healthy:
                self.mark_healthy(url)

    def report(self) -> dict[str, Any]:
        """Health and counters per URL (what `GET /routing` on the adapter answers)."""
        now = self._clock()
        return {
            "urls": [self.replicas[url].report(now) for url in self.urls],
            "remembered_conversations": len(self._assigned),
            "health_check_interval_seconds": self.health_check_interval,
        }

    async def aclose(self) -> None:
        """Stop the background probe (server shutdown)."""
        prober, self._prober = self._prober, None
        if prober is None or prober.done():
            return
        prober.cancel()
        if prober.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await prober

    def _route(self, key: str, exclude: Collection[str]) -> str | None:
        """The URL for the conversation's next try: its remembered URL while usable, else the next usable URL
        round-robin (remembered from now on); None when no usable URL is left."""
        current = self._assigned.get(key)
        if current is not None and current not in exclude and self._usable(current):
            self._assigned.move_to_end(key)
            return current
        for step in range(len(self.urls)):
            url = self.urls[(self._cursor + step) % len(self.urls)]
            if url not in exclude and self._usable(url):
                self._cursor = (self._cursor + step + 1) % len(self.urls)
                break
        else:
            return None
        if current is None:
            self.replicas[url].conversations_started += 1
        else:
            self.replicas[url].conversations_moved_in += 1
        self._assigned[key] = url
        self._assigned.move_to_end(key)
        if len(self._assigned) > MAX_REMEMBERED_CONVERSATIONS:
            self._assigned.popitem(last=False)
        return url

    def _usable(self, url: str) -> bool:
        return self.replicas[url].healthy or len(self.urls) == 1

    def _none_healthy_message(self, failures: Mapping[str, UpstreamUnavailable]) -> str:
        now = self._clock()
        parts = []
        for url in self.urls:
            replica = self.replicas[url]
            if url in failures:
                parts.append(f"{url} (failed this request: {failures[url].message})")
            else:
                since = now - (replica.unhealthy_since if replica.unhealthy_since is not None else now)
                parts.append(f"{url} (unhealthy for {since:.0f} s: {replica.last_error})")
        return (
            f"no healthy vLLM URL: {'; '.join(parts)}. Unhealthy URLs are probed with GET /health every "
            f"{self.health_check_interval:g} s and rejoin when healthy; retry later"
        )

    def _ensure_prober(self) -> None:
        if self._probe is None or (self._prober is not None and not self._prober.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # marked outside the server's loop (a unit test): probe_unhealthy() is called by hand
            return
        self._prober = loop.create_task(self._probe_until_all_healthy())

    async def _probe_until_all_healthy(self) -> None:
        # Runs only while some URL is unhealthy: a gym with healthy replicas sends no probes.
        while any(not replica.healthy for replica in self.replicas.values()):
            await asyncio.sleep(self.health_check_interval)
            await self.probe_unhealthy()

    async def _safe_probe(self, url: str) -> bool:
        assert self._probe is not None
        try:
            return await self._probe(url)
        except Exception:  # a probe that cannot tell counts as unhealthy; the loop must keep running
            return False
