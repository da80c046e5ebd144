"""One fleet, one fingerprint: every answer is held to the fingerprint the fleet's workers were checked to serve."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nemo_gym_tok.contract.provenance import FINGERPRINT_KEY, fingerprint_difference
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import REPLICA_KEY

AskFingerprint = Callable[[str], Awaitable[dict[str, str] | None]]
"""A worker's fingerprint, asked of the worker itself (None: it answers without the hook); WorkerUnreachable when it
cannot be asked."""

UNREACHABLE_RETRY_SECONDS = 10.0
"""How long a listed worker that could not be asked waits before it is asked again (the router lists dead workers)."""


UNREACHABLE = object()


class WorkerUnreachable(Exception):
    """A worker the router lists did not answer the fingerprint probe."""


class FleetFingerprint:
    """The fingerprint every replica behind this adapter must serve. Behind vllm-router, the router's workers are
    asked for theirs (each directly, not through the router) before the first answer is accepted, and again when the
    list gains a worker: the expected fingerprint is the fleet's, not that of whichever replica answered first. Alone
    in front of one vLLM, its first hooked answer sets it. Once the fleet is known to be hooked, an answer without a
    fingerprint is refused (a worker without the hook, or one whose tokenizer the hook could not read): ids sampled
    on another tokenizer or template are not the fleet's, and mixed into a rollout they would break it silently."""

    def __init__(self) -> None:
        self.expected: dict[str, str] | None = None
        self.hooked: bool | None = None
        self.source = ""
        """Where the expected fingerprint came from, as errors name it."""
        self._checked: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._differing: dict[str, ApiError] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()

    async def check_workers(self, router_url: str, listed: Iterable[str], ask: AskFingerprint) -> None:
        """Hold the router's current workers to the fleet: the first time, each is asked and the fingerprint most of
        them serve is the fleet's (awaited); later, a newly listed worker is asked in the background. Raises ApiError
        (502) while a listed worker is known to differ, or when no worker answered the first check."""
        workers = set(listed)
        for gone in [url for url in self._checked | self._differing.keys() if url not in workers]:
            self._checked.discard(gone)  # asked again if it comes back: it may have restarted as something else
            self._differing.pop(gone, None)
        if self.hooked is None:
            async with self._lock:
                if self.hooked is None:
                    await self._first_check(router_url, sorted(workers), ask)
        else:
            now = time.monotonic()
            for url in workers - self._checked:
                running = self._probes.get(url)
                if (running is None or running.done()) and now >= self._retry_at.get(url, 0.0):
                    self._probes[url] = asyncio.create_task(self._ask_one(url, ask))
        for url in sorted(workers):
            if url in self._differing:
                raise self._differing[url]

    async def _first_check(self, router_url: str, workers: list[str], ask: AskFingerprint) -> None:
        answers = await asyncio.gather(*(self._asked(url, ask) for url in workers))
        answered = {url: found for url, found in zip(workers, answers, strict=True) if found is not UNREACHABLE}
        if not answered:
            raise ApiError(
                502,
                f"none of the workers vllm-router at {router_url} lists ({', '.join(workers) or 'none'}) answered the "
                "fleet check's fingerprint probe, so no answer can be held to the fleet's tokenizer and chat "
                "template: the answer is refused",
                error_type="fleet_unchecked",
            )
        (most, count), *_ = Counter(_sha(found) for found in answered.values()).most_common(1)
        reference = next(url for url, found in answered.items() if _sha(found) == most)
        where = f"the fleet check of vllm-router at {router_url}: {count} of {len(answered)} workers serve it"
        self._hold(reference, answered[reference], where)
        for url, found in answered.items():
            self._record(url, found)

    async def _ask_one(self, url: str, ask: AskFingerprint) -> None:
        found = await self._asked(url, ask)
        if found is not UNREACHABLE:
            self._record(url, found)

    async def _asked(self, url: str, ask: AskFingerprint) -> Any:
        """`ask(url)`, or UNREACHABLE (asked again after UNREACHABLE_RETRY_SECONDS)."""
        try:
            return await ask(url)
        except WorkerUnreachable:
            self._retry_at[url] = time.monotonic() + UNREACHABLE_RETRY_SECONDS
            return UNREACHABLE

    def _record(self, url: str, found: dict[str, str] | None) -> None:
        problem = self._hold(url, found, self.source)
        if problem is not None:
            self._differing[url] = problem
        self._checked.add(url)

    def check(self, result: dict[str, Any]) -> None:
        """Raise a 502 naming the replica whose answer in `result` carries another fingerprint than the fleet's, or
        none where the fleet's workers carry one."""
        for choice in result.get("choices") or []:
            message = choice.get("message") or {}
            found, replica = message.get(FINGERPRINT_KEY), message.get(REPLICA_KEY)
            found = dict(found) if isinstance(found, dict) else None
            if self.hooked is None and found is None:
                continue  # one stock vLLM: its answers say nothing, and there is nothing to compare
            name = replica if isinstance(replica, str) else "a worker that does not name itself"
            problem = self._hold(name, found, f"the first answer, from replica {name}")
            if problem is not None:
                raise problem

    def _hold(self, name: str, found: dict[str, str] | None, where: str) -> ApiError | None:
        """Learn the fleet's fingerprint from `found` when none is known; else what is wrong with `found`, or None."""
        if self.hooked is None:
            self.hooked, self.expected, self.source = found is not None, found, where
            return None
        if not self.hooked:
            if found is None:
                return None
            return ApiError(
                502,
                f"replica {name} answers with the prefix-splice hook while the fleet's workers have none "
                f"({self.source}): serve every worker with `ngt vllm-serve` (or none)",
                error_type="replica_mismatch",
            )
        if found is None:
            return ApiError(
                502,
                f"replica {name} answered without a model_fingerprint while the fleet's workers serve one "
                f"({self.source}): it runs without the hook, or the hook found no tokenizer file to fingerprint. Its "
                "ids cannot be held to the fleet's tokenizer and chat template, so its answer is refused",
                error_type="replica_unfingerprinted",
            )
        assert self.expected is not None
        if found.get("sha256") != self.expected.get("sha256"):
            return ApiError(
                502,
                f"replica {name} serves {fingerprint_difference(self.expected, found)} unlike the rest of the fleet "
                f"({self.source}): ids it samples are not the fleet's, so its answer is refused rather than mixed "
                "into a rollout. Serve every replica from the same model directory, --chat-template and "
                "--default-chat-template-kwargs, or take this one out of the router (`POST /remove_worker`)",
                error_type="replica_mismatch",
            )
        return None


def _sha(found: dict[str, str] | None) -> str | None:
    return None if found is None else found.get("sha256")
