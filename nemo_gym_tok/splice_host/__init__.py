"""The splice host: one server's splice state and the splice of one request, shared by the vLLM hook and the adapter.

The pure algorithm is nemo_gym_tok.splice; a host keeps what a server learns across requests (profiles, renderers
by scope, the render memo) and reads what a request asks. The hook hosts it over vLLM's renderer
(nemo_gym_tok.vllm.chat_rendering), the adapter over a local copy of the served template (LocalTemplate).
"""

from nemo_gym_tok.splice_host.host import (
    MAX_SCOPES,
    ScopedRenderer,
    SpliceHost,
    TemplateRenderer,
    profile_key,
    scope_key,
)
from nemo_gym_tok.splice_host.local_template import LocalTemplate, template_text
from nemo_gym_tok.splice_host.request import (
    SpliceRequest,
    first_turn_telemetry,
    new_segment_telemetry,
    read_splice_request,
    within_vocabulary,
)

__all__ = [
    "MAX_SCOPES",
    "LocalTemplate",
    "ScopedRenderer",
    "SpliceHost",
    "SpliceRequest",
    "TemplateRenderer",
    "first_turn_telemetry",
    "new_segment_telemetry",
    "profile_key",
    "read_splice_request",
    "scope_key",
    "template_text",
    "within_vocabulary",
]
