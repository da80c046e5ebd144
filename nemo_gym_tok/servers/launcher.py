"""Starts every server of a merged config (plus the head) as child processes, restarts crashed ones, stops them all."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from nemo_gym_tok.common.managed_process import ManagedProcess
from nemo_gym_tok.config import GymConfig, ServerInstance
from nemo_gym_tok.router import RouterProcess, RouterStartError
from nemo_gym_tok.servers.auth import AUTH_TOKEN_ENV, auth_headers, auth_token_of
from nemo_gym_tok.servers.nemo_gym_servers import NeMoGymStartError, is_nemo_gym_instance, start_nemo_gym_server
from nemo_gym_tok.servers.registry import validate_instance
from nemo_gym_tok.servers.routers import (
    RouterConfigError,
    exited_router,
    routed_instances,
    start_routers,
    stop_routers,
)
from nemo_gym_tok.servers.serve import SPEC_ENV, spec_for
from nemo_gym_tok.servers.supervision import (
    CrashHistory,
    PortInUseError,
    PortRequest,
    RestartPolicy,
    bind_ports,
    describe_exit,
    restart_policy,
)

HEAD_NAME = "head"
EXTERNAL_URL_KEY = "url"
"""An instance field: the server runs elsewhere at this base URL (e.g. a NeMo Gym resources server started by its own
launcher); `ngt run` starts nothing for it, checks it answers, and gives every server and `ngt collect` that URL."""
DEFAULT_HEAD_PORT = 11500
STOP_GRACE_SECONDS = 10.0


class LaunchError(RuntimeError):
    """A server did not come up; the message names it and says why."""


@dataclass
class ChildServer:
    """One server process, and what restarting it needs: its instance, its listening socket, its exits so far."""

    name: str
    url: str
    process: ManagedProcess
    instance: ServerInstance
    listener: socket.socket
    history: CrashHistory
    restart_at: float | None = None
    """Monotonic time a pending restart is due (set when the process exited and the policy allows a restart)."""
    healthy: bool = True
    """False from a restart until its first good /health answer."""
    restarts: int = 0


def head_address(config: GymConfig) -> tuple[str, int]:
    """Where the head server listens: top-level `head_server: {host, port}` in the config."""
    head: dict[str, Any] = config.values.get("head_server") or {}
    return str(head.get("host", "127.0.0.1")), int(head.get("port", DEFAULT_HEAD_PORT))


class Gym:
    """The running servers of one config. Use as a context manager, or call `start()` / `stop()`."""

    def __init__(self, config: GymConfig, *, ready_timeout: float = 120.0) -> None:
        self.config = config
        self.ready_timeout = ready_timeout
        self.children: list[ChildServer] = []
        self.urls: dict[str, str] = {}
        self.head_url = ""
        self.auth_token: str | None = None
        """The gym's bearer token (config `auth_token`, else $NGT_AUTH_TOKEN); set by `start()`."""
        self.restart = RestartPolicy()
        self.nemo_gym_children: dict[str, ManagedProcess] = {}
        """NeMo Gym servers started from their package (an instance with `nemo_gym_python`), by instance name: not
        restarted (their state is NeMo Gym's), stopped with the rest."""
        self.routers: dict[str, RouterProcess] = {}
        """The vllm-routers started for model adapters with a `router` field, by instance name (servers/routers.py)."""
        self._listeners: dict[str, socket.socket] = {}
        self._probe: httpx.Client | None = None

    def __enter__(self) -> Gym:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        external = external_urls(self.config)
        launched = {name: inst for name, inst in self.config.instances.items() if name not in external}
        nemo_gym = {name: inst for name, inst in launched.items() if is_nemo_gym_instance(inst)}
        try:
            routed = routed_instances(self.config)  # their base_url is the router's, known once it runs
        except RouterConfigError as exc:
            raise LaunchError(str(exc)) from None
        for name, instance in launched.items():
            if name not in nemo_gym and name not in routed:
                validate_instance(instance)  # fail on config errors before any process starts
        self.auth_token = auth_token_of(self.config)
        self.restart = restart_policy(self.config)
        head_host, head_port = head_address(self.config)
        requests = [PortRequest(HEAD_NAME, head_host, head_port, "head_server.port")] + [
            PortRequest(
                name,
                _host_of(inst),
                int(inst.fields.get("port") or 0),
                f"{name}.{inst.kind}.{inst.implementation}.port",
            )
            for name, inst in launched.items()
        ]
        try:
            # Every port, the head's included, is bound here before any process starts: one held by another
            # process is refused now, instead of that process answering our readiness probe.
            self._listeners = bind_ports(requests)
        except PortInUseError as exc:
            raise LaunchError(str(exc)) from None
        ports = {name: int(sock.getsockname()[1]) for name, sock in self._listeners.items()}
        self.urls = {
            name: external[name] if name in external else f"http://{_client_host(_host_of(inst))}:{ports[name]}"
            for name, inst in self.config.instances.items()
        }
        self.head_url = f"http://{_client_host(head_host)}:{ports[HEAD_NAME]}"
        head = ServerInstance(HEAD_NAME, "head", "head", {"host": head_host, "servers": self.urls}, {})
        try:
            self._start_routers(routed)
            head.fields["routers"] = {name: router.url for name, router in self.routers.items()}
            self._spawn(head, ports[HEAD_NAME], self.head_url)
            for name, instance in launched.items():
                if name in nemo_gym:
                    self._spawn_nemo_gym(instance, ports[name])
                else:
                    self._spawn(instance, ports[name], self.urls[name])
            self._wait_until_ready({name: self.urls[name] for name in external})
        except BaseException:
            self.stop()
            raise

    def _start_routers(self, routed: list[str]) -> None:
        try:
            self.routers = start_routers(self.config, ready_timeout=self.ready_timeout)
        except (RouterConfigError, RouterStartError) as exc:
            raise LaunchError(str(exc)) from None
        for name in routed:
            validate_instance(self.config.instances[name])

    def _spawn(self, instance: ServerInstance, port: int, url: str) -> None:
        listener = self._listeners[instance.name]
        process = self._start_server(instance, port, listener)
        self.children.append(ChildServer(instance.name, url, process, instance, listener, CrashHistory(self.restart)))

    def _spawn_nemo_gym(self, instance: ServerInstance, port: int) -> None:
        # NeMo Gym's server binds its own socket: the port reserved for it is let go just before it starts.
        self._listeners.pop(instance.name).close()
        try:
            process = start_nemo_gym_server(instance, _host_of(instance), port, die_with_parent=True)
        except NeMoGymStartError as exc:
            raise LaunchError(str(exc)) from None
        self.nemo_gym_children[instance.name] = process

    def _start_server(self, instance: ServerInstance, port: int, listener: socket.socket) -> ManagedProcess:
        spec = spec_for(instance, port=port, servers=self.urls, head_url=self.head_url, listen_fd=listener.fileno())
        env = {**os.environ, SPEC_ENV: spec}
        env.pop(AUTH_TOKEN_ENV, None)  # the config's token wins over the caller's environment, and none means none
        if self.auth_token:
            env[AUTH_TOKEN_ENV] = self.auth_token
        # A process group of its own: Ctrl-C reaches only the supervisor, which stops children in order; the kernel
        # SIGTERMs the child if the supervisor dies, even by SIGKILL.
        return ManagedProcess.start(
            [sys.executable, "-m", "nemo_gym_tok.servers.serve"],
            env=env,
            pass_fds=(listener.fileno(),),  # the child serves on the socket the supervisor bound and keeps
            die_with_parent=True,
        )

    def _wait_until_ready(self, external: dict[str, str]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        pending = [(child.name, child.url, child.process) for child in self.children]
        pending += [(name, self.urls[name], process) for name, process in self.nemo_gym_children.items()]
        with httpx.Client(timeout=2.0, headers=auth_headers(self.auth_token)) as http:
            _wait_external(http, external, deadline)
            while pending:
                for child in list(pending):
                    name, url, process = child
                    code = process.returncode
                    if code is not None:
                        raise LaunchError(f"server {name!r} exited with code {code} before becoming healthy")
                    try:
                        if http.get(f"{url}/health").status_code == 200:
                            pending.remove(child)
                    except httpx.TransportError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(name for name, _, _ in pending)
                    raise LaunchError(f"not healthy after {self.ready_timeout:.0f}s: {names}")
                if pending:
                    time.sleep(0.1)

    def exited_child(self) -> ChildServer | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if not c.process.alive), None)

    def supervise(self, report: Callable[[str], None]) -> str | None:
        """One supervision pass: schedule, run and follow restarts of exited children; `report` gets each event.

        Returns why the whole gym must stop (a child exited with restarts off, or more often than the policy
        allows within its window), or None while everything is running or coming back. A restarted child dies with
        the thread that called this (the kernel's parent-death signal follows the forking thread): call it from a
        thread that lives as long as the gym.
        """
        now = time.monotonic()
        router_gone = exited_router(self.routers)
        if router_gone is not None:
            return f"{router_gone} (ngt run does not restart routers)"
        for name, process in self.nemo_gym_children.items():
            if not process.alive:
                return f"NeMo Gym server {name!r} {describe_exit(process.returncode)} (ngt run does not restart those)"
        for child in self.children:
            code = child.process.returncode
            if code is not None and child.restart_at is None:
                child.process.kill()  # what the exited server left in its process group; reaps it
                delay = child.history.restart_delay(now)
                if delay is None:
                    return self._give_up_reason(child, code)
                child.restart_at = now + delay
                child.healthy = False
                report(
                    f"server {child.name!r} {describe_exit(code)}; restarting it in {delay:g}s "
                    f"(restart {len(child.history.exits)} of at most {self.restart.max_restarts} "
                    f"within {self.restart.window_seconds:g}s)"
                )
            elif code is not None and child.restart_at is not None and now >= child.restart_at:
                port = int(child.listener.getsockname()[1])
                child.process = self._start_server(child.instance, port, child.listener)
                child.restart_at = None
                child.restarts += 1
                report(f"server {child.name!r} restarted (pid {child.process.pid})")
            elif code is None and not child.healthy and self._answers_health(child):
                child.healthy = True
                report(f"server {child.name!r} is healthy again at {child.url}")
        return None

    def _give_up_reason(self, child: ChildServer, code: int) -> str:
        if not self.restart.enabled:
            return f"server {child.name!r} {describe_exit(code)} (restart.enabled is false)"
        exits = len(child.history.exits) + 1
        return (
            f"server {child.name!r} {describe_exit(code)}: {exits} exits within {self.restart.window_seconds:g}s, "
            f"more than restart.max_restarts={self.restart.max_restarts} allows"
        )

    def _answers_health(self, child: ChildServer) -> bool:
        # A short timeout: the listening socket is ours, so a connection to a child still starting up is accepted
        # by the kernel and waits; the next supervision pass simply asks again.
        if self._probe is None:
            self._probe = httpx.Client(timeout=0.5, headers=auth_headers(self.auth_token))
        try:
            return self._probe.get(f"{child.url}/health").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        """SIGTERM every child's process group, wait up to the grace period, then SIGKILL whatever is left."""
        processes = [child.process for child in self.children] + list(self.nemo_gym_children.values())
        for process in processes:
            process.terminate()  # all at once: they shut down side by side within one grace period
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in processes:
            process.stop(grace=max(0.0, deadline - time.monotonic()))
        self.children.clear()
        self.nemo_gym_children.clear()
        stop_routers(self.routers)  # after the adapters, which call through them
        self.routers = {}
        for listener in self._listeners.values():
            listener.close()
        self._listeners = {}
        if self._probe is not None:
            self._probe.close()
            self._probe = None


