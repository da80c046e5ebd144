"""A stock vLLM (no splice hook: `splice: adapter`) with this package's exact reload switched on alone, an inference
key and a weights key, serving an untied model: a server of its own configuration, so it runs in
`make test-server-configs`, not in the default suite. vLLM's own key guard covers /v1 only; the plugin extends it to
every development route, which the weights key alone opens (the inference key, the one a gym sends through a router,
opens none); keyed pushes follow the untied model, and a tied checkpoint is refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.vllm.exact_reload import EXACT_RELOAD_ENV
from nemo_gym_tok.vllm.hook import ENABLE_ENV
from nemo_gym_tok.vllm.route_auth import WEIGHTS_KEY_ENV
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS
from nemo_gym_tok.weights import WeightPushError, push_weights
from tests.servers import hooked_server
from tests.weights_support import DEV_MODE_ENV, assert_serves, perturbed_checkpoint

pytestmark = pytest.mark.vllm
MODEL = "tiny-qwen3"

# vLLM 0.32's development-mode routes that change or reveal what a server serves (docs/training.md).
WEIGHT_CHANGING_ROUTES = (
    "/pause",
    "/resume",
    "/abort_requests",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/server_info",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
)


@pytest.fixture(scope="module")
def checkpoints(rl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A perturbed tied step 1, and an untied step 0 and step 1."""
    root = tmp_path_factory.mktemp("keyed-checkpoints")
    return {
        "step-1": perturbed_checkpoint(rl_model_dir, root / "step-1", seed=1),
        "untied-0": perturbed_checkpoint(rl_model_dir, root / "untied-0", seed=0, scale=0.0, untie=True),
        "untied-1": perturbed_checkpoint(rl_model_dir, root / "untied-1", seed=3, untie=True),
    }


def test_a_stock_server_with_the_exact_reload_and_two_keys_guards_its_routes_and_follows_an_untied_model(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM without the splice hook (stock chat templating, `splice: adapter`), with this package's exact reload
    switched on alone, an inference key and a weights key, serving an untied model: vLLM's own guard covers /v1 only;
    the plugin extends it to every development route, which the weights key alone opens (the inference key, the one
    a gym sends through a router, opens none); keyed pushes follow the untied model, and a tied checkpoint is
    refused."""
    inference_key, weights_key = "inference-key-123", "weights-key-123"
    with hooked_server(
        checkpoints["untied-0"],
        served_model_name=MODEL,
        extra_args=(*CPU_SERVING_ARGS, "--max-model-len", "512", "--api-key", inference_key),
        env={DEV_MODE_ENV: "1", ENABLE_ENV: "0", EXACT_RELOAD_ENV: "1", WEIGHTS_KEY_ENV: weights_key},
        log_path=tmp_path_factory.mktemp("keyed-vllm") / "vllm.log",
        hook=False,
        what="stock vLLM with the exact reload and two API keys: ",
    ) as server:
        url = server.base_url
        served = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
        for path in WEIGHT_CHANGING_ROUTES:
            assert path in served, f"{path} is not served in development mode: the list here is out of date"
            method = "POST" if "post" in served[path] else "GET"
            for key in (None, inference_key):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                answer = httpx.request(method, f"{url}{path}", headers=headers, timeout=30)
                assert answer.status_code == 401, f"{method} {path} answered {answer.status_code} with key {key}"
        # The weights key opens them: a body vLLM refuses before acting tells an open route without changing anything.
        opened = httpx.post(
            f"{url}/collective_rpc", json=[], headers={"Authorization": f"Bearer {weights_key}"}, timeout=30
        )
        assert opened.status_code == 400, opened.text
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert_serves(url, checkpoints["untied-0"], api_key=inference_key)
        for key in (None, inference_key):
            with pytest.raises(WeightPushError, match="API key"):
                push_weights([url], checkpoints["untied-1"], version="untied-1", api_key=key)
        report = push_weights([url], checkpoints["untied-1"], version="untied-1", api_key=weights_key)
        assert report.version == "untied-1"
        assert_serves(url, checkpoints["untied-1"], api_key=weights_key)
        with pytest.raises(WeightPushError, match="own output layer") as refused:
            push_weights([url], checkpoints["step-1"], version="tied-into-untied", api_key=weights_key)
        assert refused.value.replicas == (url,)
        assert_serves(url, checkpoints["untied-1"], api_key=inference_key)
