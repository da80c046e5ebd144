"""`ngt vllm-serve` pins vLLM's Harmony system date to the day the server starts, unless the caller set it."""

from __future__ import annotations

import datetime

from nemo_gym_tok.cli.vllm_serve import START_DATE_ENV, server_env
from nemo_gym_tok.vllm.hook import ENABLE_ENV


def test_the_start_date_is_pinned_to_the_day_the_server_starts() -> None:
    env = server_env({"PATH": "/bin"}, today=datetime.date(2025, 12, 31))
    assert env == {"PATH": "/bin", ENABLE_ENV: "1", START_DATE_ENV: "2025-12-31"}


def test_a_date_the_caller_set_is_kept() -> None:
    assert server_env({START_DATE_ENV: "2024-01-02"})[START_DATE_ENV] == "2024-01-02"
    assert server_env({START_DATE_ENV: ""}, today=datetime.date(2025, 1, 1))[START_DATE_ENV] == "2025-01-01"
