"""The vLLM model adapter: `/v1/chat/completions` and `/v1/responses` in front of vLLM, token ids exact."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message, error_param
from nemo_gym_tok.contract.provenance import generation_defaults, model_fingerprint
from nemo_gym_tok.router.fleet import PROBE_PATH, answered_fingerprint, probe_body
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig, ModelServer
from nemo_gym_tok.servers.bodies import json_object
from nemo_gym_tok.servers.json_response import JSONBytesResponse
from nemo_gym_tok.servers.openapi import json_body
from nemo_gym_tok.splice import NEW_SEGMENT_KEY, PREFIX_KEY, TERMINATOR_ENV
from nemo_gym_tok.types import ChatCompletionRequest, ResponsesRequest
from nemo_gym_tok.types.responses import PREVIOUS_KEY
from nemo_gym_tok.types.tokens import NEW_SEGMENT_REASON_KEY, SEGMENT_HISTORY_WITHOUT_IDS
from responses_api_models.vllm_model.behind_router import (
    DeclaredWorkers,
    RouterView,
    crossing_body,
    detect_router,
    server_label,
)
from responses_api_models.vllm_model.calls import ChatCall, PreparedCall
from responses_api_models.vllm_model.chat_answer import chat_result_to_response, context_overflow_result, response_body
from responses_api_models.vllm_model.chat_events import chat_sse
from responses_api_models.vllm_model.chat_form import chat_form, kept_chat_messages
from responses_api_models.vllm_model.config import VLLMModelConfig
from responses_api_models.vllm_model.fleet import FleetFingerprint, WorkerUnreachable
from responses_api_models.vllm_model.local_splice import AdapterSplicer
from responses_api_models.vllm_model.nemo_gym_token_store import NeMoGymTokenStore
from responses_api_models.vllm_model.reasoning_parser import refuse_parsed_reasoning
from responses_api_models.vllm_model.request_metadata import apply_metadata
from responses_api_models.vllm_model.response_chain import ResponseChain
from responses_api_models.vllm_model.response_fields import request_echo
from responses_api_models.vllm_model.responses_events import responses_sse
from responses_api_models.vllm_model.rollout_paths import RolloutPathMiddleware, rollout_of
from responses_api_models.vllm_model.session_key import conversation_key
from responses_api_models.vllm_model.streaming import open_chat_stream
from responses_api_models.vllm_model.token_capture import (
    attach_bundles,
    attach_provenance,
    capture_request_fields,
    drop_unrequested,
    token_in_prompt,
    tokenize_request,
)
from responses_api_models.vllm_model.upstream import VLLMUpstream, answer_json, conversation, is_context_overflow
from responses_api_models.vllm_model.weight_versions import WeightVersionReads

ADAPTER_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "n", PREFIX_KEY, "start_token_segment"})
"""Top-level fields the adapter reads itself (routing, token ids, streaming): allowed whatever `forwarded_fields`
says. Bundle fields ride on messages, so they are never top-level fields."""
RESPONSES_ADAPTER_FIELDS = frozenset({"input", "instructions", PREVIOUS_KEY, "store"})
"""`/v1/responses` fields that become the chat `messages` (with the kept history `previous_response_id` names)."""
RESPONSES_ALIASES = {"max_output_tokens": "max_tokens"}
FINGERPRINT_SECONDS = 60.0
"""How long a worker behind the router has to answer the fleet check's 1-token probe."""
"""`/v1/responses` fields that reach vLLM under a chat name: listing either name in `forwarded_fields` allows it."""


