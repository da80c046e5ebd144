"""Processes a figure watches from outside (Linux /proc): vLLM's API server behind a URL, resident memory, CPU time."""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlsplit

from benchkit.timing import process_cpu_seconds


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid`, in KiB (0 when it has exited)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def api_server_pid(url: str) -> int | None:
    """The pid of the vLLM API server answering `url`: the process started with `--port <its port>` whose parent was
    not (a wrapper such as `timeout` has no such argument; the engine core and workers rename themselves VLLM::*).
    None when no single such process runs on this machine (a remote server)."""
    port = str(urlsplit(url).port or 80)
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        words = [word.decode(errors="replace") for word in argv]
        if comm.startswith("VLLM::") or not any(w == "--port" and n == port for w, n in zip(words, words[1:])):
            continue
        found[int(entry.name)] = parent
    roots = [pid for pid, parent in found.items() if parent not in found]
    return roots[0] if len(roots) == 1 else None


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of `pid` so far; NaN when it is unknown or gone."""
    if pid is None:
        return float("nan")
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return float("nan")
