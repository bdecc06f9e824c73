"""Headers every answer carries, whatever answered it: ``X-Content-Type-Options: nosniff`` on all
(a value a tenant wrote, in a JSON body or a packet, is never sniffed into a page), and the
dashboard's security headers (no framing, no inline script, no referrer) on everything under
/dashboard: its static files and the 404 and 405 Starlette answers with, not only its pages."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from run_engine.dashboard.core import SECURITY_HEADERS

_NOSNIFF = [(b"x-content-type-options", b"nosniff")]
_DASHBOARD = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
#: a static file may be cached (it changes only with a release)
_STATIC = [(k, v) for k, v in _DASHBOARD if k != b"cache-control"]


class BaselineHeaders:
    def __init__(self, app: ASGIApp, dashboard: str = "/dashboard") -> None:
        self.app = app
        self.dashboard = dashboard
        self.static = dashboard + "/static/"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        wanted = _NOSNIFF
        if path == self.dashboard or path.startswith(self.dashboard + "/"):
            wanted = _STATIC if path.startswith(self.static) else _DASHBOARD

        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in wanted if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with)
