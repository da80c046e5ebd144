"""A conversation's Responses items as a model server is sent them: token fields apart, the latest bundle back."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, TELEMETRY_FIELDS

TOKEN_FIELDS = frozenset((*BUNDLE_FIELDS, *TELEMETRY_FIELDS))


class ModelHistory:
    """The items of a conversation, each stored without its token fields, and which bundles go back to the model.

    Only the latest call's bundle is sent back: the prefix of the next prompt is read from the last bundled item, and
    nothing reads the earlier ones (resending them makes every request as large as all the calls' ids together). One
    exception: a call that opens with a function call right after a call that ended on its text (no item between)
    would read as one call once converted to chat, so the earlier call keeps its bundle, which closes it
    (conversion.py). Used by the simple agent for its episodes and by the adapter for `previous_response_id`.
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        """Every item, without bundle or telemetry fields."""
        self.latest: tuple[int, dict[str, Any]] | None = None
        """The latest bundled item's index and its token fields as the model server returned them."""
        self.separators: dict[int, dict[str, Any]] = {}
        """Earlier bundled items whose bundle is still sent: it is all that tells their call from the next."""

    def copy(self) -> ModelHistory:
        """An independent history with the same items (the item dicts shared: they are never changed in place)."""
        twin = ModelHistory()
        twin.items = list(self.items)
        twin.latest = self.latest
        twin.separators = dict(self.separators)
        return twin

    def add_call(self, items: list[Any]) -> None:
        """Append one model call's output items."""
        for item in items:
            self.add(item)

    def add(self, item: Any) -> dict[str, Any]:
        """Append an item (a model output item, a tool result, a user turn); the token fields it came with, which
        become the latest bundle when they hold a prompt. A bundle sits on its call's last item, so a function call
        right after the latest bundled item, a message, opens a new call with nothing between (the exception above)."""
        latest = self.latest
        if (
            latest is not None
            and latest[0] == len(self.items) - 1
            and item_type(item) == "function_call"
            and item_type(self.items[-1]) == "message"
        ):
            self.separators[latest[0]] = latest[1]
        token_fields = {k: v for k, v in item.items() if k in TOKEN_FIELDS} if isinstance(item, dict) else {}
        if token_fields:
            item = {k: v for k, v in item.items() if k not in TOKEN_FIELDS}
        self.items.append(item)
        if token_fields.get("prompt_token_ids") is not None:
            self.latest = (len(self.items) - 1, token_fields)
        return token_fields

    def for_model(self) -> list[dict[str, Any]]:
        """The items for the next model call: the latest call's bundle (and any separator's) back on its item."""
        history = list(self.items)
        if self.latest is None:
            return history
        for index, token_fields in [*self.separators.items(), self.latest]:
            history[index] = {**history[index], **token_fields}
        return history

    def bundled_ids(self) -> int:
        """How many ids the bundles sent back hold: what keeping this history costs, beyond its text."""
        return sum(
            len(fields.get("prompt_token_ids") or ()) + len(fields.get("generation_token_ids") or ())
            for fields in [*self.separators.values(), *([self.latest[1]] if self.latest else [])]
        )


def item_type(item: Any) -> str | None:
    """A Responses item's type (a bare `role` item is a message); None for what is not an item."""
    return item.get("type", "message") if isinstance(item, dict) else None
