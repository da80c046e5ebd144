"""Every push proven on real vLLM servers: four planted faults a push's 200s do not show, each caught by the probe.

NGT_TEST_PROBE_OFF=1 runs the same tests with the probe switched off (the push given no probe, verify_replicas
reduced to its label check): each fault test must then fail, which is how they were checked to depend on the probe.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.vllm_server import VLLMServer
from nemo_gym_tok.weights import (
    ProbeResult,
    Replica,
    WeightProbe,
    WeightProbeError,
    WeightPushError,
    probe_from_checkpoint,
    probe_replica,
    push_weights,
    verify_replicas,
)
from tests.weights_support import perturbed_checkpoint, set_weight_version, weight_version

pytestmark = pytest.mark.vllm
PROBE_OFF = os.environ.get("NGT_TEST_PROBE_OFF") == "1"
PROBE_BUDGET_SECONDS = 0.5  # measured 33 to 52 ms a server; the goal is 60 ms, the bound loose for a busy machine
PROBE_REPEATS = 20


def label(what: str) -> str:
    """A label no server has served: a push refuses the label a server serves now (the session servers are shared)."""
    return f"{what}-{uuid.uuid4().hex[:8]}"


def probe_or_off(probe: WeightProbe) -> WeightProbe | None:
    return None if PROBE_OFF else probe


def verify(urls: Sequence[str], probe: WeightProbe, version: str) -> list[ProbeResult]:
    """verify_replicas, or with the probe off only its label check (what a fleet manager without a probe can see)."""
    if not PROBE_OFF:
        return verify_replicas(urls, probe, version=version)
    labels = {url: weight_version(url) for url in urls}
    wrong = [url for url, served in labels.items() if served != version]
    if wrong:
        raise WeightProbeError(
            "; ".join(f"{url} serves weight version {labels[url]!r}, not {version!r}" for url in wrong), wrong
        )
    return []


def show(what: str, error: WeightPushError | WeightProbeError) -> None:
    gaps = ", ".join(result.format() for result in getattr(error, "probes", getattr(error, "results", ())))
    print(f"{what}: {gaps or 'no probe answered'}\n  {error}")


def wider_mlp_checkpoint(source: Path, dest: Path) -> Path:
    """`source` with an MLP twice as wide (intermediate_size doubled, the new rows and columns random): vLLM's reload
    narrows each tensor to the served model's width and loads it without a word, so the server serves `source`'s
    weights while the trainer's model is this one."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["intermediate_size"] *= 2
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights, generator = load_file(dest / "model.safetensors"), torch.Generator().manual_seed(5)
    for name, tensor in list(weights.items()):
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")):
            extra = torch.randn(tensor.shape, generator=generator) * tensor.std()
            # gate and up widen their rows (outputs), down its columns (inputs); vLLM keeps the first of each.
            weights[name] = torch.cat([tensor, extra], dim=1 if "down_proj" in name else 0).contiguous()
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def reshaped_checkpoint(source: Path, dest: Path, *, extra_rows: int = 0, extra_layer: bool = False) -> Path:
    """`source` with `extra_rows` more vocabulary rows, or a third layer (a copy of the second)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    weights = load_file(dest / "model.safetensors")
    if extra_rows:
        config["vocab_size"] += extra_rows
        embedding = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = torch.cat([embedding, embedding[:extra_rows].clone()]).contiguous()
    if extra_layer:
        config["num_hidden_layers"] += 1
        config["layer_types"] = [*config["layer_types"], config["layer_types"][-1]]
        for name in [name for name in weights if name.startswith("model.layers.1.")]:
            weights[name.replace("model.layers.1.", "model.layers.2.")] = weights[name].clone()
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def checkpoints(rl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe-checkpoints")
    step_1 = perturbed_checkpoint(rl_model_dir, root / "step-1", seed=1)
    return {
        "step-0": rl_model_dir,
        "step-1": step_1,
        "step-2": perturbed_checkpoint(rl_model_dir, root / "step-2", seed=2),
        "wider-mlp": wider_mlp_checkpoint(step_1, root / "wider-mlp"),
        "extra-layer": reshaped_checkpoint(step_1, root / "extra-layer", extra_layer=True),
        "bigger-vocab": reshaped_checkpoint(step_1, root / "bigger-vocab", extra_rows=64),
    }


@pytest.fixture(scope="module")
def probes(checkpoints: dict[str, Path], tiny_model_dir: Path) -> dict[str, WeightProbe]:
    """Each checkpoint's probe as `ngt push-weights --probe` computes it (transformers, float32, CPU)."""
    made = {name: probe_from_checkpoint(path) for name, path in checkpoints.items() if name != "extra-layer"}
    return {**made, "tiny": probe_from_checkpoint(tiny_model_dir)}


