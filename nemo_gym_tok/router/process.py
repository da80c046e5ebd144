"""Starts vLLM's own router (the vllm-router wheel) as a process in front of the gym's vLLM replicas, and stops it."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nemo_gym_tok.common.managed_process import ManagedProcess, log_tail
from nemo_gym_tok.common.net import free_port, port_in_use, shared_ssl_context
from nemo_gym_tok.router.workers import RouterError, list_workers, worker_base_url

ROUTER_VERSION = "0.1.17"
"""The vllm-router release this package is written and tested against (pyproject.toml pins it)."""
INSTALL_HINT = f"pip install vllm-router=={ROUTER_VERSION} (or `make setup`)"
ROUTER_POLICIES: tuple[str, ...] = (
    "consistent_hash",
    "sticky_least_loaded",
    "cache_aware",
    "round_robin",
    "power_of_two",
)
"""The policies the gym may ask for. consistent_hash and sticky_least_loaded keep a session on one replica by the
SESSION_HEADER; round_robin and power_of_two ignore it; cache_aware matches prompt text instead."""
DEFAULT_POLICY = "consistent_hash"
SESSION_HEADER = "x-session-id"
"""The request header the router's session-affine policies key on (`x-correlation-id` works as well)."""
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
# The router ignores its --log-level in 0.1.17 and reads RUST_LOG; at info it writes one line per routed request.
_RUST_LOG = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
# Flags the spec's own fields set and RouterProcess relies on (readiness, ports): extra_args may not repeat them.
_OWNED_FLAGS = ("--host", "--port", "--worker-urls", "--policy", "--prometheus-port", "--api-key")


class RouterStartError(RuntimeError):
    """vllm-router is not installed, exited during start-up, or was not ready in time; the message names its log."""


def check_router_installed() -> None:
    """Raises RouterStartError when this Python cannot run vllm-router (its launcher or its Rust extension)."""
    missing = [name for name in ("vllm_router", "vllm_router_rs") if importlib.util.find_spec(name) is None]
    if missing:
        raise RouterStartError(
            f"vllm-router is not installed in {sys.executable} (no module {', '.join(missing)}); {INSTALL_HINT}"
        )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RouterSpec.{name} must be a whole number of at least 1, not {value!r}")


