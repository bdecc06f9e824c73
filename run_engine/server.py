"""The API server process: engine + HTTP apps on uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn

from run_engine import heap
from run_engine.api.access_log import AccessLog
from run_engine.api.app import create_app
from run_engine.api.context import ApiContext, costly_read_gate
from run_engine.api.slow_requests import SLOW
from run_engine.api.stalls import STALLS
from run_engine.api.stalls import STATE_KEY as STALL_KEY
from run_engine.engine import BATCH_DRAIN_S, RunEngine
from run_engine.metrics import EngineMetrics
from run_engine.ratelimit import ConnectionCaps, RequestLimiter
from run_engine.realtime import RealtimeHub
from run_engine.run_log import RunLog
from run_engine.run_tokens import RunTokens
from run_engine.settings import EngineSettings
from run_engine.wakeups import WakeUps

log = logging.getLogger(__name__)


#: the request line and headers together; more is answered 431 and the connection closed
MAX_HEAD_BYTES = 64 * 1024


def _http_protocol() -> type | str:
    """uvicorn's httptools protocol with a bound on the request head: httptools alone buffers
    headers of any size, so a client could hold megabytes of the server's memory per request."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"  # h11 bounds the head itself (h11_max_incomplete_event_size)

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head = 0
        _too_large = False
        _in_head = True  # a connection starts with a request head
        _head_raw = 0  # bytes received while in a head (httptools reports a header only once it is
        # complete, and grows a header without end quadratically: one endless header held the
        # event loop for seconds before any of the counts below saw it)

        # a request head or body that stops arriving is closed (run_engine/api/slow_requests.py):
        # uvicorn bounds neither, and a connection that sends nothing stays open for ever
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            SLOW.head_begins(self)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                if self._head_raw > MAX_HEAD_BYTES:
                    self._too_large = True
                    self.send_400_response("request head too large")
                    return
                self._head_raw += len(data)
            else:
                SLOW.body_arrives(self)
            super().data_received(data)

        def on_message_begin(self) -> None:
            self._head = 0
            self._too_large = False
            self._in_head = True
            self._head_raw = 0
            SLOW.head_begins(self)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            SLOW.body_begins(self)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            SLOW.done(self)
            super().on_message_complete()

        def _count(self, n: int) -> None:
            self._head += n
            if self._head > MAX_HEAD_BYTES:
                self._too_large = True
                raise httptools.HttpParserError("request head too large")

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        # a connection whose answer is not read is watched, and cut once it stops for good
        # (run_engine/api/stalls.py); the key its environment's answers count under is the one the
        # request's handler left in its scope's state
        def pause_writing(self) -> None:
            super().pause_writing()
            scope = getattr(self, "scope", None) or {}
            STALLS.watch(self.transport, (scope.get("state") or {}).get(STALL_KEY))

        def resume_writing(self) -> None:
            super().resume_writing()
            STALLS.unwatch(self.transport)

        def connection_lost(self, exc: Exception | None) -> None:
            STALLS.unwatch(self.transport)
            SLOW.done(self)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if not self._too_large:
                super().send_400_response(msg)
                return
            body = (b'{"error":{"code":"request_header_too_large","message":"the request line and headers '
                    b'are larger than %d bytes"}}' % MAX_HEAD_BYTES)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return BoundedHttpToolsProtocol


@contextlib.asynccontextmanager
async def api_context(settings: EngineSettings, *, secret: str, public_url: str) -> AsyncIterator[ApiContext]:
    """The engine and everything the API needs; ``secret`` is the installation secret
    (:func:`run_engine.tenancy.resolve_secret`)."""
    engine = await RunEngine.create(settings)
    wakeups = WakeUps(engine.redis, channel=f"{settings.key_prefix}:wake")
    realtime = RealtimeHub(engine.redis, prefix=settings.key_prefix)
    # counters and histograms of /metrics, and the log line per state change that matters
    uninstall = [EngineMetrics().install(engine.events), RunLog().install(engine.events)]
    limiter: RequestLimiter | None = None
    try:
        engine.resources.on_work(wakeups.notify)
        # a supervisor long-polling a waiting run's snapshot wakes when the run continues or is cancelled
        for name in ("run_continued", "run_cancelled"):
            engine.events.subscribe(name, lambda e: wakeups.notify(f"run:{e.run_id}"))
        await wakeups.start()
        engine.events.subscribe("*", realtime.on_event)
        await realtime.start()
        limiter = RequestLimiter(engine.redis, prefix=settings.key_prefix, rate_per_s=settings.api_rate_limit,
                                 burst=settings.api_rate_burst)
        caps = ConnectionCaps({"streams": settings.max_streams_per_key,
                               "long-polls": settings.max_long_polls_per_token})
        yield ApiContext(engine=engine, tokens=RunTokens(secret), wakeups=wakeups, public_url=public_url,
                         realtime=realtime, limiter=limiter, caps=caps, secret=secret,
                         costly_reads=costly_read_gate(settings.db_pool_max))
    finally:  # shielded: a second Ctrl-C must not leave connections and tasks behind
        for undo in uninstall:
            undo()
        await asyncio.shield(_close(engine, wakeups, realtime, limiter))


