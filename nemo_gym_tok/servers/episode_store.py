"""Per-episode state of an environment, keyed by the x-session-id the agent sends."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from nemo_gym_tok.servers.api_errors import ApiError

State = TypeVar("State")


class EpisodeStore(Generic[State]):
    """`start` at seed_session, `get` in tools and step, `end` in verify (which frees it). Episodes that are never
    verified (an agent that crashed) are evicted oldest first past `max_episodes`, so memory stays bounded.
    An unknown session is the caller's mistake: HTTP 400."""

    def __init__(self, max_episodes: int = 100_000) -> None:
        self._states: OrderedDict[str, State] = OrderedDict()
        self.max_episodes = max_episodes

    def start(self, session_id: str, state: State) -> State:
        self._states.pop(session_id, None)  # seeding again restarts the episode, so a retried seed is harmless
        self._states[session_id] = state
        while len(self._states) > self.max_episodes:
            self._states.popitem(last=False)
        return state

    def get(self, session_id: str) -> State:
        try:
            return self._states[session_id]
        except KeyError:
            raise ApiError(400, f"unknown session {session_id!r}; call /seed_session first") from None

    def end(self, session_id: str) -> State:
        state = self.get(session_id)
        del self._states[session_id]
        return state

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._states

    def __len__(self) -> int:
        return len(self._states)
