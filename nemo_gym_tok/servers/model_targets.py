"""The vLLMs a config's model adapters reach (`ngt push-weights -c`): each base_url, or its running router's workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.keys import effective_key
from nemo_gym_tok.common.net import client_host, shared_ssl_context
from nemo_gym_tok.config import GymConfig, load_config
from nemo_gym_tok.router import is_vllm_router
from nemo_gym_tok.servers.auth import auth_headers, auth_token_of
from nemo_gym_tok.servers.launcher import head_address

MODEL_KIND = "responses_api_models"
LOOKUP_TIMEOUT = 5.0
"""Seconds for the head's /routers and a router's /list_workers: both answer from memory."""


@dataclass
class PushTargets:
    """The URLs to push to (a running router's stands for the workers it lists now), the servers' API key (the first
    adapter's that sets one), and one line per routed adapter saying which worker list it used."""

    urls: list[str] = field(default_factory=list)
    api_key: str | None = None
    notes: list[str] = field(default_factory=list)


def push_targets(config_paths: list[str], overrides: list[str], http: httpx.Client | None = None) -> PushTargets:
    """The config's model adapters' vLLMs: a `base_url` as it is (a router there stands for its workers), and for an
    adapter with a `router` field the router `ngt run` started for it when one answers, else its `worker_urls`."""
    config = load_config(config_paths, overrides)
    targets = PushTargets()
    client = http or httpx.Client(timeout=LOOKUP_TIMEOUT, verify=shared_ssl_context())
    try:
        for name, instance in config.instances.items():
            if instance.kind != MODEL_KIND:
                continue
            fields: dict[str, Any] = instance.fields
            base_url = fields.get("base_url")
            targets.urls.extend([base_url] if isinstance(base_url, str) else list(base_url or []))
            router = fields.get("router")
            if isinstance(router, dict) and isinstance(router.get("worker_urls"), list):
                _add_routed(targets, config, name, router, client)
            if targets.api_key is None:
                targets.api_key = effective_key(fields.get("api_key"))
    finally:
        if http is None:
            client.close()
    return targets


def _add_routed(targets: PushTargets, config: GymConfig, name: str, router: dict[str, Any], http: httpx.Client) -> None:
    found, how = running_router(config, name, router, http)
    if found is not None:
        targets.urls.append(found)
        targets.notes.append(f"{name}: pushing to the workers its running router {found} lists now ({how})")
        return
    configured = [str(url) for url in router["worker_urls"]]
    targets.urls.extend(configured)
    targets.notes.append(
        f"{name}: no running router answered ({how}); pushing to the config's router.worker_urls {configured}"
    )


def running_router(config: GymConfig, name: str, router: dict[str, Any], http: httpx.Client) -> tuple[str | None, str]:
    """The URL of the vllm-router running for model instance `name`, and how it was found: named by the head of the
    `ngt run` of this config (`GET /routers`), else at the router's own fixed `port`; (None, what was tried) when
    neither answers as a vllm-router."""
    tried = []
    host, port = head_address(config)
    if port:
        head = f"http://{client_host(host)}:{port}"
        named, why = _named_by_head(head, name, config, http)
        if named is not None and is_vllm_router(named, http):
            return named, f"named by the head of ngt run at {head}"
        tried.append(why or f"the head at {head} names {named}, where no vllm-router answers")
    else:
        tried.append("head_server.port is 0 (a free port each run), so no head can be asked")
    router_port = router.get("port")
    if isinstance(router_port, int) and router_port:
        url = f"http://{client_host(str(router.get('host') or '127.0.0.1'))}:{router_port}"
        if is_vllm_router(url, http):
            return url, "at the router's port in the config"
        tried.append(f"no vllm-router answers at its configured port ({url})")
    return None, "; ".join(tried)


def _named_by_head(head: str, name: str, config: GymConfig, http: httpx.Client) -> tuple[str | None, str]:
    try:
        answer = http.get(f"{head}/routers", headers=auth_headers(auth_token_of(config)), timeout=LOOKUP_TIMEOUT)
    except httpx.TransportError as exc:
        return None, f"no head answers at {head} ({type(exc).__name__})"
    if answer.status_code != 200:
        return None, f"the head at {head} answered GET /routers with {answer.status_code}"
    try:
        routers = loads_exact(answer.content)
    except ValueError:
        routers = None
    url = routers.get(name) if isinstance(routers, dict) else None
    if not isinstance(url, str):
        return None, f"the head at {head} names no router for {name}"
    return url, ""
