"""The agent's way of calling the adapter, timed: `/v1/responses` continuing the previous answer against token-in."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from targets import Reading, worst

from benchkit.episode import Call, tokenize
from benchkit.figures import Table, fmt
from benchkit.gym_processes import cpu_seconds
from benchkit.server import JSON_HEADERS, MODEL, BenchError
from benchkit.timing import median, percentile, ratio
from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.contract.conversion import chat_message_to_items, items_to_chat_messages
from nemo_gym_tok.contract.model_history import TOKEN_FIELDS
from nemo_gym_tok.types.responses import ResponseItem


def responses_input(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items, each assistant message's bundle (where it has one) on its last item."""
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant":
            items += [item.model_dump(exclude_none=True) for item in chat_message_to_items(message)]
        elif role == "tool":
            output = {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            items.append(output)
        else:
            items.append({"type": "message", "role": role, "content": message["content"]})
    return items


def responses_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A chat call's tools and tool_choice in the Responses request's form."""
    out: dict[str, Any] = {}
    if "tools" in fields:
        out["tools"] = [{"type": "function", **tool["function"]} for tool in fields["tools"]]
    if "tool_choice" in fields:
        out["tool_choice"] = fields["tool_choice"]
    return out


def answered_message(answer: dict[str, Any]) -> dict[str, Any]:
    """The assistant message (with its bundle) of an adapter's Responses answer."""
    messages = items_to_chat_messages([ResponseItem.model_validate(item) for item in answer["output"]])
    if len(messages) != 1 or "prompt_token_ids" not in messages[0]:
        raise BenchError(f"the adapter's answer is not one model call with its bundle: {answer['output']!r:.300}")
    return messages[0]


BRIDGE = {"role": "user", "content": "Go on with the plan."}
"""The user turn between the chain's first answer and the answer the timed call continues."""


def plain_message(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key not in TOKEN_FIELDS}


@dataclass
class ChainedCall:
    """One call of an episode timed the agent's way. Each round builds a chain, untimed: the call before it sent
    whole, with its bundle (its answer, 1 token, kept; the earlier turns keep their ids, as they do in an agent's
    chain), a continued call with one user turn (its answer, `answer_tokens` long, kept, with its chat messages: a
    prompt the adapter spliced itself, as every chained call after the second is), then the timed call continues
    that answer with the user message of `call`, varied per round: the kept chat messages and the new turn's splice,
    as the agent's calls take them."""

    before: Call
    call: Call
    answer_tokens: int
    answer_ids: list[int] | None = None
    """The ids the bridge answer may be sampled from (vLLM's allowed_token_ids), None for any: the bench model is
    random, so its free text is byte soup, whose tokenization (the turn's measurement, in the adapter as in the hook)
    costs up to ten times a real model's text of the same length and varies with the server's random state."""

    def first_body(self) -> bytes:
        return self._body({"input": responses_input(self.before.bundled), "max_output_tokens": 1})

    def bridge_body(self, previous_id: str) -> bytes:
        sampling = {} if self.answer_ids is None else {"allowed_token_ids": self.answer_ids}
        return self._continued(previous_id, BRIDGE, self.answer_tokens, sampling)

    def continued_body(self, previous_id: str, user: dict[str, Any]) -> bytes:
        return self._continued(previous_id, user, 1)

    def user(self, tokenizer: Any, round_: int) -> dict[str, Any]:
        return self.call.varied(tokenizer, round_).bundled[-1]

    def _continued(
        self, previous_id: str, user: dict[str, Any], tokens: int, sampling: dict[str, Any] | None = None
    ) -> bytes:
        return self._body(
            {
                "previous_response_id": previous_id,
                "input": [{"type": "message", "role": "user", "content": user["content"]}],
                "max_output_tokens": tokens,
                **(sampling or {}),
            }
        )

    def _body(self, fields: dict[str, Any]) -> bytes:
        return orjson.dumps({"model": MODEL, **fields, "store": True, **responses_fields(self.before.fields)})

    def messages(self, first: dict[str, Any], bridged: dict[str, Any], user: dict[str, Any]) -> list[dict[str, Any]]:
        """The timed call's history as chat messages, the bundle of the answer it continues on that answer alone."""
        return [
            *self.before.plain,
            plain_message(answered_message(first)),
            BRIDGE,
            answered_message(bridged),
            user,
        ]

    def token_in_body(self, capture: dict[str, Any], messages: list[dict[str, Any]], ids: list[int]) -> bytes:
        """The timed call as a direct token-in chat request: the plain messages, the capture fields the adapter sends
        vLLM, and the spliced ids."""
        plain = [plain_message(message) for message in messages]
        return orjson.dumps({**capture, "messages": plain, "kv_transfer_params": {"prompt_token_ids": ids}})

    def chain(self, http: httpx.Client, adapter: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The round's untimed chain: the first answer and the answer the timed call continues."""
        _, first = post_json(http, f"{adapter}/v1/responses", self.first_body())
        _, bridged = post_json(http, f"{adapter}/v1/responses", self.bridge_body(first["id"]))
        if bridged.get("store") is not True:
            raise BenchError("the adapter did not keep its answer (store is not true)")
        return first, bridged


def post_json(http: httpx.Client, url: str, content: bytes) -> tuple[float, dict[str, Any]]:
    """Wall milliseconds of one POST and its JSON answer; BenchError unless 200."""
    started = time.perf_counter()
    answer = http.post(url, content=content, headers=JSON_HEADERS)
    elapsed = (time.perf_counter() - started) * 1000
    if answer.status_code != 200:
        raise BenchError(f"POST {url} answered HTTP {answer.status_code}: {answer.text[:500]}")
    return elapsed, loads_exact(answer.content)


def capture_fields(chained: ChainedCall, adapter: str, proxy: Any, hooked: str, tokenizer: Any) -> dict[str, Any]:
    """What the adapter sends vLLM besides the messages and ids for a timed call, recorded once (round -3, never
    timed); BenchError unless its ids are the ones token-in is given (the hook's splice of the same history)."""
    with httpx.Client(timeout=600) as http, httpx.Client(base_url=hooked, timeout=600) as hooked_http:
        first, bridged = chained.chain(http, adapter)
        user = chained.user(tokenizer, -3)
        post_json(http, f"{adapter}/v1/responses", chained.continued_body(bridged["id"], user))
        sent = loads_exact(proxy.posts("/v1/chat/completions")[-1].body)
        messages = chained.messages(first, bridged, user)
        if sent["kv_transfer_params"]["prompt_token_ids"] != tokenize(hooked_http, messages, chained.before.fields):
            raise BenchError(f"the adapter's ids for continued call {chained.call.number} are not the hook's")
    return {key: value for key, value in sent.items() if key not in ("messages", "kv_transfer_params")}


def timed_chained(
    chained: ChainedCall,
    capture: dict[str, Any],
    adapter: str,
    stock: str,
    hooked: str,
    tokenizer: Any,
    repeats: int,
    adapter_pid: int,
    warmup: int = 2,
) -> dict[str, Any]:
    """`repeats` rounds (after `warmup`) of the continued call through the adapter and as direct token-in, the order
    rotated each round. Each round first builds its chain (ChainedCall, untimed); the timed call sends the id of the
    chain's last answer and a user message never sent before; its own answer is deleted after (untimed). Per variant
    p50 and p95, the paired ratio (median over rounds), the adapter's CPU ms per continued call (its total over the
    timed calls over their number: /proc counts in ticks of 10 ms), and the history's ids."""
    times: dict[str, list[float]] = {"adapter": [], "direct token-in": []}
    cpu = 0.0
    paired: list[float] = []
    ids_seen = 0
    with httpx.Client(timeout=600) as http, httpx.Client(base_url=hooked, timeout=600) as hooked_http:
        for round_ in range(-warmup, repeats):
            first, bridged = chained.chain(http, adapter)
            user = chained.user(tokenizer, round_)
            messages = chained.messages(first, bridged, user)
            ids = tokenize(hooked_http, messages, chained.before.fields)
            ids_seen = len(ids)
            continued = chained.continued_body(bridged["id"], user)
            direct = chained.token_in_body(capture, messages, ids)
            measured: dict[str, float] = {}
            order = ["adapter", "direct token-in"]
            for name in order[round_ % 2 :] + order[: round_ % 2]:
                if name == "adapter":
                    before = cpu_seconds(adapter_pid)
                    measured[name], reply = post_json(http, f"{adapter}/v1/responses", continued)
                    spent = (cpu_seconds(adapter_pid) - before) * 1000
                else:
                    measured[name], _ = post_json(http, f"{stock}/v1/chat/completions", direct)
            http.delete(f"{adapter}/v1/responses/{reply['id']}")
            if round_ >= 0:
                for name, value in measured.items():
                    times[name].append(value)
                cpu += spent
                paired.append(ratio(measured["adapter"], measured["direct token-in"]))
    return {
        "call": chained.call.number,
        "ids": ids_seen,
        **{name: (percentile(values, 50), percentile(values, 95)) for name, values in times.items()},
        "paired": median(paired),
        "adapter cpu": cpu / repeats if repeats else float("nan"),
    }


def chained_summary(rows: list[dict[str, Any]]) -> tuple[Table, dict[str, Reading]]:
    """Per size, the median and the worst over the histories of adapter / direct token-in (the ratio of p50s, and
    paired); and the readings the targets judge."""
    table = Table(
        "Adapter (splice: adapter), continued /v1/responses calls, by size: median and worst of the histories",
        [
            "size",
            "histories",
            "/direct token-in p50 median",
            "/direct token-in p50 worst",
            "paired median",
            "paired worst",
            "adapter - direct token-in p50 ms, median",
            "adapter CPU ms per call, median",
        ],
    )
    readings: dict[str, Reading] = {}
    for size in sorted({row["size"] for row in rows}):
        at = [row for row in rows if row["size"] == size]
        where = [f"{r['ids']} ids, history {r['history']}" for r in at]
        p50 = worst([(ratio(r["adapter"][0], r["direct token-in"][0]), w) for r, w in zip(at, where)])
        paired = worst([(r["paired"], w) for r, w in zip(at, where)])
        readings[f"P1b.adapter/token-in.p50@{size // 1024}k.worst"] = p50
        table.add(
            f"{size / 1024:g}k",
            len(at),
            median([ratio(r["adapter"][0], r["direct token-in"][0]) for r in at]),
            f"{fmt(p50.value, 2)} ({p50.where})",
            median([r["paired"] for r in at]),
            f"{fmt(paired.value, 2)} ({paired.where})",
            median([r["adapter"][0] - r["direct token-in"][0] for r in at]),
            median([r["adapter cpu"] for r in at]),
            digits=2,
        )
    return table, readings
