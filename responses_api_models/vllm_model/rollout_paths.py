"""NeMo Gym's rollout paths: `/ng-rollout/<id>[/training-token-capture]/<route>` served as `<route>`, id kept."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_tok.servers.api_errors import error_response

ROLLOUT_SEGMENT = "ng-rollout"
CAPTURE_SEGMENT = "training-token-capture"
STATE_KEY = "nemo_gym_rollout"
# NeMo Gym's own rule for rollout ids: they name files in its capture directory, so nothing else is accepted.
ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PATH = re.compile(rf"/{ROLLOUT_SEGMENT}/(?P<rollout_id>[^/]*)(?P<capture>/{CAPTURE_SEGMENT})?(?P<route>/.*)?")


@dataclass(frozen=True)
class Rollout:
    """The rollout a request belongs to, and whether NeMo Gym asked for training-token capture of it."""

    rollout_id: str
    training_capture: bool


def parse_rollout_path(path: str) -> tuple[Rollout, str] | str | None:
    """(the rollout, the route after the prefix) for a NeMo Gym rollout path; None for any other path; a message
    saying what is wrong for a malformed one."""
    if not path.startswith(f"/{ROLLOUT_SEGMENT}/"):
        return None
    match = _PATH.fullmatch(path)
    if match is None or not match["route"] or match["route"] == "/":
        return (
            f"{path}: a NeMo Gym rollout path is /{ROLLOUT_SEGMENT}/<rollout id>[/{CAPTURE_SEGMENT}]/<route>, "
            "e.g. /ng-rollout/3-0/training-token-capture/v1/responses"
        )
    rollout_id = match["rollout_id"]
    if not ROLLOUT_ID.fullmatch(rollout_id):
        return (
            f"rollout id {rollout_id!r} in {path}: use letters, digits, dots, dashes or underscores, starting "
            "with a letter or digit (NeMo Gym's rule: the id names its capture files)"
        )
    return Rollout(rollout_id, match["capture"] is not None), match["route"]


def rollout_of(scope_or_request: Any) -> Rollout | None:
    """The rollout a request came in under (set by RolloutPathMiddleware), None for a plain path."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    state = scope.get("state")
    return state.get(STATE_KEY) if isinstance(state, dict) else None


class RolloutPathMiddleware:
    """Strips NeMo Gym's rollout prefix before routing, so `/ng-rollout/7-0/v1/responses` is `/v1/responses`, and
    keeps the rollout in the request's state; a malformed prefix is a 400 saying how to write it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            parsed = parse_rollout_path(scope.get("path", ""))
            if isinstance(parsed, str):
                await error_response(400, parsed, param="path")(scope, receive, send)
                return
            if parsed is not None:
                rollout, route = parsed
                state = dict(scope.get("state") or {})
                state[STATE_KEY] = rollout
                scope = {**scope, "path": route, "raw_path": route.encode(), "state": state}
        await self.app(scope, receive, send)
