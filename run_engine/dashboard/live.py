"""Server-Sent Events that tell an open page to refresh: a run's detail on each change of the run,
the runs list on changes of any run of the environment (at most one a second). The page then
fetches its own fragment again, so what it shows always comes from the same code as a full load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from run_engine.api.http import ApiError
from run_engine.api.inputs import looks_like_id
from run_engine.api.stream import unreadable, while_allowed
from run_engine.dashboard.core import SECURITY_HEADERS, Dash, page, signed_in
from run_engine.realtime import env_key
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus

KEEPALIVE_S = 15.0
THROTTLE_S = 1.0
RECHECK_S = 10.0  # a run is also re-read this often (a lost notification only delays a refresh)


def _stream(request: Request, dash: Dash, events: AsyncGenerator[bytes, None]) -> Response:
    release = dash.ctx.acquire("streams", dash.auth.bucket)

    async def still_signed_in() -> bool:
        again = await signed_in(request)  # the session may have expired, or its key been rotated
        return again is not None and again.env.id == dash.env.id

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in while_allowed(events, still_signed_in):
                yield chunk
        finally:
            release()

    return StreamingResponse(guarded(), media_type="text/event-stream", background=BackgroundTask(release),
                             headers={**SECURITY_HEADERS, "X-Accel-Buffering": "no"})


@page
async def run_events(request: Request, dash: Dash) -> Response:
    run_id = request.path_params["run_id"]
    engine = dash.ctx.engine
    # light, here and below: only the run's status and last change are looked at, never its payload
    # (megabytes, maybe, decoded on the loop every tenant shares at every wake)
    if not looks_like_id(run_id, "run") or await engine.get_run(run_id, dash.env.id, light=True) is None:
        raise ApiError(404, "not_found", "run not found")
    hub = dash.ctx.realtime
    if hub is None:
        raise ApiError(503, "unavailable", "realtime is not running in this process")

    async def events() -> AsyncGenerator[bytes, None]:
        async with hub.watch(run_id) as changed:
            last = None
            while True:
                # in the environment's turns, as the API's streams (run_engine/api/stream.py)
                try:
                    async with dash.ctx.costly_reads.turn(dash.env.id):
                        run = await engine.get_run(run_id, dash.env.id, light=True)
                except Exception as exc:
                    if not unreadable(exc):  # PostgreSQL away: read again at the next wake or recheck
                        raise
                else:
                    if run is None:
                        return
                    if (run.status, run.updated_at) != last:
                        if last is not None:
                            yield b"event: changed\ndata: " + run.status.encode() + b"\n\n"
                        last = (run.status, run.updated_at)
                        if RunStatus(run.status) in FINAL_RUN_STATUSES:
                            # the last change may still be settling (output, snapshots): one more look
                            await asyncio.sleep(THROTTLE_S)
                            yield b"event: changed\ndata: final\n\n"
                            return
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECHECK_S)
                if not changed.is_set():
                    yield b": keep-alive\n\n"

    return _stream(request, dash, events())


@page
async def env_events(request: Request, dash: Dash) -> Response:
    hub = dash.ctx.realtime
    if hub is None:
        raise ApiError(503, "unavailable", "realtime is not running in this process")

    async def events() -> AsyncGenerator[bytes, None]:
        async with hub.watch(env_key(dash.env.id)) as changed:
            while True:
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                yield b"event: changed\ndata: runs\n\n"
                await asyncio.sleep(THROTTLE_S)

    return _stream(request, dash, events())
