"""`previous_response_id`: the adapter keeps each answered history, so a caller sends only what is new."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.contract.model_history import TOKEN_FIELDS, ModelHistory
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.responses import ASSISTANT_ITEM_TYPES, PREVIOUS_KEY, PREVIOUS_NOT_FOUND


@dataclass(frozen=True)
class KeptResponse:
    """One answered call's whole history (its input and output) and the instructions it ran under."""

    history: ModelHistory
    instructions: str | None
    ids: int
    """Ids its bundles hold: what the store's bound counts."""
    chat: list[dict[str, Any]] | None
    """The history as chat messages, already validated (chat_form.kept_chat_messages); None: not known."""


@dataclass
class ChainedCall:
    """A Responses body whose `input` is the whole history, and that history, to keep once the call is answered."""

    body: dict[str, Any]
    history: ModelHistory
    previous: str | None
    """The `previous_response_id` the call continued, echoed on its response."""
    store: bool
    """Keep the response (the request's `store`, true unless it says false, as OpenAI's default is)."""
    new_items: list[Any]
    """The items the request sent (on a continued call, the new ones only)."""
    sent_as_kept: bool = False
    """The input holds the history's bundles as ModelHistory puts them back and ends on new items that are not the
    model's: the answered history's chat messages can be made from this call's (chat_form.kept_chat_messages)."""
    kept_chat: list[dict[str, Any]] | None = None
    """The kept response's chat messages, when this call may take them instead of converting the history."""


class ResponseChain:
    """The responses the adapter holds for `previous_response_id`, least recently used dropped past `max_ids`.

    Only the bundles a next call needs are held (ModelHistory: the latest one, for the prefix), so a conversation
    costs its text plus one prompt's ids, and a call that continues one sends its new items only: its body no longer
    grows with the history. A response is continued once: the answer that continues it holds its history, and it is
    dropped, so a conversation holds one response however long it runs; a caller done with it deletes that one
    (DELETE /v1/responses/{id}). A response the adapter no longer holds (continued already, deleted, dropped past
    the bound, answered before a restart, never kept) is a 400 of type `previous_response_not_found`, never a call
    on a shorter history.
    """

    def __init__(self, max_ids: int) -> None:
        self.max_ids = max_ids
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()
        self._ids = 0
        self.calls_on_kept_chat = 0
        """Continued calls that took the kept chat messages instead of converting their history (a bench and test
        reading)."""

    def __len__(self) -> int:
        return len(self._kept)

    def expand(self, raw: dict[str, Any]) -> ChainedCall:
        """`raw` with its input made the whole history: the kept response's items, then the new ones."""
        previous = raw.get(PREVIOUS_KEY)
        store = raw.get("store", True)
        if not isinstance(store, bool):
            raise ApiError(400, "store: true or false is expected", param="store")
        if previous is None:
            history = ModelHistory()
            items = _input_items(raw.get("input"), continued=False) if store and self.max_ids > 0 else []
            for item in items:
                history.add(item)
            body = {k: v for k, v in raw.items() if k != PREVIOUS_KEY}
            plain = bool(items) and not any(_has_token_fields(item) for item in items) and _is_new(items[-1])
            return ChainedCall(body, history, None, store, items, sent_as_kept=plain)
        if not isinstance(previous, str) or not previous:
            raise ApiError(400, f"{PREVIOUS_KEY}: a response id (a string) is expected", param=PREVIOUS_KEY)
        kept = self._kept.get(previous)
        if kept is None:
            raise ApiError(400, self._not_found(previous), param=PREVIOUS_KEY, error_type=PREVIOUS_NOT_FOUND)
        self._kept.move_to_end(previous)
        instructions = raw.get("instructions")
        if instructions is not None and instructions != kept.instructions:
            raise ApiError(
                400,
                f"instructions: they differ from those of {previous}, whose history this call continues: changed "
                "instructions change the prompt the kept ids cover. Omit them (the previous ones are kept), or send "
                "the whole input without previous_response_id",
                param="instructions",
            )
        new_items = _input_items(raw.get("input"), continued=True)
        history = kept.history.copy()
        for item in new_items:
            history.add(item)
        body = {k: v for k, v in raw.items() if k != PREVIOUS_KEY}
        body["input"] = history.for_model()
        if kept.instructions is not None:
            body["instructions"] = kept.instructions
        # New items that are all the caller's (tool results, user turns) follow the kept answer, which its bundle
        # closed: converting the whole history would give the kept messages again, then theirs.
        as_kept = bool(new_items) and all(_is_new(item) and not _has_token_fields(item) for item in new_items)
        kept_chat = kept.chat if as_kept else None
        self.calls_on_kept_chat += kept_chat is not None
        return ChainedCall(body, history, previous, store, new_items, sent_as_kept=as_kept, kept_chat=kept_chat)

    def answered(
        self, response: dict[str, Any], call: ChainedCall, chat: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """`response` with `previous_response_id` and `store` echoed as OpenAI's Response states them, kept for a
        later call if the request let it be (`store` says whether it was), with `chat`, its history's chat messages
        where they are known."""
        response[PREVIOUS_KEY] = call.previous
        response["store"] = call.store and self._keep(response, call, chat)
        return response

    def _keep(self, response: dict[str, Any], call: ChainedCall, chat: list[dict[str, Any]] | None) -> bool:
        """Hold `response` (its output after `call`'s history); whether it is held (not when the store is off or one
        conversation alone is over the bound)."""
        response_id = response.get("id")
        if self.max_ids <= 0 or not isinstance(response_id, str):
            return False
        history = call.history.copy()
        history.add_call(list(response.get("output") or []))
        kept = KeptResponse(history, call.body.get("instructions"), history.bundled_ids(), chat)
        if kept.ids > self.max_ids:
            return False
        self.forget(response_id)
        if call.previous is not None:  # continued once: its history lives on in this answer
            self.forget(call.previous)
        self._kept[response_id] = kept
        self._ids += kept.ids
        while self._ids > self.max_ids:
            _, dropped = self._kept.popitem(last=False)
            self._ids -= dropped.ids
        return True

    def forget(self, response_id: str) -> bool:
        """Drop a kept response (DELETE /v1/responses/{id}: a caller done with its conversation); whether it was
        held."""
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return False
        self._ids -= kept.ids
        return True

    def _not_found(self, previous: str) -> str:
        if self.max_ids <= 0:
            return (
                f"{PREVIOUS_KEY}: this adapter keeps no responses (response_store_max_ids: 0); send the whole input "
                f"without {PREVIOUS_KEY}"
            )
        return (
            f"{PREVIOUS_KEY}: {previous!r} is not held by this adapter (continued already: a response is continued "
            "once; deleted; never answered here or answered with store: false; dropped to stay within "
            f"response_store_max_ids: {self.max_ids} ids; or answered before a restart); send the whole input "
            f"without {PREVIOUS_KEY}"
        )


def _is_new(item: Any) -> bool:
    """An item that is not the model's (a user, system or developer message, a tool result)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type", "message")
    return kind not in ASSISTANT_ITEM_TYPES and not (kind == "message" and item.get("role") == "assistant")


def _has_token_fields(item: Any) -> bool:
    return isinstance(item, dict) and any(key in item for key in TOKEN_FIELDS)


def _input_items(value: Any, *, continued: bool) -> list[Any]:
    """The request's `input` as items (text is one user message). Any other value is left to validation, but not
    when the call continues a kept one: the input it would have replaced is refused here."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    if continued:
        raise ApiError(400, "input: text or a list of items is expected (the new ones only)", param="input")
    return []
