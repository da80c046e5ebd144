"""P10: request bytes per model call at call 80 of one history, by client: TRL, the OpenAI SDK, NeMo Gym, the agent.

    .venv/bin/python bench/p10_client_bytes.py                 # starts the hooked bench vLLM
    .venv/bin/python bench/p10_client_bytes.py --vllm-url URL

One history of --calls model calls (80): a number_guess episode played by this project's simple agent through the
vllm_model adapter (splice: hook, token information on), P5's episode made longer (bench/p5_request_bytes.py `play`,
max_output_tokens --max-tokens, a random model that rarely guesses right). Then each client makes its own --calls
calls on that history, each generating for real, every request body recorded at the wire by a recording proxy
(benchkit.hops.RecordingProxy) in front of the server it goes to: TRL 1.16's VLLMClient (straight to vLLM), the
OpenAI SDK against the adapter (chat with the whole history, Responses with previous_response_id), NeMo Gym 0.7.0's
vllm_model (its own server, from .venv-nemo-gym) driven with the input its simple agent builds, and the simple agent
itself with chain_responses true and false. Each body's bytes are set against the call's own prompt ids as compact
JSON (orjson.dumps of the ids vLLM answered with, `[1,2,3]`).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.hops import RecordingProxy, adapter_stack, serve_app
from benchkit.server import JSON_HEADERS, MODEL, BenchError, note
from benchkit.timing import ratio
from p5_request_bytes import play
from targets import Reading

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.types.responses import PREVIOUS_KEY
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

NEMO_GYM_MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
"""NeMo Gym's shipped vllm_model config with token information on (`return_token_id_information: true`)."""
CHAT_FIELDS = ("role", "content", "name", "reasoning", "tool_calls", "tool_call_id")
"""What a chat harness keeps of each message of its history (beside the latest assistant message's bundle)."""
NEMO_GYM_STEP = """\
import sys

import orjson
from pydantic import TypeAdapter

from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming as Params

items = TypeAdapter(Params.model_fields["input"].annotation)
body, outputs = None, []
for line in sys.stdin.buffer:
    step = orjson.loads(line)
    if body is None:
        body = Params.model_validate(step)
    else:
        outputs.extend(NeMoGymResponse.model_validate(step["answer"]).output)
        outputs.extend(items.validate_python(step["new"]))
    sent = body.model_copy(update={"input": body.input + outputs})
    sys.stdout.buffer.write(orjson.dumps(sent.model_dump(exclude_unset=True)) + b"\\n")
    sys.stdout.buffer.flush()
"""
"""Run in .venv-nemo-gym: the body of each model call as NeMo Gym 0.7.0's simple agent makes it (`_create_episode`:
the request params validated once, each answer validated as NeMoGymResponse and its output items appended to the
next call's input, `model_copy(update={"input": ...})`; ServerClient then sends `model_dump(exclude_unset=True)` as
orjson). The one step its agent does not take is the user turn after a text answer (it ends the rollout there):
number_guess's user turns are appended as input items, validated by the params' own input type."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--calls", type=int, default=80, help="model calls in the history (default 80)")
    p.add_argument("--report", type=int, nargs="+", default=[1, 20, 40, 80], help="calls in the table")
    p.add_argument("--max-tokens", type=int, default=64, help="max output tokens of the history's calls")
    p.add_argument("--replay-tokens", type=int, default=16, help="max tokens of a call that replays a history")
    return p


@dataclass
class History:
    """The reference history: what the agent (chain_responses: true) sent per call, and what vLLM got and answered."""

    request: dict[str, Any]
    """Every Responses field of a call but `input` and `previous_response_id` (the row's)."""
    inputs: list[list[dict[str, Any]]]
    """Per call: the items the agent sent (call 1: the row's input; later: the items after the previous answer)."""
    messages: list[list[dict[str, Any]]]
    """Per call: the chat messages the adapter sent vLLM (the previous call's bundle on the last assistant one)."""
    prompts: list[list[int]]
    """Per call: the prompt ids vLLM answered with."""


@dataclass
class Measured:
    """One client's hop: the bytes of each call's request body and each call's prompt ids, or why not measured."""

    client: str
    hop: str
    sizes: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    reason: str = ""


def prompt_of(answer: bytes) -> list[int]:
    """The prompt ids of a vLLM answer (chat or completions, with token ids asked for), [] if it has none."""
    body = loads_exact(answer)
    choice = (body.get("choices") or [{}])[0]
    for where in (body, choice, choice.get("message") or {}):
        if isinstance(where.get("prompt_token_ids"), list):
            return where["prompt_token_ids"]
    return []


def prompts_of(proxy: RecordingProxy, path: str) -> list[list[int]]:
    return [prompt_of(e.answer) for e in proxy.posts(path)]


def checked(response: httpx.Response, what: str) -> httpx.Response:
    if response.status_code != 200:
        raise BenchError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
    return response


def agent_runs(url: str, args: argparse.Namespace) -> tuple[History, list[Measured]]:
    """The reference history (the agent, chain_responses: true) and the agent's hops both ways."""
    episode = argparse.Namespace(turns=args.calls, max_tokens=args.max_tokens)
    measured: list[Measured] = []
    history = None
    for chain in (True, False):
        note(f"P10: the simple agent, chain_responses: {str(chain).lower()}, {args.calls} calls ...")
        to_adapter, to_vllm = play(url, episode, chain_responses=chain)
        to_adapter, to_vllm = to_adapter[: args.calls], to_vllm[: args.calls]
        prompts = [prompt_of(e.answer) for e in to_vllm]
        name = AGENT if chain else "this project's simple agent, chain_responses: false"
        measured.append(Measured(name, "agent -> adapter", [len(e.body) for e in to_adapter], prompts))
        measured.append(Measured(name, "adapter -> vLLM", [len(e.body) for e in to_vllm], prompts))
        if chain:
            bodies = [loads_exact(e.body) for e in to_adapter]
            unchained = [n + 1 for n, body in enumerate(bodies[1:], 1) if PREVIOUS_KEY not in body]
            if unchained:
                raise BenchError(f"the agent sent calls {unchained[:5]} without {PREVIOUS_KEY}: no new items to replay")
            request = {k: v for k, v in bodies[0].items() if k not in ("input", PREVIOUS_KEY)}
            messages = [loads_exact(e.body)["messages"] for e in to_vllm]
            history = History(request, [body["input"] for body in bodies], messages, prompts)
    assert history is not None
    return history, measured


def trl(url: str, history: History, args: argparse.Namespace) -> list[Measured]:
    """TRL 1.16's VLLMClient.generate with each call's prompt ids, as GRPOTrainer's tool loop calls it in server mode
    (`_generate_single_turn` -> VLLMGeneration.generate -> VLLMClient.generate, one prompt, n=1)."""
    from trl.generation.vllm_client import VLLMClient

    to_vllm = RecordingProxy(url)
    with serve_app(to_vllm.app()) as relay:
        client = VLLMClient(base_url=relay, connection_timeout=60)
        for ids in history.prompts:
            # GRPOConfig's defaults; max_tokens stands for max_completion_length; generation_kwargs {} (its None).
            client.generate(
                prompts=[ids],
                n=1,
                repetition_penalty=1.0,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                max_tokens=args.replay_tokens,
                logprobs=0,
                structured_outputs_regex=None,
                generation_kwargs={},
            )
    posts = to_vllm.posts("/v1/completions")
    return [
        Measured(
            "TRL 1.16 VLLMClient.generate (GRPOTrainer tool loop)",
            "trainer -> vLLM /v1/completions",
            [len(e.body) for e in posts],
            prompts_of(to_vllm, "/v1/completions"),
        )
    ]


def harness_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat harness's history: each message's chat fields, and the bundle on the last assistant message only."""
    last = max((n for n, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    kept = []
    for n, message in enumerate(messages):
        fields = (*CHAT_FIELDS, *BUNDLE_FIELDS) if n == last else CHAT_FIELDS
        kept.append({k: message[k] for k in fields if k in message})
    return kept


def sdk_chat(url: str, history: History, args: argparse.Namespace) -> list[Measured]:
    """The OpenAI SDK's chat.completions.create with the whole history, the latest bundle on its assistant message."""
    from openai import OpenAI

    with adapter_stack(url) as (to_adapter, to_vllm, front):
        client = OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=600)
        for messages in history.messages:
            client.chat.completions.create(
                model=MODEL,
                messages=harness_messages(messages),
                max_tokens=args.replay_tokens,
                seed=history.request.get("seed"),
                extra_headers={SESSION_HEADER: "p10-sdk-chat"},
            )
        sizes = [len(e.body) for e in to_adapter.posts("/v1/chat/completions")]
        return [
            Measured(
                "OpenAI SDK chat.completions.create (whole history)",
                "client -> adapter",
                sizes,
                prompts_of(to_vllm, "/v1/chat/completions"),
            )
        ]


