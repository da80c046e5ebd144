"""The prefix splice done in the adapter, for a vLLM server without the plugin: token-in chat completions.

Stock vLLM (0.30 and later) takes a chat request's prompt as ids (`kv_transfer_params.prompt_token_ids`: templating
and tokenization are skipped, tool-choice validation and tool/reasoning parsing still run) and reports the ids it
used (`return_token_ids`). So the adapter can do what the hook does inside vLLM: take the template's ids for the
request from the server's `/tokenize`, run the same pure splice and structural check (nemo_gym_tok.splice) with a
local copy of the served tokenizer and chat template, and send the spliced ids. The local copy is proven to be the
server's on every request: its ids for the whole prompt must equal `/tokenize`'s, or the request is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.contract.token_sources import first_difference
from nemo_gym_tok.servers.errors import ApiError
from nemo_gym_tok.splice import (
    BUNDLE_KEYS,
    NEW_SEGMENT_KEY,
    PREFIX_KEY,
    HFChatRenderer,
    PrefixSource,
    SpliceError,
    TemplateProfile,
    check_starts_with,
    detect_profile,
    find_prefix_source,
    splice_prefix,
)
from responses_api_models.vllm_model.developer_role import as_server_renders
from responses_api_models.vllm_model.hub_access import hub_unreachable, offline_advice
from responses_api_models.vllm_model.upstream import answer_json

TOKEN_FIELDS = (*BUNDLE_KEYS, "generation_log_probs")
"""Fields the adapter reads and a stock vLLM must not be relied on to ignore: stripped before the token-in call."""
NEW_SEGMENT_TELEMETRY = {"applied": False, "template_differed": False, "replaced_tokens": 0, "new_segment": True}
HARMONY_REFUSAL = (
    "the adapter cannot splice a prefix for a Harmony (GPT-OSS) model: vLLM renders its prompts with openai_harmony, "
    "which /tokenize does not expose; serve it with `ngt vllm-serve` (the hook splices inside vLLM) and set "
    "splice: hook or auto"
)

Post = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""POST `path` with a JSON body to the vLLM URL the conversation is on; returns the httpx response."""


@dataclass
class SplicedCall:
    """The chat body to send to vLLM and the splice telemetry to report (None when nothing was spliced)."""

    body: dict[str, Any]
    telemetry: dict[str, Any] | None


