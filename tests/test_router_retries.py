"""One generation per attempt, behind the real vllm-router: the adapter in front of the router `RouterSpec`'s
defaults start, over two stub workers (processes, so one can be killed) that count the calls they take. vLLM's own
500 is generated once; a call that times out after reaching an engine is not sent again (and the router, whose
timeout is longer, sends nothing twice); a storm of 400s opens no breaker; a killed worker fails no call, and none is
generated more than twice. Stubs: the errors are ones a real vLLM cannot be made to give on demand."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.router import SESSION_HEADER, RouterProcess, RouterSpec
from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

REPO = Path(__file__).resolve().parents[1]
ADAPTER_TIMEOUT = 3.0

# A worker that answers chat calls as POST /mode last told it ("ok", "500", "400" or "sleep:SECONDS") and counts the
# calls each message content reached it with (GET /seen?content=...).
STUB_PROCESS = """
import asyncio, sys, uvicorn
from collections import Counter
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from responses_api_models.vllm_model.tests.fake_upstream import chat_completion
app, mode, seen = FastAPI(), {"chat": "ok"}, Counter()
app.get("/health")(lambda: {})
@app.post("/mode")
async def set_mode(request: Request):
    mode.update(await request.json())
    return mode
@app.get("/seen")
def count(content: str):
    return {"calls": seen[content]}
@app.post("/v1/chat/completions")
async def chat(request: Request):
    body = await request.json()
    seen[body["messages"][-1]["content"]] += 1
    how = mode["chat"]
    if how == "500":
        return JSONResponse({"error": {"message": "vLLM failed on this request", "code": 500}}, status_code=500)
    if how == "400":
        return JSONResponse({"error": {"message": "a client's mistake", "code": 400}}, status_code=400)
    if how.startswith("sleep:"):
        await asyncio.sleep(float(how[6:]))
    return JSONResponse(chat_completion(body["model"], {"role": "assistant", "content": sys.argv[2]}))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


class Stub:
    def __init__(self, name: str) -> None:
        self.name, port = name, free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-c", STUB_PROCESS, str(port), name], cwd=REPO)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"stub worker {name} did not start")

    def mode(self, chat: str) -> None:
        httpx.post(f"{self.url}/mode", json={"chat": chat}, timeout=5).raise_for_status()

    def seen(self, content: str) -> int:
        return int(httpx.get(f"{self.url}/seen", params={"content": content}, timeout=5).json()["calls"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, dict[str, Stub]]]:
    """Two stub workers behind the router, the adapter in front of it; yields the adapter's URL and the stubs. One
    per module: each test sets the modes it needs back to "ok", and the test that kills a worker comes last."""
    with ExitStack() as stack:
        stubs = {name: Stub(name) for name in ("A", "B")}
        for stub in stubs.values():
            stack.callback(stub.stop)
        router = stack.enter_context(RouterProcess(RouterSpec(tuple(stub.url for stub in stubs.values()))))
        config = VLLMModelConfig(
            base_url=f"{router.url}/v1", model="m", request_timeout_seconds=ADAPTER_TIMEOUT, retry_backoff_seconds=0.01
        )
        adapter = stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app()))
        yield adapter, stubs


def chat(adapter: str, content: str, session: str) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{adapter}/v1/chat/completions", json=body, headers={SESSION_HEADER: session}, timeout=60)


def sessions_of(adapter: str, worker: str, count: int) -> list[str]:
    """The first `count` of 64 session keys the router sends to `worker`; tried again for up to 15 s, as a breaker an
    earlier test opened on it (RouterSpec: 5 s) closes."""
    deadline = time.monotonic() + 15
    while True:
        on: list[str] = []
        for key in (f"s{i}" for i in range(64)):
            if chat(adapter, "which?", key).json()["choices"][0]["message"]["content"] == worker:
                on.append(key)
                if len(on) == count:
                    return on
        assert time.monotonic() < deadline, f"only {len(on)} of 64 sessions on {worker}"
        time.sleep(1)


def calls(stubs: dict[str, Stub], content: str) -> int:
    return sum(stub.seen(content) for stub in stubs.values())


def test_vllms_own_500_is_generated_once_and_passed_on(fleet: tuple[str, dict[str, Stub]]) -> None:
    adapter, stubs = fleet
    (session,) = sessions_of(adapter, "A", 1)
    stubs["A"].mode("500")
    answer = chat(adapter, "fails", session)
    assert answer.status_code == 502 and "vLLM failed on this request" in answer.json()["error"]["message"]
    assert calls(stubs, "fails") == 1  # neither the router nor the adapter sent it again
    stubs["A"].mode("ok")


def test_a_call_that_times_out_after_reaching_an_engine_is_not_sent_again(
    fleet: tuple[str, dict[str, Stub]],
) -> None:
    adapter, stubs = fleet
    (session,) = sessions_of(adapter, "A", 1)
    stubs["A"].mode(f"sleep:{ADAPTER_TIMEOUT + 2}")
    started = time.monotonic()
    answer = chat(adapter, "slow", session)
    assert answer.status_code == 504, answer.text
    assert "not sent again: the engine may still be producing this turn" in answer.json()["error"]["message"]
    assert time.monotonic() - started < ADAPTER_TIMEOUT + 2
    time.sleep(3)  # what the router would have sent meanwhile had it timed out first (its timeout is 1800 s)
    assert calls(stubs, "slow") == 1
    stubs["A"].mode("ok")


def test_a_storm_of_400s_opens_no_breaker(fleet: tuple[str, dict[str, Stub]]) -> None:
    adapter, stubs = fleet
    sessions = sessions_of(adapter, "A", 2)
    stubs["A"].mode("400")
    for index in range(20):
        answer = chat(adapter, f"bad-{index}", sessions[index % 2])
        assert answer.status_code == 400 and answer.json()["error"]["message"] == "a client's mistake"
    assert sum(calls(stubs, f"bad-{index}") for index in range(20)) == 20  # each sent once
    stubs["A"].mode("ok")
    for session in sessions:  # still A's: the router did not shut it out
        assert chat(adapter, "after", session).json()["choices"][0]["message"]["content"] == "A"


def test_a_killed_worker_fails_no_call_and_none_is_generated_more_than_twice(
    fleet: tuple[str, dict[str, Stub]],
) -> None:
    adapter, stubs = fleet
    sessions = sessions_of(adapter, "A", 6)
    stubs["A"].stop()
    for index, session in enumerate(sessions):
        answer = chat(adapter, f"after-kill-{index}", session)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "B"  # moved, by the adapter's one retry
        assert stubs["B"].seen(f"after-kill-{index}") == 1
