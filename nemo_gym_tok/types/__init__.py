"""Request, message and item models of the token contract."""

from nemo_gym_tok.types.chat import ChatCompletionRequest, ChatMessage
from nemo_gym_tok.types.responses import Response, ResponseItem, ResponsesRequest, ResponseUsage
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, PrefixSplice, TokenBundleMixin, bundle_of

__all__ = [
    "BUNDLE_FIELDS",
    "ChatCompletionRequest",
    "ChatMessage",
    "PrefixSplice",
    "Response",
    "ResponseItem",
    "ResponseUsage",
    "ResponsesRequest",
    "TokenBundleMixin",
    "bundle_of",
]
