"""Every resources server refuses bad bodies on every route, bad rows and sessions, with a 4xx naming the problem."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from resources_servers.capital_lookup.app import SERVER as CapitalLookup
from resources_servers.grid_navigation.app import SERVER as GridNavigation
from resources_servers.number_guess.app import SERVER as NumberGuess
from tests.bad_inputs.cases import BAD_BODIES, BODY_IDS, SMALL_LIMIT, assert_refused

ENVIRONMENTS = {"number_guess": NumberGuess, "capital_lookup": CapitalLookup, "grid_navigation": GridNavigation}
TOOL_OF = {"number_guess": None, "capital_lookup": "lookup_capital", "grid_navigation": "move"}
S = {"x-session-id": "s"}


@pytest.fixture(scope="module", params=sorted(ENVIRONMENTS))
def env(request: pytest.FixtureRequest) -> Iterator[tuple[str, TestClient]]:
    server = ENVIRONMENTS[request.param]
    config = server.config_class(max_body_bytes=SMALL_LIMIT)
    with TestClient(server(request.param, config).build_app()) as http:
        yield request.param, http


def routes_of(name: str) -> list[str]:
    tool = TOOL_OF[name]
    return ["/seed_session", "/step", "/verify", *([f"/{tool}"] if tool else [])]


@pytest.mark.parametrize("case", BAD_BODIES, ids=BODY_IDS)
def test_every_route_refuses_the_bad_body(env, case) -> None:
    name, http = env
    for route in routes_of(name):
        answer = http.post(route, content=case.raw, headers={**S, "content-type": "application/json"})
        assert_refused(answer, case.status, case.names)


def test_a_chunked_body_past_the_limit_is_413(env) -> None:
    _, http = env
    chunks = iter([b'{"pad": "', *[b"x" * 1024] * 8, b'"}'])  # no Content-Length: counted while streaming
    assert_refused(http.post("/seed_session", content=chunks, headers=S), 413, "streamed past it")


@pytest.mark.parametrize(
    "name, row, param",
    [
        ("number_guess", {"secret": "5"}, "secret"),
        ("number_guess", {"secret": True}, "secret"),
        ("number_guess", {"secret": 101}, "secret"),
        ("number_guess", {}, "secret"),
        ("capital_lookup", {"expected_answer": 5}, "expected_answer"),
        ("capital_lookup", {"expected_answer": "  "}, "expected_answer"),
        ("grid_navigation", {"grid": "5x5"}, "grid"),
        ("grid_navigation", {"grid": {"size": 99}}, "grid.size"),
    ],
)
def test_a_bad_row_is_400_naming_its_field(name: str, row: dict, param: str) -> None:
    http = TestClient(ENVIRONMENTS[name](name, ENVIRONMENTS[name].config_class()).build_app())
    assert_refused(http.post("/seed_session", json=row, headers=S), 400, param, param=param)


def test_session_and_episode_mistakes(env) -> None:
    name, http = env
    for route in routes_of(name):
        assert_refused(http.post(route, json={}), 400, "x-session-id")
        if route in ("/seed_session", "/step"):
            continue  # seeding makes a session known; the default /step keeps no state to miss
        assert_refused(
            http.post(route, json={"output": [], "response": {"output": []}}, headers={"x-session-id": "nobody"}),
            400,
            "unknown session 'nobody'",
        )
    assert_refused(
        http.post("/verify", json={"response": {"output": "x"}}, headers=S),
        400,
        "response.output",
        param="response.output",
    )


def test_unknown_routes_and_methods_answer_in_the_error_shape(env) -> None:
    _, http = env
    assert_refused(http.post("/nope", json={}, headers=S), 404, "Not Found: POST /nope")
    assert_refused(http.get("/seed_session"), 405, "Method Not Allowed")
    assert_refused(http.post("/health", json={}), 405, "Method Not Allowed")


def test_tools_lists_exactly_the_declared_tools(env) -> None:
    name, http = env
    declared = http.get("/tools").json()["tools"]
    assert (TOOL_OF[name] in declared) if TOOL_OF[name] else declared == []
    assert not {"seed_session", "step", "verify", "health"} & set(declared)
