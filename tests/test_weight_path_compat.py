"""The static check of the weight-update path: the installed vLLM's own source, and releases shaped otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_tok.vllm.exact_reload import check_reload_internals
from nemo_gym_tok.vllm.route_auth import dev_route_paths
from nemo_gym_tok.vllm_wheels.weight_path_compat import NCCL_ROUTES, PUSH_ROUTES, weight_path_problems
from nemo_gym_tok.vllm_wheels.wheel_source import ModuleSources


def installed_sources() -> ModuleSources:
    import vllm

    root = Path(vllm.__file__).parent.parent

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    return ModuleSources(read)


def test_the_installed_vllm_has_the_whole_weight_path() -> None:
    assert weight_path_problems(installed_sources()) == []
    assert check_reload_internals() == []
    assert set(PUSH_ROUTES) | set(NCCL_ROUTES) <= set(dev_route_paths())


RL_029 = """
@router.post("/pause")
async def pause_generation(raw_request, mode: str = "abort"): ...
@router.post("/resume")
async def resume_generation(raw_request): ...
@router.post("/update_weight_version")
async def update_weight_version(raw_request, new_version: str): ...
@router.get("/weight_info")
async def weight_info(raw_request): ...
@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(raw_request):
    body = await raw_request.json()
    init_info = body.get("init_info")
@router.post("/start_weight_update")
async def start_weight_update(raw_request): ...
@router.post("/update_weights")
async def update_weights(raw_request):
    update_info = (await raw_request.json()).get("update_info")
@router.post("/finish_weight_update")
async def finish_weight_update(raw_request, weight_version: str | None = None): ...
"""
OTHERS = {
    "vllm/entrypoints/serve/dev/rpc/api_router.py": '@router.post("/collective_rpc")\nasync def rpc(request): ...\n',
    "vllm/entrypoints/serve/dev/cache/api_router.py": (
        '@router.post("/reset_prefix_cache")\nasync def reset(raw_request, reset_running_requests: bool = False): ...\n'
    ),
    "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    def reload_weights(self, weights_path): ...\n",
    "vllm/v1/worker/worker_base.py": "class WorkerBase: ...\n",
    "vllm/model_executor/layers/utils.py": "def dispatch_cpu_unquantized_gemm(layer, remove_weight): ...\n",
    "vllm/distributed/weight_transfer/nccl_engine.py": "class NCCLWeightTransferEngine: ...\n",
    "vllm/entrypoints/serve/middleware/authenticate.py": (
        'GUARDED_PREFIX = ("/v1",)\nclass AuthenticationMiddleware:\n'
        "    def __call__(self, scope, receive, send):\n"
        "        return scope['path'].startswith(GUARDED_PREFIX) and self.app\n"
    ),
}


def test_a_029_shaped_release_with_body_keys_fits() -> None:
    files = {"vllm/entrypoints/serve/dev/rlhf/api_router.py": RL_029, **OTHERS}
    assert weight_path_problems(ModuleSources.from_files(files)) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (("vllm/entrypoints/serve/dev/rlhf/api_router.py", '"/pause"', '"/halt"'), "no /pause route (push path)"),
        (("vllm/entrypoints/serve/dev/rlhf/api_router.py", "weight_version: str", "label: str"), "/finish_weight_"),
        (("vllm/v1/worker/gpu_model_runner.py", "reload_weights", "load_again"), "GPUModelRunner.reload_weights"),
        (("vllm/v1/worker/gpu_model_runner.py", "weights_path", "path"), "takes no weights_path"),
        (("vllm/entrypoints/serve/middleware/authenticate.py", "GUARDED_PREFIX =", "GUARDED ="), "GUARDED_PREFIX"),
        (("vllm/entrypoints/serve/middleware/authenticate.py", "(GUARDED_PREFIX)", "(self.guarded)"), "does not read"),
        (("vllm/entrypoints/serve/middleware/authenticate.py", "self.app", "self.inner"), "does not call self.app"),
    ],
)
def test_what_a_release_moved_is_named(change: tuple[str, str, str], problem: str) -> None:
    files = {"vllm/entrypoints/serve/dev/rlhf/api_router.py": RL_029, **OTHERS}
    path, old, new = change
    files[path] = files[path].replace(old, new)
    problems = weight_path_problems(ModuleSources.from_files(files))
    assert len(problems) == 1 and problem in problems[0], problems