def external_urls(config: GymConfig) -> dict[str, str]:
    """Instance name -> base URL of the instances that run elsewhere (their `url` field); a bad URL is a LaunchError."""
    found: dict[str, str] = {}
    for name, instance in config.instances.items():
        url = instance.fields.get(EXTERNAL_URL_KEY)
        if url is None:
            continue
        where = f"{name}.{instance.kind}.{instance.implementation}.{EXTERNAL_URL_KEY}"
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise LaunchError(f"{where}: expected the server's base URL (http://host:port), got {url!r}")
        found[name] = url.rstrip("/")
    return found


def _wait_external(http: httpx.Client, external: dict[str, str], deadline: float) -> None:
    """Until each external server answers HTTP at all (any status: it is not ours to judge its /health)."""
    pending = dict(external)
    while pending:
        for name, url in list(pending.items()):
            try:
                http.get(f"{url}/health")
                del pending[name]
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{name} ({url})" for name, url in pending.items())
            raise LaunchError(f"external servers not reachable: {names} (the `{EXTERNAL_URL_KEY}` field of each)")
        if pending:
            time.sleep(0.2)


def _host_of(instance: ServerInstance) -> str:
    return str(instance.fields.get("host", "127.0.0.1"))


def _client_host(bind_host: str) -> str:
    return "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
