"""The key guard over vLLM's development routes fails closed: a vLLM that moved what it extends does not start them."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from nemo_gym_tok.vllm import exact_reload, plugin, route_auth
from nemo_gym_tok.vllm.route_auth import (
    DEV_MODE_ENV,
    GUARDED_NAME,
    MIDDLEWARE_NAME,
    WEIGHTS_KEY_ENV,
    RouteGuardMissing,
)

DEV_ON = {DEV_MODE_ENV: "1"}


@pytest.fixture
def auth_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """vLLM's API-key module, its tuple and middleware restored after the test (guard_weight_routes extends it)."""
    module = importlib.import_module(route_auth.AUTH_MODULE)
    monkeypatch.setattr(module, GUARDED_NAME, getattr(module, GUARDED_NAME))
    middleware = getattr(module, MIDDLEWARE_NAME)
    monkeypatch.setattr(module, MIDDLEWARE_NAME, middleware)
    monkeypatch.setattr(middleware, "__call__", vars(middleware)["__call__"])  # split_keys wraps it in place
    return module


class PrefixesOnSelf:
    """A middleware of a release that keeps its prefixes on the instance: the module's tuple is no longer read."""

    guarded = ("/v1",)

    def __call__(self, scope: dict, receive: object, send: object) -> bool:
        return scope["path"].startswith(self.guarded)


def test_in_place_the_dev_routes_join_the_guarded_prefixes(auth_module: ModuleType) -> None:
    assert route_auth.guard_problem(auth_module) is None
    assert route_auth.guard_weight_routes(DEV_ON) is True
    guarded = getattr(auth_module, GUARDED_NAME)
    assert all(path.startswith(guarded) for path in (*route_auth.WEIGHT_ROUTES, *route_auth.dev_route_paths()))


@pytest.mark.parametrize(
    ("move", "named"),
    [
        ("delete the tuple", f"no tuple of path prefixes at {route_auth.AUTH_MODULE}.{GUARDED_NAME}"),
        ("make the tuple a list", f"no tuple of path prefixes at {route_auth.AUTH_MODULE}.{GUARDED_NAME}"),
        ("delete the middleware", f"{MIDDLEWARE_NAME}.__call__ does not read {GUARDED_NAME}"),
        ("middleware reads elsewhere", f"{MIDDLEWARE_NAME}.__call__ does not read {GUARDED_NAME}"),
        ("move the module", "vllm.entrypoints.serve.middleware.nowhere does not import"),
    ],
)
def test_a_moved_guard_refuses_the_dev_routes(
    auth_module: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, move: str, named: str
) -> None:
    if move == "delete the tuple":
        monkeypatch.delattr(auth_module, GUARDED_NAME)
    elif move == "make the tuple a list":
        monkeypatch.setattr(auth_module, GUARDED_NAME, list(getattr(auth_module, GUARDED_NAME)))
    elif move == "delete the middleware":
        monkeypatch.delattr(auth_module, MIDDLEWARE_NAME)
    elif move == "middleware reads elsewhere":
        monkeypatch.setattr(auth_module, MIDDLEWARE_NAME, PrefixesOnSelf)
    else:
        monkeypatch.setattr(route_auth, "AUTH_MODULE", "vllm.entrypoints.serve.middleware.nowhere")
    before = getattr(auth_module, GUARDED_NAME, None)
    with pytest.raises(RouteGuardMissing, match=f"{DEV_MODE_ENV}=1 .*refusing to serve them unguarded") as raised:
        route_auth.guard_weight_routes(DEV_ON)
    assert named in str(raised.value)
    assert getattr(auth_module, GUARDED_NAME, None) == before  # nothing half-patched
    # Without the development routes there is nothing to guard: a warning, and the server starts.
    with caplog.at_level(logging.WARNING, logger="nemo_gym_tok.vllm.route_auth"):
        assert route_auth.guard_weight_routes({}) is False
    assert named in caplog.text


def test_the_plugin_stops_a_dev_mode_server_whose_guard_moved(
    auth_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM calls each general plugin unguarded (vllm.plugins.load_general_plugins): the error stops the server."""
    monkeypatch.delattr(auth_module, GUARDED_NAME)
    monkeypatch.setattr(exact_reload, "install_exact_reload", lambda: True)  # the worker's patch is not under test
    for name, value in {**DEV_ON, "NEMO_GYM_TOK_EXACT_RELOAD": "1", "VLLM_CONFIGURE_LOGGING": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NEMO_GYM_TOK_PREFIX_SPLICE", raising=False)
    with pytest.raises(RouteGuardMissing, match=GUARDED_NAME):
        plugin.register()


INFERENCE_KEY, WEIGHTS_KEY = "inference-key", "weights-key"


def keyed_app(auth_module: ModuleType) -> TestClient:
    """vLLM's own API-key middleware, keyed with the inference key, over an app that answers 200 on every path."""

    async def ok(scope: dict, receive: object, send: object) -> None:
        await PlainTextResponse("ok")(scope, receive, send)  # type: ignore[arg-type]

    middleware = getattr(auth_module, MIDDLEWARE_NAME)(ok, tokens=[INFERENCE_KEY])

    async def app(scope: dict, receive: object, send: object) -> None:  # as Starlette's stack calls a middleware
        await middleware(scope, receive, send)

    return TestClient(app)


@pytest.mark.parametrize(
    ("key", "path", "status"),
    [
        (INFERENCE_KEY, "/v1/models", 200),
        (INFERENCE_KEY, "/pause", 401),
        (INFERENCE_KEY, "/collective_rpc", 401),
        (INFERENCE_KEY, "/update_weight_version", 401),
        (WEIGHTS_KEY, "/pause", 200),
        (WEIGHTS_KEY, "/collective_rpc", 200),
        (WEIGHTS_KEY, "/v1/completions", 200),  # the trainer's probe reads log probs with the weights key
        (None, "/health", 200),
        (None, "/pause", 401),
        (None, "/v1/models", 401),
        ("wrong", "/pause", 401),
        ("wrong", "/v1/models", 401),
    ],
)
def test_a_weights_key_alone_opens_the_routes_that_change_weights(
    auth_module: ModuleType, key: str | None, path: str, status: int
) -> None:
    assert route_auth.guard_weight_routes({**DEV_ON, WEIGHTS_KEY_ENV: WEIGHTS_KEY}) is True
    route_auth.guard_weight_routes({**DEV_ON, WEIGHTS_KEY_ENV: WEIGHTS_KEY})  # idempotent: wrapped once
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = keyed_app(auth_module).post(path, headers=headers)
    assert answer.status_code == status, (key, path, answer.text)
    if status == 401 and path == "/pause" and key == INFERENCE_KEY:
        assert "weights key" in answer.text


def test_without_a_weights_key_the_inference_key_opens_every_guarded_route(auth_module: ModuleType) -> None:
    """Today's single key, for a server that is not behind a router: the gym's fleet check refuses it there."""
    assert route_auth.guard_weight_routes(DEV_ON) is True
    client = keyed_app(auth_module)  # no lifespan: the app under the middleware answers HTTP only
    assert client.post("/pause", headers={"Authorization": f"Bearer {INFERENCE_KEY}"}).status_code == 200
    assert client.post("/pause").status_code == 401


def test_a_weights_key_on_a_moved_guard_refuses_to_start(
    auth_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(auth_module, GUARDED_NAME)
    with pytest.raises(RouteGuardMissing):
        route_auth.guard_weight_routes({WEIGHTS_KEY_ENV: WEIGHTS_KEY})
