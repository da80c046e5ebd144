"""Weight-push error paths a real server cannot be made to produce on cue (a reload failing on one of two servers, a
rollback failing, an answer that is not JSON, a Ctrl-C part-way), against a fake of vLLM's weight routes; the usage
checks of `ngt push-weights` and `vllm-serve`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import nemo_gym_tok.weights.push as push_module
from nemo_gym_tok.cli.main import main as ngt
from nemo_gym_tok.cli.vllm_serve import exposed_weight_routes, split_key_problem
from nemo_gym_tok.vllm.exact_reload import STATUS_METHOD as WORKER_STATUS_METHOD
from nemo_gym_tok.weights import (
    STATUS_METHOD,
    WeightPushError,
    check_checkpoint_dir,
    check_version_label,
    push_weights,
    server_root,
)
from tests.fake_vllm import HOSTS, FakeVLLM


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def push(fake: FakeVLLM, checkpoint: Path, **options: object):
    """A push to both hosts, the first named twice (its /v1 URL and its root): each server is pushed once."""
    urls = [f"{HOSTS[0]}/v1", *HOSTS]
    with httpx.Client(transport=httpx.MockTransport(fake.handler)) as http:
        return push_weights(urls, checkpoint, version="v1", http=http, **options)


def test_a_reload_failing_on_one_server_puts_every_server_back(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.fail[("http://b:8000", "reload_weights")] = str(checkpoint)
    with pytest.raises(WeightPushError, match="could not reload.*http://b:8000") as refused:
        push(fake, checkpoint)
    assert refused.value.replicas == ("http://b:8000",) and refused.value.left_paused == ()
    for state in fake.state.values():
        assert state == {"version": "v0", "weights": "/w/0", "paused": False}


def test_a_server_that_cannot_be_put_back_stays_paused_and_is_named(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.fail[("http://b:8000", "/update_weight_version")] = None
    fake.fail[("http://b:8000", "reload_weights")] = "/w/0"  # the rollback's reload
    with pytest.raises(WeightPushError, match="left paused.*http://b:8000") as refused:
        push(fake, checkpoint)
    assert refused.value.left_paused == ("http://b:8000",)
    assert fake.state["http://a:8000"] == {"version": "v0", "weights": "/w/0", "paused": False}
    assert fake.state["http://b:8000"]["paused"] is True


def test_an_answer_that_is_not_json_part_way_puts_every_server_back_and_names_it(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.garbage.add(("http://a:8000", "/reset_prefix_cache"))
    with pytest.raises(WeightPushError, match="could not reset.*http://a:8000.*not JSON") as refused:
        push(fake, checkpoint)
    assert refused.value.replicas == ("http://a:8000",) and refused.value.left_paused == ()
    assert "put back" in str(refused.value) and refused.value.unproven_version is None
    assert fake.back_as_before()


def test_a_keyboard_interrupt_part_way_rolls_every_server_back_then_is_raised_again(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.interrupt.add(("http://b:8000", "/update_weight_version"))
    with pytest.raises(KeyboardInterrupt) as interrupted:
        push(fake, checkpoint)
    notes = " ".join(getattr(interrupted.value, "__notes__", []))
    assert "stopped part-way by KeyboardInterrupt" in notes and "every server was put back" in notes
    assert fake.back_as_before()


def test_an_exception_of_the_push_itself_part_way_rolls_back_and_chains_it(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a server's answer but a fault on this side (a bug, MemoryError, ...) once the servers are paused: every
    server is put back, and the error names the cause, chained to it."""
    calls = {"count": 0}
    real = push_module.try_each

    def failing_on_the_reload(replicas: list, action: object) -> list:
        calls["count"] += 1
        if calls["count"] == 4:  # preflight, pause, then this is the reload step
            raise RuntimeError("planted fault")
        return real(replicas, action)

    monkeypatch.setattr(push_module, "try_each", failing_on_the_reload)
    fake = FakeVLLM(HOSTS)
    with pytest.raises(WeightPushError, match="stopped part-way by RuntimeError: planted fault") as stopped:
        push(fake, checkpoint)
    assert isinstance(stopped.value.__cause__, RuntimeError) and "every server was put back" in str(stopped.value)
    assert fake.back_as_before()


