"""Sticks each conversation to one vLLM URL and spreads new conversations across the URLs."""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict

from fastapi import Request

from nemo_gym_tok.servers.client import SESSION_HEADER

SESSION_COOKIE = "ngt_session"
MAX_REMEMBERED_SESSIONS = 100_000


def session_of(request: Request) -> tuple[str, bool]:
    """The conversation's session id: the `x-session-id` header, else the session cookie, else a new id (True)."""
    explicit = request.headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE)
    return (explicit, False) if explicit else (uuid.uuid4().hex, True)


class SessionRouter:
    """Round-robin for new sessions; a known session always gets the URL it got first (KV-cache reuse)."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one vLLM base URL is needed")
        self.urls = list(urls)
        self._next = itertools.cycle(self.urls)
        self._assigned: OrderedDict[str, str] = OrderedDict()

    def url_for(self, session_id: str) -> str:
        url = self._assigned.get(session_id)
        if url is None:
            url = next(self._next)
            self._assigned[session_id] = url
            if len(self._assigned) > MAX_REMEMBERED_SESSIONS:
                self._assigned.popitem(last=False)
        else:
            self._assigned.move_to_end(session_id)
        return url
