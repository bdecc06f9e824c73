"""``GET /realtime/v1/runs/{runId}``: Server-Sent Events, ``event: run`` with the run object on
every change (of its status, metadata or tags), closed after the terminal one. Changes made by any server process arrive
through :class:`run_engine.realtime.RealtimeHub`; the run is also re-read every few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from datetime import datetime

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError
from run_engine.api.inputs import looks_like_id
from run_engine.api.openapi import operation
from run_engine.api.public import can_read
from run_engine.api.public_tokens import forbidden
from run_engine.api.serialize import run_object
from run_engine.api.shape_stream import shape
from run_engine.dependencies import unavailable_dependency
from run_engine.engine import ShapeRead
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus

log = logging.getLogger(__name__)
RECHECK_S = 10.0  # a safety net only: changes arrive through RealtimeHub at once
#: a stream whose credential could not be checked again for this many intervals ends
UNCHECKED_CHECKS = 3
KEEPALIVE_S = 15.0


def _event(data: dict[str, object]) -> bytes:
    return b"event: run\ndata: " + orjson.dumps(data) + b"\n\n"


async def while_allowed(chunks: AsyncGenerator[bytes, None], allowed: Callable[[], Awaitable[bool]],
                        every_s: float | None = None) -> AsyncIterator[bytes]:
    """``chunks`` for as long as the credential that opened the stream holds (a token that expires,
    a key rotated, a session ended: the stream ends), checked before a chunk goes out at most every
    ``every_s``. A check that cannot be made now (PostgreSQL or Redis away) is made again at the
    next chunk; none made for ``UNCHECKED_CHECKS`` intervals, the stream ends (the client opens it
    again, and is let in or refused as any new request): a session signed out, or a token revoked,
    meanwhile is not streamed to for as long as an outage lasts."""
    every_s = RECHECK_S if every_s is None else every_s
    checked = time.monotonic()
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if time.monotonic() - checked >= every_s:
                try:
                    if not await allowed():
                        return
                    checked = time.monotonic()
                except Exception as exc:  # noqa: BLE001 (anything but a refusal: look again later)
                    if time.monotonic() - checked >= every_s * UNCHECKED_CHECKS:
                        log.warning("a stream's credential could not be checked again for %.0f s: ending it "
                                    "(%r)", time.monotonic() - checked, exc)
                        return
                    log.warning("a stream's credential could not be checked again: %r", exc)
            yield chunk


def unreadable(exc: Exception) -> bool:
    """Whether a stream's read of its run failed for PostgreSQL being away (a failover, a restart,
    a pool without a free connection for 10 s): logged, and the stream reads again at its next
    wake or recheck (the client gets the change it missed then), and ends once its credential could
    not be checked for ``UNCHECKED_CHECKS`` intervals (:func:`while_allowed`), as cleanly as at its
    run's end. Raised out of the stream, the error cut the response short (a chunked body left
    unfinished) and logged two tracebacks per open stream."""
    global _warned
    if (dependency := unavailable_dependency(exc)) is None:
        return False
    if time.monotonic() - _warned >= RECHECK_S:  # one line for every open stream would flood the log
        _warned = time.monotonic()
        log.warning("streams could not read their runs (%s unavailable: %r); reading again at their next wake",
                    dependency, exc)
    return True


_warned = -RECHECK_S


@operation("Server-Sent Events: the run object on every change", None, media="text/event-stream",
           security="apiKeyOrPublicToken")
async def run_stream(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, public=True)
    run_id = request.path_params["run_id"]
    # light: only its id, task, tags and batch decide who may read it (a payload of megabytes is not
    # read and decoded on every request of a shape client)
    run = await ctx.engine.get_run(run_id, auth.env_id, light=True) if looks_like_id(run_id, "run") else None
    if run is None:
        raise ApiError(404, "not_found", "run not found")
    if not can_read(auth, run):
        raise forbidden()
    if "offset" in request.query_params:  # Trigger.dev's SDK: the shape protocol (runs.subscribeToRun)
        env_id = auth.env_id

        async def load(_changed_after: datetime | None) -> ShapeRead:
            return await ctx.engine.shape_runs(env_id, ids=[run_id], limit=1)

        return await shape(ctx, auth, request, run_id, load, run_id)
    hub = ctx.realtime
    if hub is None:
        raise ApiError(503, "unavailable", "realtime is not running in this process")
    # counted against the credential's cap (429 over it) until the stream ends, however it ends
    release = ctx.acquire("streams", auth.bucket)

    async def still_allowed() -> bool:
        try:
            again = await ctx.env_auth(request, public=True, recheck=True)
        except ApiError:
            return False
        return again.env_id == auth.env_id and can_read(again, run)

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            async with hub.watch(run_id) as changed:
                last: tuple[str, datetime] | None = None  # the status and last change sent
                idle = 0.0
                while True:
                    # light: the stream is woken (and rechecks) more often than its run changes, and
                    # the run's payload (megabytes, maybe) is read and decoded only for an event to
                    # send. Every change sets updated_at: a status, and its metadata and tags too.
                    # In the environment's turn of the costly reads: how often its streams read is
                    # the tenant's to decide (a hundred streams of a run whose metadata it changes
                    # a thousand times a second), and without turns their reads queued in front of
                    # every other tenant's for the database pool and the event loop
                    try:
                        async with ctx.costly_reads.turn(auth.env_id):
                            run = await ctx.engine.get_run(run_id, auth.env_id, light=True)
                            if run is not None and (run.status, run.updated_at) != last:
                                run = await ctx.engine.get_run(run_id, auth.env_id)
                    except Exception as exc:
                        if not unreadable(exc):
                            raise
                    else:
                        if run is None:  # deleted by retention meanwhile
                            return
                        if (run.status, run.updated_at) != last:
                            last = (run.status, run.updated_at)
                            idle = 0.0
                            yield _event(run_object(run))
                            if RunStatus(run.status) in FINAL_RUN_STATUSES:
                                return
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), RECHECK_S)
                    idle += RECHECK_S if not changed.is_set() else 0.0
                    if idle >= KEEPALIVE_S:
                        idle = 0.0
                        yield b": keep-alive\n\n"
        finally:
            release()

    return StreamingResponse(while_allowed(events(), still_allowed), media_type="text/event-stream",
                             background=BackgroundTask(release),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


ROUTES = [Route("/realtime/v1/runs/{run_id}", run_stream, methods=["GET"])]