@dataclass(frozen=True)
class RouterSpec:
    """One vllm-router in front of `worker_urls`.

    `worker_urls` are the replicas' base URLs, `http(s)://host:port` WITHOUT `/v1`: a trailing `/v1` or `/` is
    stripped here (the router appends `/v1/...` itself and would count `http://h:8000/` and `http://h:8000` as two
    workers). `port` 0 means a free port, picked when the process starts. `extra_args` go last on the command line,
    so they override the tuning values below (not the flags the other fields set).

    The tuning defaults differ from the router's (5 attempts, a breaker after 10 failures, open 60 s): a request the
    router sends again may be generated again (it retries vLLM's own 500s and its timeouts alike), and with the
    adapter's own retry on top one call could be generated six times. Here the router sends each request once and
    opens a worker's breaker at its first failure; the adapter sends again, once, a call a dead worker lost, which the
    open breaker steers to a live worker (measured with stub workers, tests/test_router_retries.py: no call fails
    after a SIGKILL, none generated twice but the lost one). The price: one 5xx from a worker keeps it out for
    `cb_timeout_duration_secs`, its sessions on its neighbours meanwhile.
    """

    worker_urls: tuple[str, ...]
    policy: str = DEFAULT_POLICY
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = field(default=None, repr=False)
    """Passed as --api-key (visible in the process list). vllm-router 0.1.17 uses it only for intra-node data-parallel
    routing: it neither asks clients for a key nor adds one to what it forwards; a client's own Authorization header
    is forwarded to the worker as sent."""
    request_timeout_secs: int = 1800
    """Long enough for a long generation; the router's own default too."""
    health_check_interval_secs: int = 5
    """The router's periodic GET /health (60 s by default): after 3 failed checks a dead replica is marked unhealthy
    (about 15 s), and a restarted one takes its sessions back after 2 good ones (about 10 s)."""
    worker_startup_check_interval_secs: int = 1
    """How often the router asks each worker's /health before it serves (30 s by default: a start-up would wait 30 s
    for a replica that was one second late)."""
    worker_startup_timeout_secs: int = 600
    """How long the router waits for its workers at start (then exits) and for a worker /add_worker names."""
    retry_max_retries: int = 1
    """Attempts per request, the first included. One: the router never sends a request again. It cannot tell vLLM's
    own 500 about a request from a worker that died mid-turn, and sends both again, timeouts too; the adapter, which
    can, sends a call again once where it may have been lost (responses_api_models/vllm_model/retry_policy.py), so a
    turn is generated at most twice end to end."""
    cb_failure_threshold: int = 1
    """Failures (5xx, connection errors) that open a worker's circuit breaker: one, so the adapter's one retry of a
    call a dead worker failed reaches a live one. 4xx answers count as successes: a client's mistakes open nothing."""
    cb_timeout_duration_secs: int = 5
    """How long an open breaker keeps its worker out before one call tries it again (60 s by default): short, so a
    breaker opened by a worker's own 5xx answer closes soon; a dead worker is kept out by the health check meanwhile
    (and that one call is sent again by the adapter)."""
    log_level: str = "warning"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        urls = self.worker_urls
        if isinstance(urls, str):
            raise ValueError(f"RouterSpec.worker_urls must be a tuple of URLs, not one string: write ({urls!r},)")
        urls = tuple(urls)
        if not urls:
            raise ValueError("RouterSpec needs at least one worker URL, e.g. worker_urls=('http://127.0.0.1:8000',)")
        normalized = tuple(worker_base_url(url) for url in urls)
        seen: dict[str, str] = {}
        for original, url in zip(urls, normalized, strict=True):
            if url in seen:
                raise ValueError(
                    f"RouterSpec.worker_urls names {url} twice ({seen[url]!r} and {original!r}); list each replica once"
                )
            seen[url] = original
        object.__setattr__(self, "worker_urls", normalized)
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; pick one of {', '.join(ROUTER_POLICIES)}")
        if not isinstance(self.host, str) or not self.host or "/" in self.host:
            raise ValueError(f"RouterSpec.host must be a host name or address like 127.0.0.1, not {self.host!r}")
        if not is_loopback(self.host):
            raise ValueError(
                f"RouterSpec.host {self.host!r} would open the router's admin routes to the network: vllm-router "
                f"{ROUTER_VERSION} serves /add_worker, /remove_worker and /workers on its inference port without any "
                "key, and a worker added there receives the fleet's requests and the key they carry. Listen on "
                "127.0.0.1 (the gym's servers reach it there), or put a loopback router behind an authenticating "
                "proxy you run (docs/scaling.md)"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"RouterSpec.port must be 0 (a free port) or a port number up to 65535, not {self.port!r}")
        for name in (
            "request_timeout_secs",
            "health_check_interval_secs",
            "worker_startup_check_interval_secs",
            "worker_startup_timeout_secs",
            "retry_max_retries",
            "cb_failure_threshold",
            "cb_timeout_duration_secs",
        ):
            _positive(name, getattr(self, name))
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"RouterSpec.log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("RouterSpec.api_key must be a non-empty string or None")
        extra = self.extra_args
        if isinstance(extra, str) or not all(isinstance(arg, str) for arg in extra):
            raise ValueError(f"RouterSpec.extra_args must be a tuple of strings like ('--queue-size', '9'): {extra!r}")
        object.__setattr__(self, "extra_args", tuple(extra))
        owned = [arg for arg in self.extra_args if arg.split("=", 1)[0] in _OWNED_FLAGS]
        if owned:
            raise ValueError(
                f"RouterSpec.extra_args repeats {owned}: set worker_urls, policy, host, port or api_key instead "
                "(RouterProcess waits on them)"
            )


