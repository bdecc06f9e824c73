"""The lines of a streamed batch (``POST /api/v3/batches/{batchId}/items``, NDJSON), each read on its
own: a line that is not a valid item of the batch (malformed JSON, past the line's bound, a bad
shape, an index not below the batch's ``runCount``) fails that item only, as an item the engine
refuses does, and the others are triggered.

A failed line is an item's when it names one of the batch's indexes: the ``index`` of its JSON, or,
when it cannot be decoded, the ``"index"`` its text opens with (``{"index": 3, "task": "…", …}``,
as Trigger.dev's SDK writes every line; only the first key is read, where no payload can put one).
That item fails; the batch counts it as sent and as finished. A line that names none is answered
with its line number and fails no item (nothing says which one it was meant to be). The body is
still refused whole when it is not items at all (no line is a valid item or names an index) and
where its bounds are the body's: more lines than ``runCount`` (counted before any is parsed), over
the request's size, more objects and arrays in all than a JSON body may hold (counted before any
line is parsed, as :func:`run_engine.api.http.read_json` counts a body's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from run_engine import jsontext
from run_engine.api.http import MAX_BODY_CONTAINERS, ApiError, error_payload, validate
from run_engine.api.inputs import MAX_CONTAINERS, needs_scan, unstorable
from run_engine.api.models import BatchStreamItem
from run_engine.engine import BatchItemError

#: the ``"index"`` (and ``"task"``) a line opens with, read from its first bytes when it cannot be decoded
_OPENING = re.compile(rb'\s*\{\s*"index"\s*:\s*(0|[1-9]\d{0,8})\s*'
                      rb'(?:\}|,(?:\s*"task"\s*:\s*"([^"\\\x00-\x1f]{1,128})")?)')
_OPENING_BYTES = 256
#: a failure's message as answered and stored with its batch: long enough for any of this API's
#: own (one naming a field of the line spells out its path, which the line may make long)
MAX_MESSAGE = 1000


@dataclass(frozen=True, slots=True)
class LineError:
    """A line of the body that made no run: its number (from 1), the batch index it names (None when
    it names none: it fails no item), the task it names, the error it would have had alone, and
    whether its item failed for good (``final``) or only for the moment (a retry may make it)."""

    line: int
    index: int | None
    task: str | None
    status: int
    code: str
    message: str
    final: bool = True

    @classmethod
    def of(cls, line: int, item: BatchStreamItem, exc: Exception, *, final: bool = True) -> LineError:
        """The error of a valid line whose item was not made (``exc``: an API or engine error)."""
        status, data, _ = error_payload(exc)
        return cls(line, item.index, item.task, status, data["error"]["code"], data["error"]["message"], final)

    def answer(self) -> dict[str, Any]:
        out: dict[str, Any] = {"line": self.line}
        if self.index is not None:
            out["index"] = self.index
        if self.task is not None:
            out["taskIdentifier"] = self.task
        return out | {"error": self.message[:MAX_MESSAGE], "errorCode": self.code}

    def failure(self) -> BatchItemError:
        """As the batch keeps it (``index`` is not None): a NUL cannot be stored, a message is bounded."""
        assert self.index is not None
        return BatchItemError(self.index, self.task or "", self.message[:MAX_MESSAGE].replace("\x00", "\\u0000"),
                              self.code)


@dataclass(frozen=True, slots=True)
class Lines:
    """A body's valid items with their line numbers, and its failed lines, both in line order."""

    items: list[tuple[int, BatchStreamItem]]
    errors: list[LineError]


def read_lines(raw: bytes | bytearray, size: int) -> Lines:
    """Each line of ``raw`` as an item of a batch of ``size`` items, or as its error (see the module
    doc); 400 or 413 for the body as a whole."""
    # the body's bound, as a JSON body's: orjson holds the GIL whatever thread decodes, and each line
    # under its own bound, 1,000 of them held 3.5 million objects and arrays in 10 MB (seconds of
    # decoding, hundreds of MB of Python objects) where the same items in one JSON body are refused
    if (brackets := raw.count(b"[") + raw.count(b"{")) > MAX_BODY_CONTAINERS:
        raise ApiError(413, "payload_too_large", f"body: holds {brackets} JSON objects and arrays (counting "
                                                 f"brackets in its strings); at most {MAX_BODY_CONTAINERS}")
    lines = bytes(raw).splitlines()
    # counted before any is parsed: a body of a million one-line items would hold the event loop
    # (every tenant's requests) for seconds, while a batch has at most runCount items to send
    if sum(1 for line in lines if line.strip()) > size:
        raise ApiError(400, "invalid_input", f"more items than the batch's runCount {size}: send each index once")
    items: list[tuple[int, BatchStreamItem]] = []
    errors: list[LineError] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        data: Any = None
        try:
            if (brackets := line.count(b"[") + line.count(b"{")) > 2 * MAX_CONTAINERS:
                # more than a payload and its metadata may hold together: refused before it is parsed
                raise ApiError(413, "payload_too_large", f"line {number}: holds {brackets} JSON objects and arrays "
                                                         f"(counting brackets in its strings); a payload and its "
                                                         f"metadata hold at most {MAX_CONTAINERS} each")
            try:
                data = jsontext.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ApiError(400, "invalid_input", f"line {number}: malformed JSON ({exc})") from None
            if needs_scan(line) and (problem := unstorable(data, f"line {number}")) is not None:
                raise ApiError(400, "invalid_input", problem)
            try:
                item = validate(BatchStreamItem, data)
            except ApiError as exc:
                raise ApiError(400, "invalid_input", f"line {number}: {exc.message}") from None
            if item.index >= size:
                raise ApiError(400, "invalid_input", f"line {number}: index {item.index} is not below the batch's "
                                                     f"runCount {size}")
        except ApiError as exc:
            index, task = _named(line, data, size)
            errors.append(LineError(number, index, task, exc.status, exc.code, exc.message))
            continue
        items.append((number, item))
    if not items and errors and all(e.index is None for e in errors):
        first = errors[0]  # not items at all: as before, the body's error is its first line's
        raise ApiError(first.status, first.code, first.message)
    return Lines(items, errors)


def _named(line: bytes, data: Any, size: int) -> tuple[int | None, str | None]:
    """The batch index (below ``size``) and the task a failed line names, if it names them."""
    if isinstance(data, dict):
        index, task = data.get("index"), data.get("task")
    elif data is None and (opening := _OPENING.match(line[:_OPENING_BYTES])) is not None:
        index = int(opening.group(1))
        task = opening.group(2).decode("utf-8", "replace") if opening.group(2) else None
    else:
        return None, None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < size:
        return None, None
    named = task if isinstance(task, str) and 0 < len(task) <= 128 and task.isprintable() else None
    return index, named