class LocalTemplate:
    """The served model's tokenizer and chat template in the adapter process, with template profiles detected once."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None,
        content_format: str,
        end_token_ids: Sequence[int],
        default_template_kwargs: Mapping[str, Any],
        terminator_override: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.content_format = content_format
        self.end_token_ids = tuple(end_token_ids)
        self.default_template_kwargs = dict(default_template_kwargs)
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        """The model's vocabulary (its embedding rows, which may outnumber the tokenizer's tokens: a model can
        generate the extra ids, and vLLM accepts them), as the hook checks ids against it."""
        self._terminator_override = terminator_override
        self._profiles: dict[tuple[str | None, str], TemplateProfile] = {}

    @classmethod
    def load(
        cls,
        source: str,
        *,
        chat_template: str | None,
        content_format: str,
        default_template_kwargs: Mapping[str, Any],
        terminator_override: str | None = None,
        local_files_only: bool = False,
    ) -> LocalTemplate:
        """Load the tokenizer (directory or hub name; `local_files_only`: from the hub cache, without asking the hub)
        and the generation config's end ids; blocking."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
        try:
            model_config = AutoConfig.from_pretrained(source, local_files_only=local_files_only)
            vocab_size = getattr(model_config.get_text_config(), "vocab_size", None)
        except (OSError, ValueError):  # a tokenizer-only directory: its own size is all there is to check against
            vocab_size = None
        try:
            configured = GenerationConfig.from_pretrained(source, local_files_only=local_files_only).eos_token_id
        except (OSError, ValueError):  # no generation config: the tokenizer's eos is the only end id
            configured = None
        ends = [
            value for value in (configured if isinstance(configured, list) else [configured]) if isinstance(value, int)
        ]
        return cls(
            tokenizer,
            chat_template=_template_text(chat_template),
            content_format=content_format,
            end_token_ids=ends,
            default_template_kwargs=default_template_kwargs,
            terminator_override=terminator_override,
            vocab_size=vocab_size if isinstance(vocab_size, int) else None,
        )

    def renderer(
        self, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any], chat_template: str | None
    ) -> HFChatRenderer:
        return HFChatRenderer(
            self.tokenizer,
            tools=tools,
            template_kwargs={**self.default_template_kwargs, **template_kwargs},
            chat_template=chat_template or self.chat_template,
            extra_end_token_ids=self.end_token_ids,
            content_format=self.content_format,
        )

    def profile(self, template_kwargs: Mapping[str, Any], chat_template: str | None) -> TemplateProfile:
        """The turn structure for one template and template-argument combination (detected without tools)."""
        key = (chat_template, json.dumps(template_kwargs, sort_keys=True, default=str))
        profile = self._profiles.get(key)
        if profile is None:
            if len(self._profiles) >= 256:  # callers choose template arguments freely; keep the cache bounded
                self._profiles.clear()
            profile = self._profiles[key] = detect_profile(
                self.renderer(None, template_kwargs, chat_template), terminator_override=self._terminator_override
            )
        return profile


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
    _templates: dict[str, LocalTemplate] = field(default_factory=dict)
    _served_root: str | None = None
    """The model path the server reported, asked once (not on every spliced turn); replicas serve the same model,
    and each request's /tokenize ids prove the loaded copy renders as that replica does."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def prepare(
        self, body: dict[str, Any], *, post: Post, get: Callable[[str], Awaitable[Any]], tokenize_body: dict[str, Any]
    ) -> SplicedCall:
        """The token-in chat body for `body` (a chat request as vLLM would get it) and its telemetry.

        `tokenize_body` is the /tokenize request that renders the same prompt. Raises ApiError: 400 for a prefix
        that cannot be proven exact (as the hook answers), 502 when the local template is not the server's.
        """
        messages = body.get("messages") or []
        template = await self._template(get)
        try:
            source = find_prefix_source(messages, body.get(PREFIX_KEY), template.vocab_size)
            new_segment = _new_segment_requested(body)
        except SpliceError as exc:
            raise ApiError(400, str(exc), param=PREFIX_KEY) from None
        sent = strip_token_fields(body)
        if source is None:
            return SplicedCall(sent, None)
        if new_segment:
            return SplicedCall(sent, dict(NEW_SEGMENT_TELEMETRY))
        if self.harmony:
            raise ApiError(400, HARMONY_REFUSAL, param=PREFIX_KEY)
        kv_params = sent.get("kv_transfer_params")
        if isinstance(kv_params, dict) and "prompt_token_ids" in kv_params:
            raise ApiError(
                400,
                "kv_transfer_params.prompt_token_ids cannot be combined with a token prefix: the adapter sends "
                "the spliced prompt there; drop one of them",
                param="kv_transfer_params",
            )
        template_ids = await _server_template_ids(post, strip_token_fields(tokenize_body))
        prompt_ids, telemetry = await asyncio.to_thread(
            _splice,
            template,
            source,
            sent["messages"],
            body,
            tokenize_body,
            template_ids,
        )
        sent["kv_transfer_params"] = {
            **(kv_params if isinstance(kv_params, dict) else {}),
            "prompt_token_ids": prompt_ids,
        }
        return SplicedCall(sent, telemetry)

    async def _template(self, get: Callable[[str], Awaitable[Any]]) -> LocalTemplate:
        source = self.tokenizer or self._served_root
        if source is None:
            source = self._served_root = await _served_model_root(get)
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


def _splice(
    template: LocalTemplate,
    source: PrefixSource,
    messages: list[dict[str, Any]],
    body: Mapping[str, Any],
    tokenize_body: Mapping[str, Any],
    template_ids: list[int],
) -> tuple[list[int], dict[str, Any]]:
    """The spliced prompt ids and the splice telemetry; the CPU-bound part, run off the event loop."""
    template_kwargs = dict(tokenize_body.get("chat_template_kwargs") or {})
    request_template = tokenize_body.get("chat_template")
    renderer = template.renderer(vllm_tool_dicts(tokenize_body.get("tools")), template_kwargs, request_template)
    messages = as_server_renders(messages, renderer.chat_template or getattr(renderer.tokenizer, "chat_template", None))
    add_generation_prompt = bool(body.get("add_generation_prompt", True))
    continue_final_message = bool(body.get("continue_final_message", False))
    try:
        if source.message_index < 0:
            check_starts_with(template_ids, source.prefix, renderer.decode)
            return template_ids, {"applied": False, "template_differed": False, "replaced_tokens": 0}
        text = renderer.render(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
        )
    except SpliceError as exc:
        raise ApiError(400, str(exc), param=PREFIX_KEY) from None
    except Exception as exc:  # noqa: BLE001 - the server rendered it, so a local failure means another template
        raise _not_the_servers_template(f"the local chat template failed on this request ({exc})") from None
    local_ids = renderer.encode(text)
    if local_ids != template_ids:
        at = first_difference(local_ids, template_ids) or 0
        raise _not_the_servers_template(
            f"for this request the server's /tokenize gives {len(template_ids)} ids and the local copy "
            f"{len(local_ids)}, "
            f"first different at id {at}: server {renderer.decode(template_ids[at : at + 12])!r}, "
            f"local {renderer.decode(local_ids[at : at + 12])!r}"
        )
    truncate = body.get("truncate_prompt_tokens")
    try:
        result = splice_prefix(
            renderer,
            template.profile(template_kwargs, request_template),
            messages,
            source,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            truncate_prompt_tokens=truncate if isinstance(truncate, int) and truncate >= 0 else None,
            template_text=text,
        )
    except SpliceError as exc:
        raise ApiError(400, str(exc), param=PREFIX_KEY) from None
    return result.prompt_token_ids, result.telemetry()


def _not_the_servers_template(detail: str) -> ApiError:
    return ApiError(
        502,
        f"the adapter's copy of the chat template and tokenizer does not render prompts as the vLLM server does: "
        f"{detail}. The splice would not be exact, so the request was not sent. Point vllm_model.tokenizer, "
        "chat_template and chat_template_kwargs at what the server serves, or serve it with `ngt vllm-serve` "
        "(splice: hook)",
        error_type="adapter_template_mismatch",
    )


async def _server_template_ids(post: Post, tokenize_body: dict[str, Any]) -> list[int]:
    response = await post("/tokenize", tokenize_body)
    if response.status_code >= 400:
        # `post` raises for every 5xx itself; a 4xx is the server refusing the prompt (a bad message, an unknown tool
        # choice): the caller's to fix.
        raise ApiError(response.status_code, error_message(response), error_type="upstream_invalid_request")
    return [int(token) for token in answer_json(response, "vLLM /tokenize")["tokens"]]


async def _served_model_root(get: Callable[[str], Awaitable[Any]]) -> str:
    response = await get("/v1/models")
    try:
        models = response.json()["data"]
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
            {key: value for key, value in message.items() if key not in TOKEN_FIELDS}
            if isinstance(message, dict)
            else message
            for message in body["messages"]
        ]
    return stripped


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


def _new_segment_requested(body: Mapping[str, Any]) -> bool:
    value = body.get(NEW_SEGMENT_KEY)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpliceError(f"{NEW_SEGMENT_KEY} must be true or false, got {value!r}")
    return value


def _template_text(chat_template: str | None) -> str | None:
    """A chat template given as a file path or as the template itself."""
    if chat_template and "\n" not in chat_template and "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text()
    return chat_template
