"""The shared body reader: every kind of the table refused, big bodies stopped early, the default 64 MiB limit."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Any

import pytest
from starlette.requests import Request

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig
from nemo_gym_tok.servers.bodies import DEFAULT_MAX_BODY_BYTES, nesting_depth, parse_json_object, read_body
from nemo_gym_tok.servers.inprocess import serve_in_thread
from resources_servers.number_guess.app import SERVER as NumberGuess
from tests.bad_inputs.cases import BAD_BODIES, SMALL_LIMIT


@pytest.mark.parametrize(
    "case", [c for c in BAD_BODIES if c.status == 400], ids=[c.kind for c in BAD_BODIES if c.status == 400]
)
def test_parse_refuses_each_kind(case) -> None:
    with pytest.raises(ApiError) as refused:
        parse_json_object(case.raw)
    assert refused.value.status == 400 and case.names in refused.value.message


@pytest.mark.parametrize(
    "raw",
    [b"", b"  ", b"{}", b"\xef\xbb\xbf{}", b'{"a": ["\\ud83d\\ude00", "\\\\ud800", 1.5e300, -0.0]}', b'{"a": "[[[[["}'],
)
def test_parse_keeps_good_bodies(raw: bytes) -> None:
    assert isinstance(parse_json_object(raw), dict)


def test_depth_bound_is_128_containers() -> None:
    assert parse_json_object(b'{"a": ' + b"[" * 127 + b"]" * 127 + b"}")
    with pytest.raises(ApiError, match="a: arrays/objects nest more than 128 deep"):
        parse_json_object(b'{"a": ' + b"[" * 128 + b"]" * 128 + b"}")


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((reference_depth(child) for child in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(child) for child in value), default=0)
    return 0


def random_document(rng: random.Random, depth: int = 0) -> Any:
    """Nested arrays and objects whose strings and keys are made of quotes, backslashes, brackets and escapes."""
    alphabet = ["a", "\\", '"', "[", "]", "{", "}", "\n", "\u00e9", "\\\\", '\\"']

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))

    draw = rng.random()
    if depth > 6 or draw < 0.3:
        return text() if rng.random() < 0.6 else rng.randrange(100)
    if draw < 0.65:
        return [random_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {text(): random_document(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_nesting_depth_reads_the_bytes_as_the_parsed_value_nests() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        value = random_document(rng)
        for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=1)):
            assert nesting_depth(raw.encode()) == reference_depth(value), raw


def test_nesting_depth_stops_counting_past_its_cap() -> None:
    deep = b"[" * 300 + b"]" * 300
    assert nesting_depth(deep) == 300
    assert nesting_depth(deep, 128) == 129 and nesting_depth(b"[[]]", 128) == 2


def test_a_long_history_has_many_brackets_but_is_not_deep() -> None:
    messages = [{"role": "user", "content": "[{" * 50, "prompt_token_ids": list(range(300))} for _ in range(200)]
    raw = json.dumps({"messages": messages}).encode()
    assert raw.count(b"[") > 128 and nesting_depth(raw) == 4  # body, messages, a message, its ids
    assert parse_json_object(raw)["messages"] == messages


def request_streaming(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A request whose body arrives in `chunks`; the list counts how many chunks the reader pulled."""
    pulled = [0]

    async def receive() -> dict[str, Any]:
        index = pulled[0]
        pulled[0] += 1
        return {"type": "http.request", "body": chunks[index], "more_body": index + 1 < len(chunks)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive), pulled


def test_a_streamed_body_is_cut_off_at_the_limit() -> None:
    request, pulled = request_streaming([b"x" * 1000] * 100, {})
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, 2500))
    assert refused.value.status == 413 and "streamed past it" in refused.value.message
    assert pulled[0] == 3  # stopped at the chunk that crossed the limit, 97 chunks never read


def test_content_length_is_checked_before_reading() -> None:
    request, pulled = request_streaming([b"x"], {"content-length": str(200 * 1024 * 1024)})
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, DEFAULT_MAX_BODY_BYTES))
    assert refused.value.status == 413 and "Content-Length is 209715200" in refused.value.message
    assert pulled[0] == 0


def test_every_server_has_the_limit_key_with_a_64_mib_default() -> None:
    assert BaseServerConfig().max_body_bytes == 64 * 1024 * 1024
    assert BaseServerConfig(max_body_bytes=SMALL_LIMIT).max_body_bytes == SMALL_LIMIT
    with pytest.raises(ValueError):
        BaseServerConfig(max_body_bytes=0)


def raw_post(base_url: str, path: str, content_length: int, sent: bytes) -> bytes:
    """POST over a bare socket announcing `content_length` but sending only `sent`: what a client streaming 200 MB
    looks like to the server before the 200 MB arrive."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"x-session-id: s\r\nContent-Length: {content_length}\r\n\r\n"
        )
        sock.sendall(head.encode() + sent)
        return sock.recv(65536)


def test_200_mb_announced_is_413_at_the_default_limit_without_sending_it() -> None:
    with serve_in_thread(NumberGuess("number_guess", NumberGuess.config_class()).build_app()) as url:
        answer = raw_post(url, "/seed_session", 200 * 1024 * 1024, b'{"secret": 5, "pad": "')
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer[:300]
    assert b"larger than this server's limit of 67108864 bytes" in rest