def test_a_compensating_resume_that_fails_after_a_refused_pause_is_named(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.fail[("http://b:8000", "/pause")] = None
    fake.fail[("http://a:8000", "/resume")] = None
    with pytest.raises(WeightPushError, match="could not pause.*left paused.*http://a:8000") as refused:
        push(fake, checkpoint)
    assert refused.value.replicas == ("http://b:8000",) and refused.value.left_paused == ("http://a:8000",)
    assert fake.state["http://a:8000"]["paused"] is True and fake.state["http://a:8000"]["weights"] == "/w/0"


def test_keep_mode_drops_the_kv_of_frozen_requests_and_wait_mode_does_not(checkpoint: Path) -> None:
    for mode, expected in (("keep", "true"), ("wait", "false")):
        fake = FakeVLLM(HOSTS)
        report = push(fake, checkpoint, pause_mode=mode)
        assert report.version == "v1" and all(state["version"] == "v1" for state in fake.state.values())
        pauses = [params["mode"] for _, path, params in fake.calls if path == "/pause"]
        resets = [params["reset_running_requests"] for _, path, params in fake.calls if path == "/reset_prefix_cache"]
        assert pauses == [mode, mode] and resets == [expected, expected]


def test_a_stock_cpu_server_is_refused_before_anything_changes(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS, exact=False)
    with pytest.raises(WeightPushError, match="refused before any change.*tied embeddings"):
        push(fake, checkpoint)
    assert not [call for call in fake.calls if call[1] in ("/pause", "/update_weight_version")]
    gpu = FakeVLLM(HOSTS, exact=False, device="cuda")  # vLLM's own reload is right off the CPU build
    assert push(gpu, checkpoint).version == "v1"


def test_a_label_already_served_is_refused(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.state["http://a:8000"]["version"] = "v1"
    with pytest.raises(WeightPushError, match="already serves weight version 'v1'"):
        push(fake, checkpoint)


@pytest.mark.parametrize(
    ("status", "message"), [(404, "VLLM_SERVER_DEV_MODE=1"), (401, "API key for the weight routes")]
)
def test_a_server_without_the_routes_or_the_key_is_named_with_the_fix(
    checkpoint: Path, status: int, message: str
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"detail": "no"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        with pytest.raises(WeightPushError, match=message):
            push_weights(["http://a:8000"], checkpoint, version="v1", http=http)


def test_inputs_are_checked_before_any_server_is_asked(tmp_path: Path, checkpoint: Path) -> None:
    assert check_version_label(7) == "7"
    for bad in ("", "two words", True, None):
        with pytest.raises(ValueError):
            check_version_label(bad)
    with pytest.raises(ValueError, match="no config.json"):
        check_checkpoint_dir(tmp_path / "..")
    assert check_checkpoint_dir(checkpoint).tie_word_embeddings is True
    assert check_checkpoint_dir("/on/the/servers/side").tie_word_embeddings is None
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert ngt(["push-weights", str(checkpoint)]) == 2  # no server named
    assert ngt(["push-weights", str(checkpoint), "--url", "http://a:1", "--version", "two words"]) == 2


def test_both_sides_spell_the_status_method_alike() -> None:
    assert STATUS_METHOD == WORKER_STATUS_METHOD


def test_vllm_serve_refuses_weight_routes_beyond_loopback_without_a_key() -> None:
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    assert exposed_weight_routes(["--host", "0.0.0.0"], dev) is not None
    assert exposed_weight_routes(["--host=10.0.0.2", "--port", "8000"], dev) is not None
    assert exposed_weight_routes(["--host", "0.0.0.0", "--api-key", "k"], dev) is None
    assert exposed_weight_routes(["--host", "0.0.0.0"], {**dev, "VLLM_API_KEY": "k"}) is None
    assert exposed_weight_routes([], dev) is None  # loopback by default
    assert exposed_weight_routes(["--host", "0.0.0.0"], {}) is None  # no weight routes served


def test_vllm_serve_splits_the_keys_only_with_two_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert split_key_problem(None, [], {}) is None
    assert split_key_problem("w", ["--api-key", "i"], {}) is None
    assert split_key_problem("w", [], {"VLLM_API_KEY": "i"}) is None
    assert "needs an inference key too" in (split_key_problem("w", [], {}) or "")
    assert "must differ" in (split_key_problem("w", ["--api-key=w"], {}) or "")
    # Refused before vLLM starts, in one line that says what to pass.
    assert ngt(["vllm-serve", "--weights-api-key", "w", "some/model", "--api-key", "w"]) == 2
    assert "must differ from --api-key" in capsys.readouterr().err


def test_a_null_weight_version_is_refused_never_taken_as_the_label_none(checkpoint: Path) -> None:
    fake = FakeVLLM(HOSTS)
    fake.state["http://b:8000"]["version"] = None
    with pytest.raises(WeightPushError, match="weight_version that is not a label: None") as refused:
        push(fake, checkpoint)
    assert refused.value.replicas == ("http://b:8000",)
    assert all(state["version"] != "None" and not state["paused"] for state in fake.state.values())
