"""Runs an ASGI app on a free loopback port in a background thread: for tests and embedding, not production."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", startup_timeout: float = 30.0, port: int | None = None
) -> Iterator[str]:
    """Serve `app` until the block exits (on `port`, else a free one); yields its base URL."""
    port = port or free_port(host)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=SERVER_KEEPALIVE_SECONDS,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"in-process server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