def sdk_responses(url: str, history: History, args: argparse.Namespace) -> list[Measured]:
    """The OpenAI SDK's responses.create with previous_response_id and the new items only, the history's fields."""
    from openai import OpenAI

    with adapter_stack(url) as (to_adapter, to_vllm, front):
        client = OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=600)
        extra = {k: v for k, v in history.request.items() if k != "max_output_tokens"}  # seed: not an SDK argument
        previous = None
        for items in history.inputs:
            chained = {"previous_response_id": previous} if previous else {}
            answer = client.responses.create(
                model=MODEL,
                input=items,
                max_output_tokens=history.request.get("max_output_tokens"),
                extra_body=extra,
                extra_headers={SESSION_HEADER: "p10-sdk-responses"},
                **chained,
            )
            previous = answer.id
        sizes = [len(e.body) for e in to_adapter.posts("/v1/responses")]
        return [
            Measured(
                "OpenAI SDK responses.create (previous_response_id + new items)",
                "client -> adapter",
                sizes,
                prompts_of(to_vllm, "/v1/chat/completions"),
            )
        ]


@contextlib.contextmanager
def nemo_gym_bodies(python: str) -> Iterator[Callable[[dict[str, Any]], bytes]]:
    """NEMO_GYM_STEP in NeMo Gym's venv: a function that takes the first request (then each answer with the items
    after it) and gives the next call's body as NeMo Gym's agent sends it."""
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            [python, "-c", NEMO_GYM_STEP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors
        )
        assert process.stdin is not None and process.stdout is not None

        def step(message: dict[str, Any]) -> bytes:
            process.stdin.write(orjson.dumps(message) + b"\n")
            process.stdin.flush()
            line = process.stdout.readline()
            if not line:
                errors.seek(0)
                raise BenchError(f"NeMo Gym's body builder exited: {errors.read().decode()[-2000:]}")
            return line.rstrip(b"\n")

        try:
            yield step
        finally:
            process.stdin.close()
            process.wait(timeout=30)


