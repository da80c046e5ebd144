"""The weight version on each bundle: the hook's own, else vLLM's `GET /weight_info` read before and after the call.

A hooked vLLM (0.32 and later) puts `weight_version` (and, when the generated ids span several versions,
`weight_version_spans`) on the message with its bundle, from the engine's own per-output record. Where the adapter
builds the bundle itself (stock vLLM: `return_token_ids`, `/tokenize`, the adapter's splice; or a hooked vLLM before
0.32, which reports none), it reads the server's current version label before sending the call and again once the
answer is in: the same label both times means every id of the call was sampled under it (labels are assumed never to
return to an earlier value); different labels mean a push happened during the call, which the adapter cannot place,
so the bundle says None (unknown). A server without the route (404: started without VLLM_SERVER_DEV_MODE=1) is
remembered per URL and never asked again; its bundles say None.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import WEIGHT_VERSION_KEY, WEIGHT_VERSION_SPANS_KEY, weight_versions_problem

WEIGHT_INFO_PATH = "/weight_info"
"""vLLM's route answering `{"weight_version": "..."}` (only with VLLM_SERVER_DEV_MODE=1)."""
HOOK_SOURCE = "message"
"""`token_source` of a bundle the hooked server built (nemo_gym_tok.contract.token_sources.TokenSource.MESSAGE)."""

Get = Callable[[str, str], Awaitable[tuple[int, bytes] | None]]


class WeightVersionReads:
    """Reads `/weight_info` per vLLM URL around the calls whose bundle the adapter makes, and settles each bundle's
    `weight_version`. Two URL sets keep it cheap: servers without the route, and servers whose answers carry the
    hook's own versions (asked again only after an answer that does not)."""

    def __init__(self, get: Get) -> None:
        """`get(url, path)`: (status, body) of one GET to the vLLM at `url`, None when it did not answer
        (VLLMUpstream.get_small)."""
        self._get = get
        self.without_route: set[str] = set()
        """URLs whose /weight_info answered 404: never asked again."""
        self.hook_reports: set[str] = set()
        """URLs whose last bundled answer carried the hook's own weight version: no read needed."""

    def needs_reads(self, url: str) -> bool:
        return url not in self.without_route and url not in self.hook_reports

    def start(self, url: str) -> asyncio.Task[str | None] | None:
        """The read of `url`'s version label, started now (it overlaps what the caller does meanwhile); None where no
        read is needed."""
        return asyncio.create_task(self.read(url)) if self.needs_reads(url) else None

    async def read(self, url: str) -> str | None:
        """The server's current label, or None: no route (remembered), an error, or an answer without one."""
        answer = await self._get(url, WEIGHT_INFO_PATH)
        if answer is None:  # unreachable or too slow: this call's version is unknown, the server may answer next call
            return None
        status, body = answer
        if status == 404:
            self.without_route.add(url)
            return None
        if status != 200:
            return None
        try:
            version = loads_exact(body).get(WEIGHT_VERSION_KEY)
        except (ValueError, AttributeError):
            return None
        return version if isinstance(version, str) else None

    async def settle(
        self, result: dict[str, Any], url: str, before: str | None, after: Awaitable[str | None] | None
    ) -> None:
        """Put `weight_version` on each bundled message of vLLM's `result` from `url`: the hook's own where its bundle
        won (checked: a malformed one is a 502), else `before` where the read `after` the answer gives the same label,
        else None; `weight_version_spans` only from the hook."""
        later: str | None = None
        read_later = False
        for choice in result.get("choices") or []:
            message = choice.get("message")
            if not isinstance(message, dict) or message.get("generation_token_ids") is None:
                continue
            version = message.get(WEIGHT_VERSION_KEY)
            if message.get("token_source") == HOOK_SOURCE and version is not None:
                spans = message.get(WEIGHT_VERSION_SPANS_KEY)
                problem = weight_versions_problem(version, spans, len(message["generation_token_ids"]))
                if problem is not None:
                    raise ApiError(502, f"vLLM at {url} reported a malformed weight version: {problem}")
                self.hook_reports.add(url)
                continue
            self.hook_reports.discard(url)  # this answer did not carry the hook's version: read around the next ones
            if not read_later and after is not None:
                later, read_later = await after, True
            message.pop(WEIGHT_VERSION_SPANS_KEY, None)
            message[WEIGHT_VERSION_KEY] = before if before is not None and before == later else None
