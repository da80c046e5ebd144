"""vLLM's API key over the routes that change weights: its own guard covers only `/v1`, `/v2`, `/inference`, `/cohere`.

With `VLLM_SERVER_DEV_MODE=1` vLLM serves `/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`,
`/update_weights`, `/sleep`, ... beside its OpenAI routes, and its `--api-key` middleware lets every one of them
through without a key (it checks a fixed tuple of path prefixes, `GUARDED_PREFIX`). This module adds the paths of
vLLM's development and RL routers to that tuple, so a server started with a key asks for it there too. Without a key
vLLM installs no middleware at all: `ngt vllm-serve` then refuses to serve those routes beyond loopback
(nemo_gym_tok.cli.vllm_serve). vLLM is imported inside functions.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("nemo_gym_tok.vllm.route_auth")

AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"
"""Where vLLM's API-key middleware reads `GUARDED_PREFIX` on every request (0.29 to 0.33)."""
GUARDED_NAME = "GUARDED_PREFIX"
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


def guard_weight_routes() -> bool:
    """Add the development routes to the prefixes vLLM's API-key middleware guards; idempotent. False (logged) when
    the installed vLLM keeps its guard elsewhere: `ngt vllm-compat` names such a release."""
    try:
        module = importlib.import_module(AUTH_MODULE)
    except ImportError:
        module = None
    guarded = getattr(module, GUARDED_NAME, None)
    if not isinstance(guarded, tuple):
        logger.warning("nemo_gym_tok: no API-key guard at %s.%s; weight routes unguarded", AUTH_MODULE, GUARDED_NAME)
        return False
    added = tuple(path for path in dev_route_paths() if not path.startswith(guarded))
    setattr(module, GUARDED_NAME, (*guarded, *added))
    return True
