"""The errors that stop `ngt collect` before (or instead of) rollouts; each message says what to fix."""

from __future__ import annotations


class CollectError(RuntimeError):
    """A problem that stops the run before (or instead of) rollouts: the message says what to fix."""


class InputError(CollectError):
    """The input file is missing or holds a line that is not a JSON object."""


class HeadError(CollectError):
    """The head server is unreachable, answers oddly, or does not know the agent."""


class ResumeError(CollectError):
    """The output holds rollouts of another input or another agent: resuming into it would mix them."""
