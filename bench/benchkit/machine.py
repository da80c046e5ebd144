"""What the figures were measured on: the machine, its load, and where vLLM's CPU worker runs."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from datetime import date
from pathlib import Path

import httpx
import orjson

from benchkit.episode import user_message
from benchkit.server import JSON_HEADERS, MODEL, server_version
from benchkit.timing import process_cpu_seconds


def machine_facts(url: str | None = None) -> dict[str, str]:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    return {
        "cpu": f"{os.cpu_count()} cores ({cpu})",
        "memory": memory,
        "python": platform.python_version(),
        "vllm": server_version(url) if url else "unknown",
        "date": date.today().isoformat(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "placement": cpu_placement(url) if url else "unknown",
    }


def cpu_placement(url: str, window: float = 0.5) -> str:
    """Where vLLM's worker process runs and how busy it stays right after a request, measured: on the CPU build it is
    pinned to its own CPUs and busy-waits on its shared-memory queue for a while after every step, so everything
    else (vLLM's API server and engine core, the bench client, the adapter) shares what is left. Every CPU
    millisecond spent in the API server or the adapter is then paid for in latency, which sets what any hop costs."""
    workers = [pid for pid in _pids() if _comm(pid) == "VLLM::Worker"]
    if len(workers) != 1:
        return f"not measured ({len(workers)} vLLM worker processes on the machine)"
    worker = workers[0]
    body = orjson.dumps({"model": MODEL, "messages": [user_message(0)], "max_tokens": 1})
    try:
        pinned = sorted(os.sched_getaffinity(worker))
        with httpx.Client(timeout=120) as http:
            http.post(f"{url}/v1/chat/completions", content=body, headers=JSON_HEADERS).raise_for_status()
        before, started = process_cpu_seconds(worker), time.monotonic()
        time.sleep(window)
        busy = (process_cpu_seconds(worker) - before) / (time.monotonic() - started)
    except (OSError, httpx.HTTPError) as exc:
        return f"not measured ({type(exc).__name__}: {exc})"
    others = sorted(set(range(os.cpu_count() or 1)) - set(pinned))
    return (
        f"vLLM's worker process is pinned to CPU {','.join(map(str, pinned))} and kept {busy:.2f} cores busy in "
        f"the {window} s after a 1-token request; its API server, its engine core, the bench client and the "
        f"adapter share CPU {','.join(map(str, others)) or 'none'}"
    )


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
