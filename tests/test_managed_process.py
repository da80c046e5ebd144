"""nemo_gym_tok.common.managed_process with real small child processes: the whole group stopped, the grace kept."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from nemo_gym_tok.common.managed_process import ManagedProcess, live_group_members, log_tail

# A child that starts a grandchild (which sleeps), prints its pid and sleeps itself.
WITH_GRANDCHILD = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""
# A child that ignores SIGTERM, says so, and sleeps.
IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(60)
"""


def _python(code: str, log: Path) -> ManagedProcess:
    return ManagedProcess.start([sys.executable, "-c", code], log_path=log)


def _first_line(process: ManagedProcess, timeout: float = 10.0) -> str:
    assert process.log_path is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = process.log_path.read_text().splitlines()
        if lines:
            return lines[0]
        time.sleep(0.02)
    raise AssertionError(f"the child wrote nothing in {timeout:g}s")


def _exists(pid: int) -> bool:
    """The process runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def test_stop_ends_the_child_and_its_grandchild(tmp_path: Path) -> None:
    process = _python(WITH_GRANDCHILD, tmp_path / "child.log")
    grandchild = int(_first_line(process))
    assert os.getpgid(process.pid) == process.pid != os.getpgid(0)  # a group of its own, not ours
    assert process.alive and process.returncode is None
    assert sorted(live_group_members(process.pid)) == sorted([process.pid, grandchild])
    started = time.monotonic()
    code = process.stop(grace=5.0)
    assert time.monotonic() - started < 3.0  # both exit on the SIGTERM: no wait for the grace
    assert code == -signal.SIGTERM and process.returncode == -signal.SIGTERM and not process.alive
    assert not _exists(grandchild) and not _exists(process.pid)
    assert live_group_members(process.pid) == []
    assert process.stop() == -signal.SIGTERM  # a second stop only answers


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    process = _python(IGNORES_SIGTERM, tmp_path / "child.log")
    assert _first_line(process) == "ignoring SIGTERM"
    started = time.monotonic()
    code = process.stop(grace=0.5)
    elapsed = time.monotonic() - started
    assert code == -signal.SIGKILL, code
    assert 0.5 <= elapsed < 3.0, elapsed  # it had the grace, then no more
    assert not _exists(process.pid)


def test_what_an_exited_child_left_behind_is_stopped_with_it(tmp_path: Path) -> None:
    # The child exits at once; its grandchild, which ignores SIGTERM, lives on in the group until stop.
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
        "g.stdout.readline()\n"  # the grandchild ignores SIGTERM from here on
        "print(g.pid, flush=True)\n"
        "time.sleep(0.3)\n"
        "sys.exit(3)\n"
    )
    process = _python(code, tmp_path / "child.log")
    grandchild = int(_first_line(process))
    assert process.wait(timeout=10) == 3 and not process.alive
    assert _exists(grandchild)
    started = time.monotonic()
    assert process.stop(grace=0.3) == 3  # the child's own code, not the signal its grandchild got
    assert time.monotonic() - started >= 0.3  # the grandchild had the grace: it outlived the SIGTERM
    assert not _exists(grandchild)


def test_kill_is_a_sigkill_to_the_group(tmp_path: Path) -> None:
    process = _python(WITH_GRANDCHILD, tmp_path / "child.log")
    grandchild = int(_first_line(process))
    assert process.kill() == -signal.SIGKILL
    assert not _exists(grandchild)


def test_return_code_wait_and_log_tail(tmp_path: Path) -> None:
    code = "import sys\nfor i in range(50): print(f'\\x1b[32mline {i}\\x1b[0m')\nsys.exit(7)"
    process = _python(code, tmp_path / "logs" / "child.log")  # the log's folder is made
    assert process.wait(timeout=10) == 7 and process.returncode == 7
    assert process.log_tail(2, strip_ansi=True) == "line 48\nline 49"
    assert process.log_tail(1) == "\x1b[32mline 49\x1b[0m"
    assert process.stop() == 7
    assert log_tail(tmp_path / "missing.log") == log_tail(None) == "(no log)"


def test_wait_returns_none_while_the_child_runs_and_stderr_joins_the_log(tmp_path: Path) -> None:
    code = "import sys, time\nprint('to stderr', file=sys.stderr, flush=True)\ntime.sleep(60)"
    with _python(code, tmp_path / "child.log") as process:
        assert _first_line(process) == "to stderr"
        assert process.wait(timeout=0.2) is None and process.alive
    assert not process.alive


def test_streams_pass_fds_and_environment(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    out = tmp_path / "out.txt"
    code = "import os, sys\nos.write(int(sys.argv[1]), os.environ['MANAGED'].encode())\nprint('out')"
    with open(out, "wb") as stream:
        process = ManagedProcess.start(
            [sys.executable, "-c", code, str(write_end)],
            stdout=stream,
            env={**os.environ, "MANAGED": "yes"},
            pass_fds=(write_end,),
        )
    os.close(write_end)
    assert process.wait(timeout=10) == 0 and process.stop() == 0
    assert os.read(read_end, 10) == b"yes" and out.read_text() == "out\n"
    os.close(read_end)
    assert process.log_path is None
    with pytest.raises(ValueError, match="not both"):
        ManagedProcess.start([sys.executable, "-c", ""], log_path=out, stdout=None, stderr=-1)
