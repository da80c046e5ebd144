"""P7's fleet: two hooked bench vLLM replicas started side by side, and their prefix caches reset between runs."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from benchkit.gym_processes import api_server_pid
from benchkit.server import BENCH_ARGS, MODEL, BenchError, bench_model, note
from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.net import server_root

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""vLLM serves POST /reset_prefix_cache only with this set (its development routes)."""


@contextlib.contextmanager
def replicas(urls: Sequence[str] | None, count: int = 2, *, log_dir: Path | None = None) -> Iterator[list[str]]:
    """The base URLs of `count` hooked vLLMs serving the bench model as MODEL: `urls` if given, else as many started
    here at once (the bench server's flags, BENCH_ARGS, each on its own port with its model worker on a CPU of its own
    (replica_cpu_env), dev mode on so that their prefix caches can be reset), stopped on exit."""
    if urls:
        yield [server_root(url) for url in urls]
        return
    from nemo_gym_tok.vllm.hook import ENABLE_ENV
    from nemo_gym_tok.vllm_server import TEST_BED_ENV, VLLMServer, replica_cpu_env

    model = bench_model()
    directory = log_dir or Path(tempfile.mkdtemp(prefix="ngt-bench-"))
    servers = [
        VLLMServer(
            model,
            served_model_name=MODEL,
            extra_args=BENCH_ARGS,
            env={**TEST_BED_ENV, ENABLE_ENV: "1", DEV_MODE_ENV: "1", **replica_cpu_env(index)},
            hook=True,
            log_path=directory / f"vllm-replica-{index}.log",
        )
        for index in range(count)
    ]
    errors: list[BaseException] = []

    def start(server: VLLMServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every start-up has ended
            errors.append(exc)

    started = time.monotonic()
    note(f"starting {count} hooked vLLM replicas at once on {model.name}, logs in {directory} ...")
    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        note(f"replicas up at {', '.join(s.base_url for s in servers)} after {time.monotonic() - started:.0f} s")
        yield [server.base_url for server in servers]
    finally:
        for server in servers:
            server.stop()


def reset_prefix_cache(url: str, http: httpx.Client, attempts: int = 20) -> bool:
    """Empties the prefix cache of the vLLM at `url`; False when it has no such route (started without dev mode).
    vLLM refuses while blocks are held (a request still running): asked again for a while, then BenchError."""
    for _ in range(attempts):
        answer = http.post(f"{url}/reset_prefix_cache")
        if answer.status_code in (404, 405):
            return False
        if answer.status_code != 200:
            raise BenchError(f"POST {url}/reset_prefix_cache answered HTTP {answer.status_code}: {answer.text[:300]}")
        if loads_exact(answer.content).get("success", True):
            return True
        time.sleep(0.5)
    raise BenchError(f"{url} kept refusing to reset its prefix cache (blocks still held after {attempts} tries)")


def worker_cpus(url: str) -> str:
    """The CPUs the vLLM worker process(es) of the server at `url` are pinned to, as `0` or `0,1` ("unknown" when
    the server is not a process of this machine): the CPU build pins each server's worker, by default to the same
    CPUs for every server on the machine."""
    api = api_server_pid(url)
    if api is None:
        return "unknown"
    parents: dict[int, int] = {}
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (entry / "comm").read_text().strip() == "VLLM::Worker":
                workers.append(int(entry.name))
    pinned: set[int] = set()
    for worker in workers:
        pid, hops = worker, 0
        while pid in parents and pid != api and hops < 8:
            pid, hops = parents[pid], hops + 1
        if pid == api:
            with contextlib.suppress(OSError):
                pinned |= os.sched_getaffinity(worker)
    return ",".join(map(str, sorted(pinned))) if pinned else "unknown"
