"""Why a prefix cannot be spliced: one exception per kind of refusal, each a 400 whose message says what to fix."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


class SpliceError(ValueError):
    """The prefix cannot be spliced exactly; the message says why and what to fix."""


class InvalidTokenIdsError(SpliceError):
    """Ids that are not non-negative ints below the vocabulary size, or a malformed bundle."""


class StalePrefixError(SpliceError):
    """The prefix does not belong to these messages."""


class StructureMismatchError(StalePrefixError):
    """Outside the model's own spans, the prefix differs from what the template renders for the messages."""

    def __init__(self, message: str, *, message_index: int | None) -> None:
        super().__init__(message)
        self.message_index = message_index


class BoundaryNotFoundError(SpliceError):
    """The template's rendering has no place where the assistant turn the prefix ends with is closed."""


class UnsupportedTemplateError(SpliceError):
    """The chat template renders turns in a way the splice cannot prove exact (no special-token turn ends, say)."""


class NoAssistantTurnsError(UnsupportedTemplateError):
    """The chat template renders no assistant turn at all (a reranker's or an embedder's fixed prompt)."""


def in_this_package(filename: str) -> bool:
    """Whether `filename` is nemo_gym_tok's own code (not a template's, Jinja's, transformers' or vLLM's)."""
    return Path(filename).resolve().is_relative_to(_PACKAGE_DIR)


def raised_in_this_package(exc: BaseException) -> bool:
    """Whether the frame that raised `exc` is nemo_gym_tok's own code: a bug of ours, never a refusal."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and in_this_package(frame.tb_frame.f_code.co_filename)
