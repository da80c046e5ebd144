"""The prefix splice done in the adapter, for a vLLM server without the plugin: token-in chat completions.

Stock vLLM (0.30 and later) takes a chat request's prompt as ids (`kv_transfer_params.prompt_token_ids`: templating
and tokenization are skipped, tool-choice validation and tool/reasoning parsing still run) and reports the ids it
used (`return_token_ids`). So the adapter does what the hook does inside vLLM, with a local copy of the served
tokenizer and chat template and the same pure splice and structural check (nemo_gym_tok.splice): it renders the
request, splices the previous call's ids in, and sends the result as the prompt.

The local copy must render as the server does. The first spliced request of each scope (template, template
arguments, tools) on a server proves it: the server's `/tokenize` ids for the whole prompt must equal the local
ones, or the request is refused (502). Later requests of that scope rely on the proof (template_proofs.py says when
it lapses) and cost the adapter what the hook costs vLLM: one rendering, a digest of the previous prompt (the render
memo), and the template's ids after it; no `/tokenize`, no tokenizing of the history.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.contract.token_sources import first_difference
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.splice import (
    NEW_SEGMENT_KEY,
    PREFIX_KEY,
    PrefixSource,
    SpliceError,
    check_in_vocabulary,
    count_image_parts,
)
from nemo_gym_tok.splice_host import (
    LocalTemplate,
    ScopedRenderer,
    SpliceRequest,
    new_segment_telemetry,
    read_splice_request,
    within_vocabulary,
)
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from responses_api_models.vllm_model.developer_role import as_server_renders
from responses_api_models.vllm_model.hub_access import hub_unreachable, offline_advice
from responses_api_models.vllm_model.template_proofs import Post, Proving, TemplateProofs

IMAGES_REFUSAL = (
    "the adapter's own splice cannot prove a history with images: stock vLLM takes no prompt ids beside images on a "
    "chat call (it ignores kv_transfer_params.prompt_token_ids when messages carry images), and the template's one "
    "placeholder per image is not the model's expanded ids. Serve the model with `ngt vllm-serve` (the hook splices "
    "image histories inside vLLM and proves them once expanded) and set splice: hook (docs/hook.md, images)"
)
HARMONY_REFUSAL = (
    "the adapter cannot splice a prefix for a Harmony (GPT-OSS) model: vLLM renders its prompts with openai_harmony, "
    "which /tokenize does not expose; serve it with `ngt vllm-serve` (the hook splices inside vLLM) and set "
    "splice: hook or auto"
)
DEFAULT_PROOF_MAX_AGE_SECONDS = 300.0
INLINE_SPLICE_MAX_IDS = 8192
"""A full splice (the whole conversation rendered, tokenized and checked) of a prefix up to this long, about a
millisecond of work, runs on the event loop: the GIL runs it alone either way, and a worker thread would add its
hand-offs (a future, two GIL switches) to a short call's critical path. Longer ones go to a thread, so the loop serves
other calls between its time slices. A next turn's splice always runs on the loop: it renders and tokenizes the new
messages only, and reads the history in two digests at C speed (about a millisecond at 32k ids)."""


@dataclass
class SplicedCall:
    """The chat body to send to vLLM and the splice telemetry to report (None when nothing was spliced)."""

    body: dict[str, Any]
    telemetry: dict[str, Any] | None
    confirm: Callable[[], Awaitable[None]] | None = None
    """Run once the answer is in: where the call went over a connection opened after the proof it relied on (the
    server may have restarted in between), it renews the proof by its probe or proves the scope again on this
    request, and refuses the answer (502) when the server no longer renders it as the local copy does."""
    measurement: TurnMeasurement | None = None
    """The measurement of the turn the call adds (does the template write it as the model did?): start it once the
    request is sent, await `ready()` before reading `telemetry`."""


@dataclass
class RequestTemplate:
    """One request's view of the local template: its renderer (scope), its messages as the server renders them and
    the rendering flags."""

    renderer: ScopedRenderer
    messages: list[Any]
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]
    """The request's own template arguments (the renderer's are these over the configured defaults)."""
    chat_template: str | None
    """The request's own chat template, if it names one."""

    def render(self) -> str:
        return self.renderer.render(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )


