"""vLLM's API key over the routes that change weights: its own guard covers only `/v1`, `/v2`, `/inference`, `/cohere`.

With `VLLM_SERVER_DEV_MODE=1` vLLM serves `/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`,
`/update_weights`, `/sleep`, ... beside its OpenAI routes, and its `--api-key` middleware lets every one of them
through without a key (it checks a fixed tuple of path prefixes, `GUARDED_PREFIX`). This module adds the paths of
vLLM's development and RL routers to that tuple, so a server started with a key asks for it there too. Without a key
vLLM installs no middleware at all: `ngt vllm-serve` then refuses to serve those routes beyond loopback
(nemo_gym_tok.cli.vllm_serve). It fails closed: where a vLLM release keeps its guard elsewhere (the tuple gone, or
the middleware no longer reading it) and the development routes are on, the plugin raises RouteGuardMissing, which
stops the server from starting, rather than serve those routes unguarded. vLLM is imported inside functions.

With a weights key (WEIGHTS_KEY_ENV, set by `ngt vllm-serve --weights-api-key`) the two keys split: the weights key
alone opens the development routes (and the inference routes too: a trainer's probe reads log probs with it), while
vLLM's --api-key opens only the inference routes. The key a gym sends through vllm-router, which forwards it to any
worker the router lists, then opens no route that changes weights.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import secrets
from collections.abc import Mapping
from types import ModuleType
from typing import Any

logger = logging.getLogger("nemo_gym_tok.vllm.route_auth")

AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"
"""Where vLLM's API-key middleware reads `GUARDED_PREFIX` on every request (0.29 to 0.33)."""
GUARDED_NAME = "GUARDED_PREFIX"
MIDDLEWARE_NAME = "AuthenticationMiddleware"
"""The middleware in AUTH_MODULE whose `__call__` reads GUARDED_NAME: extending the tuple guards nothing otherwise."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""vLLM serves its development and RL routes (those that change weights) only with this set to 1."""
WEIGHTS_KEY_ENV = "NGT_WEIGHTS_API_KEY"
"""The key that alone opens the development routes, when set (the module's docstring)."""
# The routers vLLM adds with VLLM_SERVER_DEV_MODE=1, by release: their paths are read from the routers themselves, so
# a route a release adds is guarded without a change here. 0.29 keeps the RL routes under serve/dev/rlhf.
DEV_ROUTER_MODULES = (
    "vllm.entrypoints.rl.online.api_router",
    "vllm.entrypoints.serve.dev.rlhf.api_router",
    "vllm.entrypoints.serve.dev.cache.api_router",
    "vllm.entrypoints.serve.dev.rpc.api_router",
    "vllm.entrypoints.serve.dev.server_info.api_router",
    "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.rlhf.api_router",
    "vllm.entrypoints.serve.rpc.api_router",
    "vllm.entrypoints.serve.cache.api_router",
    "vllm.entrypoints.serve.sleep.api_router",
)
# The routes a weight update goes through, guarded even where no router above imports (an optional package missing).
WEIGHT_ROUTES = (
    "/pause",
    "/resume",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/weight_checker",
    "/sleep",
    "/wake_up",
)


def dev_route_paths() -> tuple[str, ...]:
    """The paths of vLLM's development and RL routes in the installed release, with WEIGHT_ROUTES, sorted."""
    paths = set(WEIGHT_ROUTES)
    for module_name in DEV_ROUTER_MODULES:
        try:
            router = getattr(importlib.import_module(module_name), "router", None)
        except ImportError:
            continue
        paths.update(route.path for route in getattr(router, "routes", ()) if getattr(route, "path", None))
    return tuple(sorted(paths))


class RouteGuardMissing(RuntimeError):
    """vLLM's development routes are on, and its API-key guard is not where this module extends it."""


