"""HTTP plumbing shared by the API apps: the error shape, body parsing with size limits,
authentication, JSON responses.

Every error is ``{"error": {"code", "message"}}`` with the status of API.md; nothing a client can
send produces a 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import orjson
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from run_engine import jsontext
from run_engine.api.inputs import is_number, needs_scan, too_many_containers, unstorable
from run_engine.dependencies import conflict_reason, refusing_writes
from run_engine.errors import (
    ConflictError,
    DuplicateExecutionError,
    InvalidTransitionError,
    LockTimeoutError,
    NotFoundError,
    QueueFullError,
    ReadTimeoutError,
    RunEngineError,
    StaleSnapshotError,
    TooLargeError,
    TooManyError,
    UnprocessableError,
    ValidationError,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

#: the engine names fields as its requests do (``TriggerRequest.max_attempts``); the API as its bodies do
WIRE_FIELDS = {"task_id": "taskId", "queue": "options.queue", "priority_s": "options.priority",
               "max_attempts": "options.maxAttempts", "tags": "options.tags",
               "idempotency_key": "options.idempotencyKey", "debounce": "options.debounce",
               "debounce.key": "options.debounce.key", "debounce.delay": "options.debounce.delay",
               "debounce.mode": "options.debounce.mode", "debounce.maxDelay": "options.debounce.maxDelay",
               "worker_group": "options.workerGroup"}
MAX_REQUEST_BYTES = 10 * 1024 * 1024


def page_size(request: Request) -> int:
    """``page[size]``: 1..100, 25 when not given."""
    raw = request.query_params.get("page[size]", "25")
    if not is_number(raw) or not 1 <= int(raw) <= 100:
        raise ApiError(400, "invalid_input", "page[size]: must be an integer 1..100")
    return int(raw)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, *, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra or {}
        self.headers = headers


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status_code=status,
                    media_type="application/json", headers=headers)


def error_payload(exc: Exception) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Status, ``{"error": …}`` body and headers for an exception (one mapping for the API)."""
    def err(status: int, code: str, message: str, extra: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str] | None]:
        return status, {"error": {"code": code, "message": message, **(extra or {})}}, headers

    if isinstance(exc, ApiError):
        return err(exc.status, exc.code, exc.message, exc.extra, exc.headers)
    if isinstance(exc, StaleSnapshotError):
        return err(409, exc.code, str(exc), {
            "latestSnapshot": {"id": exc.latest_snapshot_id, "executionStatus": exc.latest_status}})
    if isinstance(exc, NotFoundError):
        return err(404, "not_found", f"{exc.kind} not found")
    if isinstance(exc, InvalidTransitionError | DuplicateExecutionError | ConflictError):
        return err(409, exc.code, str(exc))
    if isinstance(exc, ValidationError):
        field = WIRE_FIELDS.get(exc.field, exc.field)
        return err(400, exc.code, f"{field}: {exc.message}")
    if isinstance(exc, TooLargeError):
        return err(413, exc.code, str(exc))
    if isinstance(exc, UnprocessableError):
        return err(422, exc.code, str(exc))
    if isinstance(exc, QueueFullError | TooManyError):
        return err(429, exc.code, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, LockTimeoutError):
        return err(503, exc.code, "the run is busy; try again", headers={"Retry-After": "1"})
    if isinstance(exc, ReadTimeoutError):  # a statement timeout: what the caller asked for, or the load
        return err(503, exc.code, str(exc), headers={"Retry-After": "2"})
    if (dependency := refusing_writes(exc)) is not None:
        name = {"postgres": "PostgreSQL", "redis": "Redis"}[dependency]
        reason = conflict_reason(exc)  # (PostgreSQL answered: what it did, not "unavailable")
        message = (f"{name} rolled the transaction back ({reason}); try again" if reason
                   else f"{name} is unavailable; try again")
        return err(503, "service_unavailable", message, {"dependency": dependency}, headers={"Retry-After": "2"})
    if isinstance(exc, HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return err(exc.status_code, code, str(exc.detail))
    if isinstance(exc, RunEngineError):
        return err(500, exc.code, str(exc))
    return err(500, "internal_error", "internal error")




async def handle_exception(request: Request, exc: Exception) -> Response:
    status, data, headers = error_payload(exc)
    if status == 503 and data["error"]["code"] in ("service_unavailable", "read_timeout"):
        log.warning("%s %s: %s (%s)", request.method, redact(request.url.path), data["error"]["message"], exc)
    elif status >= 500:
        log.error("error on %s %s", request.method, redact(request.url.path), exc_info=exc)
    return json_response(data, status, headers)


async def handle_refusing(request: Request, exc: Exception) -> Response:
    """A dependency refusing writes for a while (dependencies.MAYBE_REFUSING) as the other outages
    (:func:`handle_exception`: a 503, one warning line); any other such error is raised on, to the
    server's error handler (a 500 with its traceback). Left to that handler alone, the refusals
    were answered 503 but raised on after it too, a traceback in the server's log per request."""
    if refusing_writes(exc) is None:
        raise exc
    return await handle_exception(request, exc)


def redact(path: str) -> str:
    """A path as it may be logged: a callback URL's signature is a credential (also when the path
    spells the route's slashes or letters percent-encoded: it is routed decoded)."""
    head, sep, _ = path.partition("/callback/")
    if sep:
        return f"{head}{sep}[redacted]"
    if "%" in path and "/callback/" in (decoded := unquote(path)):
        return quote(decoded.partition("/callback/")[0], safe="/") + "/callback/[redacted]"
    return path


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p in {"function-after", "union"})]
    return ".".join(parts) or "body"


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body; 413 as soon as it is (or says it will be) larger than ``limit``, 400 when
    the client goes before it ends (starlette's ClientDisconnect was a 500, its traceback logged
    twice at ERROR: a client's doing, and one an aborted upload repeats at will)."""
    declared = request.headers.get("content-length")
    if declared and is_number(declared) and int(declared) > limit:
        raise ApiError(413, "payload_too_large", f"request body is larger than {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, "payload_too_large", f"request body is larger than {limit} bytes")
    except ClientDisconnect:
        raise ApiError(400, "invalid_input", "body: the client disconnected before the request body ended") from None
    return body


SCAN_OFF_LOOP_BYTES = 256 * 1024  # a body or payloads this large are walked in a thread
#: the most objects and arrays a request body may hold (a batch of payloads, each of at most
#: inputs.MAX_CONTAINERS): ~0.1 s of decoding with the collector paused
MAX_BODY_CONTAINERS = 1_000_000


async def read_json(request: Request, *, limit: int = MAX_REQUEST_BYTES, required: bool = True,
                    scan: bool = True) -> Any:
    """The request's JSON body: 413 over ``limit``, 400 when malformed, and (with ``scan``) 400 for
    a value that cannot be stored (NUL, too deep: :mod:`run_engine.api.inputs`), naming the field."""
    body = await read_body(request, limit)
    if not body:
        if required:
            raise ApiError(400, "invalid_input", "body: a JSON body is required")
        return None
    # orjson holds the GIL whatever thread decodes: what bounds the time a body holds the event
    # loop is how many objects and arrays it may hold, counted before it is decoded
    if (brackets := body.count(b"[") + body.count(b"{")) > MAX_BODY_CONTAINERS:
        raise ApiError(413, "payload_too_large", f"body: holds {brackets} JSON objects and arrays (counting "
                                                 f"brackets in its strings); at most {MAX_BODY_CONTAINERS}")
    try:
        data = jsontext.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "invalid_input", f"body: malformed JSON ({exc})") from None
    if scan and needs_scan(body):
        # a large body is walked off the event loop: the loop's other requests go on meanwhile
        problem = await asyncio.to_thread(unstorable, data) if len(body) > SCAN_OFF_LOOP_BYTES else unstorable(data)
        if problem is not None:
            raise ApiError(400, "invalid_input", problem.removeprefix("body."))
    return data


JSON_PAYLOAD_TYPES = ("application/json", "application/super+json")


@dataclass(frozen=True, slots=True)
class DecodedPayload:
    """A payload sent as JSON text (Trigger.dev's SDK sends them so), decoded already: off the
    event loop when large (:func:`decode_payload`)."""

    value: Any


def decode_json_text(text: str, payload_type: str, field: str) -> Any:
    """The value of a payload's JSON text: 400 when it is not JSON or cannot be stored, 413 when
    it holds too many objects and arrays (before it is decoded)."""
    if (problem := too_many_containers(text)) is not None:
        raise ApiError(413, "payload_too_large", f"{field}: {problem}")
    try:
        decoded = jsontext.loads(text)
    except orjson.JSONDecodeError:
        raise ApiError(400, "invalid_input", f"{field}: not valid JSON for payloadType {payload_type}") from None
    if payload_type == "application/super+json" and isinstance(decoded, dict) and "json" in decoded:
        decoded = decoded["json"]
    if (problem := unstorable(decoded, field)) is not None:
        raise ApiError(400, "invalid_input", problem)
    return decoded


async def decode_payloads(payloads: Sequence[tuple[Any, str | None, str]], limit: int,
                          failed: dict[int, ApiError] | None = None) -> list[Any]:
    """Each (payload, its payloadType, its field) sent as JSON text as a :class:`DecodedPayload`
    (anything else as it is): 413 at once for a text over the payload limit, and all of them
    decoded and walked in a thread when together they are large. A 3 MiB text of a million empty
    lists took the event loop, and every tenant's requests on it, for two seconds; a batch of many
    texts each under the bound, as long. With ``failed``, a payload's own error is put there by
    its position instead of raised (the payload is answered as it was given)."""
    texts = [(i, p, t, f) for i, (p, t, f) in enumerate(payloads) if isinstance(p, str) and t in JSON_PAYLOAD_TYPES]
    if not texts:
        return list(payloads and [p for p, _, _ in payloads])
    for i, text, _, field in texts:
        if len(text) > limit:
            error = ApiError(413, "payload_too_large", f"{field}: larger than {limit} bytes")
            if failed is None:
                raise error
            failed[i] = error
    texts = [t for t in texts if not failed or t[0] not in failed]

    def decode_all() -> list[Any]:
        out: list[Any] = []
        for _, text, kind, field in texts:
            try:
                out.append(DecodedPayload(decode_json_text(text, kind, field)))
            except ApiError as exc:
                if failed is None:
                    raise
                out.append(exc)
        return out

    decoded = (await asyncio.to_thread(decode_all) if sum(len(text) for _, text, _, _ in texts) > SCAN_OFF_LOOP_BYTES
               else decode_all())
    out = [p for p, _, _ in payloads]
    for (i, _, _, _), value in zip(texts, decoded, strict=True):
        if isinstance(value, ApiError) and failed is not None:
            failed[i] = value
        else:
            out[i] = value
    return out


async def decode_payload(payload: Any, payload_type: str | None, field: str, limit: int) -> Any:
    """:func:`decode_payloads` of one payload."""
    (out,) = await decode_payloads([(payload, payload_type, field)], limit)
    return out


def validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_input", "body: must be a JSON object")
    try:
        return model.model_validate(data)
    except PydanticError as exc:
        first = exc.errors()[0]
        raise ApiError(400, "invalid_input", f"{_field_path(first['loc'])}: {first['msg']}") from None


async def body(request: Request, model: type[M], *, required: bool = True, scan: bool = True) -> M:
    data = await read_json(request, required=required, scan=scan)
    return validate(model, {} if data is None else data)


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "missing or malformed Authorization: Bearer header")
    return token.strip()


class TtlCache:
    """A tiny cache for credential look-ups (keys are hashes; entries expire)."""

    def __init__(self, ttl_s: float = 5.0, size: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._data: dict[str, tuple[float, Any]] = {}

    def get(self, key: str) -> Any:
        hit = self._data.get(key)
        if hit is None or time.monotonic() - hit[0] > self.ttl_s:
            return None
        return hit[1]

    def put(self, key: str, value: Any) -> None:
        if len(self._data) >= self.size:
            self._data.clear()
        self._data[key] = (time.monotonic(), value)
