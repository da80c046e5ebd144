"""The stock vLLM wheel of every supported release against the hook and the weight path (`make test-vllm-wheels`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nemo_gym_tok.vllm import internals
from nemo_gym_tok.vllm_wheels import compat

REQUIRE_WHEELS_ENV = "NGT_REQUIRE_VLLM_WHEELS"
"""Set to 1 where the wheels are expected (`make test-vllm-wheels`, which .ci/run runs): a missing one fails there
instead of skipping, so CI cannot pass with none of them checked."""


def stock_wheel(version: str) -> Path:
    """The cached wheel of `version` (this module never downloads: `ngt vllm-compat` does); skip without it, unless
    REQUIRE_WHEELS_ENV says it must be there."""
    wheel = compat.cached_wheel(version)
    if wheel is None:
        where = f"no cached vllm {version} wheel in {compat.wheel_cache_dir()}"
        if os.environ.get(REQUIRE_WHEELS_ENV) == "1":
            pytest.fail(f"{where}, and {REQUIRE_WHEELS_ENV}=1 expects it (`make vllm-compat` downloads it)")
        pytest.skip(f"{where} (run `make vllm-compat`)")
    return wheel


@pytest.mark.parametrize("version", compat.supported_releases())
def test_the_stock_wheel_fits(version: str) -> None:
    """The hook, the splice point and the weight-update path (the GPU trainer's NCCL routes among them) in place, and
    weight versions from 0.32 on."""
    report = compat.check_wheel(stock_wheel(version), version)
    assert report.problems == []
    assert report.splice_point == compat.SplicePoint(True, True, True, True, True)
    assert report.weight_path == []
    assert report.weight_versions == internals.field_expected(internals.WEIGHT_VERSIONS_FIELD, version)
