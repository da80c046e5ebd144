"""Weight pushes on real vLLM servers: served log probs follow the pushed weights (tied and untied), all or none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.cli.main import main as ngt
from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.vllm_server import VLLMServer
from nemo_gym_tok.weights import Replica, WeightPushError, push_weights
from tests.weights_support import (
    assert_serves,
    checkpoint_without,
    mean_and_max_gap,
    perturbed_checkpoint,
    recomputed_log_probs,
    served_log_probs,
    weight_version,
)

pytestmark = pytest.mark.vllm
MODEL = "tiny-qwen3"
STALE_NATS = 0.02  # a stale output layer measured 0.053 mean: well above this


@pytest.fixture(scope="module")
def checkpoints(rl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Step 0 (the served copy) and two perturbed steps."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "step-0": rl_model_dir,
        "step-1": perturbed_checkpoint(rl_model_dir, root / "step-1", seed=1),
        "step-2": perturbed_checkpoint(rl_model_dir, root / "step-2", seed=2),
    }


@pytest.fixture
def second_replica(vllm_server: VLLMServer, tiny_model_dir: Path) -> Iterator[VLLMServer]:
    """The shared hooked vLLM (weight routes on: conftest.py) as a second replica for the two-server pushes, put back
    on its own weights and label afterwards, so the tests after this one see the server they expect. A server of its
    own would cost the suite another vLLM start (about a minute on 2 cores)."""
    url = vllm_server.base_url
    before = weight_version(url)
    try:
        yield vllm_server
    finally:
        push_weights([url], tiny_model_dir, version=before)
        assert weight_version(url) == before


def bundle_version(base_url: str) -> str | None:
    """The weight version on the bundle of one short chat completion (the hook puts it on the message)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "logprobs": True,
        "seed": 0,
    }
    message = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    return message.get("weight_version")


def test_served_log_probs_follow_each_push_and_come_back_with_step_0(
    rl_vllm_server: VLLMServer, checkpoints: dict[str, Path]
) -> None:
    url = rl_vllm_server.base_url
    push_weights([url], checkpoints["step-0"], version="tied-0")
    at_step_0 = assert_serves(url, checkpoints["step-0"])
    for step in ("step-1", "step-2"):
        report = push_weights([url], checkpoints[step], version=f"tied-{step}")
        print(report.format())
        assert report.seconds > 0 and set(report.phases) == {
            "preflight",
            "pause",
            "reload",
            "reset",
            "version",
            "resume",
        }
        served = assert_serves(url, checkpoints[step])
        old_mean, _ = mean_and_max_gap(served, recomputed_log_probs(checkpoints["step-0"]))
        assert old_mean > STALE_NATS, "the perturbed weights must be told apart from step 0's by this probe"
        assert weight_version(url) == f"tied-{step}"
        assert bundle_version(url) == f"tied-{step}"
    push_weights([url], checkpoints["step-0"], version="tied-0-again")
    back = served_log_probs(url, MODEL)
    assert mean_and_max_gap(back, at_step_0)[1] < 1e-3, "reloading step 0 must give step 0's log probs back"


def test_two_servers_take_a_push_together_or_not_at_all(
    rl_vllm_server: VLLMServer,
    second_replica: VLLMServer,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    urls = [rl_vllm_server.base_url, second_replica.base_url]
    pushed = ["push-weights", str(checkpoints["step-1"]), "--version", "both-1", "--probe"]
    code = ngt([*pushed, *(f"--url={u}/v1" for u in urls)])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0 and "version both-1" in printed and "reload" in printed and "proven on 2 server(s)" in printed
    for url in urls:
        assert weight_version(url) == "both-1"
        assert_serves(url, checkpoints["step-1"])

    dead = f"http://127.0.0.1:{free_port()}"
    code = ngt(
        ["push-weights", str(checkpoints["step-2"]), "--version", "both-2", *(f"--url={u}" for u in [*urls, dead])]
    )
    error = capsys.readouterr().err
    assert code == 1 and dead in error and "refused before any change" in error
    for url in urls:
        assert weight_version(url) == "both-1", "a push that one server refused changes none"
        assert_serves(url, checkpoints["step-1"])

    # A checkpoint without one tensor: each server loads the others in place, then its worker refuses the reload, and
    # the push puts both back on step 1's weights and label.
    partial = checkpoint_without(checkpoints["step-2"], tmp_path / "step-2-partial", "model.norm.weight")
    with pytest.raises(WeightPushError, match="could not reload.*model.norm.weight") as refused:
        push_weights(urls, partial, version="both-2")
    assert set(refused.value.replicas) == set(urls) and refused.value.left_paused == ()
    for url in urls:
        assert weight_version(url) == "both-1"
        assert_serves(url, checkpoints["step-1"])


def test_stock_cpu_vllm_serves_a_stale_tied_output_layer_so_a_push_there_is_refused(
    plain_vllm_server: VLLMServer, tiny_model_dir: Path, checkpoints: dict[str, Path]
) -> None:
    """Why the worker-side fix exists: vLLM's own reload on its CPU build leaves a tied output layer's packed copy
    as it was. The push refuses such a server; the test then shows the stale layer with vLLM's own routes and puts
    the shared stock server back on its weights."""
    url = plain_vllm_server.base_url
    with pytest.raises(WeightPushError, match="tied embeddings") as refused:
        push_weights([url], checkpoints["step-1"], version="stock-1")
    assert refused.value.replicas == (url,)
    with httpx.Client(timeout=300) as http:
        replica = Replica(url, http)
        assert replica.reload_status() is None  # no exact reload on a stock server
        try:
            replica.pause("wait")
            replica.reload(str(checkpoints["step-1"]))
            replica.reset_prefix_cache(running_requests=False)
            replica.resume()
            served = served_log_probs(url, MODEL)
            stale, stale_max = mean_and_max_gap(served, recomputed_log_probs(checkpoints["step-1"]))
            old, _ = mean_and_max_gap(served, recomputed_log_probs(tiny_model_dir))
            print(f"stock CPU reload, served vs pushed: {stale:.4f} nats mean ({stale_max:.4f} max), vs old {old:.4f}")
            assert stale > STALE_NATS, (
                f"vLLM's own reload now serves the pushed tied model ({stale:.4f} nats mean): the CPU build may have "
                "fixed its stale output layer; nemo_gym_tok.vllm.exact_reload and the push's refusal can be revisited"
            )
        finally:
            replica.pause("wait")
            replica.reload(str(tiny_model_dir))
            replica.reset_prefix_cache(running_requests=False)
            replica.resume()
    assert_serves(url, tiny_model_dir)
