"""What a splice returns: the prompt first, then its verification and the measurement of the turn it adds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RepairedTurn:
    """An assistant turn whose model ids the template's rendering got wrong."""

    message_index: int
    replaced_tokens: int
    """Template ids from the first difference to the end of the turn's body: what the model's ids replaced."""


@dataclass(frozen=True)
class SpliceResult:
    prompt_token_ids: list[int]
    kept_prefix_length: int
    """How many of the prefix's ids open the prompt (all, or all but an end token the template's closing replaces)."""
    template_differed: bool
    """The template's ids for the prefix's own assistant turn (messages[a]) were not the model's ids. Earlier turns
    were reported by the calls that added them (each turn is new on exactly one call)."""
    replaced_tokens: int
    """Template ids of that turn from the first difference to its end: what the model's ids replaced."""
    end_token_replaced: bool
    """The model's final end token became the template's closing (GPT-OSS <|return|> -> <|end|>, say)."""
    repaired_turns: tuple[RepairedTurn, ...] | None
    """The prefix's own turn when it was repaired (empty when it was not); None where the template's text for the
    turn was not known (no template text given, or it could not be aligned)."""
    checked_by_text: bool = False
    """The structural check was proven by the template's text (the fast walk, _fixed_text); False where the exact
    id-by-id walk, which tokenizes the history's fixed text, had to decide."""

    def telemetry(self) -> dict[str, Any]:
        telemetry: dict[str, Any] = {
            "applied": True,
            "template_differed": self.template_differed,
            "replaced_tokens": self.replaced_tokens,
        }
        if self.repaired_turns is not None:
            telemetry["repaired_turns"] = [
                {"message_index": turn.message_index, "replaced_tokens": turn.replaced_tokens}
                for turn in self.repaired_turns
            ]
        if self.end_token_replaced:
            telemetry["end_token_replaced"] = True
        return telemetry


class SplicedPrompt:
    """A splice's prompt, before the rest of its work: what a server needs to hand the engine, first.

    Two parts of a splice do not change the prompt, and a server can run them while the engine generates: measuring
    the turn the call adds against the template (SpliceResult's telemetry; it tokenizes that turn's text) and, on the
    fast path, confirming the tail against the template's rendering of the neutral messages (`verify`). A server
    must call `verify()` (or `result()`) before it releases anything generated from the prompt: it raises the
    SpliceError that makes the answer a refusal instead. Both are safe to run in a worker thread, once.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        kept_prefix_length: int,
        end_token_replaced: bool,
        checked_by_text: bool,
        verify: Callable[[], None],
        measure_turn: Callable[[], tuple[bool, int, tuple[RepairedTurn, ...] | None]],
        *,
        new_turn: bool = False,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.new_turn = new_turn
        """Spliced at the cost of the new messages (the short conversation; see splice._new_turn)."""
        self.kept_prefix_length = kept_prefix_length
        self.end_token_replaced = end_token_replaced
        self.checked_by_text = checked_by_text
        self._verify: Callable[[], None] | None = verify
        self._measure_turn = measure_turn

    def verify(self) -> None:
        """Finish the proof that the prompt is exact; raises a SpliceError where it is not."""
        if self._verify is not None:
            self._verify()
            self._verify = None

    def result(self) -> SpliceResult:
        """The complete splice: the prompt, verified, and the measurement of the turn it adds."""
        self.verify()
        differed, replaced, repaired = self._measure_turn()
        return SpliceResult(
            prompt_token_ids=self.prompt_token_ids,
            kept_prefix_length=self.kept_prefix_length,
            template_differed=differed,
            replaced_tokens=replaced,
            end_token_replaced=self.end_token_replaced,
            repaired_turns=repaired,
            checked_by_text=self.checked_by_text,
        )