def nemo_gym(url: str, history: History, args: argparse.Namespace) -> list[Measured]:
    """NeMo Gym 0.7.0's vllm_model as NeMo Gym starts it, driven with the input its simple agent builds."""
    from tests.nemo_gym.gym import NEMO_GYM_PYTHON, running_gym

    client = "NeMo Gym 0.7.0 vllm_model (simple agent's input: every output item appended)"
    if not NEMO_GYM_PYTHON.exists():
        reason = f"{NEMO_GYM_PYTHON} is missing (`make .venv-nemo-gym/.nemo-gym-0.7.0` builds it)"
        return [Measured(client, "agent -> vllm_model", reason=reason)]
    # NeMo Gym's way of seeding a row's calls (num_repeats_add_seed): metadata.extra_body, a JSON string.
    request = {k: v for k, v in history.request.items() if k != "seed"}
    if "seed" in history.request:
        request["metadata"] = {"extra_body": orjson.dumps({"seed": history.request["seed"]}).decode()}
    to_vllm = RecordingProxy(url)
    with ExitStack() as stack:
        relay = stack.enter_context(serve_app(to_vllm.app()))
        overrides = {"policy_base_url": f"{relay}/v1", "policy_api_key": "unused", "policy_model_name": MODEL}
        running = stack.enter_context(running_gym([NEMO_GYM_MODEL_CONFIG], overrides))
        to_model = RecordingProxy(running.url("policy_model"))
        front = stack.enter_context(serve_app(to_model.app()))
        step = stack.enter_context(nemo_gym_bodies(str(NEMO_GYM_PYTHON)))
        body = step({**request, "input": history.inputs[0]})
        with httpx.Client(timeout=600) as http:
            for n in range(len(history.inputs)):
                answer = checked(
                    http.post(f"{front}/v1/responses", content=body, headers=JSON_HEADERS),
                    f"NeMo Gym's vllm_model, call {n + 1}",
                )
                if n + 1 < len(history.inputs):
                    body = step({"answer": loads_exact(answer.content), "new": history.inputs[n + 1]})
    prompts = prompts_of(to_vllm, "/v1/chat/completions")
    return [
        Measured(client, "agent -> vllm_model", [len(e.body) for e in to_model.posts("/v1/responses")], prompts),
        Measured(client, "vllm_model -> vLLM", [len(e.body) for e in to_vllm.posts("/v1/chat/completions")], prompts),
    ]


