"""The resources-server contract in the base class: routes, session header, reserved names, verify checks."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer
from nemo_gym_tok.servers.episode_store import EpisodeStore


class Counter(ResourcesServer):
    def __init__(self, *args, reward=1.0, tool_name="increment", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: EpisodeStore[int] = EpisodeStore()
        self.reward, self.tool_name = reward, tool_name

    async def seed_session(self, session_id, row):
        self.counts.start(session_id, 0)
        return {}

    def tools(self):
        async def increment(session_id, arguments):
            self.counts.start(session_id, self.counts.get(session_id) + int(arguments.get("by", 1)))
            return {"count": self.counts.get(session_id)}

        return {self.tool_name: increment}

    async def verify(self, session_id, body):
        return {"reward": self.reward, "count": self.counts.end(session_id)}


def client(**options) -> TestClient:
    return TestClient(Counter("counter", BaseServerConfig(), **options).build_app())


S = {"x-session-id": "e1"}
EPISODE = {"response": {"output": []}}


def test_episode_through_the_routes() -> None:
    http = client()
    assert http.post("/seed_session", json={}, headers=S).json() == {}
    assert http.post("/increment", json={"by": 2}, headers=S).json() == {"output": {"count": 2}}
    assert http.post("/step", json={"output": []}, headers=S).json() == {"done": True}
    assert http.post("/verify", json=EPISODE, headers=S).json() == {"reward": 1.0, "count": 2}
    gone = http.post("/verify", json=EPISODE, headers=S)
    assert gone.status_code == 400 and "unknown session 'e1'" in gone.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/seed_session", "/step", "/verify", "/increment"])
def test_missing_session_header_is_400(path: str) -> None:
    answer = client().post(path, json=EPISODE)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "missing the x-session-id header that names the episode"


@pytest.mark.parametrize("body", [{}, {"response": {}}, {"response": {"output": "x"}}])
def test_verify_needs_the_episode(body: dict) -> None:
    http = client()
    http.post("/seed_session", json={}, headers=S)
    answer = http.post("/verify", json=body, headers=S)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "response.output"


def test_non_object_body_is_400() -> None:
    answer = client().post("/step", content=b"[1]", headers={**S, "content-type": "application/json"})
    assert answer.status_code == 400 and "must be a JSON object" in answer.json()["error"]["message"]


@pytest.mark.parametrize("name", ["verify", "step", "seed_session", "health"])
def test_reserved_tool_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"cannot be named '{name}'"):
        client(tool_name=name)


def test_a_reward_that_is_not_a_number_is_the_environments_bug() -> None:
    http = TestClient(Counter("counter", BaseServerConfig(), reward=True).build_app(), raise_server_exceptions=False)
    http.post("/seed_session", json={}, headers=S)
    answer = http.post("/verify", json=EPISODE, headers=S)
    assert answer.status_code == 500 and "numeric reward" in answer.json()["error"]["message"]


def test_episode_store_evicts_the_oldest_unverified_episodes() -> None:
    from nemo_gym_tok.servers.api_errors import ApiError

    store: EpisodeStore[int] = EpisodeStore(max_episodes=2)
    store.start("a", 1)
    store.start("b", 2)
    store.start("a", 3)  # restarted: now the newest
    store.start("c", 4)
    assert len(store) == 2 and "b" not in store and store.get("a") == 3
    with pytest.raises(ApiError, match="unknown session 'b'"):
        store.end("b")
    assert store.end("c") == 4 and len(store) == 1
