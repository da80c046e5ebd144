"""Small networking helpers shared by the launchers and the clients made per call."""

from __future__ import annotations

import functools
import socket
import ssl


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Something accepts connections on `host:port` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0


@functools.lru_cache(maxsize=1)
def shared_ssl_context() -> ssl.SSLContext:
    """One TLS context per process, for the httpx clients made per call (`verify=`): httpx builds a new one, loading
    the CA bundle, in every Client's constructor even for http:// URLs. That load took from a fraction of a second up
    to 13 s on a 2-core machine busy with vLLM, and a weight push (a new client each) waited for it before pausing
    anything."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def server_root(url: str) -> str:
    """A server's root for a base URL as configs and users give it: `http://host:8000/v1/` -> `http://host:8000`.
    Every client of a vLLM server or a router appends its own paths to this one form."""
    root = url.strip().rstrip("/")
    return root.removesuffix("/v1").rstrip("/")


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host` (a wildcard address is reached on loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
