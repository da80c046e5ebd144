"""`ngt vllm-serve` pins vLLM's Harmony system date to the day the server starts and keeps idle connections open for
longer than clients keep them, unless the caller set either."""

from __future__ import annotations

import datetime

from nemo_gym_tok.cli.vllm_serve import KEEPALIVE_ENV, START_DATE_ENV, server_env
from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS
from nemo_gym_tok.vllm.hook import ENABLE_ENV


def test_the_start_date_is_pinned_to_the_day_the_server_starts() -> None:
    env = server_env({"PATH": "/bin"}, today=datetime.date(2025, 12, 31))
    assert env == {
        "PATH": "/bin",
        ENABLE_ENV: "1",
        START_DATE_ENV: "2025-12-31",
        KEEPALIVE_ENV: str(SERVER_KEEPALIVE_SECONDS),
    }


def test_a_date_the_caller_set_is_kept() -> None:
    assert server_env({START_DATE_ENV: "2024-01-02"})[START_DATE_ENV] == "2024-01-02"
    assert server_env({START_DATE_ENV: ""}, today=datetime.date(2025, 1, 1))[START_DATE_ENV] == "2025-01-01"


def test_a_keep_alive_the_caller_set_is_kept() -> None:
    assert server_env({KEEPALIVE_ENV: "90"})[KEEPALIVE_ENV] == "90"
    assert server_env({KEEPALIVE_ENV: ""})[KEEPALIVE_ENV] == str(SERVER_KEEPALIVE_SECONDS)