async def _close(engine: RunEngine, wakeups: WakeUps, realtime: RealtimeHub, limiter: RequestLimiter | None) -> None:
    if limiter is not None:  # its decisions under way (requests cancelled by the stop) end first
        await limiter.drain(BATCH_DRAIN_S)
    await realtime.stop()
    await wakeups.stop()
    await engine.close()


class Shutdown:
    """SIGINT and SIGTERM at any moment of start-up or serving mean one graceful stop; a second
    SIGINT stops at once. Installed by the commands before they start anything, so that no signal
    falls between two handlers (the asyncio runner's and uvicorn's) and is lost."""

    def __init__(self) -> None:
        self.requested = False
        self._server: uvicorn.Server | None = None
        self._starting: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> Shutdown:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.info("stopping (%s)", signal.Signals(signum).name)
        if self._server is not None:
            self._server.should_exit = True
        elif self._starting is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._starting.cancel)  # waiting for PostgreSQL, say

    def starting(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._starting = asyncio.current_task()

    def serving(self, server: uvicorn.Server) -> None:
        self._starting = None
        self._server = server
        server.should_exit = self.requested


async def serve(settings: EngineSettings, *, host: str, port: int, secret: str, public_url: str | None = None,
                shutdown: Shutdown | None = None, on_started: Callable[[], None] | None = None,
                fd: int | None = None) -> None:
    """The API until ``shutdown`` is requested (or the task is cancelled); ``on_started`` is
    called once the port is listening. ``fd``: accept on this inherited listening socket (one of
    ``server --workers N``) instead of binding ``host:port``."""
    url = public_url or f"http://{host}:{port}"
    shutdown = shutdown or Shutdown()
    shutdown.starting()
    try:
        async with api_context(settings, secret=secret, public_url=url) as ctx:
            task = asyncio.current_task()
            if shutdown.requested or (task is not None and task.cancelling()):
                return  # stopped while starting (a library may have swallowed the cancel: 3.11's wait_for can)
            # our access log (run_engine/api/access_log.py) instead of uvicorn's
            config = uvicorn.Config(AccessLog(create_app(ctx)), host=host, port=port, log_level="warning",
                                    access_log=False, log_config=None, lifespan="off", timeout_graceful_shutdown=1,
                                    http=_http_protocol())
            server = _Server(config, on_shutdown=ctx.wakeups.stop_waiting)
            shutdown.serving(server)
            sockets = [socket.socket(fileno=fd)] if fd is not None else None
            serving = asyncio.ensure_future(server.serve(sockets=sockets))
            try:
                await asyncio.shield(_announce(server, serving, url, on_started))
                await asyncio.shield(serving)
            except asyncio.CancelledError:
                # cancelled by an embedding program: uvicorn ignores a cancel while it starts, so
                # ask it to stop the way its own signal handler does
                server.should_exit = True
                await serving
                raise
    except asyncio.CancelledError:
        if not shutdown.requested:
            raise  # a signal's cancel ends start-up quietly; any other cancel propagates


class _Server(uvicorn.Server):
    """uvicorn's server that, when it begins to shut down (its own signal handler, or
    ``should_exit``), first lets long-polls answer: they would otherwise be cut off after the
    graceful period with a traceback and a 500."""

    def __init__(self, config: uvicorn.Config, *, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


async def _announce(server: uvicorn.Server, serving: asyncio.Future[None], url: str,
                    on_started: Callable[[], None] | None) -> None:
    while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn has a flag, no event)
        await asyncio.sleep(0.02)
    if server.started:
        log.info("run-engine API listening on %s", url)
        heap.settle()  # start-up is over: out of the full collections' way (run_engine/heap.py)
        if on_started is not None:
            on_started()
