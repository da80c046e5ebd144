"""The head server answers every mistake (unknown route, wrong method) as a JSON error in the OpenAI shape."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from nemo_gym_tok.servers.head import HeadServer, HeadServerConfig
from tests.bad_inputs.cases import BAD_BODIES, assert_refused


@pytest.fixture(scope="module")
def head() -> TestClient:
    return TestClient(HeadServer("head", HeadServerConfig(servers={"a": "http://127.0.0.1:1"})).build_app())


def test_unknown_route_and_wrong_method(head: TestClient) -> None:
    assert_refused(head.get("/nope"), 404, "Not Found: GET /nope")
    assert_refused(head.post("/servers", json={}), 405, "Method Not Allowed: POST /servers")
    assert_refused(head.delete("/health"), 405, "Method Not Allowed")


def test_a_body_on_a_get_is_ignored_not_a_crash(head: TestClient) -> None:
    # The head reads no body: a nested or NaN body on its GET routes changes nothing.
    for case in BAD_BODIES[:12]:
        answer = head.request("GET", "/servers", content=case.raw, headers={"content-type": "application/json"})
        assert answer.status_code == 200 and answer.json() == {"a": "http://127.0.0.1:1"}
