"""Worker-side fix of vLLM's in-place weight reload on its CPU build: no layer keeps a packed copy of old weights.

vLLM's CPU linear kernel packs each weight once, after loading (`dispatch_cpu_unquantized_gemm`). An in-place reload
(`POST /collective_rpc {"method": "reload_weights", ...}`) re-runs that packing only for layers that received a tensor
from the checkpoint. A tied output layer (`tie_word_embeddings`, as in the embedded tiny model) receives none: its
weight is the embedding's, but its packed copy stays the old one, and the server then samples and reports log probs of
"new body + old output layer" without any error (docs/training.md). This module wraps the model runner's
`reload_weights` so that, on the CPU platform, every layer that kept its weight beside a packed copy is packed again
from the weight it holds now, and adds a worker method the weight push asks to learn that the fix is there.

It is installed by the plugin in every vLLM process (the worker runs in the engine process), only when the hook or
EXACT_RELOAD_ENV is switched on; vLLM is imported inside functions.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("nemo_gym_tok.vllm.exact_reload")

EXACT_RELOAD_ENV = "NEMO_GYM_TOK_EXACT_RELOAD"
"""`1` installs this fix without the prefix-splice hook (a vLLM with stock chat templating, `splice: adapter`)."""
STATUS_METHOD = "nemo_gym_tok_reload_status"
"""The worker method `POST /collective_rpc {"method": STATUS_METHOD}` calls: what the weight push asks before it
reloads (nemo_gym_tok.weights)."""

# module, class, method: what this module wraps, and the symbols it calls (checked by check_reload_internals and,
# per release, by `ngt vllm-compat`).
RELOAD_METHOD = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights")
WORKER_CLASS = ("vllm.v1.worker.worker_base", "WorkerBase")
PACKING_FUNCTION = ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
_MARKER = "__nemo_gym_tok_exact_reload__"


def repack_kept_weights(model: Any) -> list[str]:
    """Pack again every CPU layer that holds its weight beside a packed copy (`cpu_linear`); their names.

    Layers whose weight the first packing removed (plain linear layers: an empty weight) are packed by vLLM's own
    reload when their tensor arrives; layers that keep their weight (embeddings and the output layer, tied or not)
    are packed from what they hold now, which after a reload is the new weight.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "cpu_linear", None) is None or weight is None:
            continue
        if weight.ndim != 2 or weight.numel() == 0 or weight.is_meta:
            continue
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        repacked.append(name)
    return repacked


class IncompleteReloadError(RuntimeError):
    """A checkpoint left some of the model's parameters as they were (vLLM itself only logs a warning)."""


def unloaded_parameters(model: Any, loaded: set[str] | None) -> list[str]:
    """The model's parameters a reload did not load (tied ones appear once in `named_parameters`, under the name the
    checkpoint loads them by); [] when the loader reports nothing (a quantized model: vLLM does not check either)."""
    if loaded is None:
        return []
    return sorted({name for name, _ in model.named_parameters()} - loaded)


def _reload_then_repack(original: Any) -> Any:
    @functools.wraps(original)
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> None:
        model = self.get_model()
        loaded: list[set[str] | None] = []
        load_weights = model.load_weights

        def recording(weights: Any, *more: Any, **options: Any) -> Any:
            names = load_weights(weights, *more, **options)
            loaded.append(set(names) if names is not None else None)
            return names

        # vLLM logs the parameters a checkpoint did not have and serves the old values: a trainer would be told new
        # weights are in force when some are not. Refused instead, naming them (the weight push rolls back).
        model.load_weights = recording
        try:
            original(self, *args, **kwargs)
        finally:
            del model.load_weights
        missing = unloaded_parameters(model, loaded[-1] if loaded else None)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise IncompleteReloadError(f"the checkpoint has no tensor for {shown}: they would keep their old values")
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            repacked = repack_kept_weights(model)
            logger.info("nemo_gym_tok: packed %d output/embedding layers again after the reload", len(repacked))

    setattr(reload_weights, _MARKER, original)
    return reload_weights


def reload_status(worker: Any) -> dict[str, Any]:
    """What the weight push needs to know of a worker: the fix is in, the device, the weights it serves now."""
    from vllm.platforms import current_platform

    model_config = worker.vllm_config.model_config
    return {
        "exact_reload": True,
        "device": "cpu" if current_platform.is_cpu() else str(current_platform.device_type),
        "weights_path": str(model_config.model),
        "tie_word_embeddings": bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
    }


def check_reload_internals() -> list[str]:
    """Names of what this fix wraps or calls that the installed vLLM lacks (empty when all are in place)."""
    import importlib

    missing = []
    for module_name, *path in (RELOAD_METHOD, WORKER_CLASS, PACKING_FUNCTION):
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            missing.append(".".join((module_name, *path)))
            continue
        for name in path:
            owner = getattr(owner, name, None)
        if owner is None:
            missing.append(".".join((module_name, *path)))
    return missing


def install_exact_reload() -> bool:
    """Wrap the model runner's reload and add the status method; idempotent. False (and a warning) when the installed
    vLLM lacks what it wraps: the weight push then finds no status method and refuses where the fix is needed."""
    import importlib

    missing = check_reload_internals()
    if missing:
        logger.warning("nemo_gym_tok: exact weight reload not installed, vLLM lacks %s", ", ".join(missing))
        return False
    module_name, class_name, method = RELOAD_METHOD
    runner = getattr(importlib.import_module(module_name), class_name)
    if not hasattr(getattr(runner, method), _MARKER):
        setattr(runner, method, _reload_then_repack(getattr(runner, method)))
    worker_base = getattr(importlib.import_module(WORKER_CLASS[0]), WORKER_CLASS[1])
    setattr(worker_base, STATUS_METHOD, reload_status)
    return True
