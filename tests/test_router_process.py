"""nemo_gym_tok.router against the real vllm-router in front of stub workers; the router's contract on chat bodies."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.contract.router_marks import (
    ROUTER_ADDED_CHAT_FIELDS,
    ROUTER_ONLY_CHAT_MARKERS,
    came_through_vllm_router,
)
from nemo_gym_tok.router import (
    INSTALL_HINT,
    SESSION_HEADER,
    RouterError,
    RouterProcess,
    RouterSpec,
    RouterStartError,
    add_worker,
    check_router_installed,
    is_vllm_router,
    list_workers,
    remove_worker,
    router_command,
)
from nemo_gym_tok.servers.inprocess import serve_in_thread


def stub_worker(name: str, *, healthy: bool = True) -> FastAPI:
    """A vLLM stand-in: /health, and a chat route that answers with its name and what reached it."""
    app = FastAPI()

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200 if healthy else 503)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return {"worker": name, "body": await request.json(), "headers": dict(request.headers)}

    @app.post("/tokenize")
    @app.post("/inference/v1/generate")
    async def raw(request: Request) -> dict[str, Any]:
        return {"worker": name, "raw": (await request.body()).decode()}

    return app


# The same stub as a process of its own, for the test that SIGKILLs a worker. It keeps idle connections open as long
# as `ngt vllm-serve` makes vLLM keep them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): with uvicorn's 5 s, the router may send on
# a connection the stub is closing that moment and answer "error sending request" for a live worker.
STUB_PROCESS = """
import sys, uvicorn
from fastapi import FastAPI, Request
app = FastAPI()
app.get("/health")(lambda: {})
@app.post("/v1/chat/completions")
async def chat(request: Request):
    return {"worker": sys.argv[2], "body": await request.json(), "headers": dict(request.headers)}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=600)
