"""Reads a request body as a JSON object, or answers the client with a 400 or 413 that names the problem."""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn

from fastapi import Request

from nemo_gym_tok.common.exact_json import NeedsStdlib, loads_exact, loads_fast
from nemo_gym_tok.servers.api_errors import ApiError

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body a server reads unless its config says otherwise (`max_body_bytes`)."""
MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects accepted; real bodies (items, tool schemas) stay far below it."""
MAX_BODY_STATE_KEY = "max_body_bytes"
"""Where build_app puts the server's limit on `app.state`, so every route's reader finds it."""


class _Refusal(Exception):
    """Raised from inside json.loads' hooks to stop the parse with a message for the client."""


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object (an empty body is `{}`), within the server's size limit."""
    limit = getattr(request.app.state, MAX_BODY_STATE_KEY, DEFAULT_MAX_BODY_BYTES)
    return parse_json_object(await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to pass `limit` bytes: from Content-Length before
    reading anything, else by counting while streaming (a chunked body has no length up front)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, f"the Content-Length header is not a byte count: {declared[:40]!r}")
        if int(declared) > limit:
            _too_large(limit, f"Content-Length is {int(declared)}")
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > limit:
            _too_large(limit, "the body streamed past it")
    return bytes(received)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed, refused with 400 when it is not one JSON object that every other server can take on: valid
    UTF-8, no NaN or Infinity (nor a number too large for a float), no lone surrogate, nesting at most
    MAX_JSON_DEPTH deep."""
    if not raw or raw.isspace():
        return {}
    body = _parse_fast(raw)
    if body is None:
        return _parse_strict(raw)
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    # orjson has refused lone surrogates already; only the depth is left to check, and fewer brackets than the
    # bound (brackets inside strings counted too) cannot nest past it. A long history has more (an object per
    # message; a body past 64 KB is not counted first), so the depth is read from the bytes at C speed; the walk,
    # which names the field, runs only past it.
    few_brackets = len(raw) <= 65536 and raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH
    if not few_brackets and nesting_depth(raw, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        _refuse_problem(json_value_problem(body, check_strings=False))
    return body


def nesting_depth(raw: bytes, cap: int | None = None) -> int:
    """How deep the arrays and objects of `raw`, a valid JSON document, nest (counted no further than `cap` + 1).

    All at C speed: every escape is dropped (a backslash and the character after it, inside strings, the only place
    JSON has them), so every quote left opens or closes a string; of the rest only quotes and brackets are kept (one
    pass over the body), the text between quotes is dropped, and each pass then removes the innermost pairs; the
    passes it takes to remove them all are the depth."""
    unescaped = _ESCAPE.sub(b"", raw) if b"\\" in raw else raw
    structure = b"".join(unescaped.translate(_AS_PARENTHESES, _NOT_STRUCTURE).split(b'"')[::2])
    depth = 0
    while structure and (cap is None or depth <= cap):
        inner = structure.replace(b"()", b"")
        if len(inner) == len(structure):
            raise ValueError("unbalanced brackets: not a valid JSON document")
        structure, depth = inner, depth + 1
    return depth


_ESCAPE = re.compile(rb"\\.", re.DOTALL)
"""A JSON escape's first two characters (enough to hide an escaped quote or backslash)."""
_AS_PARENTHESES = bytes.maketrans(b"[{]}", b"(())")
"""Arrays and objects alike: only how they nest counts."""
_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'[]{}"')
"""Every byte but brackets and quotes: what bytes.translate deletes to leave the structure of the text."""


def _parse_fast(raw: bytes) -> Any | None:
    """`raw` parsed by orjson, or None for the strict reader to decide: when orjson refuses the document (it refuses
    all the strict reader does: invalid UTF-8, NaN and Infinity, numbers past a float, lone surrogates, nesting past
    1024, but says it less clearly), and when it may hold an integer past 64 bits, which orjson would make a float."""
    try:
        return loads_fast(raw)
    except NeedsStdlib:
        return None


def _parse_strict(raw: bytes) -> dict[str, Any]:
    """The reference reader: the stdlib parser with hooks that name each refusal (and the only one that keeps a
    BOM-prefixed body or an integer past 64 bits exact)."""
    try:
        text = raw.decode("utf-8-sig")  # strict (json.loads(bytes) lets raw surrogates through); a BOM is dropped
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = loads_exact(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _Refusal as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        # The C parser stops at the interpreter's recursion limit; anything that deep is past our bound anyway.
        raise ApiError(400, f"request body: arrays/objects nest more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    # Cheap prechecks keep the walk off the common body: fewer brackets than the bound cannot nest past it, and a
    # lone surrogate can only come from a \uD800-\uDFFF escape (raw surrogate bytes failed the strict decode).
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    escaped_surrogate = _SURROGATE_ESCAPE.search(text) is not None
    if deep or escaped_surrogate:
        _refuse_problem(json_value_problem(body, check_strings=escaped_surrogate))
    return body


def _refuse_problem(problem: tuple[str | None, str] | None) -> None:
    """The 400 for what json_value_problem found, if anything."""
    if problem is not None:
        param, message = problem
        raise ApiError(400, f"request body: {message}", param=param)


def json_value_problem(
    value: Any,
    max_depth: int = MAX_JSON_DEPTH,
    *,
    check_strings: bool = True,
) -> tuple[str | None, str] | None:
    """(top-level field, what is wrong) for the first value in `value` nested past `max_depth` or (with
    `check_strings`) holding a lone surrogate, or None. Walks with an explicit stack, so no depth makes it recurse."""
    stack: list[tuple[Any, str | None, int]] = [(value, None, 0)]
    while stack:
        node, top, depth = stack.pop()
        if isinstance(node, (dict, list)) and depth >= max_depth:
            return top, f"{_field(top)}arrays/objects nest more than {max_depth} deep"
        if isinstance(node, dict):
            for key, child in node.items():
                child_top = top if top is not None else str(key)[:100]
                if check_strings and _has_lone_surrogate(key):
                    return None, f"{_field(top)}an object key has a lone UTF-16 surrogate (\\ud800-\\udfff)"
                if isinstance(child, (dict, list)) or (check_strings and isinstance(child, str)):
                    stack.append((child, child_top, depth + 1))
        elif isinstance(node, list):
            stack.extend(
                (child, top, depth + 1)
                for child in node
                if isinstance(child, (dict, list)) or (check_strings and isinstance(child, str))
            )
        elif isinstance(node, str) and _has_lone_surrogate(node):
            return (
                top,
                f"{_field(top)}a string has a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode",
            )
    return None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _field(top: str | None) -> str:
    return f"{top}: " if top is not None else ""


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():  # the common case, checked at C speed
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: valid JSON, but no float holds it and no strict encoder writes it back
        raise _Refusal(f"the number {text[:40]} is out of range for a 64-bit float")
    return value


def _refuse_constant(name: str) -> NoReturn:
    raise _Refusal(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _too_large(limit: int, how: str) -> NoReturn:
    raise ApiError(
        413,
        f"request body is larger than this server's limit of {limit} bytes ({how}); "
        f"raise max_body_bytes in its config to accept it",
        error_type="invalid_request_error",
    )