@dataclass
class AdapterSplicer:
    """Splices in the adapter: one LocalTemplate per tokenizer source, loaded on first use."""

    tokenizer: str | None
    """Where to load the served tokenizer from; None asks the server (`/v1/models`' root, the model path it serves)."""
    chat_template: str | None = None
    content_format: str = "auto"
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    harmony: bool = False
    terminator_override: str | None = None
    proof_max_age_seconds: float = DEFAULT_PROOF_MAX_AGE_SECONDS
    proofs: TemplateProofs = field(init=False)
    _templates: dict[str, LocalTemplate] = field(default_factory=dict)
    _served_root: str | None = None
    """The model path the server reported, asked once (not on every spliced turn); replicas serve the same model,
    and each scope's proof on each server shows the loaded copy renders as that server does."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.proofs = TemplateProofs(self.proof_max_age_seconds)

    async def prepare(
        self,
        body: dict[str, Any],
        *,
        post: Post,
        get: Callable[[str], Awaitable[Any]],
        tokenize_body: dict[str, Any],
        server: str = "",
        epoch: Callable[[], int] = lambda: 0,
        asked: SpliceRequest | None = None,
    ) -> SplicedCall:
        """The token-in chat body for `body` (a chat request as vLLM would get it) and its telemetry.

        `tokenize_body` is the /tokenize request that renders the same prompt; `server` names the vLLM server the
        request goes to and `epoch()` its connection epoch (VLLMUpstream.epoch), which the template proofs are kept
        by; `asked`: the request's prefix as the adapter read it at validation (ChatCall), else read here.
        Raises ApiError: 400 for a prefix that cannot be proven exact (as the hook answers), 502 when the local
        template is not the server's.
        """
        messages = body.get("messages") or []
        template = await self._template(get)
        # A prefix read at validation is checked against the vocabulary here, but for a next turn's splice only
        # past the prompt its digest proves this adapter spliced (splice_new_turn): `unchecked` says which.
        unchecked = None if asked is None else template.vocab_size
        try:
            if asked is None:
                asked = read_splice_request(
                    messages, body.get(PREFIX_KEY), body.get(NEW_SEGMENT_KEY), template.vocab_size
                )
            elif asked.new_segment:
                asked = within_vocabulary(asked, unchecked)
        except SpliceError as exc:
            raise ApiError(400, str(exc), param=PREFIX_KEY) from None
        sent = strip_token_fields(body)
        source = asked.source
        if source is None:
            return SplicedCall(sent, None)
        if asked.new_segment:
            return SplicedCall(sent, new_segment_telemetry())
        if self.harmony:
            raise ApiError(400, HARMONY_REFUSAL, param=PREFIX_KEY)
        if any(count_image_parts(message) for message in messages):
            raise ApiError(400, IMAGES_REFUSAL, param=PREFIX_KEY)
        kv_params = sent.get("kv_transfer_params")
        if isinstance(kv_params, dict) and "prompt_token_ids" in kv_params:
            raise ApiError(
                400,
                "kv_transfer_params.prompt_token_ids cannot be combined with a token prefix: the adapter sends "
                "the spliced prompt there; drop one of them",
                param="kv_transfer_params",
            )
        request = _request_template(template, sent["messages"], body, tokenize_body)
        proving = Proving(self.proofs, request.renderer, server, post, epoch, strip_token_fields(tokenize_body))
        proof, renewed = await proving.standing()
        spliced: _Spliced | None = None
        if proof is not None:
            # Proven scope: no /tokenize. A local failure the proof cannot explain (the template raising on these
            # messages) asks the server after all, which tells a bad request (its 4xx) from a different template.
            spliced = _splice_next_turn(template, request, source, body, unchecked)
            if spliced is None and len(source.prefix) <= INLINE_SPLICE_MAX_IDS:
                spliced = _splice(template, request, source, body, None, unchecked)
            elif spliced is None:
                spliced = await asyncio.to_thread(_splice, template, request, source, body, None, unchecked)
        if spliced is None:
            if unchecked is not None:  # before the proof's /tokenize: a bad id is the caller's 400, not a server call
                try:
                    within_vocabulary(asked, unchecked)
                except SpliceError as exc:
                    raise ApiError(400, str(exc), param=PREFIX_KEY) from None
            proof, renewed = None, False
            template_ids = await proving.prove()
            spliced = await asyncio.to_thread(_splice, template, request, source, body, template_ids)
            assert spliced is not None
            proving.record()
        prompt_ids, telemetry = spliced.prompt_ids, spliced.telemetry
        telemetry["proof"] = self.proofs.telemetry(proof, renewed=renewed)
        measurement = None if spliced.measure is None else TurnMeasurement(spliced.measure, telemetry)
        sent["kv_transfer_params"] = {
            **(kv_params if isinstance(kv_params, dict) else {}),
            "prompt_token_ids": prompt_ids,
        }

        async def confirm() -> None:
            # The answer's telemetry stays what the call relied on (a stream sent it in its first chunk already):
            # this check only decides whether the answer may be given at all.
            if epoch() == proving.relied_on:
                return
            standing, _ = await proving.standing()
            if standing is not None:
                return
            template_ids = await proving.prove()
            local_ids = await asyncio.to_thread(lambda: request.renderer.encode(request.render()))
            _check_same_ids(request.renderer, template_ids, local_ids)
            proving.record()

        return SplicedCall(sent, telemetry, confirm, measurement)

    async def model_source(self, get: Callable[[str], Awaitable[Any]]) -> str:
        """Where the served tokenizer and model files are: `tokenizer`, else the path the server reports (asked once:
        the provenance of every answer reads it too)."""
        source = self.tokenizer or self._served_root
        if source is None:
            source = self._served_root = await served_model_root(get)
        return source

    async def _template(self, get: Callable[[str], Awaitable[Any]]) -> LocalTemplate:
        source = await self.model_source(get)
        template = self._templates.get(source)
        if template is not None:
            return template
        async with self._lock:
            template = self._templates.get(source)
            if template is None:
                # Offline, a hub name loads from the cache at once, or fails at once, instead of after the hub
                # client's minute of retries.
                unreachable = await hub_unreachable(source)
                try:
                    template = await asyncio.to_thread(
                        LocalTemplate.load,
                        source,
                        chat_template=self.chat_template,
                        content_format=self.content_format,
                        default_template_kwargs=self.default_template_kwargs,
                        terminator_override=self.terminator_override,
                        local_files_only=unreachable is not None,
                    )
                except (OSError, ValueError) as exc:
                    detail = (
                        offline_advice(source, unreachable)
                        if unreachable is not None
                        else (f"{exc}. Set vllm_model.tokenizer to the model's directory or hub name")
                    )
                    raise ApiError(
                        502,
                        f"the adapter splices prompts itself (splice: adapter) and needs the served tokenizer, but "
                        f"could not load it from {source!r}: {detail}",
                        error_type="adapter_tokenizer_unavailable",
                    ) from None
                self._templates[source] = template
        return template


def _request_template(
    template: LocalTemplate, messages: list[Any], body: Mapping[str, Any], tokenize_body: Mapping[str, Any]
) -> RequestTemplate:
    template_kwargs = dict(tokenize_body.get("chat_template_kwargs") or {})
    chat_template = tokenize_body.get("chat_template")
    renderer = template.renderer(vllm_tool_dicts(tokenize_body.get("tools")), template_kwargs, chat_template)
    return RequestTemplate(
        renderer,
        as_server_renders(messages, renderer.inner.chat_template or getattr(renderer.tokenizer, "chat_template", None)),
        bool(body.get("add_generation_prompt", True)),
        bool(body.get("continue_final_message", False)),
        template_kwargs,
        chat_template,
    )


@dataclass
class _Spliced:
    """A request's spliced prompt, with its telemetry so far and what completes it."""

    prompt_ids: list[int]
    telemetry: dict[str, Any]
    measure: Callable[[], dict[str, Any]] | None = None
    """The splice's full telemetry, measuring the turn the call adds against the template (it tokenizes that turn's
    text): nothing the prompt depends on, so it is left for while vLLM works (TurnMeasurement)."""


