"""The OpenAPI document of the HTTP edge, built from the request models and the response
models below, so that clients and contract fuzzers (schemathesis) see every body.

The routes read their bodies themselves (size limit, depth check, parsing off the event
loop), so FastAPI cannot infer request schemas from their signatures; the document is
written here once, from the same pydantic models `cluster.protocol` validates with.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cluster import protocol as p
from cluster.frontend import CHAT, COMPLETIONS

MODELS = "/v1/models"
HEALTH = "/health"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, the body of every 4xx and 5xx."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobItem(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobItem]


class CompletionLogprobs(BaseModel):
    """An echoed prompt's first token has null `token_logprobs` and `top_logprobs`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    """/health: `ok`, each worker's state or what the service waits for (open-ended)."""

    model_config = ConfigDict(extra="allow")

    ok: bool


_ERRORS = {
    "400": "Invalid request: the message names the field.",
    "401": "Missing or wrong API key (when keys are configured).",
    "404": "Unknown model.",
    "413": "Request body over edge.max_body_bytes.",
    "422": "Prompt over the prefill cap (the circuit breaker).",
    "429": "Queues full; retry after Retry-After seconds.",
    "503": "Not ready, restarting or a worker failed; retry after Retry-After seconds.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "string"}}}


def openapi_spec(title: str = "tokenflow", version: str = "0.1.0") -> dict[str, Any]:
    """The whole document (OpenAPI 3.1, JSON Schema as pydantic writes it)."""
    schemas: dict[str, Any] = {}

    def ref(model: type[BaseModel], mode: str = "serialization") -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                         mode=mode)  # type: ignore[arg-type]
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def json_body(schema: dict[str, Any], description: str,
                  headers: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"description": description,
                                "content": {"application/json": {"schema": schema}}}
        if headers:
            body["headers"] = headers
        return body

    error = ref(ErrorResponse)
    auth_errors = {"401": json_body(error, _ERRORS["401"]),
                   "503": json_body(error, _ERRORS["503"], _RETRY_AFTER)}

    def generate(request: type[BaseModel], response: type[BaseModel],
                 summary: str) -> dict[str, Any]:
        ok = json_body(ref(response), "The answer; with `stream`, server-sent events.")
        # Each event: `data:` a JSON chunk (the last one `[DONE]`), or an error body.
        ok["content"]["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
        responses = {"200": ok}
        for status, text in _ERRORS.items():
            retry = _RETRY_AFTER if status in ("429", "503") else None
            responses[status] = json_body(error, text, retry)
        return {"post": {
            "summary": summary, "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref(request, "validation")}}},
            "responses": responses}}

    paths = {
        COMPLETIONS: generate(p.CompletionRequest, CompletionResponse, "Text completion"),
        CHAT: generate(p.ChatCompletionRequest, ChatCompletionResponse, "Chat completion"),
        MODELS: {"get": {"summary": "Served models", "security": [{"bearer": []}, {}],
                         "responses": {"200": json_body(ref(ModelList), "The models."),
                                       **auth_errors}}},
        HEALTH: {"get": {"summary": "Health (open without a key)", "responses": {
            "200": json_body(ref(Health), "At least one worker is up."),
            "503": json_body({"anyOf": [ref(Health), error]}, "Not healthy yet.",
                             _RETRY_AFTER)}}},
    }
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths,
            "components": {"schemas": schemas, "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"}}}}
