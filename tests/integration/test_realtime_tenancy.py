"""From a review of realtime as one tenant against another: how often a run's streams read their
run is the tenant's to decide (a hundred streams of a run whose metadata it changes a thousand times
a second), so those reads take the environment's turns of the costly reads (ReadGate), as its
shapes and lists do, and never queue in front of another tenant's for the database pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from run_engine.api.app import create_app
from run_engine.api.context import ApiContext
from run_engine.engine import TriggerRequest
from run_engine.realtime import RealtimeHub
from run_engine.run_tokens import RunTokens
from run_engine.tenancy import Environment, ensure_environment
from run_engine.wakeups import WakeUps

from .conftest import Harness


async def until(check: Any, what: str, deadline_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not check():
        assert loop.time() < end, f"not within {deadline_s} s: {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def realtime_app(h: Harness) -> AsyncIterator[ApiContext]:
    prefix = h.engine.resources.settings.key_prefix
    hub = RealtimeHub(h.engine.redis, prefix=prefix)
    await hub.start()
    try:
        yield ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t", realtime=hub,
                         wakeups=WakeUps(h.engine.redis, channel=f"{prefix}:wake"), secret="test-secret")
    finally:
        await hub.stop()


async def waiting_run(h: Harness, env: Environment) -> str:
    months = datetime.fromtimestamp(h.clock.now() + 90 * 86400, UTC)
    run = await h.engine.trigger(TriggerRequest(env_id=env.env_id, task_id="hello", delay_until=months, payload=1))
    return run.id


async def test_a_tenants_stream_reads_wait_for_its_own_turns_while_anothers_stream_goes_on(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a stream read its run whenever it was woken, outside any turn: a tenant's hundred
    streams of one run whose metadata changed as fast as it could change it kept a hundred reads
    (each a whole run, its payload of megabytes maybe) queued for the eight connections of the pool
    and the event loop every tenant shares; another tenant's read of one run took 0.6 s (median,
    1.3 s at p95) instead of 6 ms. Now its streams wait for its own two turns."""
    from run_engine.api import stream

    monkeypatch.setattr(stream, "RECHECK_S", 0.05)
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.1)
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    mine, theirs = await waiting_run(h, h.env), await waiting_run(h, other)
    full_reads: list[str] = []
    get_run = h.engine.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        if not light:
            full_reads.append(run_id)
        return await get_run(run_id, env_id, light=light)

    monkeypatch.setattr(h.engine, "get_run", counted)
    async with realtime_app(h) as ctx:
        gate = ctx.costly_reads
        app = create_app(ctx)
        async with (httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                      headers={"Authorization": f"Bearer {h.env.api_key}"}) as a,
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                      headers={"Authorization": f"Bearer {other.api_key}"}) as b):
            streams = [asyncio.ensure_future(a.get(f"/realtime/v1/runs/{mine}")),
                       asyncio.ensure_future(b.get(f"/realtime/v1/runs/{theirs}"))]
            try:
                await until(lambda: full_reads.count(mine) == 1 and full_reads.count(theirs) == 1,
                            "each stream's first event")
                release = asyncio.Event()
                held = 0

                async def hold() -> None:  # the tenant's costly reads in flight (its lists, its other streams)
                    nonlocal held
                    async with gate.turn(h.env.env_id):
                        held += 1
                        await release.wait()

                hogs = [asyncio.create_task(hold()) for _ in range(2)]
                await until(lambda: held == 2, "the tenant's two turns taken")
                await h.engine.set_metadata(h.env.env_id, mine, {"n": 1})
                await h.engine.set_metadata(other.env_id, theirs, {"n": 1})
                # its stream's read waits for one of its turns (before: it read at once, outside any)
                await until(lambda: gate.waiting_or_reading(h.env.env_id) == 3, "the stream waiting for a turn")
                await until(lambda: full_reads.count(theirs) == 2, "the other tenant's event")
                assert full_reads.count(mine) == 1
                release.set()
                await asyncio.gather(*hogs)
                await until(lambda: full_reads.count(mine) == 2, "the tenant's event once its turns are back")
                await h.engine.cancel(mine)
                await h.engine.cancel(theirs)
                answers = await asyncio.wait_for(asyncio.gather(*streams), 20)
            finally:
                for s in streams:
                    s.cancel()
    for answer in answers:
        assert answer.status_code == 200
        assert '"metadata":{"n":1}' in answer.text and '"status":"CANCELED"' in answer.text
    assert gate.waiting_or_reading(h.env.env_id) == 0


async def test_a_live_run_page_reads_its_run_light_and_in_its_environments_turns(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run page's live stream looks at the run's status and last change alone. Before, it read
    the run whole (its payload of megabytes, maybe, decoded on the shared loop) at every wake and
    every recheck, outside any turn: a page open on a run whose metadata changed fast read it whole
    at every change."""
    from run_engine.dashboard import live

    from .test_dashboard_sessions import sign_in

    monkeypatch.setattr(live, "RECHECK_S", 0.05)
    monkeypatch.setattr(live, "THROTTLE_S", 0.01)
    run_id = await waiting_run(h, h.env)
    reads: list[bool] = []  # light or not, the page's reads of its run
    get_run = h.engine.get_run

    async def counted(run_id_: str, env_id: str | None = None, *, light: bool = False) -> Any:
        if run_id_ == run_id:
            reads.append(light)
        return await get_run(run_id_, env_id, light=light)

    async with realtime_app(h) as ctx:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                     base_url="http://t") as c:
            await sign_in(c, h.env.api_key)
            monkeypatch.setattr(h.engine, "get_run", counted)
            page = asyncio.ensure_future(c.get(f"/dashboard/runs/{run_id}/events"))
            try:
                await until(lambda: len(reads) >= 3, "the page's first reads and rechecks")
                release = asyncio.Event()
                held = 0

                async def hold() -> None:
                    nonlocal held
                    async with ctx.costly_reads.turn(h.env.env_id):
                        held += 1
                        await release.wait()

                hogs = [asyncio.create_task(hold()) for _ in range(2)]
                await until(lambda: held == 2, "the tenant's two turns taken")
                await h.engine.set_metadata(h.env.env_id, run_id, {"n": 1})
                await until(lambda: ctx.costly_reads.waiting_or_reading(h.env.env_id) == 3,
                            "the page's read waiting for a turn")
                release.set()
                await asyncio.gather(*hogs)
                await h.engine.cancel(run_id)
                answer = await asyncio.wait_for(page, 20)
            finally:
                page.cancel()
    assert answer.status_code == 200
    assert "event: changed\ndata: final" in answer.text
    assert reads and all(reads), f"the page read its run whole {reads.count(False)} times"
