"""`ngt run` as a user runs it: a subprocess that serves two configured servers and stops them all on SIGINT."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
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
        ("alpha.resources_servers.echo.repeats=many", "--set: alpha.resources_servers.echo.repeats: Input should be a valid integer"),
        ("beta.resources_servers.echo.greeting=${nope}", "--set: beta.resources_servers.echo.greeting: ${nope} is not defined"),
    ],
)
def test_config_errors_are_one_line_and_start_nothing(override: str, expected: str) -> None:
    result = subprocess.run(
        [*NGT, "run", "-c", str(FIXTURES / "two_servers.yaml"), "--set", override],
        capture_output=True, text=True, timeout=60,
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
    assert vllm_command("m", ["--port", "9"])[1:] == ["-m", "nemo_gym_tok.cli.vllm_serve", "serve", "m", "--port", "9"]
