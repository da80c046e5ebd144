"""Starts every server of a merged config (plus the head) as child processes and stops them all together."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from nemo_gym_tok._net import free_port

from nemo_gym_tok.config import GymConfig, ServerInstance
from nemo_gym_tok.servers.registry import validate_instance
from nemo_gym_tok.servers.serve import SPEC_ENV, spec_for

HEAD_NAME = "head"
DEFAULT_HEAD_PORT = 11500
STOP_GRACE_SECONDS = 10.0


class LaunchError(RuntimeError):
    """A server did not come up; the message names it and says why."""


@dataclass
class ChildServer:
    name: str
    url: str
    process: subprocess.Popen[bytes]


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

    def __enter__(self) -> Gym:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for instance in self.config.instances.values():
            validate_instance(instance)  # fail on config errors before any process starts
        ports = {name: _port_or_free(inst) for name, inst in self.config.instances.items()}
        self.urls = {
            name: f"http://{_client_host(inst.fields.get('host', '127.0.0.1'))}:{ports[name]}"
            for name, inst in self.config.instances.items()
        }
        head_host, head_port = head_address(self.config)
        head_port = head_port or free_port(head_host)
        self.head_url = f"http://{_client_host(head_host)}:{head_port}"
        head = ServerInstance(HEAD_NAME, "head", "head", {"host": head_host, "servers": self.urls}, {})
        try:
            self._spawn(head, head_port, self.head_url)
            for name, instance in self.config.instances.items():
                self._spawn(instance, ports[name], self.urls[name])
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, instance: ServerInstance, port: int, url: str) -> None:
        env = {**os.environ, SPEC_ENV: spec_for(instance, port=port, servers=self.urls, head_url=self.head_url)}
        process = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym_tok.servers.serve"],
            env=env,
            start_new_session=True,  # Ctrl-C reaches only the supervisor, which stops children in order
            preexec_fn=_die_with_parent,
        )
        self.children.append(ChildServer(instance.name, url, process))

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        pending = list(self.children)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for child in list(pending):
                    code = child.process.poll()
                    if code is not None:
                        raise LaunchError(f"server {child.name!r} exited with code {code} before becoming healthy")
                    try:
                        if http.get(f"{child.url}/health").status_code == 200:
                            pending.remove(child)
                    except httpx.TransportError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise LaunchError(f"not healthy after {self.ready_timeout:.0f}s: {names}")
                if pending:
                    time.sleep(0.1)

    def exited_child(self) -> ChildServer | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self) -> None:
        """SIGTERM every child, wait up to the grace period, then SIGKILL whatever is left."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.children.clear()


def _port_or_free(instance: ServerInstance) -> int:
    port = int(instance.fields.get("port") or 0)
    return port or free_port(str(instance.fields.get("host", "127.0.0.1")))


def _client_host(bind_host: str) -> str:
    return "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the child if the supervisor dies, even by SIGKILL.
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