def _splice_next_turn(
    template: LocalTemplate,
    request: RequestTemplate,
    source: PrefixSource,
    body: Mapping[str, Any],
    vocab_size: int | None,
) -> _Spliced | None:
    """A proven scope's next turn spliced at the cost of its new messages (splice_new_turn), or None where the full
    splice (`_splice`) must decide. `vocab_size`: as in `_splice`, checked past the prompt the digest proves."""
    if source.message_index < 0:
        return None
    try:
        ready = template.host.splice_new_turn(
            request.renderer,
            template.profile(request.template_kwargs, request.chat_template),
            request.messages,
            source,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            vocab_size=vocab_size,
        )
    except SpliceError as exc:
        raise ApiError(400, str(exc), param=PREFIX_KEY) from None
    if ready is None:
        return None
    return _Spliced(ready.prompt_token_ids, {"applied": True}, lambda: ready.result().telemetry())


def _splice(
    template: LocalTemplate,
    request: RequestTemplate,
    source: PrefixSource,
    body: Mapping[str, Any],
    template_ids: list[int] | None,
    vocab_size: int | None = None,
) -> _Spliced | None:
    """The spliced prompt ids, proven, and the splice telemetry; the CPU-bound part (a long one runs off the event
    loop).

    `template_ids` are the server's ids for the whole prompt, which the local copy must reproduce (the proof), or
    None for a proven scope (its next turn tried `_splice_next_turn` first); then None says the local template failed
    where the server's answer is needed.
    `vocab_size`: the prefix's ids are still to be checked against it (a 400 names the first out of it).
    """
    renderer = request.renderer
    host = template.host
    try:
        if vocab_size is not None:
            check_in_vocabulary(source, vocab_size)
        text = request.render()
        if source.message_index < 0:
            local_ids = renderer.encode(text) if template_ids is None else template_ids
            return _Spliced(local_ids, host.check_first_turn(local_ids, source, renderer))
    except SpliceError as exc:
        raise ApiError(400, str(exc), param=PREFIX_KEY) from None
    except Exception as exc:  # noqa: BLE001 - the server renders it, so a local failure means another template
        if template_ids is None:
            return None
        raise _not_the_servers_template(f"the local chat template failed on this request ({exc})") from None
    if template_ids is not None:
        _check_same_ids(renderer, template_ids, renderer.encode(text))
    try:
        prompt = host.splice(
            renderer,
            template.profile(request.template_kwargs, request.chat_template),
            request.messages,
            source,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            template_text=text,
            new_turn=False,  # tried above where it can apply
        )  # proven before it returns (no deferred verification): only the measurement is left
    except SpliceError as exc:
        raise ApiError(400, str(exc), param=PREFIX_KEY) from None
    return _Spliced(prompt.prompt_token_ids, {"applied": True}, lambda: prompt.result().telemetry())


