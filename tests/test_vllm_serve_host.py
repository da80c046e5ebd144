"""`ngt vllm-serve` listens on loopback unless the user names a host."""

from __future__ import annotations

from nemo_gym_tok.cli.vllm_serve import DEFAULT_HOST, vllm_command


def test_loopback_unless_a_host_is_given() -> None:
    command = vllm_command("model", ["--port", "8000"])
    assert command[-5:] == ["model", "--host", DEFAULT_HOST, "--port", "8000"] and DEFAULT_HOST == "127.0.0.1"
    for given in (["--host", "0.0.0.0"], ["--host=0.0.0.0"]):
        command = vllm_command("model", [*given, "--port", "8000"])
        assert DEFAULT_HOST not in command and command[-len(given) - 2 : -2] == given
