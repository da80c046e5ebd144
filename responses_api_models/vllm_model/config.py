"""The vLLM model adapter's configuration: its fields, and the validators that refuse combinations that cannot work."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nemo_gym_tok.servers.base import BaseServerConfig

MULTI_URL_REFUSAL = (
    "base_url lists {count} vLLM servers: the adapter does not route between replicas itself; vLLM's own router does. "
    "Put them under `router: {{worker_urls: [...]}}` on this adapter (`ngt run` starts vllm-router in front of them, "
    "each conversation kept on one replica by consistent hashing of its session), or point base_url at a "
    "vllm-router that already runs (docs/scaling.md)"
)


class VLLMModelConfig(BaseServerConfig):
    base_url: str | None = None
    """The vLLM server's URL, with or without `/v1`, or a vllm-router's in front of several (detected by its
    `/list_workers`): every call then carries its conversation's `x-session-id`, which the router keeps on one
    replica. A list of URLs is refused with how to route them (MULTI_URL_REFUSAL)."""
    router: dict[str, Any] | None = None
    """vllm-router to start in front of several vLLM servers: `worker_urls` (required), `policy` (default
    consistent_hash), `host`, `port` (0: a free one) and the tuning values of nemo_gym_tok.router.RouterSpec. `ngt run`
    starts it before this adapter, points base_url at it, and stops it with the gym."""
    model: str
    """The model name vLLM serves (its --served-model-name)."""
    api_key: str = "EMPTY"
    return_token_id_information: bool = False
    """Put prompt_token_ids, generation_token_ids and generation_log_probs on every returned message."""
    use_return_token_ids: bool = True
    """Ask vLLM for `return_token_ids`; false uses the `/tokenize` fallback for prompt ids."""
    exclude_tools_when_tool_choice_none: bool = False
    """Mirror of the vLLM server's flag of that name: the /tokenize fallback then leaves tools out likewise."""
    harmony: bool = False
    """The served model is GPT-OSS: vLLM renders its chat prompts with Harmony, while /tokenize renders the Hugging Face
    template, so /tokenize is no source of its prompt ids (use_return_token_ids must stay true)."""
    splice: Literal["hook", "adapter", "auto"] = "auto"
    """Who splices the exact previous ids into the prompt: `hook` (vLLM served with `ngt vllm-serve`), `adapter`
    (this adapter, against any vLLM 0.30+: the splice with a local copy of the template, then a token-in chat call)
    or `auto` (the hook where the server has it, detected once per URL, else the adapter)."""
    tokenizer: str | None = None
    """Adapter-side splice: where to load the served tokenizer and chat template (directory or hub name); unset, the
    model path the server reports on /v1/models."""
    chat_template: str | None = None
    """Adapter-side splice: the server's --chat-template (file or text), when it overrides the tokenizer's."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """Adapter-side splice: the server's --chat-template-content-format."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Adapter-side splice: the server's --default-chat-template-kwargs."""
    template_proof_max_age_seconds: float = Field(default=300.0, gt=0)
    """Adapter-side splice: the local template is proven to render as the server does (its /tokenize ids) on the
    first spliced request of each template scope per server, renewed by a short probe after a new connection to that
    server or a failed call, and proven anew after this many seconds (template_proofs.py)."""
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields set on every request sent to vLLM, over what the caller sent (e.g. temperature: 1.0)."""
    forwarded_fields: list[str] | None = None
    """Top-level request fields a caller may send, forwarded to vLLM; None forwards every field. A field outside the
    list is a 400 naming it. The fields the adapter itself reads (ADAPTER_FIELDS) are always allowed."""
    response_store_max_ids: int = Field(default=4_000_000, ge=0)
    """`/v1/responses` keeps each answer's history for a later call's `previous_response_id` (the caller then sends
    only its new items), bounded by the ids of the bundles held (one prompt per conversation, about 36 bytes an id in
    memory); the least recently continued are dropped first. 0 keeps none (response_chain.py)."""
    max_attempts: int = 3
    """Attempts per vLLM call while the request reaches no engine (unreachable, 429, vLLM's 503). One that may have
    generated the turn (the connection dropped mid-call, a router's or proxy's 502/500) is sent again once, a timeout
    or vLLM's own 5xx never (retry_policy.py)."""
    retry_backoff_seconds: float = 0.5
    request_prompt_and_generation_token_ids: bool | None = None
    """NeMo Gym's key (its vllm_model_for_training.yaml writes `false`, its default): whether its adapter asks vLLM for
    `return_token_ids` or takes prompt ids from `/tokenize`. Accepted so its files start this adapter; which way this
    adapter takes the ids is `use_return_token_ids` (vLLM's own ids wherever the server gives them, which every vLLM it
    supports does), and either way each turn's ids are checked against the history's."""
    uses_reasoning_parser: bool | None = None
    """NeMo Gym's key (its training configs set it): whether the vLLM server runs a reasoning parser. False: it runs
    none, so an answer that carries reasoning apart from its content means the server is not the one the config
    describes, and is refused (502 `reasoning_parser_mismatch`), as NeMo Gym's adapter refuses it. True: reasoning
    comes back apart from the content, as `reasoning_content` (Chat Completions) and reasoning items (Responses), which
    is how this adapter always returns it. Unset: no assumption."""
    nemo_gym_token_capture_dir: str | None = None
    """NeMo Gym's `token_id_capture.dir`: calls on its training-capture paths are recorded there in its file store's
    layout (nemo_gym_token_store.py). Unset, such calls are served with their bundles only."""

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_url(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) == 1:
                return value[0]
            raise ValueError(MULTI_URL_REFUSAL.format(count=len(value)) if value else "give the vLLM server's URL")
        return value

    @model_validator(mode="after")
    def _somewhere_to_call(self) -> VLLMModelConfig:
        if self.base_url is None:
            raise ValueError(
                "router: {worker_urls: [...]} is started by `ngt run`, which then points base_url at it; started "
                "another way, set base_url to the vLLM server or to a running vllm-router"
                if self.router is not None
                else "set base_url to the vLLM server's URL (or to a vllm-router in front of several)"
            )
        return self

    @model_validator(mode="after")
    def _tokenize_cannot_render_harmony(self) -> VLLMModelConfig:
        if self.harmony and not self.use_return_token_ids:
            raise ValueError(
                "harmony: true with use_return_token_ids: false would take GPT-OSS prompt ids from /tokenize, which "
                "renders the Hugging Face template, not Harmony; set use_return_token_ids: true"
            )
        return self

    @model_validator(mode="after")
    def _capture_needs_bundles(self) -> VLLMModelConfig:
        if self.nemo_gym_token_capture_dir and not self.return_token_id_information:
            raise ValueError(
                "nemo_gym_token_capture_dir records the token bundle of each answer: set "
                "return_token_id_information: true"
            )
        return self
