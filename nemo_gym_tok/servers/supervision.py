"""`ngt run`'s ports and crashes: every port bound up front, crashed children restarted with back-off."""

from __future__ import annotations

import signal
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_tok.config import ConfigError, GymConfig

RESTART_KEY = "restart"
"""Top-level config key of the restart policy."""
MAX_BACKOFF_SECONDS = 30.0
"""The doubling back-off stops growing here, so a flapping server is retried at least this often."""
LISTEN_BACKLOG = 2048  # uvicorn's default, so the supervisor's socket queues as many connections as uvicorn's would


class RestartPolicy(BaseModel):
    """`restart:` in the config: how `ngt run` treats a child server that exits without being asked to."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """False: the first exit of any server stops the whole gym."""
    max_restarts: int = Field(5, ge=0)
    """Restarts of one server allowed within `window_seconds`; one more exit in that window stops the gym."""
    window_seconds: float = Field(60.0, gt=0)
    backoff_seconds: float = Field(1.0, ge=0)
    """Wait before the first restart; it doubles with each further restart in the window (up to 30 s)."""


def restart_policy(config: GymConfig) -> RestartPolicy:
    """The validated `restart:` mapping of the config (defaults when absent); a bad value is a one-line ConfigError."""
    raw = config.values.get(RESTART_KEY)
    if raw is None:
        return RestartPolicy()
    if not isinstance(raw, dict):
        raise ConfigError(
            config.sources.get((RESTART_KEY,)),
            RESTART_KEY,
            "expected a mapping, e.g. {enabled: true, max_restarts: 5, backoff_seconds: 1}",
        )
    try:
        return RestartPolicy.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = (RESTART_KEY, *(str(part) for part in error["loc"]))
        shown = error["type"] != "missing" and "input" in error
        detail = error["msg"] + (f" (got {error['input']!r})" if shown else "")
        source = next(
            (config.sources[path[:end]] for end in range(len(path), 0, -1) if path[:end] in config.sources), None
        )
        raise ConfigError(source, ".".join(path), detail) from None


@dataclass
class CrashHistory:
    """The recent exits of one child server, against the policy."""

    policy: RestartPolicy
    exits: deque[float] = field(default_factory=deque)

    def restart_delay(self, now: float) -> float | None:
        """Count an exit at `now` (monotonic): seconds to wait before restarting, or None when the gym must stop."""
        if not self.policy.enabled:
            return None
        while self.exits and now - self.exits[0] > self.policy.window_seconds:
            self.exits.popleft()
        if len(self.exits) >= self.policy.max_restarts:
            return None
        self.exits.append(now)
        return min(self.policy.backoff_seconds * 2 ** (len(self.exits) - 1), MAX_BACKOFF_SECONDS)


def describe_exit(returncode: int) -> str:
    """`exited with code 3` or `was killed by SIGKILL`."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class PortInUseError(RuntimeError):
    """A configured port is held by another process (or configured twice); the message names it and the key."""


@dataclass(frozen=True)
class PortRequest:
    """One server's listening address, and the config key that sets its port (for the error message)."""

    name: str
    host: str
    port: int
    key: str


def bind_ports(requests: Sequence[PortRequest]) -> dict[str, socket.socket]:
    """A listening socket for every request (port 0: a free one), or PortInUseError with nothing left bound.

    The supervisor keeps these sockets and hands each to its child, so no other process can take a port between
    this check and the child's start, or while a crashed child is restarted; a probe therefore always reaches
    our own server, and connections made during a restart wait in the queue instead of being refused.
    """
    bound: dict[str, socket.socket] = {}
    owners: dict[int, str] = {}
    try:
        for request in requests:
            if request.port and request.port in owners:
                raise PortInUseError(
                    f"port {request.port} is configured twice: for {owners[request.port]!r} and for "
                    f"{request.name!r} ({request.key}); give each server its own port"
                )
            try:
                sock = _listen(request.host, request.port)
            except OSError as exc:
                raise PortInUseError(
                    f"cannot listen on {request.host}:{request.port} for {request.name!r}: "
                    f"{exc.strerror or exc}{' (another process holds it)' if request.port else ''}; "
                    f"stop that process or change {request.key}"
                ) from None
            bound[request.name] = sock
            owners[int(sock.getsockname()[1])] = request.name
    except BaseException:
        for sock in bound.values():
            sock.close()
        raise
    return bound


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    # SO_REUSEADDR as uvicorn sets it: a port left in TIME_WAIT by the last run is free, one that is listened on is not.
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