def guard_problem(module: ModuleType | None) -> str | None:
    """Why vLLM's API-key middleware cannot be extended through `module` (AUTH_MODULE, None when it does not import),
    or None when GUARDED_NAME is a tuple of path prefixes that MIDDLEWARE_NAME reads on each request."""
    if module is None:
        return f"{AUTH_MODULE} does not import"
    guarded = getattr(module, GUARDED_NAME, None)
    if not isinstance(guarded, tuple) or not all(isinstance(prefix, str) for prefix in guarded):
        return f"no tuple of path prefixes at {AUTH_MODULE}.{GUARDED_NAME}"
    middleware = getattr(module, MIDDLEWARE_NAME, None)
    call = vars(middleware).get("__call__") if isinstance(middleware, type) else None
    call = getattr(call, "_ngt_wrapped", call)  # split_keys' wrapper hands the rest to vLLM's own __call__
    # The middleware reads the module global at each request; a release that keeps the prefixes elsewhere (an
    # attribute, a closure) leaves the tuple in place but unread, and extending it would guard nothing.
    names = getattr(getattr(call, "__code__", None), "co_names", ())
    if GUARDED_NAME not in names:
        return f"{AUTH_MODULE}.{MIDDLEWARE_NAME}.__call__ does not read {GUARDED_NAME}"
    # The split keys hand a request on to the middleware's `app`, as its own __call__ does.
    if "app" not in names:
        return f"{AUTH_MODULE}.{MIDDLEWARE_NAME}.__call__ does not call self.app"
    return None


def guard_weight_routes(environ: Mapping[str, str] | None = None) -> bool:
    """Add the development routes to the prefixes vLLM's API-key middleware guards, and split the keys when
    WEIGHTS_KEY_ENV is set; idempotent. Where the installed vLLM keeps its guard elsewhere (`ngt vllm-compat` names
    such a release): RouteGuardMissing when `environ` (os.environ by default) turns the development routes on or sets
    a weights key, else False, logged (no such route is served)."""
    env = os.environ if environ is None else environ
    try:
        module = importlib.import_module(AUTH_MODULE)
    except ImportError:
        module = None
    problem = guard_problem(module)
    if problem is not None:
        if env.get(DEV_MODE_ENV) == "1" or env.get(WEIGHTS_KEY_ENV):
            raise RouteGuardMissing(
                f"nemo_gym_tok: {DEV_MODE_ENV}=1 serves the routes that change weights (/pause, /collective_rpc, "
                f"/update_weights, ...), and this vLLM keeps its API-key guard elsewhere ({problem}): refusing to "
                f"serve them unguarded. Unset {DEV_MODE_ENV}, or run a vLLM release `ngt vllm-compat` passes"
            )
        logger.warning("nemo_gym_tok: %s; vLLM's development routes would be unguarded (they are off)", problem)
        return False
    guarded = getattr(module, GUARDED_NAME)
    added = tuple(path for path in dev_route_paths() if not path.startswith(guarded))
    setattr(module, GUARDED_NAME, (*guarded, *added))
    weights_key = env.get(WEIGHTS_KEY_ENV)
    if weights_key:
        split_keys(getattr(module, MIDDLEWARE_NAME), weights_key, dev_route_paths())
    return True


def split_keys(middleware: type, weights_key: str, weight_paths: tuple[str, ...]) -> None:
    """Wrap `middleware.__call__` (vLLM's API-key middleware) so that `weights_key` opens every route and is the only
    key that opens a path under `weight_paths`; other requests go to vLLM's own check. Idempotent."""
    original = vars(middleware)["__call__"]
    if hasattr(original, "_ngt_wrapped"):
        return
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse

    weights_hash = hashlib.sha256(weights_key.encode("utf-8")).digest()

    def __call__(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return original(self, scope, receive, send)
        if bearer_matches(Headers(scope=scope).get("Authorization"), weights_hash):
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(weight_paths):
            refusal = JSONResponse(
                content={"error": "Unauthorized: this route changes weights and opens only with the weights key"},
                status_code=401,
            )
            return refusal(scope, receive, send)
        return original(self, scope, receive, send)

    __call__._ngt_wrapped = original  # type: ignore[attr-defined]
    middleware.__call__ = __call__  # type: ignore[method-assign]


def bearer_matches(authorization: str | None, key_hash: bytes) -> bool:
    """Whether an `Authorization: Bearer TOKEN` header carries the key whose sha256 is `key_hash`. Compared by digest
    in constant time, as vLLM compares its own keys."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return secrets.compare_digest(hashlib.sha256(token.encode("utf-8")).digest(), key_hash)
