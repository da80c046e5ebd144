"""Starts a child process in a process group of its own and stops it together with every process it started."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

GROUP_EXIT_SECONDS = 5.0
"""After a SIGKILL, how long `stop` and `kill` wait for the group's processes to be gone before reaping the child."""
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
"""A colour code in a log (vllm-router colours its lines)."""
Stream = int | IO[Any] | None
"""Where a child's stdout or stderr goes, as `subprocess.Popen` takes it (None: this process's own)."""


class ManagedProcess:
    """A child that leads a new session, so its process group is the child and everything it starts (vLLM's engine
    core, a router's workers, uvicorn's workers) unless one of those starts a session of its own.

    Signals go to the whole group, so a child's children are stopped with it and none is left holding a port or a
    GPU. The child is reaped only by `stop` or `kill`: until then its pid stays reserved (an exited child is a
    zombie), so the group id cannot name some other process's group when it is signalled. Linux (the group's live
    members are read from /proc).
    """

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path | None) -> None:
        """Wraps a Popen started with start_new_session=True; use `ManagedProcess.start`."""
        self._popen = popen
        self.log_path = log_path
        """The file the child writes stdout and stderr to (None: the streams `start` was given)."""
        self._lock = threading.Lock()
        self._terminated = False

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        stdout: Stream = None,
        stderr: Stream = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        pass_fds: Sequence[int] = (),
        die_with_parent: bool = False,
    ) -> ManagedProcess:
        """Start `argv` in a new session, stdin from /dev/null, stdout and stderr both to `log_path` (truncated), else
        to `stdout` and `stderr` (None: this process's own).

        `env` is the child's whole environment (None: this one's); `pass_fds` stay open in the child (a listening
        socket it serves on); `die_with_parent`: the kernel SIGTERMs the child when the thread that started it
        ends, however it ends (Linux's parent-death signal; other processes of its group get nothing from it).
        """
        if log_path is not None and (stdout is not None or stderr is not None):
            raise ValueError("give a log_path or stdout/stderr streams, not both")
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") if log_path is not None else contextlib.nullcontext() as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else stdout,
                stderr=subprocess.STDOUT if log is not None else stderr,
                env=None if env is None else dict(env),
                cwd=cwd,
                pass_fds=tuple(pass_fds),
                start_new_session=True,  # a group of its own: a terminal's Ctrl-C reaches the parent, which stops it
                preexec_fn=_set_parent_death_signal if die_with_parent else None,
            )
        return cls(popen, log_path)

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group's id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while the child runs; then its exit code, or -N when signal N ended it (as subprocess reports it)."""
        with self._lock:
            if self._popen.returncode is not None:
                return self._popen.returncode
            try:  # WNOWAIT: the exited child stays a zombie, its pid reserved, until `stop` or `kill` reaps it
                info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped behind our back (SIGCHLD ignored): Popen says what it can
                return self._popen.wait()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    @property
    def alive(self) -> bool:
        """The child itself has not exited (its own children may outlive it until `stop`)."""
        return self.returncode is None

    def wait(self, timeout: float | None = None) -> int | None:
        """The child's return code once it exits, waiting up to `timeout` seconds (None: as long as it takes);
        None when it still runs then. Reaps nothing and signals nothing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        _wait_until(lambda: not self.alive, deadline)
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM to the whole group, once (a second SIGTERM makes some servers skip their clean shutdown); returns
        at once. `stop` sends it too: call this first to let several processes shut down side by side."""
        if not self._terminated:
            self._terminated = True
            self._signal_group(signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM to the group, up to `grace` seconds for the child and every live process of its group to exit,
        SIGKILL to whatever is left of the group, then reap the child; returns its return code. Also after the child
        exited on its own (what it left behind is stopped the same way); a second call only returns the code."""
        if not self._reaped():
            deadline = time.monotonic() + grace
            self.terminate()
            _wait_until(self._group_gone, deadline)
        return self._finish()

    def kill(self) -> int:
        """SIGKILL to the whole group at once, a crash with no goodbye (for crash tests), then reap the child;
        returns its return code (-9 unless it had exited before)."""
        self._signal_group(signal.SIGKILL)
        return self._finish()

    def log_tail(self, lines: int = 40, *, strip_ansi: bool = False) -> str:
        """The last `lines` lines of the log file (see `log_tail`)."""
        return log_tail(self.log_path, lines, strip_ansi=strip_ansi)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _reaped(self) -> bool:
        return self._popen.returncode is not None

    def _signal_group(self, sig: int) -> None:
        with self._lock:
            if self._reaped():  # the pid is free again: its number may name another group now
                return
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def _group_gone(self) -> bool:
        return not self.alive and not live_group_members(self.pid)

    def _finish(self) -> int:
        """SIGKILL what is left of the group (the unreaped child keeps its id ours), wait for it, reap the child."""
        self._signal_group(signal.SIGKILL)
        _wait_until(self._group_gone, time.monotonic() + GROUP_EXIT_SECONDS)
        with self._lock:
            return self._popen.wait()


def live_group_members(pgid: int) -> list[int]:
    """The pids of the processes of group `pgid` that have not exited (zombies left out), from /proc; [] without
    /proc."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        # After the command name in parentheses (which may hold spaces): state, ppid, pgrp, ...
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            found.append(int(name))
    return found


def log_tail(path: Path | None, lines: int = 40, *, strip_ansi: bool = False) -> str:
    """The last `lines` lines of the log at `path` for an error message, colour codes removed with `strip_ansi`;
    "(no log)" when there is none."""
    if path is None:
        return "(no log)"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join((ANSI_ESCAPE.sub("", text) if strip_ansi else text).splitlines()[-lines:])


def _wait_until(done: Callable[[], bool], deadline: float | None) -> None:
    """Poll `done` until it is true or `deadline` (monotonic; None: no deadline) has passed."""
    pause = 0.005
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 2, 0.05)


def _set_parent_death_signal() -> None:
    # Runs in the child between fork and exec. Linux only; elsewhere the child simply outlives a killed parent.
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