class VLLMModel(ModelServer):
    config_class: ClassVar[type[BaseServerConfig]] = VLLMModelConfig
    config: VLLMModelConfig

    def setup_routes(self, app: FastAPI) -> None:
        self.base_url = str(self.config.base_url)
        self.upstream = VLLMUpstream(
            api_key=self.config.api_key,
            timeout=self.config.http_timeout(),
            limits=self.config.http_limits(),
            max_attempts=self.config.max_attempts,
            backoff_seconds=self.config.retry_backoff_seconds,
        )
        self.splicer = AdapterSplicer(
            tokenizer=self.config.tokenizer,
            chat_template=self.config.chat_template,
            content_format=self.config.chat_template_content_format,
            default_template_kwargs=self.config.default_chat_template_kwargs,
            harmony=self.config.harmony,
            terminator_override=os.environ.get(TERMINATOR_ENV) or None,
            proof_max_age_seconds=self.config.template_proof_max_age_seconds,
        )
        self._hooked: dict[str, bool] = {}
        self._routers: dict[str, RouterView | None] = {}
        self.fleet = FleetFingerprint()
        self.declared_workers = DeclaredWorkers(self.config.router)
        self.weight_versions = WeightVersionReads(self.upstream.get_small)
        self._provenance: dict[str, tuple[dict[str, Any] | None, dict[str, str] | None]] = {}
        capture_dir = self.config.nemo_gym_token_capture_dir
        self.capture_store = NeMoGymTokenStore(capture_dir) if capture_dir else None
        self.kept_responses = ResponseChain(self.config.response_store_max_ids)
        app.add_middleware(RolloutPathMiddleware)

        @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest, session="optional"))
        async def chat_completions(request: Request) -> HTTPResponse:
            body = await json_object(request)
            self._check_forwarded(body)
            chat = ChatCall.validated(self._with_metadata(body))
            conversation.set(conversation_key(request, body))
            self._check_capture(request, chat)
            if chat.stream:
                return await self.stream(chat, self.base_url)
            result = await self.complete(chat, self.base_url)
            await self._capture(request, result, chat)
            return JSONBytesResponse(result)

        @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest, session="optional"))
        async def responses(request: Request) -> HTTPResponse:
            raw = await json_object(request)
            self._check_forwarded(raw, responses_api=True)
            chained = self.kept_responses.expand(raw)  # the whole history, where the call continues a kept one
            form = chat_form(chained)
            chat = ChatCall.validated(self._with_metadata(form.body), checked=form.checked)
            conversation.set(conversation_key(request, raw))
            self._check_capture(request, chat)
            echo = request_echo(form.request)

            def settle(response: dict[str, Any]) -> dict[str, Any]:
                kept_chat = kept_chat_messages(chained, chat.body["messages"], response.get("output") or [])
                return self.kept_responses.answered(response, chained, kept_chat)

            if chat.stream:  # `stream` is not a Responses-only field: the chat body carries it
                return await self.stream(chat, self.base_url, as_responses=echo, settle=settle)
            result = await self.complete(chat, self.base_url)
            response = settle(response_body(result, self.config.model, echo))
            await self._capture(request, response, chat)
            return JSONBytesResponse(response)

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str) -> HTTPResponse:
            if not self.kept_responses.forget(response_id):
                raise ApiError(404, f"no response {response_id!r} is kept by this adapter", param="response_id")
            return JSONBytesResponse({"id": response_id, "object": "response", "deleted": True})

    def _with_metadata(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        """NeMo Gym's per-row `metadata` settings applied (request_metadata.py); the fields its `extra_body` adds
        are held to `forwarded_fields` like the caller's own."""
        body, added = apply_metadata(chat_body)
        self._check_forwarded({name: body[name] for name in added})
        return body

    def _check_capture(self, request: Request, chat: ChatCall) -> None:
        """400 for a call on NeMo Gym's training-capture path that the adapter could not capture."""
        rollout = rollout_of(request)
        if rollout is None or not rollout.training_capture:
            return
        if chat.stream and self.capture_store is not None:
            raise ApiError(
                400,
                "stream: true on a training-capture path: the adapter records unstreamed calls only; "
                "send stream: false (NeMo Gym's agents do)",
                param="stream",
            )
        if self.capture_store is None and not self.config.return_token_id_information:
            raise ApiError(
                400,
                f"rollout {rollout.rollout_id}: training-token capture asked for, but this adapter neither "
                "records (nemo_gym_token_capture_dir unset) nor returns token ids (return_token_id_information: false);"
                " set either on the adapter",
                param="path",
            )

    async def _capture(self, request: Request, answer: dict[str, Any], chat: ChatCall) -> None:
        rollout = rollout_of(request)
        if rollout is not None and rollout.training_capture and self.capture_store is not None:
            await self.capture_store.record(
                rollout.rollout_id, answer, chat_body=chat.body, required_prefix=chat.required_prefix
            )

    def _check_forwarded(self, body: dict[str, Any], *, responses_api: bool = False) -> None:
        """400 naming the first top-level field outside `forwarded_fields` (when set): refused, never dropped
        silently, so a caller learns that the operator does not let it set that field."""
        allowed = self.config.forwarded_fields
        if allowed is None:
            return
        always = ADAPTER_FIELDS | (RESPONSES_ADAPTER_FIELDS if responses_api else frozenset())
        for name in body:
            if name in always or name in allowed or (responses_api and RESPONSES_ALIASES.get(name) in allowed):
                continue
            listed = ", ".join(sorted(allowed)) or "none"
            raise ApiError(
                400,
                f"{name}: this adapter does not forward the field {name!r} to the model (forwarded_fields: "
                f"{listed}; plus the fields the adapter reads itself)",
                param=name,
            )

    async def complete(self, chat: ChatCall, url: str) -> dict[str, Any]:
        """One chat completion against vLLM at `url`, with bundles resolved, prefix checked and errors mapped."""
        if chat.stream:
            raise ApiError(400, "stream: true goes through stream(), not complete()", param="stream")
        call = await self.prepare(chat, url)
        sent = None if call.measurement is None else call.measurement.start
        response = await self.upstream.post(url, "/v1/chat/completions", call.body, on_sent=sent)
        if is_context_overflow(response):
            return context_overflow_result(self.config.model, error_message(response))
        if response.status_code >= 400:
            raise ApiError(
                response.status_code,
                error_message(response),
                param=error_param(response),  # e.g. the hook's field
                error_type="upstream_invalid_request",
            )
        what = "vllm-router" if await self.router_at(url) else "vLLM"
        return await self.finish(call, answer_json(response, f"{what} at {url}"), url)

    async def stream(
        self,
        chat: ChatCall,
        url: str,
        *,
        as_responses: dict[str, Any] | None = None,
        settle: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> StreamingResponse:
        """`chat` streamed from vLLM at `url` as server-sent events: chat chunks, or Responses events when
        `as_responses` is given (the request echo of `request_echo`). Every refusal (prepare's, vLLM's status, the
        prefix check on the first chunk) comes before the first byte (streaming.py)."""
        call = await self.prepare(chat, url)
        stream = await open_chat_stream(
            call,
            url,
            post=lambda body: self.upstream.open_stream(
                url, "/v1/chat/completions", body, on_sent=None if call.measurement is None else call.measurement.start
            ),
            prompt_ids=lambda: self._prompt_ids(call, url),
            server=server_label(url, await self.router_at(url)),
            finish=lambda result: self.finish(call, result, url),
            overflow=lambda reason: context_overflow_result(self.config.model, reason),
        )
        if as_responses is not None:
            return responses_sse(
                stream,
                to_response=lambda result: chat_result_to_response(result, self.config.model, as_responses),
                settle=settle,
            )
        return chat_sse(stream, call)

    async def prepare(self, chat: ChatCall, url: str) -> PreparedCall:
        """The body to send vLLM at `url` for `chat`: sampling overrides, token capture fields, and (where the adapter
        splices) the spliced prompt as token-in ids. Every refusal of the request happens here, before any answer.
        A call that returns its bundle also reads the server's weight version meanwhile (weight_versions.py): done
        before the call is sent, so no id of the call can be sampled before the label that was read."""
        reading = self.weight_versions.start(url) if self.config.return_token_id_information else None
        try:
            call = await self._prepare(chat, url)
        except BaseException:
            if reading is not None:
                reading.cancel()
            raise
        if reading is not None:
            call.weight_version_before, call.weight_version_read = await reading, True
        return call

    async def _prepare(self, chat: ChatCall, url: str) -> PreparedCall:
        required_prefix = chat.required_prefix
        capture = self.config.return_token_id_information
        needs_ids = capture or required_prefix is not None
        if needs_ids and (chat.n or 1) > 1:
            raise ApiError(400, "n > 1 is not supported with token ids (one bundle per call); send n: 1", param="n")

        caller_body = chat.body
        body = {**caller_body, **self.config.sampling_overrides}  # a new top level; messages and ids shared, not copied
        body["model"] = self.config.model
        if needs_ids:
            body.update(capture_request_fields(body, use_return_token_ids=self.config.use_return_token_ids))
        telemetry: dict[str, Any] | None = None
        confirm = measurement = None
        router = await self.router_at(url)
        if required_prefix is not None and await self.splices_here(url):
            if router is not None:
                raise ApiError(
                    502,
                    f"the adapter's own splice (splice: {self.config.splice}) cannot run behind vllm-router at "
                    f"{url}: it proves its local chat template against the server it calls, and the router decides "
                    "which worker that is. Serve the workers with the hook (`ngt vllm-serve`) and set splice: hook "
                    "(docs/scaling.md)",
                    error_type="adapter_splice_behind_router",
                )
            spliced = await self.splicer.prepare(
                body,
                post=lambda path, payload: self.upstream.post(url, path, payload),
                get=lambda path: self.upstream.get(url, path),
                tokenize_body=tokenize_request(
                    body, exclude_tools_when_tool_choice_none=self.config.exclude_tools_when_tool_choice_none
                ),
                server=url,
                epoch=lambda: self.upstream.epoch(url),
                asked=chat.asked,  # read once, at validation
            )
            body, telemetry, confirm, measurement = (
                spliced.body,
                spliced.telemetry,
                spliced.confirm,
                spliced.measurement,
            )
            if needs_ids:
                body["return_token_ids"] = True  # the prompt ids are the spliced ones, never a /tokenize re-render
        elif router is not None:
            body = crossing_body(body, required_prefix)
        return PreparedCall(body, caller_body, required_prefix, capture, needs_ids, telemetry, confirm, measurement)

    async def finish(self, call: PreparedCall, result: dict[str, Any], url: str) -> dict[str, Any]:
        """vLLM's chat completion `result` as the caller gets it: splice telemetry, bundles resolved and checked, and
        what the adapter asked for only for itself removed."""
        # The second weight version read: the answer is in, so every id of the call was sampled before it.
        after = None
        if call.capture and call.weight_version_read and call.weight_version_before is not None:
            after = asyncio.create_task(self.weight_versions.read(url))
        try:
            return await self._finish(call, result, url, after)
        finally:
            if after is not None and not after.done():
                after.cancel()

    async def _finish(
        self, call: PreparedCall, result: dict[str, Any], url: str, after: asyncio.Task[str | None] | None
    ) -> dict[str, Any]:
        if await self.router_at(url) is not None:
            listed = await self.declared_workers.check(self.upstream.get_small, url)
            model = str(call.body.get("model") or "")
            await self.fleet.check_workers(url, listed, lambda worker: self._worker_fingerprint(worker, model))
        if self.config.uses_reasoning_parser is False:
            refuse_parsed_reasoning(result, url)
        if call.confirm is not None:
            await call.confirm()
        if call.measurement is not None:
            await call.measurement.ready()
        if call.telemetry is not None:
            result["prefix_splice"] = {**call.telemetry, "spliced_by": "adapter"}
        elif isinstance(result.get("prefix_splice"), dict):
            result["prefix_splice"]["spliced_by"] = "hook"
            if call.body.get(NEW_SEGMENT_KEY) and not call.caller_body.get(NEW_SEGMENT_KEY):
                result["prefix_splice"][NEW_SEGMENT_REASON_KEY] = SEGMENT_HISTORY_WITHOUT_IDS  # crossing_body set it
        if call.needs_ids:
            await attach_bundles(
                result,
                generation_body=call.body,
                required_prefix=call.required_prefix,
                return_bundle=call.capture,
                tokenize=lambda tokenize_body: self._tokenize(url, tokenize_body),
                upstream_url=url,
                server=server_label(url, await self.router_at(url), result),
                exclude_tools_when_tool_choice_none=self.config.exclude_tools_when_tool_choice_none,
            )
            self.fleet.check(result)
            drop_unrequested(result, call.caller_body, bundle_returned=call.capture)
            if call.capture:
                defaults, fingerprint = await self._model_files(url)
                attach_provenance(result, call.body, defaults, fingerprint)
                await self.weight_versions.settle(result, url, call.weight_version_before, after)
        return result

    async def _model_files(self, url: str) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
        """The served model's generation defaults and tokenizer fingerprint, read once per server from its directory
        (vllm_model.tokenizer, else the root vLLM's /v1/models names). (None, None) where that is not a directory
        this adapter can read (a hub name, another host): the record then says so instead of failing the call."""
        known = self._provenance.get(url)
        if known is None:
            known = self._provenance[url] = await self._read_model_files(url)
        return known

    async def _read_model_files(self, url: str) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
        try:
            source = await self.splicer.model_source(lambda path: self.upstream.get(url, path))
        except ApiError:
            return None, None
        if not Path(source).is_dir():
            return None, None
        try:
            defaults = await asyncio.to_thread(generation_defaults, source)
        except (OSError, ValueError):
            defaults = None
        try:
            fingerprint = await asyncio.to_thread(model_fingerprint, source)
        except OSError:
            fingerprint = None
        return defaults, fingerprint

    async def _worker_fingerprint(self, worker_url: str, model: str) -> dict[str, str] | None:
        """The fingerprint a worker behind the router serves, asked of it directly with the adapter's key."""
        answer = await self.upstream.post_small(worker_url, PROBE_PATH, probe_body(model), timeout=FINGERPRINT_SECONDS)
        if answer is None or answer[0] != 200:
            raise WorkerUnreachable(f"{worker_url}: {'no answer' if answer is None else f'HTTP {answer[0]}'}")
        try:
            return answered_fingerprint(loads_exact(answer[1]))
        except ValueError:
            raise WorkerUnreachable(f"{worker_url}: an answer that is not JSON") from None

    async def router_at(self, url: str) -> RouterView | None:
        """The vllm-router at `url`, or None for a vLLM; asked once per URL (behind_router.py)."""
        if url not in self._routers:
            self._routers[url] = await detect_router(self.upstream.get_small, url)
        return self._routers[url]

    async def splices_here(self, url: str) -> bool:
        """Whether the adapter splices for `url` (splice: adapter, or auto on a server without the hook)."""
        if self.config.splice != "auto":
            return self.config.splice == "adapter"
        hooked = self._hooked.get(url)
        if hooked is None:
            hooked = self._hooked[url] = await self._has_hook(url)
        return not hooked

    async def _has_hook(self, url: str) -> bool:
        """Ask the server once: the hook answers a /tokenize with an invalid required prefix with a 400 naming it; a
        stock vLLM ignores the unknown field and tokenizes."""
        probe = {"model": self.config.model, "messages": [{"role": "user", "content": "."}], PREFIX_KEY: [-1]}
        response = await self.upstream.post(url, "/tokenize", probe)
        if response.status_code == 200:
            return False
        if response.status_code == 400 and PREFIX_KEY in response.text:
            return True
        raise ApiError(
            502,
            f"splice: auto could not tell whether the vLLM server at {url} has the prefix-splice hook: its "
            f"/tokenize answered HTTP {response.status_code}: {error_message(response)}. Set splice: hook or adapter",
        )

    async def aclose(self) -> None:
        await self.upstream.aclose()
        await super().aclose()

    async def _prompt_ids(self, call: PreparedCall, url: str) -> list[int]:
        """The prompt ids `call` generated from: the token-in ids it sent (the adapter's splice), else /tokenize's."""
        return token_in_prompt(call.body) or await self._tokenize(
            url,
            tokenize_request(
                call.body, exclude_tools_when_tool_choice_none=self.config.exclude_tools_when_tool_choice_none
            ),
        )

    async def _tokenize(self, url: str, body: dict[str, Any]) -> list[int]:
        response = await self.upstream.post(url, "/tokenize", body)
        if response.status_code >= 400:
            raise ApiError(
                502, f"vLLM /tokenize fallback failed with HTTP {response.status_code}: {error_message(response)}"
            )
        return list(answer_json(response, f"vLLM /tokenize at {url}")["tokens"])


SERVER = VLLMModel
