"""Runs one gym server in this process (the child side of `ngt run`), from a JSON spec in the environment."""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from typing import Any

import uvicorn

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.config import ConfigError, ServerInstance
from nemo_gym_tok.servers.client import AUTH_TOKEN_ENV, ServerClient
from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS
from nemo_gym_tok.servers.registry import ENTRYPOINT_KEY, resolve_entrypoint, validate_instance

SPEC_ENV = "NGT_SERVER_SPEC"
YOUNG_COLLECTION_THRESHOLD = 20_000
"""Allocations between two collections of the youngest generation (CPython's default: 700)."""


def spec_for(
    instance: ServerInstance, *, port: int, servers: dict[str, str], head_url: str | None, listen_fd: int | None = None
) -> str:
    """The JSON a child needs to run `instance`: its fields (with the chosen port), every server's URL, and the
    inherited listening socket's fd when the launcher bound the port itself."""
    fields = {**instance.fields, "port": port}
    if ENTRYPOINT_KEY in fields:
        fields[ENTRYPOINT_KEY] = resolve_entrypoint(instance)
    spec: dict[str, Any] = {
        "name": instance.name,
        "kind": instance.kind,
        "implementation": instance.implementation,
        "fields": fields,
        "servers": servers,
        "head_url": head_url,
        "listen_fd": listen_fd,
    }
    return json.dumps(spec)


def main() -> int:
    spec = loads_exact(os.environ[SPEC_ENV])
    instance = ServerInstance(spec["name"], spec["kind"], spec["implementation"], spec["fields"], {})
    try:
        server_class, config = validate_instance(instance)
    except ConfigError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    # The launcher hands the gym's token over in the environment (set, or removed when the gym has none).
    client = ServerClient(
        spec["servers"],
        head_url=spec.get("head_url"),
        auth_token=os.environ.get(AUTH_TOKEN_ENV),
        timeout=config.http_timeout(),
        limits=config.http_limits(),
    )
    server = server_class(instance.name, config, client)
    app = server.build_app()
    quiet_garbage_collector()
    listen_fd = spec.get("listen_fd")
    # The launcher's socket, already bound and listening: it outlives this process, so a restart keeps the port.
    # Without one, uvicorn binds host:port itself.
    sockets = None if listen_fd is None else [socket.socket(fileno=int(listen_fd))]
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_keep_alive=SERVER_KEEPALIVE_SECONDS,
        )
    ).run(sockets=sockets)
    return 0


def quiet_garbage_collector() -> None:
    """Fewer, cheaper garbage collections while serving. A long history's request makes thousands of short-lived
    containers (its messages, id lists), and at CPython's default threshold they set off several collections per
    request; almost all of them are freed by reference counting anyway once the answer is sent, before a collection at
    the higher threshold looks at them. What start-up built (modules, the app) lives on: frozen out of every scan."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


if __name__ == "__main__":
    sys.exit(main())
