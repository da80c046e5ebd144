"""The push's probe and verify_replicas against a fake of vLLM (tests/fake_vllm.py): a server off the expected log
probs fails the push, every server is put back and the pushed label reported unproven; the probe's own checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nemo_gym_tok.cli.main import main as ngt
from nemo_gym_tok.weights import (
    PROBE_TOKEN_IDS,
    ProbeResult,
    WeightProbe,
    WeightProbeError,
    WeightPushError,
    push_weights,
    verify_replicas,
)
from tests.fake_vllm import HOSTS, FakeVLLM

POSITIONS = len(PROBE_TOKEN_IDS) - 1
PUSHED = [-2.0 - 0.01 * i for i in range(POSITIONS)]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def fleet(checkpoint: Path) -> FakeVLLM:
    """Two hosts on /w/0; a host that loads `checkpoint` serves PUSHED."""
    fake = FakeVLLM(HOSTS)
    fake.log_probs[str(checkpoint.resolve())] = PUSHED
    return fake


def probe(bound: float = 0.01) -> WeightProbe:
    return WeightProbe(PROBE_TOKEN_IDS, tuple(PUSHED), bound)


def test_a_proven_push_reports_each_servers_probe(checkpoint: Path) -> None:
    fake = fleet(checkpoint)
    with fake.client() as http:
        report = push_weights(HOSTS, checkpoint, version="v1", http=http, probe=probe())
    assert [result.url for result in report.probes] == HOSTS
    assert all(result.mean_gap < 1e-9 and result.ok(0.01) for result in report.probes)
    assert list(report.phases)[-1] == "probe" and "proven on 2 server(s)" in report.format()
    completions = [params for _, path, params in fake.calls if path == "/v1/completions"]
    assert len(completions) == 2 and completions[0]["prompt"] == list(PROBE_TOKEN_IDS)
    assert completions[0]["model"] == "fake-policy" and completions[0]["prompt_logprobs"] == 0


def test_without_a_probe_nothing_is_asked_after_the_resume(checkpoint: Path) -> None:
    fake = fleet(checkpoint)
    with fake.client() as http:
        report = push_weights(HOSTS, checkpoint, version="v1", http=http)
    assert report.probes == () and "probe" not in report.phases and "proven" not in report.format()
    assert not [call for call in fake.calls if call[1].startswith("/v1/")]
    assert fake.calls[-1][1] == "/resume"


def test_a_server_off_the_probe_fails_the_push_every_server_is_put_back_and_the_label_is_unproven(
    checkpoint: Path,
) -> None:
    fake = fleet(checkpoint)
    fake.stale["http://b:8000"] = [value + 0.05 for value in PUSHED]
    with fake.client() as http, pytest.raises(WeightPushError, match="probe failed on 1 server") as refused:
        push_weights(HOSTS, checkpoint, version="v1", http=http, probe=probe())
    error = refused.value
    assert error.replicas == ("http://b:8000",) and error.left_paused == () and error.unproven_version == "v1"
    assert "0.0500 nats mean" in str(error) and "refuse every turn labelled 'v1'" in str(error)
    assert {result.url: round(result.mean_gap, 4) for result in error.probes} == {HOSTS[0]: 0.0, HOSTS[1]: 0.05}
    assert fake.back_as_before()
    # The rollback pauses the servers (they were serving the unproven weights) before reloading the old ones.
    rollback = [path for host, path, _ in fake.calls if host == HOSTS[0]][-5:]
    assert rollback == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


def test_a_server_that_cannot_answer_the_probe_fails_the_push_too(checkpoint: Path) -> None:
    fake = fleet(checkpoint)
    fake.garbage.add(("http://a:8000", "/v1/completions"))
    with fake.client() as http, pytest.raises(WeightPushError, match="probe not answered.*http://a:8000.*not JSON"):
        push_weights(HOSTS, checkpoint, version="v1", http=http, probe=probe())
    assert fake.back_as_before()


def test_a_resume_failing_under_a_probe_rolls_back_instead_of_leaving_an_unproven_fleet(checkpoint: Path) -> None:
    fake = fleet(checkpoint)
    fake.fail[("http://b:8000", "/resume")] = None
    with fake.client() as http, pytest.raises(WeightPushError, match="cannot be proven") as refused:
        push_weights(HOSTS, checkpoint, version="v1", http=http, probe=probe())
    assert refused.value.unproven_version == "v1" and refused.value.left_paused == ("http://b:8000",)
    assert fake.state["http://a:8000"] == {"version": "v0", "weights": "/w/0", "paused": False}
    assert fake.state["http://b:8000"]["weights"] == "/w/0" and fake.state["http://b:8000"]["version"] == "v0"


def test_verify_replicas_names_a_server_on_another_label_or_other_weights(checkpoint: Path) -> None:
    fake = fleet(checkpoint)
    with fake.client() as http:
        push_weights(HOSTS, checkpoint, version="v1", http=http, probe=probe())
        assert [result.url for result in verify_replicas(HOSTS, probe(), version="v1", http=http)] == HOSTS
        # b restarted: its start-up weights under `default`; then given the label alone (a rejoin that sets it).
        fake.state["http://b:8000"].update(weights="/w/0", version="default")
        with pytest.raises(WeightProbeError, match="1 of 2 server.*'default', not 'v1'.*http://b:8000") as caught:
            verify_replicas(HOSTS, probe(), version="v1", http=http)
        assert caught.value.replicas == ("http://b:8000",) and len(caught.value.results) == 2
        fake.state["http://b:8000"]["version"] = "v1"
        with pytest.raises(WeightProbeError, match=r"http://b:8000 serves log probs 1\.1500 nats mean") as caught:
            verify_replicas(HOSTS, probe(), version="v1", http=http)
        assert caught.value.replicas == ("http://b:8000",)
    assert not [call for call in fake.calls[-6:] if call[1] in ("/pause", "/collective_rpc", "/update_weight_version")]


def test_a_probe_checks_what_it_is_given() -> None:
    ids = (1, 2, 3)
    assert WeightProbe(list(ids), [-1.0, -2.0]).token_ids == ids  # lists are kept as tuples
    for bad, message in (
        (dict(token_ids=(1,), expected_log_probs=()), "at least 2"),
        (dict(token_ids=ids, expected_log_probs=(-1.0,)), "one value per token after the first: 2"),
        (dict(token_ids=ids, expected_log_probs=(-1.0, math.nan)), "finite.*position 1"),
        (dict(token_ids=ids, expected_log_probs=(-1.0, math.inf)), "finite"),
        (dict(token_ids=ids, expected_log_probs=(-1.0, 0.5)), "at most 0"),
        (dict(token_ids=(1, -2, 3), expected_log_probs=(-1.0, -1.0)), "non-negative"),
        (dict(token_ids=ids, expected_log_probs=(-1.0, -1.0), max_mean_gap=0), "max_mean_gap"),
        (dict(token_ids=ids, expected_log_probs=(-1.0, -1.0), max_mean_gap=math.nan), "max_mean_gap"),
    ):
        with pytest.raises(ValueError, match=message):
            WeightProbe(**bad)
    served_nan = WeightProbe(ids, (-1.0, -1.0)).compare("http://x", [-1.0, math.nan], 0.01)
    assert served_nan.mean_gap == math.inf and not served_nan.ok(0.01)
    assert ProbeResult("http://x", 0.01, 0.02, 0.03).ok(0.01) and not ProbeResult("http://x", 0.011, 0, 0).ok(0.01)
    assert len(PROBE_TOKEN_IDS) == 32 and max(PROBE_TOKEN_IDS) < 151643


def test_push_weights_cli_probe_usage_mistakes(checkpoint: Path) -> None:
    url = ["--url", "http://127.0.0.1:9"]
    assert ngt(["push-weights", str(checkpoint), *url, "--probe-bound", "0.02"]) == 2  # a bound without --probe
    assert ngt(["push-weights", str(checkpoint), *url, "--probe", "--probe-bound", "-1"]) == 2
    assert ngt(["push-weights", "/on/the/servers/side", *url, "--probe"]) == 2
