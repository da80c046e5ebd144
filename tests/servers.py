"""Starting a real vLLM server (hooked, or stock) for a test folder: one per configuration, or reused from a URL."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from nemo_gym_tok.vllm_server import VLLMServer, VLLMStartupError


@contextlib.contextmanager
def hooked_server(
    model_dir: Path,
    *,
    served_model_name: str,
    extra_args: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    reuse_env: str | None = None,
    what: str = "",
    hook: bool = True,
    port: int = 0,
    launched: VLLMServer | None = None,
) -> Iterator[VLLMServer]:
    """The server, stopped on exit. `reuse_env` names a variable that, for local iteration only, points at a server
    already started the same way (CI never sets it); a start-up failure fails the test with the log's tail.
    `launched`: the same server launched earlier (VLLMServer.launch), waited for here instead of started."""
    reuse = os.environ.get(reuse_env) if reuse_env else None
    if reuse:
        host, port = reuse.removeprefix("http://").rstrip("/").split(":")
        yield VLLMServer(model_dir, served_model_name=served_model_name, host=host, port=int(port), hook=hook)
        return
    server = launched or VLLMServer(
        model_dir,
        served_model_name=served_model_name,
        extra_args=tuple(extra_args),
        env=dict(env),
        log_path=log_path,
        hook=hook,
        port=port,
    )
    try:
        server.wait_ready() if launched else server.start()
    except VLLMStartupError as exc:
        pytest.fail(f"{what}{exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