"""


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        yield {name: stack.enter_context(serve_in_thread(stub_worker(name))) for name in ("A", "B", "C")}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:
        yield client


def _router(spec: RouterSpec, log_dir: Path) -> RouterProcess:
    return RouterProcess(spec, log_path=log_dir / "router.log")


@pytest.fixture(scope="module")
def hash_router(workers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    spec = RouterSpec((workers["A"], workers["B"]))
    with _router(spec, tmp_path_factory.mktemp("hash-router")) as router:
        yield router


@pytest.fixture(scope="module")
def round_robin_router(workers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    spec = RouterSpec((workers["A"], workers["B"]), policy="round_robin")
    with _router(spec, tmp_path_factory.mktemp("rr-router")) as router:
        yield router


def _chat(http: httpx.Client, router: RouterProcess, body: dict[str, Any], session: str | None) -> dict[str, Any]:
    headers = {SESSION_HEADER: session} if session is not None else {}
    response = http.post(f"{router.url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_started_router_is_ready_and_lists_its_workers(
    hash_router: RouterProcess, workers: dict[str, str], http: httpx.Client
) -> None:
    assert hash_router.running and isinstance(hash_router.pid, int)
    assert hash_router.url == f"http://127.0.0.1:{hash_router.port}"
    assert hash_router.prometheus_port not in (None, 29000, hash_router.port)
    assert http.get(f"{hash_router.url}/health").status_code == 200
    assert sorted(list_workers(hash_router.url, http=http)) == sorted([workers["A"], workers["B"]])
    assert list_workers(f"{hash_router.url}/v1/") == list_workers(hash_router.url)  # a base URL with /v1 works
    assert is_vllm_router(hash_router.url, http) and is_vllm_router(f"{hash_router.url}/v1")
    assert not is_vllm_router(workers["A"], http)  # a vLLM stand-in: 404 on /list_workers
    assert not is_vllm_router(f"http://127.0.0.1:{free_port()}", http)  # nothing listens
    comm = Path(f"/proc/{hash_router.pid}/cmdline").read_bytes()
    assert comm.startswith(b"vllm::router"), comm  # the process title the router sets itself


def test_a_router_stops_and_a_second_stop_does_nothing(workers: dict[str, str], tmp_path: Path) -> None:
    router = _router(RouterSpec((workers["A"],)), tmp_path)
    with pytest.raises(RuntimeError, match="before start"):
        router.url
    with router:
        url = router.url
        with pytest.raises(RouterStartError, match="running already"):
            router.start()
    assert not router.running and router.pid is not None
    router.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2.0)
    with pytest.raises(RouterStartError, match="in use already"):
        RouterProcess(RouterSpec((workers["A"],), port=int(workers["A"].rsplit(":", 1)[1]))).start(timeout=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"worker_urls": ()}, "at least one worker URL"),
        ({"worker_urls": "http://127.0.0.1:8000"}, "not one string"),
        ({"worker_urls": ("http://h:8000", "http://h:8000/v1/")}, "names http://h:8000 twice"),
        ({"worker_urls": ("127.0.0.1:8000",)}, "does not start with http:// or https://"),
        ({"worker_urls": ("http://h:8000/api",)}, "has a path"),
        ({"worker_urls": ("http://h:99999",)}, "invalid port"),
        ({"worker_urls": ("http://:8000",)}, "names no host"),
        ({"worker_urls": ("http://h:1",), "policy": "least_loaded"}, "pick one of consistent_hash"),
        ({"worker_urls": ("http://h:1",), "port": 70000}, "RouterSpec.port"),
        ({"worker_urls": ("http://h:1",), "retry_max_retries": 0}, "retry_max_retries must be"),
        ({"worker_urls": ("http://h:1",), "log_level": "trace"}, "log_level"),
        ({"worker_urls": ("http://h:1",), "extra_args": ("--port", "9")}, "repeats"),
        ({"worker_urls": ("http://h:1",), "extra_args": "--queue-size 9"}, "tuple of strings"),
        ({"worker_urls": ("http://h:1",), "host": "0.0.0.0"}, "admin routes to the network"),
        ({"worker_urls": ("http://h:1",), "host": "10.1.2.3"}, "/add_worker, /remove_worker"),
        ({"worker_urls": ("http://h:1",), "host": "gpu-node-7"}, "without any key"),
    ],
)
def test_a_spec_refuses_what_the_router_could_not_serve(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterSpec(**kwargs)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.9", "localhost", "::1", "[::1]"])
def test_a_router_listens_on_loopback_only(host: str) -> None:
    assert RouterSpec(("http://h:1",), host=host).host == host


def test_a_spec_strips_v1_and_builds_the_command() -> None:
    spec = RouterSpec(["http://a:8000/v1/", "https://b:9000/"], api_key="s3cret", extra_args=["--queue-size", "9"])
    assert spec.worker_urls == ("http://a:8000", "https://b:9000") and spec.extra_args == ("--queue-size", "9")
    assert "s3cret" not in repr(spec)
    command = router_command(spec, 1234, 5678)
    assert command[:3] == [sys.executable, "-m", "vllm_router.launch_router"]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--port"] == "1234" and flags["--prometheus-port"] == "5678" and flags["--api-key"] == "s3cret"
    assert flags["--policy"] == "consistent_hash" and flags["--worker-startup-check-interval"] == "1"
    assert command[-5:] == ["--worker-urls", "http://a:8000", "https://b:9000", "--queue-size", "9"]


def test_a_missing_router_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    check_router_installed()
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm_router_rs" else real(name))
    with pytest.raises(RouterStartError, match="vllm_router_rs") as caught:
        check_router_installed()
    assert INSTALL_HINT in str(caught.value) and "pip install vllm-router==0.1.17" in INSTALL_HINT


def test_consistent_hash_keeps_each_session_on_one_worker(hash_router: RouterProcess, http: httpx.Client) -> None:
    served: dict[str, set[str]] = defaultdict(set)
    for turn in range(5):
        for session in range(40):
            body = {"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}]}
            served[f"session-{session}"].add(_chat(http, hash_router, body, f"session-{session}")["worker"])
    split = {session: names for session, names in served.items() if len(names) > 1}
    assert not split, f"sessions served by more than one worker: {split}"
    spread = Counter(next(iter(names)) for names in served.values())
    assert set(spread) == {"A", "B"} and min(spread.values()) >= 8, spread


def test_round_robin_spreads_requests_without_a_session(round_robin_router: RouterProcess, http: httpx.Client) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    spread = Counter(_chat(http, round_robin_router, body, None)["worker"] for _ in range(20))
    assert spread == {"A": 10, "B": 10}, spread


def test_workers_are_listed_added_and_removed(workers: dict[str, str], http: httpx.Client, tmp_path: Path) -> None:
    with _router(RouterSpec((workers["A"],)), tmp_path) as router:
        assert list_workers(router.url, http=http) == [workers["A"]]
        assert add_worker(router.url, f"{workers['C']}/v1/", http=http) == workers["C"]
        assert sorted(list_workers(router.url)) == sorted([workers["A"], workers["C"]])
        with pytest.raises(RouterError, match="answered 400: Worker .* already exists") as refused:
            add_worker(router.url, workers["C"], http=http)
        assert refused.value.status == 400 and refused.value.router_url == router.url
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        reached = {_chat(http, router, body, f"s{i}")["worker"] for i in range(20)}
        assert reached == {"A", "C"}
        assert remove_worker(router.url, workers["C"], http=http) == workers["C"]
        assert list_workers(router.url, http=http) == [workers["A"]]
        with pytest.raises(RouterError, match="is not one of its workers"):
            remove_worker(router.url, workers["C"], http=http)
        with pytest.raises(ValueError, match="does not start with http"):
            add_worker(router.url, "localhost:8000", http=http)
    with pytest.raises(RouterError, match="GET /list_workers failed"):
        list_workers(router.url, http=http)


def test_a_worker_that_never_answers_health_fails_the_start(tmp_path: Path) -> None:
    # The router gives up on its own (--worker-startup-timeout-secs) and exits.
    spec = RouterSpec((f"http://127.0.0.1:{free_port()}",), worker_startup_timeout_secs=2)
    router = _router(spec, tmp_path / "exit")
    with pytest.raises(RouterStartError) as exited:
        router.start(timeout=30)
    message = str(exited.value)
    assert "exited with code 1" in message and str(router.log_path) in message, message
    assert "to become healthy" in message, message  # the router's own words, from the log's tail
    assert not router.running
    # A worker that answers 503: the router waits longer than the caller, who gets the error.
    with serve_in_thread(stub_worker("sick", healthy=False)) as sick:
        router = _router(RouterSpec((sick,)), tmp_path / "timeout")
        started = time.monotonic()
        with pytest.raises(RouterStartError, match=r"was not ready after 2s") as late:
            router.start(timeout=2)
        assert time.monotonic() - started < 15 and str(router.log_path) in str(late.value)
        assert not router.running


def test_a_killed_workers_first_call_is_the_routers_own_error_and_the_rest_move(
    workers: dict[str, str], http: httpx.Client, tmp_path: Path
) -> None:
    """What the adapter's retry policy relies on (retry_policy.py): with RouterSpec's defaults the router sends nothing
    twice; a dead worker's first call comes back as the router's own 500, in text, not JSON (vLLM's errors are JSON),
    and the breaker it opened moves every later call to a live worker."""
    port = free_port()
    doomed = subprocess.Popen([sys.executable, "-c", STUB_PROCESS, str(port), "doomed"])
    try:
        with _router(RouterSpec((workers["A"], f"http://127.0.0.1:{port}")), tmp_path) as router:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            owner = {f"s{i}": _chat(http, router, body, f"s{i}")["worker"] for i in range(20)}
            assert set(owner.values()) == {"A", "doomed"}, owner
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
            answers = [
                http.post(f"{router.url}/v1/chat/completions", json=body, headers={SESSION_HEADER: s}) for s in owner
            ]
            failed = [answer for answer in answers if answer.status_code != 200]
            assert len(failed) == 1, [(answer.status_code, answer.text[:200]) for answer in failed]
            assert failed[0].status_code == 500 and failed[0].text.startswith("Request failed: error sending request")
            assert failed[0].headers["content-type"].startswith("text/plain")
            assert answers.index(failed[0]) == list(owner.values()).index("doomed")  # the first call it owned
            assert {answer.json()["worker"] for answer in answers if answer.status_code == 200} == {"A"}
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()


# What the router forwards of a chat request, as measured on vllm-router 0.1.17. The gym relies on this: the token
# bundle on messages does not survive the router (the vLLM hook tells such a request by the router's markers), a
# top-level required_prefix_token_ids does. A change here is a change of the router's contract: update
# nemo_gym_tok/contract/router_marks.py and what relies on it, then this test.
SENT_MESSAGES = [
    {"role": "system", "content": "sys", "name": "operator"},
    {"role": "user", "content": "hi", "prompt_token_ids": [1]},
    {
        "role": "assistant",
        "content": "x",
        "reasoning_content": "rc",
        "reasoning": "r",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    },
    {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
]
FORWARDED_MESSAGES = [
    {"role": "system", "content": "sys", "name": "operator"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "x", "reasoning": "r"},  # bundle and reasoning_content dropped
    {  # content None dropped
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    },
    {"role": "tool", "content": "42", "tool_call_id": "c1"},  # a tool message's name dropped
]
ADDED_DEFAULTS = {
    "stream": False,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def test_the_router_contract_on_chat_bodies(hash_router: RouterProcess, http: httpx.Client) -> None:
    sent = {
        "model": "m",
        "messages": SENT_MESSAGES,
        "required_prefix_token_ids": [1, 2, 3],
        "temperature": 0.7,
        "seed": 12345678901,
        "skip_special_tokens": False,
        "unknown_top_level": {"kept": True},
    }
    answer = _chat(http, hash_router, sent, "contract-session")
    got = answer["body"]
    assert got["messages"] == FORWARDED_MESSAGES, (
        "vllm-router changed what it keeps of chat messages (tests/test_router_process.py explains what relies on it)"
    )
    assert set(got) - set(sent) == ROUTER_ADDED_CHAT_FIELDS - {"skip_special_tokens"}, "the router adds other fields"
    assert {k: got[k] for k in ADDED_DEFAULTS if k not in sent} == {
        k: v for k, v in ADDED_DEFAULTS.items() if k not in sent
    }, "the router's defaults for the fields it adds changed"
    assert set(ADDED_DEFAULTS) == ROUTER_ADDED_CHAT_FIELDS
    for key in ("required_prefix_token_ids", "temperature", "seed", "skip_special_tokens", "unknown_top_level"):
        assert got[key] == sent[key], f"the router changed the top-level field {key!r} it should keep as sent"
    assert answer["headers"].get(SESSION_HEADER) == "contract-session", "the session header no longer reaches vLLM"
    assert came_through_vllm_router(got) and not came_through_vllm_router(sent)
    assert ROUTER_ONLY_CHAT_MARKERS <= ROUTER_ADDED_CHAT_FIELDS


def test_the_router_contract_on_token_routes(hash_router: RouterProcess, http: httpx.Client) -> None:
    tokenize = b'{"model":"m","messages":[{"role":"user","content":"hi","prompt_token_ids":[1]}],"x":1}'
    answer = http.post(f"{hash_router.url}/tokenize", content=tokenize, headers={"content-type": "application/json"})
    assert answer.json()["raw"].encode() == tokenize, "the router no longer forwards /tokenize bodies as sent"
    generate = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "unknown": 1}
    answer = http.post(f"{hash_router.url}/inference/v1/generate", json=generate)
    forwarded = json.loads(answer.json()["raw"])
    assert forwarded == {**generate, "stream": False}, "the router changed what it forwards of /inference/v1/generate"


def test_the_router_keeps_image_parts_of_chat_messages(hash_router: RouterProcess, http: httpx.Client) -> None:
    """docs/clients.md tells a vision client what crosses the router: its image parts, in every role that has them,
    as sent; a bundle's `image_runs` on an assistant message does not (message fields the router does not know)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
    parts = [{"type": "text", "text": "look"}, image]
    sent = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "x", "image_runs": [{"position": 3, "length": 4, "digest": "d"}]},
        {"role": "tool", "content": parts, "tool_call_id": "c1"},
    ]
    got = _chat(http, hash_router, {"model": "m", "messages": sent}, "image-session")["body"]["messages"]
    assert got[0]["content"] == parts
    assert got[1] == {"role": "assistant", "content": "x"}
    assert got[2]["content"] == parts
