"""The OpenAPI document, derived from the routes: each handler declares what it takes and returns
with :func:`operation`, and :func:`openapi_document` walks the app's routes. A route without a
declaration fails the build of the document (tests/unit/test_openapi.py), so the document is
complete by construction."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.routing import BaseRoute, Route

from run_engine.api.schemas import Error

F = TypeVar("F", bound=Callable[..., Any])

#: the statuses every authenticated operation may answer with, and what they mean (API.md)
ERRORS = {400: "invalid input (the message names the field)", 401: "missing or bad credentials",
          403: "credentials of another scope", 404: "unknown id, or an id of another environment",
          409: "conflict: stale snapshot or wrong state", 413: "payload too large",
          422: "well-formed but impossible", 429: "rate limited (see Retry-After)",
          431: "request head too large", 503: "a dependency is unavailable, or a list or realtime read took too long "
                                             "(read_timeout); retry"}
SECURITY: dict[str, list[dict[str, list[str]]]] = {"apiKey": [{"apiKey": []}],
            "apiKeyOrRunToken": [{"apiKey": []}, {"runToken": []}],
            "apiKeyOrPublicToken": [{"apiKey": []}, {"publicToken": []}],
            "anyToken": [{"apiKey": []}, {"runToken": []}, {"publicToken": []}],
            "workerToken": [{"workerToken": []}], "metricsToken": [{"metricsToken": []}], "none": []}


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True, slots=True)
class Operation:
    summary: str
    response: type[BaseModel] | None
    body: type[BaseModel] | None = None
    query: Sequence[Query] = ()
    security: str = "apiKey"
    media: str = "application/json"
    body_required: bool = True
    any_body: bool = False  # the body is any JSON value (a callback's output)


def operation(summary: str, response: type[BaseModel] | None, *, body: type[BaseModel] | None = None,
              query: Sequence[Query] = (), security: str = "apiKey", media: str = "application/json",
              body_required: bool = True, any_body: bool = False) -> Callable[[F], F]:
    """Declare a handler for the OpenAPI document."""
    op = Operation(summary, response, body, tuple(query), security, media, body_required, any_body)

    def mark(handler: F) -> F:
        handler.__openapi__ = op  # type: ignore[attr-defined]
        return handler

    return mark


PAGE = (Query("page[size]", {"type": "integer", "minimum": 1, "maximum": 100, "default": 25}),
        Query("page[after]", {"type": "string", "maxLength": 512}, "the `next` cursor of the previous page"))


def csv(name: str, description: str = "comma-separated") -> Query:
    return Query(name, {"type": "string", "maxLength": 4096}, description)


_PARAM = re.compile(r"{(\w+)(?::\w+)?}")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def openapi_document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    components: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        if model.__name__ not in components:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(Error)}}}
    paths: dict[str, Any] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        op: Operation | None = getattr(route.endpoint, "__openapi__", None)
        if op is None:
            raise RuntimeError(f"route {route.path} has no @operation declaration")
        path = _PARAM.sub(lambda m: "{" + _camel(m.group(1)) + "}", route.path)
        params = [{"name": _camel(m.group(1)), "in": "path", "required": True,
                   "schema": {"type": "string", "minLength": 1, "maxLength": 256}}
                  for m in _PARAM.finditer(route.path)]
        params += [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                    **({"description": q.description} if q.description else {})} for q in op.query]
        ok: dict[str, Any] = {"description": "OK"}
        if op.media in ("text/event-stream", "text/plain"):
            ok["content"] = {op.media: {"schema": {"type": "string"}}}
        elif op.response is not None:
            ok["content"] = {"application/json": {"schema": ref(op.response)}}
        responses = {"200": ok}
        if op.security != "none" or op.body is not None or op.any_body or params:
            responses.update({str(code): {"description": text, **error} for code, text in ERRORS.items()})
        responses.setdefault("503", {"description": ERRORS[503], **error})  # any call, PostgreSQL or Redis down
        entry: dict[str, Any] = {"summary": op.summary, "operationId": route.name,
                                 "security": SECURITY[op.security], "parameters": params, "responses": responses}
        if op.body is not None or op.any_body:
            schema: dict[str, Any] = ref(op.body) if op.body is not None else {}
            entry["requestBody"] = {"required": op.body_required,
                                    "content": {"application/json": {"schema": schema}}}
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = {**entry, "operationId": f"{method.lower()}_{route.name}"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "run-engine", "version": "1",
                 "description": "The HTTP API of run-engine (API.md). Errors are {error: {code, message}}."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "an environment's secret API key"},
            "runToken": {"type": "http", "scheme": "bearer", "description": "a run token (inside a task)"},
            "publicToken": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                            "description": "a public access token (a JWT with scopes, Trigger.dev's)"},
            "workerToken": {"type": "http", "scheme": "bearer", "description": "a worker group token"},
            "metricsToken": {"type": "http", "scheme": "bearer",
                             "description": "the installation's RUN_ENGINE_METRICS_TOKEN"}}},
    }