CLIENTS: tuple[tuple[str, Callable[[str, History, argparse.Namespace], list[Measured]]], ...] = (
    ("TRL 1.16 VLLMClient", trl),
    ("OpenAI SDK chat.completions", sdk_chat),
    ("OpenAI SDK responses", sdk_responses),
    ("NeMo Gym 0.7.0 vllm_model", nemo_gym),
)


def at(values: Sequence[Any], call: int) -> Any:
    return values[call - 1] if 0 < call <= len(values) else "-"


def run(url: str, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    started = time.monotonic()
    figure = Figure("P10", "Request bytes per model call at 80 calls, by client", command("p10_client_bytes.py", argv))
    history, measured = agent_runs(url, args)
    for name, measure in CLIENTS:
        note(f"P10: {name}, {len(history.inputs)} calls ...")
        try:
            measured.extend(measure(url, history, args))
        except Exception as exc:  # noqa: BLE001 - the figure says why this client was not measured
            traceback.print_exc()
            measured.append(Measured(name, "-", reason=f"{type(exc).__name__}: {str(exc)[:400]}"))
    last = max(args.report)
    table = Table(
        f"Bytes of each model call's request body, against the call's own prompt ids as compact JSON at call {last}",
        [
            "client",
            "hop",
            *(f"bytes at call {n}" for n in args.report),
            f"prompt ids at call {last}",
            f"ids JSON bytes at call {last}",
            f"ratio (bytes / ids JSON) at {last}",
        ],
    )
    reference = [len(orjson.dumps(ids)) for ids in history.prompts]
    table.add(
        "reference: the call's prompt ids, orjson.dumps",
        "-",
        *(at(reference, n) for n in args.report),
        len(at(history.prompts, last)),
        at(reference, last),
        1.0,
        digits=3,
    )
    rows = []
    for m in measured:
        if m.reason or len(m.sizes) < last:
            why = m.reason or f"only {len(m.sizes)} calls recorded"
            table.add(m.client, m.hop, *("n/a" for _ in args.report), "n/a", "n/a", "n/a")
            figure.notes.append(f"Not measured: {m.client} ({m.hop}): {why}.")
            rows.append({"client": m.client, "hop": m.hop, "reason": why})
            continue
        ids = at(m.prompts, last) if len(m.prompts) >= last else []
        ids_json = len(orjson.dumps(ids)) if ids else float("nan")
        table.add(
            m.client,
            m.hop,
            *(at(m.sizes, n) for n in args.report),
            len(ids) if ids else "n/a",
            ids_json,
            ratio(at(m.sizes, last), ids_json),
            digits=3,
        )
        rows.append(
            {
                "client": m.client,
                "hop": m.hop,
                "bytes": {n: at(m.sizes, n) for n in args.report},
                "prompt_ids": len(ids),
                "ids_json": ids_json,
                "ratio": ratio(at(m.sizes, last), ids_json),
                "same_prompt_as_reference": ids == history.prompts[last - 1],
            }
        )
    figure.tables.append(table)
    same = [f"{r['client']} ({r['hop']})" for r in rows if r.get("same_prompt_as_reference") is False]
    figure.notes += notes(args, len(history.inputs), same)
    figure.data = {"rows": rows, "calls": len(history.inputs), "last": last, "readings": readings(rows, last)}
    figure.seconds = time.monotonic() - started
    return figure


AGENT = "this project's simple agent, chain_responses: true"
"""The client the bytes target judges: the agent as it runs by default."""


def readings(rows: list[dict[str, Any]], last: int) -> dict[str, Reading]:
    """The bytes target's reading: the agent's request at the last call over that call's prompt ids in JSON."""
    for row in rows:
        if row["client"] == AGENT and row["hop"] == "agent -> adapter" and "ratio" in row:
            where = f"call {last}: {row['bytes'][last]} bytes, {row['prompt_ids']} prompt ids ({row['ids_json']} bytes)"
            return {"P10.agent-bytes/ids-json@last": Reading(row["ratio"], where)}
    return {}


def notes(args: argparse.Namespace, calls: int, differing: list[str]) -> list[str]:
    return [
        f"The history: one number_guess episode of {calls} model calls (max_output_tokens {args.max_tokens}) played by "
        "this project's simple agent (chain_responses: true) through the vllm_model adapter (splice: hook, "
        "return_token_id_information: true) on the hooked bench vLLM (bench/p5_request_bytes.py `play`). Every "
        "client then made its own calls on that history, each generating for real; bytes are the raw request "
        "bodies recorded by a recording proxy in front of the server each was sent to (benchkit.hops.RecordingProxy). "
        "Prompt ids: those vLLM answered each call with; ids JSON: orjson.dumps of them (`[1,2,3]`).",
        "This project's simple agent: the same episode played twice more (number_guess, the row's seed on every call), "
        "chain_responses true (previous_response_id + the new items) and false (the whole history, the latest bundle "
        "on its item); adapter -> vLLM is the chat request the adapter makes of either (the whole history as "
        "messages, the latest bundle on the last assistant message).",
        f"TRL 1.16: trl.generation.vllm_client.VLLMClient(base_url=<proxy in front of vLLM>) (its __init__ only "
        "checks GET /health and reads /v1/models; NCCL is init_communicator's, never called), then per call "
        f"generate(prompts=[the call's prompt ids], n=1, max_tokens={args.replay_tokens}, GRPOConfig's sampling "
        "defaults, logprobs=0): what GRPOTrainer's _tool_call_loop sends through _generate_single_turn in server "
        "mode (the concatenated prompt + completion + tool ids), POST /v1/completions with `prompt` = [ids]. A "
        "trainer batches its conversations into one request: per conversation the bytes are the same.",
        "OpenAI SDK (openai package, base_url = a proxy in front of the adapter): chat.completions.create(messages="
        "<the history of the call: role, content (reasoning, tool calls where there are) of each message, and the "
        "bundle prompt_token_ids, generation_token_ids, generation_log_probs on the last assistant message only>, "
        f"max_tokens={args.replay_tokens}, seed), the bundle in the messages as docs/token-contract.md's custom "
        "harness sends it (no extra_body needed for it; a harness that keeps every field of each answer, as that "
        "example's model_dump does, sends more: constrained_by, generation_forced_mask, ...). responses.create("
        "previous_response_id=<its previous answer's id>, input=<the items the agent sent after that answer>, "
        f"max_output_tokens={args.max_tokens}, extra_body={{seed}}), its own chain of answers.",
        "NeMo Gym 0.7.0: its vllm_model (responses_api_models/vllm_model/configs/vllm_model_for_training.yaml, "
        "return_token_id_information: true) started from .venv-nemo-gym as NeMo Gym's launcher starts it "
        "(tests/nemo_gym/gym.py running_gym: `python app.py` with the config its parser resolved), base_url a proxy "
        "in front of vLLM; each call's body made by NeMo Gym's own classes in its venv the way its simple agent "
        "makes it (the request params, then every answer's output items, which carry their token ids, appended to "
        "the next input; model_dump(exclude_unset=True) as orjson, as its ServerClient posts it), number_guess's "
        "user turn of the history appended after each answer; the row's seed as metadata.extra_body. Its agent "
        "itself ends a rollout at a text answer, so the calls are driven here.",
        "Prompt at the last call not the reference's (the client's own answers made its history): "
        + (", ".join(differing) if differing else "none"),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
