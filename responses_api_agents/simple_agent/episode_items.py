"""The episode's items, kept once, and what the model, the environment and the record each get of them."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.records.rollout_record import PromptPacker
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, TELEMETRY_FIELDS

_TOKEN_FIELDS = frozenset((*BUNDLE_FIELDS, *TELEMETRY_FIELDS))


class EpisodeItems:
    """The episode's items, kept once, and what each party gets of them: the model, the environment, the record.

    Items are stored without their token fields. Each model call's bundle is kept apart, packed as a version 2
    rollout record stores it; only the latest call's bundle is kept whole, because the adapter takes the next
    prompt's prefix from the last bundled item and nothing else reads the earlier ones (resending them made every
    request as large as the whole episode's ids, turn after turn). One exception: a call that starts with a function
    call right after a call that ended on its text (no item between, as when /step continues without a user turn)
    would read as one call to the adapter, so the earlier call keeps its bundle, which closes it (conversion.py).
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        """Every item after the input, without bundle or telemetry fields: what environments get."""
        self._packed: dict[int, dict[str, Any]] = {}
        """Item index -> the token fields it came with, its prompt packed (prefix length + suffix) for the record."""
        self._latest: tuple[int, dict[str, Any]] | None = None
        """The latest bundled item's index and its token fields as the model server returned them."""
        self._separators: dict[int, dict[str, Any]] = {}
        """Earlier bundled items whose bundle is still sent: it is all that tells their call from the next (above)."""
        self._packer = PromptPacker()

    def add_call(self, items: list[dict[str, Any]]) -> None:
        """Append one model call's output items."""
        latest = self._latest
        if (
            items
            and latest is not None
            and latest[0] == len(self.items) - 1
            and _is_type(items[0], "function_call")
            and _is_type(self.items[-1], "message")
        ):
            self._separators[latest[0]] = latest[1]
        for item in items:
            self.add(item)

    def add(self, item: dict[str, Any]) -> None:
        """Append an item of the episode (a model output item, a tool result, a user turn)."""
        token_fields = {k: v for k, v in item.items() if k in _TOKEN_FIELDS} if isinstance(item, dict) else {}
        if token_fields:
            item = {k: v for k, v in item.items() if k not in _TOKEN_FIELDS}
        index = len(self.items)
        self.items.append(item)
        if not token_fields:
            return
        if token_fields.get("prompt_token_ids") is not None:
            self._packed[index] = self._packer.pack(token_fields)
            self._latest = (index, token_fields)
        else:
            self._packed[index] = token_fields  # telemetry without a bundle: recorded as it came

    def for_model(self, send_bundle: bool) -> list[dict[str, Any]]:
        """The history for the next model call: the items, the latest call's bundle back on its item (if sent)."""
        if not send_bundle or self._latest is None:
            return list(self.items)
        history = list(self.items)
        for index, token_fields in [*self._separators.items(), self._latest]:
            history[index] = {**history[index], **token_fields}
        return history

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


def _is_type(item: Any, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type", "message") == kind