def router_command(spec: RouterSpec, port: int, prometheus_port: int) -> list[str]:
    """The command line that starts vllm-router for `spec` on `port`, its metrics on `prometheus_port`.

    The metrics port must be a real one: the router refuses 0 and, by default, takes 29000, so a second router on
    the machine would die at start-up.
    """
    command = [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--host",
        spec.host,
        "--port",
        str(port),
        "--policy",
        spec.policy,
        "--prometheus-host",
        spec.host,
        "--prometheus-port",
        str(prometheus_port),
        "--request-timeout-secs",
        str(spec.request_timeout_secs),
        "--health-check-interval-secs",
        str(spec.health_check_interval_secs),
        "--worker-startup-check-interval",
        str(spec.worker_startup_check_interval_secs),
        "--worker-startup-timeout-secs",
        str(spec.worker_startup_timeout_secs),
        "--retry-max-retries",
        str(spec.retry_max_retries),
        "--cb-failure-threshold",
        str(spec.cb_failure_threshold),
        "--cb-timeout-duration-secs",
        str(spec.cb_timeout_duration_secs),
        "--log-level",
        spec.log_level,
    ]
    if spec.api_key is not None:
        command += ["--api-key", spec.api_key]
    return [*command, "--worker-urls", *spec.worker_urls, *spec.extra_args]


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name or address, IPv6 with or without brackets)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _in_use(host: str, port: int) -> bool:
    try:
        return port_in_use(_client_host(host).strip("[]"), port)
    except OSError:  # an address port_in_use's IPv4 socket cannot reach: the router's own bind will say
        return False


class RouterProcess:
    """One vllm-router process for a RouterSpec, its output in a log file (`log_path`, else a new temp file)."""

    def __init__(self, spec: RouterSpec, *, log_path: str | Path | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_path) if log_path is not None else None
        self.port: int | None = None
        self.prometheus_port: int | None = None
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """`http://host:port`, the router's base URL (no `/v1`); known once `start` has picked the port."""
        if self.port is None:
            raise RuntimeError("the router has no URL before start(): its port is picked then")
        return f"http://{_client_host(self.spec.host)}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.alive

    def _name(self) -> str:
        where = f"{self.spec.host}:{self.port}" if self.port is not None else self.spec.host
        return f"vllm-router ({self.spec.policy} on {where}, workers {', '.join(self.spec.worker_urls)})"

    def start(self, timeout: float = 120.0) -> RouterProcess:
        """Starts the router and returns once GET /health answers 200 and /list_workers lists every worker.

        The router serves only once every worker answers GET /health, so `timeout` covers the workers' start-up
        too. Raises RouterStartError (the process stopped) when it exits or is not ready within `timeout`.
        """
        if self.running:
            raise RouterStartError(f"{self._name()} is running already (pid {self.pid}); stop() it first")
        check_router_installed()
        host = self.spec.host
        if self.spec.port and _in_use(host, self.spec.port):
            # Otherwise the readiness check could find whatever listens there and report success.
            raise RouterStartError(f"{host}:{self.spec.port} is in use already; stop what listens there or use port 0")
        self.port = self.spec.port or free_port(host)
        self.prometheus_port = free_port(host)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="ngt-router-")) / "router.log"
        self._process = ManagedProcess.start(
            router_command(self.spec, self.port, self.prometheus_port),
            log_path=self.log_path,
            env={**os.environ, "RUST_LOG": _RUST_LOG[self.spec.log_level]},
        )
        try:
            self._wait_until_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ready(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        expected = set(self.spec.worker_urls)
        state = "no answer yet"
        with httpx.Client(timeout=5.0, verify=shared_ssl_context()) as http:
            while True:
                code = self._process.returncode
                if code is not None:
                    raise RouterStartError(
                        f"{self._name()} exited with code {code} during start-up.\n"
                        f"Last lines of its log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    health = http.get(f"{self.url}/health")
                    if health.status_code != 200:
                        state = f"GET /health answered {health.status_code}"
                    else:
                        listed = list_workers(self.url, http=http)
                        if expected <= set(listed):
                            return
                        state = f"/list_workers lists {listed}"
                except (httpx.TransportError, RouterError) as exc:
                    # The router binds its port only once every worker answered /health: refused until then.
                    state = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        raise RouterStartError(
            f"{self._name()} was not ready after {timeout:.0f}s ({state}); it serves only once every worker answers "
            f"GET /health.\nLast lines of its log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the router's log, colour codes removed."""
        if self.log_path is None:
            return "(no log yet)"
        return log_tail(self.log_path, lines, strip_ansi=True)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the router's process group, then SIGKILL after `grace` seconds (ManagedProcess.stop); does
        nothing once stopped. The router's own graceful shutdown waits for requests in flight, which a long
        generation would stretch past any grace."""
        if self._process is not None:
            self._process.stop(grace)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
