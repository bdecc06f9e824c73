"""The access log: one line per request on the logger ``run_engine.access`` with ``method``,
``path``, ``status``, ``duration_ms`` and ``client``. A 4xx answer is INFO and a 5xx WARNING, so
refused requests are seen server-side; anything else is DEBUG, so at the default level a successful
request costs a clock read and a level check, no line. Lines at INFO and above are capped at
:data:`MAX_LINES_PER_S` per process (a client flooding 4xx must not flood the log): the next line
after a capped second says how many were ``dropped``.

The path is logged without its query string (it may carry anything), with a callback URL's
signature redacted, and never a header (the Authorization header is a credential)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from run_engine.api.http import redact

log = logging.getLogger("run_engine.access")

MAX_PATH = 512
MAX_LINES_PER_S = 100
_UNSAFE = re.compile(rb"[^\x21-\x7e]")


def loggable_path(scope: Scope) -> str:
    """The request path as sent (percent-encoded), bytes outside printable ASCII encoded too, a
    callback signature redacted, at most :data:`MAX_PATH` characters."""
    raw: bytes = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "replace")
    raw = raw.partition(b"?")[0][: MAX_PATH * 3]
    if _UNSAFE.search(raw):
        raw = _UNSAFE.sub(lambda m: b"%%%02X" % m.group(0)[0], raw)
    return redact(raw.decode("ascii"))[:MAX_PATH]


class AccessLog:
    """ASGI middleware around the whole app (outside its error handling, so a 500 is seen too)."""

    def __init__(self, app: ASGIApp, max_lines_per_s: int = MAX_LINES_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.max_lines_per_s = max_lines_per_s
        self._clock = clock
        self._second = 0
        self._lines = 0
        self.dropped = 0  # lines over the cap not yet reported

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500
            raise
        finally:
            level = logging.WARNING if status >= 500 else logging.INFO if status >= 400 else logging.DEBUG
            if status and log.isEnabledFor(level) and self._admit(level):
                self._log(level, scope, status, time.perf_counter() - began)

    def _admit(self, level: int) -> bool:
        if level < logging.INFO:
            return True
        second = int(self._clock())
        if second != self._second:
            self._second, self._lines = second, 0
        if self._lines >= self.max_lines_per_s:
            self.dropped += 1
            return False
        self._lines += 1
        return True

    def _log(self, level: int, scope: Scope, status: int, seconds: float) -> None:
        client = scope.get("client")
        fields = {"method": scope.get("method", ""), "path": loggable_path(scope), "status": status,
                  "duration_ms": round(seconds * 1000, 2), "client": client[0] if client else None}
        if self.dropped and level >= logging.INFO:
            fields["dropped"], self.dropped = self.dropped, 0
        log.log(level, "request", extra=fields)
