"""The weight-update path against a vLLM release's source (no install): routes, reload, packing, key guard, NCCL.

`ngt vllm-compat` runs it on every supported release's wheel beside the hook's check
(nemo_gym_tok.vllm_wheels.compat): vLLM's own routes a push drives (`ngt push-weights`) and a GPU trainer's NCCL path
drives (TRL's server mode), the parameters the push passes them, what the worker-side exact reload wraps and calls
(nemo_gym_tok.vllm.exact_reload), and the tuple the route guard extends (nemo_gym_tok.vllm.route_auth). Nothing here
runs a GPU: it reads source.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nemo_gym_tok.vllm.exact_reload import PACKING_FUNCTION, RELOAD_METHOD, WORKER_CLASS
from nemo_gym_tok.vllm.route_auth import AUTH_MODULE, DEV_ROUTER_MODULES, GUARDED_NAME, MIDDLEWARE_NAME
from nemo_gym_tok.vllm_wheels.wheel_source import ModuleSources, parameter_names

# What `ngt push-weights` calls (nemo_gym_tok.weights.replica), with the parameters it passes.
PUSH_ROUTES = {
    "/weight_info": (),
    "/collective_rpc": (),
    "/pause": ("mode",),
    "/resume": (),
    "/reset_prefix_cache": ("reset_running_requests",),
    "/update_weight_version": ("new_version",),
}
# vLLM's weight-transfer engine as a GPU trainer drives it (TRL's VLLMClient: init_communicator, update_named_params);
# `finish_weight_update` takes the version, so one call ends the update and labels the bundles after it.
NCCL_ROUTES = {
    "/init_weight_transfer_engine": ("init_info",),
    "/start_weight_update": (),
    "/update_weights": ("update_info",),
    "/finish_weight_update": ("weight_version",),
}
NCCL_ENGINE = ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine")
RELOAD_PARAMETERS = ("weights_path",)


def _routes(sources: ModuleSources) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every `@router.get/post("/path")` function of vLLM's development and RL routers, by path."""
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for module_name in DEV_ROUTER_MODULES:
        parsed = sources.module(module_name)
        if parsed is None:
            continue
        for node in parsed[0].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for path in _decorated_paths(node):
                    found[path] = node
    return found


def _decorated_paths(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    for decorator in function.decorator_list:
        if (
            isinstance(decorator, ast.Call)
            and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr in ("get", "post")
            and decorator.args
            and isinstance(decorator.args[0], ast.Constant)
            and isinstance(decorator.args[0].value, str)
        ):
            yield decorator.args[0].value


def _accepted(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """What a route reads: its parameters (0.32 on: FastAPI binds body fields to them) and the string keys its body
    looks up (0.29 to 0.31 read `body.get("init_info")` from the parsed JSON)."""
    keys = {node.value for node in ast.walk(function) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return set(parameter_names(function)) | keys


def _top_level(sources: ModuleSources, module_name: str, name: str) -> ast.stmt | None:
    parsed = sources.module(module_name)
    if parsed is None:
        return None
    for node in parsed[0].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return node
    return None


def _method(sources: ModuleSources, module_name: str, class_name: str, method: str) -> ast.stmt | None:
    owner = _top_level(sources, module_name, class_name)
    if not isinstance(owner, ast.ClassDef):
        return None
    return next(
        (
            node
            for node in owner.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method
        ),
        None,
    )


def weight_path_problems(sources: ModuleSources) -> list[str]:
    """What the release lacks of the weight-update path (empty when it has all of it)."""
    problems = []
    routes = _routes(sources)
    for group, wanted in (("push", PUSH_ROUTES), ("NCCL", NCCL_ROUTES)):
        for path, parameters in wanted.items():
            function = routes.get(path)
            if function is None:
                problems.append(f"no {path} route ({group} path)")
                continue
            missing = [name for name in parameters if name not in _accepted(function)]
            if missing:
                problems.append(f"{path} takes no {', '.join(missing)} ({group} path)")
    reload = _method(sources, *RELOAD_METHOD)
    if not isinstance(reload, (ast.FunctionDef, ast.AsyncFunctionDef)):
        problems.append(f"missing {'.'.join(RELOAD_METHOD)} (the exact reload wraps it)")
    elif any(name not in parameter_names(reload) for name in RELOAD_PARAMETERS):
        problems.append(f"{'.'.join(RELOAD_METHOD)} takes no weights_path")
    for module_name, name in (WORKER_CLASS, PACKING_FUNCTION, NCCL_ENGINE, (AUTH_MODULE, GUARDED_NAME)):
        if _top_level(sources, module_name, name) is None:
            problems.append(f"missing {module_name}.{name}")
    # The guard extends the tuple only because the middleware reads it on each request (route_auth.guard_problem).
    call = _method(sources, AUTH_MODULE, MIDDLEWARE_NAME, "__call__")
    if call is None or not any(isinstance(node, ast.Name) and node.id == GUARDED_NAME for node in ast.walk(call)):
        problems.append(f"{AUTH_MODULE}.{MIDDLEWARE_NAME}.__call__ does not read {GUARDED_NAME} (the key guard)")
    # The weights key hands a request on to the middleware's `app` (route_auth.split_keys).
    elif not any(isinstance(node, ast.Attribute) and node.attr == "app" for node in ast.walk(call)):
        problems.append(f"{AUTH_MODULE}.{MIDDLEWARE_NAME}.__call__ does not call self.app (the weights key)")
    return problems
