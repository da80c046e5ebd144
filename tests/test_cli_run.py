"""`ngt run` as a user runs it: a subprocess that serves configured servers, refuses held ports, restarts a crashed
server, and stops them all on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
NGT = [sys.executable, "-m", "nemo_gym_tok"]


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def read_urls(process: subprocess.Popen[str], timeout: float = 90.0) -> dict[str, str]:
    urls: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"ngt run exited early with {process.wait()}")
        if line.startswith("all servers healthy"):
            return urls
        name, _, url = line.strip().partition(": ")
        urls[name] = url
    raise AssertionError("ngt run did not become healthy in time")


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_run_serves_both_servers_and_a_signal_stops_every_child(stop_signal: signal.Signals) -> None:
    process = subprocess.Popen(
        [*NGT, "run", "-c", str(FIXTURES / "two_servers.yaml")], stdout=subprocess.PIPE, text=True
    )
    try:
        urls = read_urls(process)
        children = children_of(process.pid)
        assert len(children) == 3  # head + alpha + beta

        listed = httpx.get(f"{urls['head']}/servers").json()
        assert listed == {"alpha": urls["alpha"], "beta": urls["beta"]}
        reply = httpx.post(f"{listed['beta']}/echo", json={"text": "x"}).json()
        assert reply == {"said": "x", "greeting": "hihi"}  # ${beta_greeting} interpolated, repeats applied

        process.send_signal(stop_signal)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    time.sleep(0.2)
    assert not [pid for pid in children if _is_alive(pid)]
    ports = [int(url.rsplit(":", 1)[1]) for url in urls.values()]
    assert all(port_is_free(port) for port in ports), ports


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "alpha.resources_servers.echo.repeats=many",
            "--set: alpha.resources_servers.echo.repeats: Input should be a valid integer",
        ),
        (
            "beta.resources_servers.echo.greeting=${nope}",
            "--set: beta.resources_servers.echo.greeting: ${nope} is not defined",
        ),
        ("restart.max_restarts=-1", "--set: restart.max_restarts: Input should be greater than or equal to 0"),
    ],
)
def test_config_errors_are_one_line_and_start_nothing(override: str, expected: str) -> None:
    result = subprocess.run(
        [*NGT, "run", "-c", str(FIXTURES / "two_servers.yaml"), "--set", override],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"ngt: {expected}")
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_malformed_yaml_via_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    result = subprocess.run([*NGT, "run", "-c", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"ngt: {bad}: malformed YAML: line 2")
    assert result.stderr.count("\n") == 1


def test_vllm_serve_help_and_plugin_registration() -> None:
    from nemo_gym_tok.cli.vllm_serve import plugin_is_registered, vllm_command

    result = subprocess.run([*NGT, "vllm-serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "NEMO_GYM_TOK_PREFIX_SPLICE=1" in result.stdout
    assert plugin_is_registered()  # the vllm.general_plugins entry point vLLM loads in each process
    assert vllm_command("m", ["--port", "9"])[1:] == [
        "-m",
        "nemo_gym_tok.cli.vllm_serve",
        "serve",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
    ]  # loopback by default


@pytest.mark.parametrize("port_key", ["head_server.port", "beta.resources_servers.echo.port"])
def test_a_port_held_by_another_process_is_refused_before_anything_starts(port_key: str) -> None:
    with socket.socket() as holder:  # another process's server on the port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [*NGT, "run", "-c", str(FIXTURES / "two_servers.yaml"), "--set", f"{port_key}={port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert result.stdout == ""  # no "healthy" line, no URLs: nothing was started
    assert result.stderr.count("\n") == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and f"change {port_key}" in result.stderr
    assert time.monotonic() - started < 30


def test_a_server_that_keeps_exiting_past_max_restarts_stops_the_gym() -> None:
    process = subprocess.Popen(
        [*NGT, "run", "-c", str(FIXTURES / "relay_gym.yaml"), "--set", "restart.max_restarts=0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        urls = read_urls(process)
        os.kill(httpx.get(f"{urls['slow_env']}/pid").json()["pid"], signal.SIGKILL)
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read() if process.stderr else ""
    assert (
        "server 'slow_env' was killed by SIGKILL: 1 exits within 60s, more than restart.max_restarts=0 allows; "
        "stopping all"
    ) in stderr


def test_a_resources_server_killed_mid_collection_is_restarted_and_a_rerun_completes_every_rollout_once(
    tmp_path: Path,
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(10)))
    output = tmp_path / "out.jsonl"
    gym = subprocess.Popen(
        [*NGT, "run", "-c", str(FIXTURES / "relay_gym.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        urls = read_urls(gym)
        first_pid = httpx.get(f"{urls['slow_env']}/pid").json()["pid"]
        command = [
            *NGT,
            "collect",
            "--input",
            str(rows),
            "--output",
            str(output),
            "--agent",
            "relay_agent",
            "--head-url",
            urls["head"],
            "--repeats",
            "2",
            "--concurrency",
            "3",
        ]
        collect = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (output.exists() and output.read_bytes().count(b"\n") >= 3):
                assert collect.poll() is None and time.monotonic() < deadline, "collect ended before the kill"
                time.sleep(0.01)
            os.kill(first_pid, signal.SIGKILL)  # rollouts are in flight at it (3 at a time, 0.3 s each)
            stdout, stderr = collect.communicate(timeout=120)
        finally:
            if collect.poll() is None:
                collect.kill()
        assert collect.returncode in (0, 1), stderr

        # The same URL is served again, by a new process.
        deadline = time.monotonic() + 60
        while (new_pid := httpx.get(f"{urls['slow_env']}/pid", timeout=30).json()["pid"]) == first_pid:
            assert time.monotonic() < deadline, "slow_env was not restarted"
            time.sleep(0.1)

        rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        assert "0 failed, 20 total" in rerun.stdout

        gym.send_signal(signal.SIGINT)
        assert gym.wait(timeout=30) == 0
    finally:
        if gym.poll() is None:
            gym.kill()
    gym_stderr = gym.stderr.read() if gym.stderr else ""
    assert "server 'slow_env' was killed by SIGKILL; restarting it in 0.2s" in gym_stderr
    assert "server 'slow_env' is healthy again" in gym_stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = Counter((r["rollout_id"]["row"], r["rollout_id"]["repeat"]) for r in records)
    assert ids == Counter({(row, repeat): 1 for row in range(10) for repeat in range(2)})
    assert {r["env_pid"] for r in records} == {first_pid, new_pid}  # served before and after the restart
    assert not Path(f"{output}.failures.jsonl").exists()
