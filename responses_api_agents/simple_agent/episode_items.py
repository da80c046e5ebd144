"""The episode's items, kept once, and what the model, the environment and the record each get of them."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.contract.model_history import ModelHistory
from nemo_gym_tok.records.rollout_record import PromptPacker


class EpisodeItems:
    """The episode's items, kept once, and what each party gets of them: the model, the environment, the record.

    What the model is sent follows `ModelHistory` (only the latest call's bundle goes back); the record keeps every
    call's bundle, packed as a version 2 rollout record stores it.
    """

    def __init__(self) -> None:
        self.history = ModelHistory()
        """The items and the bundles the model is sent back."""
        self._packed: dict[int, dict[str, Any]] = {}
        """Item index -> the token fields it came with, its prompt packed (prefix length + suffix) for the record."""
        self._packer = PromptPacker()

    @property
    def items(self) -> list[dict[str, Any]]:
        """Every item after the input, without bundle or telemetry fields: what environments get."""
        return self.history.items

    def add_call(self, items: list[dict[str, Any]]) -> None:
        """Append one model call's output items."""
        for item in items:
            self.add(item)

    def add(self, item: dict[str, Any]) -> None:
        """Append an item of the episode (a model output item, a tool result, a user turn)."""
        fields = self.history.add(item)
        if not fields:
            return
        index = len(self.history.items) - 1
        latest = self.history.latest
        bundled = latest is not None and latest[0] == index
        # A bundle is packed for the record; telemetry without one is recorded as it came.
        self._packed[index] = self._packer.pack(fields) if bundled else fields

    def for_model(self, send_bundle: bool) -> list[dict[str, Any]]:
        """The history for the next model call: the items, the latest call's bundle back on its item (if sent)."""
        return self.history.for_model() if send_bundle else list(self.history.items)

    def recorded(self) -> list[dict[str, Any]]:
        """The items as the rollout record (schema_version 2) holds them: each call's packed bundle on its item."""
        return [{**item, **self._packed[i]} if i in self._packed else item for i, item in enumerate(self.items)]


def function_call_output(call: dict[str, Any], output: str | list[dict[str, Any]]) -> dict[str, Any]:
    """The item that answers the model's function call `call` with `output`: text, or content parts."""
    return {"type": "function_call_output", "call_id": call.get("call_id"), "output": output}


CONTENT_PART_TYPES = frozenset({"input_text", "input_image"})


def content_parts(result: Any) -> list[dict[str, Any]] | None:
    """`result` when a tool answered Responses content parts with an image among them (a picture for a vision
    model: sent on as parts, not as JSON text); None for any other value."""
    if not isinstance(result, list) or not result:
        return None
    if not all(isinstance(part, dict) and part.get("type") in CONTENT_PART_TYPES for part in result):
        return None
    return result if any(part["type"] == "input_image" for part in result) else None
