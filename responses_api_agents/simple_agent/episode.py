"""The simple agent's one episode loop: seed, model calls with the environment's answers between them, verdict."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from nemo_gym_tok.common.remote_errors import error_type
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types.responses import PREVIOUS_KEY, PREVIOUS_NOT_FOUND, Response, ResponseUsage
from nemo_gym_tok.types.tokens import PREFIX_KEY
from responses_api_agents.simple_agent.episode_items import EpisodeItems
from responses_api_agents.simple_agent.peers import Peers, checked_json
from responses_api_agents.simple_agent.rows import model_row_field, rollout_record


@dataclass(frozen=True)
class PlayedEpisode:
    """An episode once its last model call is answered: what /verify may be shown of it."""

    responses: list[dict[str, Any]]
    """Every model answer, as it came."""
    items: EpisodeItems
    """The episode's items after the input, token fields kept apart."""
    transcript: list[dict[str, Any]]
    """The same items with every call's token bundle where the model server put it."""
    summary: dict[str, Any]
    """The episode as one Responses object (usage summed, `model_calls`): the record's `response`, less its items."""


class EnvironmentProtocol(Protocol):
    """How one episode talks to its environment; one implementation per protocol a resources server may speak."""

    async def seed(self, row: dict[str, Any]) -> None:
        """Start the episode on the environment for `row`."""

    def ends_before_tools(self, response: dict[str, Any]) -> bool:
        """Whether this model answer ends the episode before any tool call of it runs."""

    async def tool_output(self, call: dict[str, Any]) -> dict[str, Any]:
        """The function_call_output item that answers the model's function call `call`."""

    async def after_text_turn(self, items: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
        """After a model turn without tool calls (the episode's items so far): a user turn to add, and whether the
        episode is done."""

    async def verify(self, row: dict[str, Any], played: PlayedEpisode) -> dict[str, Any]:
        """The fields the environment's verdict adds to the rollout record (`reward` among them)."""

    async def close(self) -> None:
        """Release what the environment holds for the episode; also called after a failed episode."""


logger = logging.getLogger(__name__)


@dataclass
class KeptResponse:
    """The model server's latest answer that it kept (`store: true`): the next call continues it by its id."""

    response_id: str | None = None
    covered: int = 0
    """How many of the episode's items (after the input) that answer's history holds."""


@dataclass(frozen=True)
class ModelCalls:
    """One episode's calls to the model server: the row's request with the episode so far as its input."""

    peers: Peers
    server: str
    """Instance name of the model server."""
    session: str
    """The episode's `x-session-id`, which keys its conversation on the model server."""
    row: dict[str, Any]
    first_input: list[dict[str, Any]]
    request: dict[str, Any]
    """Every Responses field of a call but `input`."""
    send_token_bundles: bool
    kept: KeptResponse | None = None
    """Set: a call after one the server kept sends `previous_response_id` and the new items only (chain_responses)."""

    async def answer(self, step: int, items: EpisodeItems) -> dict[str, Any]:
        """The model server's answer to the episode's `step`-th call."""
        response = None
        if self.kept is not None and self.kept.response_id is not None:
            response = await self._continue(self.kept.response_id, items.items[self.kept.covered :])
        if response is None:
            body = {**self.request, "input": self.first_input + items.for_model(self.send_token_bundles)}
            if step == 0 and PREFIX_KEY in self.row:  # a harness's prefix for the episode's first call
                body[PREFIX_KEY] = self.row[PREFIX_KEY]
            # Only the first call is the row's as sent; a refusal later is about the episode the gym built.
            row_param = model_row_field if step == 0 else None
            response = await self.peers.call(self.server, "/v1/responses", body, self.session, row_param=row_param)
        if self.kept is not None:
            kept_id = response.get("id") if response.get("store") is True else None
            self.kept.response_id = kept_id if isinstance(kept_id, str) else None
            self.kept.covered = len(items.items) + len(response.get("output") or [])
        return response

    async def release(self) -> None:
        """Tell the model server the episode is done with its kept response (it holds one per conversation): a
        courtesy that frees its memory now rather than at its bound, so a failure is only logged."""
        if self.kept is None or self.kept.response_id is None:
            return
        response_id, self.kept.response_id = self.kept.response_id, None
        try:
            answer = await self.peers.servers.delete(self.server, f"/v1/responses/{response_id}")
        except httpx.HTTPError as exc:
            logger.debug("deleting kept response %s on %s failed: %s", response_id, self.server, exc)
            return
        if answer.status_code not in (200, 404):  # 404: dropped already, or a server with no such route
            logger.debug("deleting kept response %s on %s: HTTP %s", response_id, self.server, answer.status_code)

    async def _continue(self, previous: str, new_items: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The answer to a call that continues the kept response `previous` with `new_items`; None when the server
        no longer holds it (dropped, restarted): the caller then sends the whole history, which is as exact."""
        body = {**self.request, PREVIOUS_KEY: previous, "input": new_items}
        answer = await self.peers.post(self.server, "/v1/responses", body, self.session)
        if answer.status_code == 400 and error_type(answer) == PREVIOUS_NOT_FOUND:
            return None
        response = checked_json(self.server, answer)
        if response.get(PREVIOUS_KEY) != previous:
            raise ApiError(
                502,
                f"{self.server} answered a call that continues {previous} without echoing its previous_response_id: "
                "it may have answered the new items alone. Set chain_responses: false on the agent for it",
            )
        return response


async def play_episode(
    row: dict[str, Any], model: ModelCalls, environment: EnvironmentProtocol, max_steps: int
) -> dict[str, Any]:
    """One rollout record (schema_version 2): the row's fields, `response` (every item of the episode, each model
    call's bundle packed once), `reward`, verifier extras."""
    await environment.seed(row)
    try:
        played = await _play_turns(model, environment, max_steps)
        verdict = await environment.verify(row, played)
    except BaseException:
        with contextlib.suppress(Exception):  # the episode's own failure is the one the caller must see
            await environment.close()
        with contextlib.suppress(Exception):
            await model.release()
        raise
    await model.release()
    await environment.close()
    return rollout_record(row, {**played.summary, "output": played.items.recorded()}, verdict)


async def _play_turns(model: ModelCalls, environment: EnvironmentProtocol, max_steps: int) -> PlayedEpisode:
    """Model calls, each answered by the environment, until it or the protocol ends the episode or `max_steps`."""
    items = EpisodeItems()
    responses: list[dict[str, Any]] = []
    transcript: list[dict[str, Any]] = []
    for step in range(max_steps):
        response = await model.answer(step, items)
        responses.append(response)
        output = response.get("output") or []
        items.add_call(output)
        transcript.extend(output)
        if environment.ends_before_tools(response):
            break
        calls = [item for item in output if item.get("type") == "function_call"]
        for call in calls:
            result = await environment.tool_output(call)
            items.add(result)
            transcript.append(result)
        if calls:
            continue
        user_turn, done = await environment.after_text_turn(items.items)
        if user_turn is not None:
            items.add(user_turn)
            transcript.append(user_turn)
        if done:
            break  # a user turn that comes with done is the environment's last word, recorded as is
    return PlayedEpisode(responses, items, transcript, _episode_response(responses, items.items))


def _episode_response(responses: list[dict[str, Any]], output: list[dict[str, Any]]) -> dict[str, Any]:
    """The episode as one Responses object: the last answer's model and status, `output`, the usage summed."""
    usage = ResponseUsage()
    for response in responses:
        part = response.get("usage") or {}
        usage.input_tokens += part.get("input_tokens", 0)
        usage.output_tokens += part.get("output_tokens", 0)
        usage.total_tokens += part.get("total_tokens", 0)
    last = responses[-1] if responses else {}
    episode = Response(model=last.get("model", ""), status=last.get("status", "completed"), output=[], usage=usage)
    return {**episode.model_dump(exclude_none=True), "output": output, "model_calls": len(responses)}
