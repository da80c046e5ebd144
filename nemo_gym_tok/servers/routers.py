"""`ngt run`'s vllm-routers: one in front of the workers a model adapter's `router` field lists, started before it."""

from __future__ import annotations

from typing import Any

import httpx

from nemo_gym_tok.common.keys import effective_key
from nemo_gym_tok.common.net import shared_ssl_context
from nemo_gym_tok.config import GymConfig, ServerInstance
from nemo_gym_tok.router import RouterProcess, RouterSpec, RouterStartError
from nemo_gym_tok.router.fleet import FleetMismatchError, check_fleet, weight_routes_opened_by
from nemo_gym_tok.servers.http_pool import DEFAULT_REQUEST_TIMEOUT_SECONDS

ROUTER_KEY = "router"


class RouterConfigError(ValueError):
    """A `router` field that cannot start a router; the message names the config key."""


def router_spec(instance: ServerInstance) -> RouterSpec | None:
    """The RouterSpec of an instance's `router` field (None without one), or RouterConfigError naming the key."""
    fields: Any = instance.fields.get(ROUTER_KEY)
    if fields is None:
        return None
    where = f"{instance.name}.{instance.kind}.{instance.implementation}.{ROUTER_KEY}"
    if not isinstance(fields, dict) or "worker_urls" not in fields:
        raise RouterConfigError(f"{where}: expected {{worker_urls: [http://host:port, ...], policy: ...}}")
    if "api_key" in fields:
        raise RouterConfigError(
            f"{where}.api_key: give the key to the adapter instead ({instance.name}.{instance.kind}."
            f"{instance.implementation}.api_key): its calls carry it through the router, and the fleet check asks each "
            "worker with it. A router key would be sent by vllm-router itself, on the routes it proxies blindly "
            "(/v1/responses, any unknown path), to every worker it lists"
        )
    if instance.fields.get("base_url"):
        raise RouterConfigError(
            f"{where}: set either base_url (a vLLM, or a router that already runs) or router (one `ngt run` starts), "
            "not both"
        )
    try:
        spec = RouterSpec(**{**fields, "worker_urls": tuple(fields["worker_urls"] or ())})
    except (TypeError, ValueError) as exc:
        raise RouterConfigError(f"{where}: {exc}") from None
    adapter_timeout = instance.fields.get("request_timeout_seconds", DEFAULT_REQUEST_TIMEOUT_SECONDS)
    if isinstance(adapter_timeout, int | float) and spec.request_timeout_secs <= adapter_timeout:
        raise RouterConfigError(
            f"{where}.request_timeout_secs ({spec.request_timeout_secs}) must be longer than the adapter's "
            f"request_timeout_seconds ({adapter_timeout:g}): a router that times out first answers as if its worker "
            "were gone, and the adapter would send the call again while the engine may still be generating it"
        )
    return spec


def routed_instances(config: GymConfig) -> list[str]:
    """The instances with a router to start, their `router` fields checked (RouterConfigError naming the key)."""
    return [name for name, instance in config.instances.items() if router_spec(instance) is not None]


def start_routers(config: GymConfig, *, ready_timeout: float) -> dict[str, RouterProcess]:
    """Start the router of every instance with a `router` field, after checking its workers serve one fingerprint,
    and point the instance's base_url at it. Raises RouterConfigError or RouterStartError (routers already started
    are stopped)."""
    specs = {name: spec for name, instance in config.instances.items() if (spec := router_spec(instance))}
    started: dict[str, RouterProcess] = {}
    try:
        for name, spec in specs.items():
            instance = config.instances[name]
            api_key = adapter_key(instance)
            try:
                fingerprints = check_fleet(spec.worker_urls, str(instance.fields.get("model")), api_key=api_key)
                check_key_opens_no_weight_route(spec.worker_urls, api_key)
            except FleetMismatchError as exc:
                raise RouterStartError(f"{name}: {exc}") from None
            unproven = [url for url, fingerprint in fingerprints.items() if fingerprint is None]
            if unproven and len(unproven) < len(fingerprints):
                raise RouterStartError(
                    f"{name}: workers {', '.join(unproven)} answer without the prefix-splice hook while the others "
                    "have it: a call the router sends them would not be spliced. Serve every worker with `ngt "
                    "vllm-serve` (or none)"
                )
            started[name] = RouterProcess(spec).start(timeout=ready_timeout)
            instance.fields["base_url"] = f"{started[name].url}/v1"
    except BaseException:
        stop_routers(started)
        raise
    return started


def adapter_key(instance: ServerInstance) -> str | None:
    """The key the adapter's calls carry (None for none: unset or the OpenAI SDK's placeholder "EMPTY")."""
    return effective_key(instance.fields.get("api_key"))


def check_key_opens_no_weight_route(worker_urls: tuple[str, ...], api_key: str | None) -> None:
    """FleetMismatchError when the adapter's key opens a worker's weight routes: through the router it reaches every
    worker the router lists, one added by /add_worker included."""
    if api_key is None:
        return
    with httpx.Client(timeout=30, verify=shared_ssl_context()) as http:
        for url in worker_urls:
            status = weight_routes_opened_by(url, api_key, http=http)
            if status is not None:
                raise FleetMismatchError(
                    f"the adapter's api_key opens the weight routes of worker {url} (POST /collective_rpc answered "
                    f"{status}, not 401), and through vllm-router it would reach every worker the router lists, one "
                    "added by /add_worker included. Split the keys: `ngt vllm-serve --weights-api-key KEY2 MODEL "
                    "--api-key KEY ...`, KEY for the adapter and KEY2 for the trainer's pushes (docs/scaling.md)"
                )


def stop_routers(routers: dict[str, RouterProcess]) -> None:
    for router in routers.values():
        router.stop()


def exited_router(routers: dict[str, RouterProcess]) -> str | None:
    """Why the gym must stop when a router it started has exited (None while all run)."""
    for name, router in routers.items():
        if not router.running:
            return f"the vllm-router in front of {name}'s workers exited (its log: {router.log_path})"
    return None