class TurnMeasurement:
    """The measurement of the turn a call adds, merged into the call's telemetry: nothing the prompt depends on, so it
    runs while vLLM works. `start` schedules it for the event loop's next turn; the caller calls it once the request's
    body is written (VLLMUpstream.post's `on_sent`): run any earlier and it holds the request back, as it did when it
    was scheduled before the send (the body's write is a task of its own, queued behind it). `ready` runs it at once
    if it has not run (the body was never written: an error), and raises what it raised (a SpliceError as the 400 the
    splice would answer)."""

    def __init__(self, measure: Callable[[], dict[str, Any]], telemetry: dict[str, Any]) -> None:
        self._measure = measure
        self._telemetry = telemetry
        self._outcome: list[BaseException | None] = []
        self._scheduled = False

    def start(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    async def ready(self) -> None:
        self._run()
        if self._outcome[0] is not None:
            raise self._outcome[0]

    def _run(self) -> None:
        if self._outcome:
            return
        try:
            measured = self._measure()
        except SpliceError as exc:
            self._outcome.append(ApiError(400, str(exc), param=PREFIX_KEY))
            return
        except Exception as exc:  # noqa: BLE001 - raised where the answer waits for it, not lost in a callback
            self._outcome.append(exc)
            return
        telemetry = self._telemetry
        merged = {**measured, **{key: value for key, value in telemetry.items() if key not in measured}}
        telemetry.clear()
        telemetry.update(merged)
        self._outcome.append(None)


def _check_same_ids(renderer: ScopedRenderer, template_ids: list[int], local_ids: list[int]) -> None:
    """The proof: the server's ids for the whole prompt are the local copy's, or a 502 showing where they part."""
    if local_ids != template_ids:
        at = first_difference(local_ids, template_ids) or 0
        raise _not_the_servers_template(
            f"for this request the server's /tokenize gives {len(template_ids)} ids and the local copy "
            f"{len(local_ids)}, first different at id {at}: server "
            f"{renderer.decode(template_ids[at : at + 12])!r}, local {renderer.decode(local_ids[at : at + 12])!r}"
        )


def _not_the_servers_template(detail: str) -> ApiError:
    return ApiError(
        502,
        f"the adapter's copy of the chat template and tokenizer does not render prompts as the vLLM server does: "
        f"{detail}. The splice would not be exact, so the request was not sent. Point vllm_model.tokenizer, "
        "chat_template and chat_template_kwargs at what the server serves, or serve it with `ngt vllm-serve` "
        "(splice: hook)",
        error_type="adapter_template_mismatch",
    )


async def served_model_root(get: Callable[[str], Awaitable[Any]]) -> str:
    response = await get("/v1/models")
    try:
        models = loads_exact(response.content)["data"]
        return str(models[0].get("root") or models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ApiError(
            502,
            f"could not read the served model's path from vLLM's /v1/models (HTTP {response.status_code}); set "
            "vllm_model.tokenizer to the model's directory or hub name",
            error_type="adapter_tokenizer_unavailable",
        ) from None


def strip_token_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` without the required prefix, the new-segment flag and the messages' token bundles."""
    stripped = {key: value for key, value in body.items() if key not in (PREFIX_KEY, NEW_SEGMENT_KEY)}
    if isinstance(body.get("messages"), list):
        stripped["messages"] = [
            {key: value for key, value in message.items() if key not in BUNDLE_FIELDS}
            if isinstance(message, dict) and not _BUNDLE_FIELD_SET.isdisjoint(message)
            else message  # shared, not copied: most messages carry no bundle
            for message in body["messages"]
        ]
    return stripped


_BUNDLE_FIELD_SET = frozenset(BUNDLE_FIELDS)


def vllm_tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the chat template: each function with name, description and parameters (None when
    absent), `strict` only when set, and nothing else."""
    if not isinstance(tools, list):
        return None
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            dumped.append(tool)
            continue
        shaped = {key: function.get(key) for key in ("name", "description", "parameters")}
        if function.get("strict") is not None:
            shaped["strict"] = function["strict"]
        dumped.append({"type": tool.get("type", "function"), "function": shaped})
    return dumped
