"""The adapter in front of vllm-router: telling a router from a vLLM, and what a call must carry to cross one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.router.workers import worker_base_url
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.tokens import NEW_SEGMENT_KEY, PREFIX_KEY

GetSmall = Callable[[str, str], Awaitable[tuple[int, bytes] | None]]
LIST_WORKERS_PATH = "/list_workers"


@dataclass(frozen=True)
class RouterView:
    """A vllm-router at `url` and the workers it listed when the adapter asked."""

    url: str
    workers: tuple[str, ...]


async def detect_router(get_small: GetSmall, base_url: str) -> RouterView | None:
    """The router at `base_url`, or None for a vLLM (which answers 404 to the router's `/list_workers`)."""
    urls = await listed_workers(get_small, base_url)
    return None if urls is None else RouterView(base_url, urls)


async def listed_workers(get_small: GetSmall, base_url: str) -> tuple[str, ...] | None:
    """The workers the router at `base_url` lists, None when it answers no such list."""
    answer = await get_small(base_url, LIST_WORKERS_PATH)
    if answer is None or answer[0] != 200:
        return None
    try:
        listed = loads_exact(answer[1])
    except ValueError:
        return None
    urls = listed.get("urls") if isinstance(listed, dict) else None
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        return None
    return tuple(urls)


class DeclaredWorkers:
    """The workers a config declares behind the router `ngt run` starts for the adapter (`router.worker_urls`). After
    each answer the router's list is read again: a worker the config did not declare (one added through the
    router's unauthenticated /add_worker) may have served the call, so the answer is refused, and every later one
    until it is gone. None declared (a router started elsewhere), any listed worker may serve; the fleet's
    fingerprint check (fleet.py) still holds each to the fleet's."""

    def __init__(self, router_fields: Mapping[str, Any] | None) -> None:
        urls = (router_fields or {}).get("worker_urls")
        self.declared = frozenset(worker_base_url(url) for url in urls) if isinstance(urls, list) else None

    async def check(self, get_small: GetSmall, router_url: str) -> tuple[str, ...]:
        """The workers the router lists now (base URLs); ApiError (502) when it lists none, or lists workers beyond
        the declared ones."""
        listed = await listed_workers(get_small, router_url)
        if listed is None:
            raise ApiError(
                502,
                f"vllm-router at {router_url} did not list its workers after the call: which worker served it, and "
                "whether that worker was checked, cannot be told, so the answer is refused",
                error_type="undeclared_worker",
            )
        workers = tuple(sorted({worker_base_url(url) for url in listed}))
        undeclared = sorted(set(workers) - self.declared) if self.declared is not None else []
        if undeclared:
            assert self.declared is not None
            raise ApiError(
                502,
                f"vllm-router at {router_url} lists {', '.join(undeclared)}, which the config does not declare "
                f"(router.worker_urls: {', '.join(sorted(self.declared))}): added through the router's /add_worker, "
                "it may have served this call, so the answer is refused. Take it out (`POST /remove_worker?url=...` "
                "on the router), or declare it and restart the gym",
                error_type="undeclared_worker",
            )
        return workers


def crossing_body(body: dict[str, Any], required_prefix: list[int] | None) -> dict[str, Any]:
    """`body` (a chat call for a hooked server) as it must cross vllm-router, which drops every message field it does
    not know (the bundle, `reasoning_content`) and keeps unknown top-level ones:
    - the required prefix goes top-level, where the hook splices from it alone;
    - a history with assistant turns and no prefix says `start_token_segment: true` when it asks for token ids
      (`return_token_ids` or `logprobs`): its
      ids are the template's by the caller's own doing (it sent no bundle), which the hook otherwise cannot tell
      from bundles the router dropped, and refuses;
    - `reasoning_content` is sent as `reasoning`, the name the router keeps (vLLM reads both).
    A new top level and new messages where they change; the caller's own objects are not touched."""
    crossing = dict(body)
    if required_prefix is not None:
        crossing.setdefault(PREFIX_KEY, required_prefix)
    elif (body.get("return_token_ids") or body.get("logprobs")) and _has_assistant_turn(body.get("messages")):
        crossing.setdefault(NEW_SEGMENT_KEY, True)
    messages = body.get("messages")
    if isinstance(messages, list) and any(_needs_renaming(message) for message in messages):
        crossing["messages"] = [_renamed(message) if _needs_renaming(message) else message for message in messages]
    return crossing


def server_label(url: str, router: RouterView | None, answer: Mapping[str, Any] | None = None) -> str:
    """Who served a call, as an error names it: the vLLM at `url`, or the worker vllm-router at `url` chose (named
    when the hooked worker said which it is)."""
    if router is None:
        return f"the vLLM server at {url}"
    replica = _replica_of(answer)
    worker = f"its worker {replica}" if replica else "the worker it chose (one of " + ", ".join(router.workers) + ")"
    return (
        f"behind vllm-router at {url} (which drops token bundles from messages; this adapter sends the prefix "
        f"top-level, where a hooked worker splices from it), {worker}"
    )


def _replica_of(answer: Mapping[str, Any] | None) -> str | None:
    for choice in (answer or {}).get("choices") or []:
        message = choice.get("message") or choice.get("delta") or {}
        if isinstance(message.get("replica"), str):
            return str(message["replica"])
    return None


def _has_assistant_turn(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(message, dict) and message.get("role") == "assistant" for message in messages
    )


def _needs_renaming(message: Any) -> bool:
    return isinstance(message, dict) and message.get("reasoning_content") is not None


def _renamed(message: dict[str, Any]) -> dict[str, Any]:
    renamed = {key: value for key, value in message.items() if key != "reasoning_content"}
    renamed.setdefault("reasoning", message["reasoning_content"])
    return renamed
