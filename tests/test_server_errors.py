"""The guard every gym server has: an unexpected exception is a JSON 500 in the OpenAI shape and one log line."""

from __future__ import annotations

import logging

import httpx
import pytest

from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer
from nemo_gym_tok.servers.inprocess import serve_in_thread


class Broken(ResourcesServer):
    """An environment with a bug in its tool."""

    def tools(self):
        async def crash(session_id, arguments):
            return {"x": 1}["missing"]

        return {"crash": crash}


def test_an_unexpected_exception_is_a_json_500_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nemo_gym_tok.servers"):
        with serve_in_thread(Broken("broken", BaseServerConfig()).build_app()) as url:
            answer = httpx.post(f"{url}/crash", json={}, headers={"x-session-id": "s"})
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"] and "Traceback" not in answer.text
    # One record (a log handler that other tests leave on the way to the root may hand caplog the same record twice).
    logged = list({id(record): record for record in caplog.records if record.name == "nemo_gym_tok.servers"}.values())
    assert len(logged) == 1 and logged[0].exc_info is None
    assert logged[0].getMessage() == "unexpected error in broken POST /crash: KeyError: 'missing'"
    assert "Traceback" not in caplog.text
