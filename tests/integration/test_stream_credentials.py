"""An open stream lasts only as long as the credential that opened it: a public token that
expires while a run waits for months ends its stream. In process (ASGI), the engine's clock fake."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

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


async def test_a_stream_ends_when_its_token_expires(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from run_engine.api import stream

    monkeypatch.setattr(stream, "RECHECK_S", 0.05)
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.1)
    await h.deploy({"id": "hello"})
    months = datetime.fromtimestamp(h.clock.now() + 90 * 86400, UTC)  # the run waits three months
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", delay_until=months))
    hub = RealtimeHub(h.engine.redis, prefix=h.engine.resources.settings.key_prefix)
    await hub.start()
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t", realtime=hub,
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     secret="test-secret")
    now = int(h.clock.now())
    token = sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                 "exp": now + 600, "scopes": [f"read:runs:{run.id}"]})
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t",
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            streaming = asyncio.ensure_future(client.get(f"/realtime/v1/runs/{run.id}"))
            await asyncio.sleep(0.5)
            assert not streaming.done()  # the token holds: the stream goes on
            h.clock.advance(3600)  # the token expires
            answer = await asyncio.wait_for(streaming, 20)  # the stream ended (the transport buffers it)
        assert answer.status_code == 200 and answer.text.startswith("event: run")
    finally:
        await hub.stop()


async def test_a_stream_of_a_one_time_token_goes_on_past_its_checks(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking the credential again is not a second use of a one-time token (nor a request
    counted against its rate): the stream goes on until its run ends."""
    from run_engine.api import stream

    monkeypatch.setattr(stream, "RECHECK_S", 0.05)
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.1)
    await h.deploy({"id": "hello"})
    months = datetime.fromtimestamp(h.clock.now() + 90 * 86400, UTC)
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", delay_until=months))
    hub = RealtimeHub(h.engine.redis, prefix=h.engine.resources.settings.key_prefix)
    await hub.start()
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t", realtime=hub,
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"),
                     secret="test-secret")
    now = int(h.clock.now())
    token = sign(h.env.api_key, {"sub": h.env.env_id, "pub": True, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                 "exp": now + 600, "scopes": [f"read:runs:{run.id}"], "otu": True})
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t",
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            streaming = asyncio.ensure_future(client.get(f"/realtime/v1/runs/{run.id}"))
            await asyncio.sleep(0.5)
            assert not streaming.done()  # checked several times meanwhile, still open
            await h.engine.cancel(run.id)
            answer = await asyncio.wait_for(streaming, 20)
        assert answer.status_code == 200 and '"status":"CANCELED"' in answer.text
    finally:
        await hub.stop()
