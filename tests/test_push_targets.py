"""Where `ngt push-weights -c CONFIG` pushes for an adapter behind a router: the live workers of its running router
(named by the head of the config's `ngt run`, else at the router's own port), else the config's worker_urls, and a
line saying which; against fake HTTP answers."""

from __future__ import annotations

from pathlib import Path

import httpx

from nemo_gym_tok.servers.model_targets import push_targets
from nemo_gym_tok.testing.gym_configs import demo_config_behind_router

WORKERS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
HEAD = "http://127.0.0.1:11577"
ROUTER = "http://127.0.0.1:30077"


def answers(routes: dict[str, object]) -> httpx.Client:
    """A client whose GETs answer `routes` (URL -> JSON body); anything else is refused as by a closed port."""

    def handle(request: httpx.Request) -> httpx.Response:
        url = str(request.url.copy_with(query=None))
        if url in routes:
            return httpx.Response(200, json=routes[url])
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    return httpx.Client(transport=httpx.MockTransport(handle))


def targets(tmp_path: Path, routes: dict[str, object], *overrides: str):
    config = demo_config_behind_router(tmp_path, WORKERS)
    with answers(routes) as http:
        return push_targets([str(config)], ["policy_model_name=tiny", "head_server.port=11577", *overrides], http)


def test_the_running_router_named_by_the_head_stands_for_its_live_workers(tmp_path: Path) -> None:
    routes = {f"{HEAD}/routers": {"policy_model": ROUTER}, f"{ROUTER}/list_workers": {"urls": WORKERS[:1]}}
    found = targets(tmp_path, routes)
    assert found.urls == [ROUTER]
    assert found.notes == [
        f"policy_model: pushing to the workers its running router {ROUTER} lists now (named by the head of ngt run at "
        f"{HEAD})"
    ]


def test_no_router_answering_falls_back_to_the_configs_worker_urls_and_says_why(tmp_path: Path) -> None:
    found = targets(tmp_path, {})
    assert found.urls == WORKERS
    assert found.notes == [
        f"policy_model: no running router answered (no head answers at {HEAD} (ConnectError)); pushing to the "
        f"config's router.worker_urls {WORKERS}"
    ]


def test_without_a_head_to_ask_the_routers_own_port_is_tried(tmp_path: Path) -> None:
    routes = {f"{ROUTER}/list_workers": {"urls": WORKERS}}
    found = targets(
        tmp_path, routes, "head_server.port=0", "policy_model.responses_api_models.vllm_model.router.port=30077"
    )
    assert found.urls == [ROUTER] and "at the router's port in the config" in found.notes[0]
    found = targets(tmp_path, {}, "head_server.port=0")
    assert found.urls == WORKERS and "head_server.port is 0" in found.notes[0]


def test_a_head_naming_a_router_that_is_gone_falls_back(tmp_path: Path) -> None:
    found = targets(tmp_path, {f"{HEAD}/routers": {"policy_model": ROUTER}})
    assert found.urls == WORKERS and f"names {ROUTER}, where no vllm-router answers" in found.notes[0]
