"""From a review of realtime at 3 a.m.: a stream whose read of its run fails because PostgreSQL is
away (a failover, a restart: no connection for the pool's 10 s) stays open and reads again at its
next wake or recheck, so its client gets the change it missed once PostgreSQL is back; before, the
error cut the response short (a chunked body left unfinished, two tracebacks logged per stream)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from psycopg_pool import PoolTimeout

from run_engine.api.app import create_app

from .conftest import Harness
from .test_realtime_review import events
from .test_realtime_tenancy import realtime_app, until, waiting_run
from .test_stream_credentials import streaming


class Outage:
    """``h.engine.get_run`` of ``run_id`` failing as while PostgreSQL is away, until ``up()``."""

    def __init__(self, h: Harness, monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
        self.down = False
        self.failed = 0
        self.full_reads = 0
        self.reads = 0
        get_run = h.engine.get_run

        async def flaky(run_id_: str, env_id: str | None = None, *, light: bool = False) -> Any:
            if run_id_ == run_id and self.down:
                self.failed += 1
                raise PoolTimeout("couldn't get a connection after 10.00 sec")
            got = await get_run(run_id_, env_id, light=light)
            if run_id_ == run_id:
                self.reads += 1
                self.full_reads += not light
            return got

        monkeypatch.setattr(h.engine, "get_run", flaky)


async def test_a_run_stream_goes_on_past_an_outage_and_sends_what_changed_meanwhile(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    async with streaming(h, monkeypatch) as (run_id, answer):
        outage = Outage(h, monkeypatch, run_id)
        await until(lambda: outage.full_reads == 1 or answer.done(), "the first event")
        outage.down = True
        await h.engine.set_metadata(h.env.env_id, run_id, {"n": 1})  # while the stream cannot read
        await until(lambda: outage.failed >= 3 or answer.done(), "reads failing at the stream's rechecks")
        assert not answer.done()  # before: the first failure ended the response, cut short
        outage.down = False
        await until(lambda: outage.full_reads == 2, "the change made meanwhile read once PostgreSQL is back")
        await h.engine.cancel(run_id)
        got = await asyncio.wait_for(answer, 20)
    assert got.status_code == 200
    assert [(e["status"], e["metadata"]) for e in events(got.text)] == [
        ("DELAYED", {}), ("DELAYED", {"n": 1}), ("CANCELED", {"n": 1})]


async def test_a_live_run_page_goes_on_past_an_outage(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.dashboard import live

    from .test_dashboard_sessions import sign_in

    monkeypatch.setattr(live, "RECHECK_S", 0.05)
    monkeypatch.setattr(live, "THROTTLE_S", 0.01)
    run_id = await waiting_run(h, h.env)
    async with realtime_app(h) as ctx, httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                                         base_url="http://t") as c:
        await sign_in(c, h.env.api_key)
        outage = Outage(h, monkeypatch, run_id)
        page = asyncio.ensure_future(c.get(f"/dashboard/runs/{run_id}/events"))
        try:
            await until(lambda: outage.reads >= 2 or page.done(), "the page open, its first read made")
            outage.down = True
            await until(lambda: outage.failed >= 3 or page.done(), "reads failing at the page's rechecks")
            assert not page.done()  # before: the first failure ended the response, cut short
            outage.down = False
            await h.engine.cancel(run_id)
            answer = await asyncio.wait_for(page, 20)
        finally:
            page.cancel()
    assert answer.status_code == 200 and "event: changed\ndata: final" in answer.text
