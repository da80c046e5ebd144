"""Request-body schemas in each gym server's OpenAPI document, for routes that read their body as raw JSON."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.types import ResponsesRequest
from nemo_gym_tok.types.tokens import TokenIds

REF_TEMPLATE = "#/components/schemas/{model}"
"""Where nested models' references point: `install_components` moves each schema's `$defs` there."""

JsonSchema = dict[str, Any]
SchemaSource = type[BaseModel] | JsonSchema


def json_body(
    schema: SchemaSource, *, session: Literal["required", "optional"] | None = None, description: str | None = None
) -> dict[str, Any]:
    """`openapi_extra` for a route: its JSON body is `schema` (a Pydantic model or a JSON schema), and, if `session`
    is set, the x-session-id header. The handler still reads the raw body itself (limits, NaN and error messages are
    its own); this only documents the body, so schema-driven clients and fuzzers know what to send."""
    body_schema = schema_of(schema)
    request_body: dict[str, Any] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
    if description:
        request_body["description"] = description
    extra: dict[str, Any] = {"requestBody": request_body}
    if session:
        extra["parameters"] = [
            {
                "name": SESSION_HEADER,
                "in": "header",
                "required": session == "required",
                "description": (
                    "names the episode (environments key its state by it; the adapter keeps it on one vLLM URL)"
                ),
                "schema": {"type": "string", "minLength": 1},
            }
        ]
    return extra


def schema_of(schema: SchemaSource) -> JsonSchema:
    """A fresh JSON schema for `schema`: nested models as `$defs`, referenced under components/schemas."""
    if isinstance(schema, dict):
        return copy.deepcopy(schema)
    return schema.model_json_schema(ref_template=REF_TEMPLATE)


def install_components(app: FastAPI) -> None:
    """Make `app.openapi()` move every request body's `$defs` into components/schemas, where REF_TEMPLATE points.

    FastAPI builds components only from the models it validates itself; our routes validate by hand, so their
    nested models would otherwise be references to nowhere."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        document = build()  # FastAPI caches the document; hoisting again finds nothing left to move
        components = document.setdefault("components", {}).setdefault("schemas", {})
        for path, operations in document.get("paths", {}).items():
            for method, operation in operations.items():
                for media in operation.get("requestBody", {}).get("content", {}).values():
                    schema = media.get("schema")
                    if not isinstance(schema, dict) or "$defs" not in schema:
                        continue
                    for name, definition in schema["$defs"].items():
                        if components.setdefault(name, definition) != definition:
                            # Two different models of one name: a reference would silently describe the wrong one.
                            raise ValueError(f"{method.upper()} {path}: two request models are named {name!r}")
                    media["schema"] = {key: value for key, value in schema.items() if key != "$defs"}
        if not components:
            del document["components"]["schemas"]
            if not document["components"]:
                del document["components"]
        return document

    app.openapi = openapi  # type: ignore[method-assign]


# The request bodies of an environment's fixed routes. Each keeps unknown fields: a row carries the environment's
# own fields, and the agent may add its own.


class SeedSessionRequest(BaseModel):
    """The input row of the episode; an environment's subclass names the fields it needs."""

    model_config = ConfigDict(extra="allow")


class StepRequest(BaseModel):
    """`/step` after a model turn without tool calls."""

    model_config = ConfigDict(extra="allow")

    output: list[dict[str, Any]] = Field(description="the episode's items so far")


class EpisodeTranscript(BaseModel):
    """The episode's Responses object as `/verify` reads it."""

    model_config = ConfigDict(extra="allow")

    output: list[dict[str, Any]] = Field(description="every item of the episode")


class VerifyRequest(BaseModel):
    """`/verify`: the input row (its fields kept as they came) plus `response`."""

    model_config = ConfigDict(extra="allow")

    response: EpisodeTranscript


ANY_OBJECT: JsonSchema = {"type": "object"}
"""The arguments schema of a tool that declares none: any JSON object reaches it."""


class AgentRunRequest(BaseModel):
    """An agent's `/run`: one input row. Its other fields are the environment's (seed_session and verify read them)."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesRequest = Field(description="the episode's first model call (its input opens it)")
    required_prefix_token_ids: TokenIds | None = Field(None, description="a harness's prefix for the first call")
