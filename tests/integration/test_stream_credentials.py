"""An open stream lasts only as long as the credential that opened it: a public token that
expires while a run waits for months ends its stream. In process (ASGI), the engine's clock fake."""

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
from run_engine.api.public_tokens import AUDIENCE, ISSUER, sign
from run_engine.engine import TriggerRequest
from run_engine.realtime import RealtimeHub
from run_engine.run_tokens import RunTokens
from run_engine.wakeups import WakeUps

from .conftest import Harness


@contextlib.asynccontextmanager
async def streaming(h: Harness, monkeypatch: pytest.MonkeyPatch,
                    **claims: Any) -> AsyncIterator[tuple[str, asyncio.Future[httpx.Response]]]:
    """A run that waits three months and its stream, opened with a public token of ``claims``
    (checked every 0.05 s): the run's id and the answer to come (the transport buffers it)."""
    from run_engine.api import stream

    monkeypatch.setattr(stream, "RECHECK_S", 0.05)
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.1)
    await h.deploy({"id": "hello"})
    months = datetime.fromtimestamp(h.clock.now() + 90 * 86400, UTC)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", delay_until=months))
    prefix = h.engine.resources.settings.key_prefix
    hub = RealtimeHub(h.engine.redis, prefix=prefix)
    await hub.start()
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t", realtime=hub,
                     wakeups=WakeUps(h.engine.redis, channel=f"{prefix}:wake"), secret="test-secret")
    now = int(h.clock.now())
    token = sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                 "exp": now + 600, "scopes": [f"read:runs:{run.id}"], **claims})
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t",
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            answer = asyncio.ensure_future(client.get(f"/realtime/v1/runs/{run.id}"))
            try:
                yield run.id, answer
            finally:
                answer.cancel()
    finally:
        await hub.stop()


async def test_a_stream_ends_when_its_token_expires(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    async with streaming(h, monkeypatch) as (_, answer):
        await asyncio.sleep(0.5)
        assert not answer.done()  # the token holds: the stream goes on
        h.clock.advance(3600)  # the token expires
        got = await asyncio.wait_for(answer, 20)  # the stream ended
    assert got.status_code == 200 and got.text.startswith("event: run")


async def test_a_stream_of_a_one_time_token_goes_on_past_its_checks(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking the credential again is not a second use of a one-time token (nor a request
    counted against its rate): the stream goes on until its run ends."""
    async with streaming(h, monkeypatch, otu=True) as (run_id, answer):
        await asyncio.sleep(0.5)
        assert not answer.done()  # checked several times meanwhile, still open
        await h.engine.cancel(run_id)
        got = await asyncio.wait_for(answer, 20)
    assert got.status_code == 200 and '"status":"CANCELED"' in got.text


async def test_a_stream_reads_the_whole_run_only_when_it_changed(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Woken by every change of its run and every RECHECK_S, a stream looks at the run's status and
    last change alone; the whole run (its payload: megabytes maybe, decoded on the loop every
    tenant shares) is read for an event to send only: once per change (a metadata change is one,
    API.md: "on every change"), never for a wake or a recheck that finds none. Before, every stream
    of a run re-read it whole on every change and every recheck."""
    full_reads: list[str] = []
    first, second = asyncio.Event(), asyncio.Event()
    get_run = h.engine.get_run

    async def counted(run_id: str, env_id: str | None = None, *, light: bool = False) -> Any:
        if not light:
            full_reads.append(run_id)
            (second if first.is_set() else first).set()
        return await get_run(run_id, env_id, light=light)

    monkeypatch.setattr(h.engine, "get_run", counted)
    async with streaming(h, monkeypatch) as (run_id, answer):
        await asyncio.wait_for(first.wait(), 20)  # the first event's read
        await h.engine.set_metadata(h.env.env_id, run_id, {"n": 1})  # wakes the stream: one change
        await asyncio.wait_for(second.wait(), 20)  # its event's read
        await asyncio.sleep(0.5)  # rechecks every 0.05 s meanwhile
        assert full_reads == [run_id, run_id]
        await h.engine.cancel(run_id)
        got = await asyncio.wait_for(answer, 20)
    assert '"status":"CANCELED"' in got.text and full_reads == [run_id, run_id, run_id]