def proven_push(url: str, checkpoint: Path, probe: WeightProbe, what: str) -> str:
    """A push the probe accepts (the start of each fault test): its label."""
    version = label(what)
    report = push_weights([url], checkpoint, version=version, probe=probe)
    print(report.format())
    return version


def test_a_correct_push_is_proven_and_the_probe_costs_tens_of_milliseconds(
    rl_vllm_server: VLLMServer, checkpoints: dict[str, Path], probes: dict[str, WeightProbe]
) -> None:
    url = rl_vllm_server.base_url
    proven_push(url, checkpoints["step-0"], probes["step-0"], "warm-up")  # a server's first answers are slow once
    for step in ("step-1", "step-2", "step-0"):
        version = label(f"proven-{step}")
        report = push_weights([url], checkpoints[step], version=version, probe=probes[step])
        print(report.format())
        (result,) = report.probes
        assert result.ok(probes[step].max_mean_gap) and result.url == url
        assert list(report.phases)[-1] == "probe" and report.phases["probe"] < PROBE_BUDGET_SECONDS
        assert [r.url for r in verify_replicas([url], probes[step], version=version)] == [url]
    with httpx.Client(timeout=60) as http:
        replica = Replica(url, http)
        model = replica.served_model()
        costs = sorted(probe_replica(replica, probes["step-0"], model).seconds for _ in range(PROBE_REPEATS))
    median = costs[len(costs) // 2]
    print(
        f"probe cost on one server, {PROBE_REPEATS} calls: median {median * 1000:.0f} ms, max {costs[-1] * 1000:.0f} ms"
    )
    assert median < PROBE_BUDGET_SECONDS


def test_a_replica_whose_reload_silently_does_nothing_fails_the_probe_and_is_rolled_back(
    rl_vllm_server: VLLMServer,
    checkpoints: dict[str, Path],
    probes: dict[str, WeightProbe],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault a: the reload answers 200 and changes nothing (planted on this side: the call never goes out)."""
    url = rl_vllm_server.base_url
    before = proven_push(url, checkpoints["step-0"], probes["step-0"], "silent-0")
    real_reload, pushed = Replica.reload, str(checkpoints["step-1"].resolve())

    def silent_reload(replica: Replica, weights_path: str) -> None:
        if not (replica.url == url and weights_path == pushed):
            real_reload(replica, weights_path)

    monkeypatch.setattr(Replica, "reload", silent_reload)
    version = label("silent-1")
    with pytest.raises(WeightPushError, match="probe failed on 1 server") as refused:
        push_weights([url], checkpoints["step-1"], version=version, probe=probe_or_off(probes["step-1"]))
    show("fault a, a reload that does nothing", refused.value)
    assert refused.value.replicas == (url,) and refused.value.unproven_version == version
    assert refused.value.left_paused == () and weight_version(url) == before
    verify([url], probes["step-0"], before)  # back on step 0, proven


def test_the_stock_cpu_reloads_stale_tied_output_layer_is_caught_by_the_probe(
    plain_vllm_server: VLLMServer,
    checkpoints: dict[str, Path],
    probes: dict[str, WeightProbe],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault b: vLLM's own reload on its CPU build, without this package's exact reload, keeps the tied output
    layer's packed copy of the old weights. The preflight refuses such a server (tests/test_weight_push.py); here that
    refusal is bypassed (the server reported untied), and the probe catches what the push would have served."""
    url = plain_vllm_server.base_url
    before, real = weight_version(url), Replica.served_weights
    verify([url], probes["tiny"], before)  # the shared stock server serves the tiny model's start-up weights
    monkeypatch.setattr(Replica, "served_weights", lambda replica: (*real(replica)[:2], False))
    version = label("stale-1")
    with pytest.raises(WeightPushError, match="probe failed on 1 server") as refused:
        push_weights([url], checkpoints["step-1"], version=version, probe=probe_or_off(probes["step-1"]))
    show("fault b, the stale tied output layer", refused.value)
    assert refused.value.replicas == (url,) and refused.value.unproven_version == version
    assert weight_version(url) == before
    verify([url], probes["tiny"], before)  # the rollback's reload of the start-up weights is right again


def test_a_checkpoint_of_another_shape_is_refused_by_the_reload_or_caught_by_the_probe(
    rl_vllm_server: VLLMServer, checkpoints: dict[str, Path], probes: dict[str, WeightProbe]
) -> None:
    """Fault c: a third layer is refused by vLLM's reload itself (a parameter it does not have), and the push rolls
    back without the probe's help; an MLP twice as wide is narrowed to the served width and loaded silently, and only
    the probe sees that the server does not serve the trainer's model."""
    url = rl_vllm_server.base_url
    before = proven_push(url, checkpoints["step-1"], probes["step-1"], "shape-1")
    with pytest.raises(WeightPushError, match="could not reload.*no module or parameter named 'layers.2'") as refused:
        push_weights([url], checkpoints["extra-layer"], version=label("extra-layer"))
    assert refused.value.left_paused == () and weight_version(url) == before
    verify([url], probes["step-1"], before)
    version = label("wider-mlp")
    with pytest.raises(WeightPushError, match="probe failed on 1 server") as refused:
        push_weights([url], checkpoints["wider-mlp"], version=version, probe=probe_or_off(probes["wider-mlp"]))
    show("fault c, an MLP twice as wide, narrowed by the reload", refused.value)
    assert refused.value.unproven_version == version and weight_version(url) == before
    verify([url], probes["step-1"], before)


def test_a_replica_restarted_after_a_push_is_kept_out_by_verify_replicas(
    rl_vllm_server: VLLMServer, checkpoints: dict[str, Path], probes: dict[str, WeightProbe]
) -> None:
    """Fault d: a replica SIGKILLed and restarted serves its start-up weights under `default`. The kill follows what
    made one here: a checkpoint with 64 more vocabulary rows, which vLLM's reload refuses part-way (an assertion in
    the embedding's loader) and which leaves its model unable to reload anything, the rollback's reload included: the
    push names it, left paused. Restarted, it is caught by verify_replicas against the last proven push; with its
    label alone set back (a rejoin that copies the fleet's label), only the probe still catches it."""
    if rl_vllm_server.process is None:
        pytest.skip("the server is reused from NGT_TEST_RL_VLLM_URL: this test cannot restart it")
    url = rl_vllm_server.base_url
    pushed = proven_push(url, checkpoints["step-2"], probes["step-2"], "restart-2")
    with pytest.raises(WeightPushError, match="could not reload|probe failed") as refused:
        push_weights([url], checkpoints["bigger-vocab"], version=label("bigger-vocab"), probe=probes["bigger-vocab"])
    print(f"a vocabulary of another size: {refused.value}")
    rl_vllm_server.process.kill()  # the API server and its engine
    rl_vllm_server.start()  # same port, its start-up weights (step 0), label `default`
    assert weight_version(url) == "default"
    with pytest.raises(WeightProbeError, match=f"'default', not '{pushed}'") as caught:
        verify([url], probes["step-2"], pushed)
    show("fault d, restarted", caught.value)
    assert caught.value.replicas == (url,)
    set_weight_version(url, pushed)
    with pytest.raises(WeightProbeError, match="off the expected weights") as caught:
        verify([url], probes["step-2"], pushed)
    show("fault d, restarted and relabelled", caught.value)
    assert caught.value.replicas == (url,)
    verify([url], probes["step-0"], pushed)  # what it does serve: step 0
