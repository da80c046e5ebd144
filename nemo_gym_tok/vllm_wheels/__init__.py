"""The static check of stock vLLM wheels against the hook (`ngt vllm-compat`): source read with `ast`, never run."""

from nemo_gym_tok.vllm_wheels.compat import (
    ReleaseReport,
    check_release,
    check_wheel,
    download_wheel,
    format_reports,
    supported_releases,
    wheel_cache_dir,
)
from nemo_gym_tok.vllm_wheels.splice_point import SplicePoint
from nemo_gym_tok.vllm_wheels.weight_path_compat import weight_path_problems
from nemo_gym_tok.vllm_wheels.wheel_source import ModuleSources

__all__ = [
    "ModuleSources",
    "ReleaseReport",
    "SplicePoint",
    "check_release",
    "check_wheel",
    "download_wheel",
    "format_reports",
    "supported_releases",
    "weight_path_problems",
    "wheel_cache_dir",
]
