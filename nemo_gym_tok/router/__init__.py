"""vLLM's own router (vllm-router) for the gym: starts it in front of the vLLM replicas and edits its worker list."""

from nemo_gym_tok.router.process import (
    DEFAULT_POLICY,
    INSTALL_HINT,
    LOG_LEVELS,
    ROUTER_POLICIES,
    ROUTER_VERSION,
    SESSION_HEADER,
    RouterProcess,
    RouterSpec,
    RouterStartError,
    check_router_installed,
    router_command,
)
from nemo_gym_tok.router.workers import (
    RouterError,
    add_worker,
    is_vllm_router,
    list_workers,
    remove_worker,
    worker_base_url,
)

__all__ = [
    "DEFAULT_POLICY",
    "INSTALL_HINT",
    "LOG_LEVELS",
    "ROUTER_POLICIES",
    "ROUTER_VERSION",
    "SESSION_HEADER",
    "RouterError",
    "RouterProcess",
    "RouterSpec",
    "RouterStartError",
    "add_worker",
    "check_router_installed",
    "is_vllm_router",
    "list_workers",
    "remove_worker",
    "router_command",
    "worker_base_url",
]
