"""The prefix splice: exact model ids for the history, the template's ids for what follows, or a 400 that says why.

Pure functions with no vLLM import and one entry point, `splice_prompt`; the splice host (nemo_gym_tok.splice_host),
which the vLLM hook and the adapter share, calls it.
"""

from nemo_gym_tok.splice._fixed_text import FixedTextMatcher
from nemo_gym_tok.splice._ids import (
    PrefixSource,
    check_in_vocabulary,
    check_starts_with,
    check_token_ids,
    find_prefix_source,
    message_field,
)
from nemo_gym_tok.splice._image_runs import (
    CollapsedPrefix,
    ImageMarkers,
    ImageMismatchError,
    ImageRun,
    check_expanded_prefix,
    collapse_image_runs,
    count_image_parts,
)
from nemo_gym_tok.splice._memo import RenderMemo
from nemo_gym_tok.splice._neutral import neutralize, with_own_tool_calls
from nemo_gym_tok.splice._new_turn import SPLICE_STAGES, StageClock, splice_new_turn
from nemo_gym_tok.splice._profile import TERMINATOR_ENV, Header, TemplateProfile, detect_profile
from nemo_gym_tok.splice._refusals import (
    BoundaryNotFoundError,
    InvalidTokenIdsError,
    NoAssistantTurnsError,
    SpliceError,
    StalePrefixError,
    StructureMismatchError,
    UnsupportedTemplateError,
    in_this_package,
    raised_in_this_package,
)
from nemo_gym_tok.splice._render import ChatRenderer, HFChatRenderer, added_token_maps, batch_decoder, text_encoder
from nemo_gym_tok.splice._result import RepairedTurn, SplicedPrompt, SpliceResult
from nemo_gym_tok.splice._splice import splice_prompt
from nemo_gym_tok.splice._structure import Body, Layout
from nemo_gym_tok.splice._tail import match_chunks, matched_layout
from nemo_gym_tok.types.tokens import NEW_SEGMENT_KEY, PREFIX_KEY  # the request fields, named in types/

__all__ = [
    "SPLICE_STAGES",
    "StageClock",
    "NEW_SEGMENT_KEY",
    "PREFIX_KEY",
    "TERMINATOR_ENV",
    "Body",
    "CollapsedPrefix",
    "ImageMarkers",
    "ImageMismatchError",
    "ImageRun",
    "BoundaryNotFoundError",
    "ChatRenderer",
    "FixedTextMatcher",
    "HFChatRenderer",
    "Header",
    "InvalidTokenIdsError",
    "Layout",
    "NoAssistantTurnsError",
    "PrefixSource",
    "RenderMemo",
    "RepairedTurn",
    "SpliceError",
    "SpliceResult",
    "SplicedPrompt",
    "StalePrefixError",
    "StructureMismatchError",
    "TemplateProfile",
    "UnsupportedTemplateError",
    "added_token_maps",
    "batch_decoder",
    "check_expanded_prefix",
    "check_in_vocabulary",
    "collapse_image_runs",
    "count_image_parts",
    "check_starts_with",
    "check_token_ids",
    "detect_profile",
    "find_prefix_source",
    "in_this_package",
    "match_chunks",
    "matched_layout",
    "message_field",
    "neutralize",
    "raised_in_this_package",
    "splice_new_turn",
    "splice_prompt",
    "text_encoder",
    "with_own_tool_calls",
]
