"""The vLLM model adapter's configuration: its fields, and the validators that refuse combinations that cannot work."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nemo_gym_tok.servers.base import BaseServerConfig


class VLLMModelConfig(BaseServerConfig):
    base_url: str | list[str]
    """vLLM server URL(s), with or without `/v1`; each conversation sticks to one."""
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
    server or a failed call, and proven anew after this many seconds (template_proof.py)."""
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields set on every request sent to vLLM, over what the caller sent (e.g. temperature: 1.0)."""
    forwarded_fields: list[str] | None = None
    """Top-level request fields a caller may send, forwarded to vLLM; None forwards every field. A field outside the
    list is a 400 naming it. The fields the adapter itself reads (ADAPTER_FIELDS) are always allowed."""
    max_attempts: int = 3
    """Attempts per vLLM call while vLLM is unreachable or answers 429, 502, 503 or 504 (upstream.RETRYABLE_STATUSES);
    any other 5xx is the request's own error and is not retried."""
    retry_backoff_seconds: float = 0.5
    health_check_interval_seconds: float = Field(default=5.0, gt=0)
    """How often a URL marked unhealthy (unreachable, or 5xx on every attempt) is probed with GET /health."""
    nemo_gym_token_capture_dir: str | None = None
    """NeMo Gym's `token_id_capture.dir`: calls on its training-capture paths are recorded there in its file store's
    layout (nemo_gym_capture.py). Unset, such calls are served with their bundles only."""

    @field_validator("base_url")
    @classmethod
    def _at_least_one_url(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one vLLM base URL")
        return value

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

    @property
    def base_urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
