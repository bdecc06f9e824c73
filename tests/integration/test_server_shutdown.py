"""A stop asked for at any moment of the server's start-up or serving ends it cleanly: nothing
left running, no signal lost (a Ctrl-C right after `run-engine dev` printed its credentials used
to be lost, and the process ran on)."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from run_engine.server import Shutdown, serve
from run_engine.settings import EngineSettings

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.01, 0.03, 0.1, 0.3, 1.0])
async def test_a_signal_at_any_moment_stops_the_server(database_url: str, redis_url: str, key_prefix: str,
                                                       delay_s: float) -> None:
    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=f"{key_prefix}:shutdown")
    shutdown = Shutdown()  # not installed: the test delivers the signal to it by hand
    before = {t for t in asyncio.all_tasks()}
    serving = asyncio.create_task(serve(settings, host="127.0.0.1", port=_free_port(), secret="s", shutdown=shutdown))
    await asyncio.sleep(delay_s)
    shutdown._on_signal(signal.SIGTERM, None)
    await asyncio.wait_for(serving, 30)  # returns, without raising
    left = {t for t in asyncio.all_tasks() if t not in before and not t.done()} - {asyncio.current_task()}
    assert not left, left
    assert shutdown.requested


async def test_a_cancel_from_an_embedding_program_propagates(database_url: str, redis_url: str,
                                                            key_prefix: str) -> None:
    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=f"{key_prefix}:shutdown")
    started = asyncio.Event()
    serving = asyncio.create_task(serve(settings, host="127.0.0.1", port=_free_port(), secret="s",
                                        on_started=started.set))
    await asyncio.wait_for(started.wait(), 30)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(serving, 30)


async def test_a_cancel_during_a_redis_close_still_closes_its_connections(redis_url: str) -> None:
    """redis-py closes a pool's connections in the tasks of a gather: a cancel that reaches the
    gather first leaves their sockets open (a stop signal during start-up did, one run in ~12 of
    this file). ``close_fully`` closes them, then lets the cancel go on."""
    import redis.asyncio as aioredis

    from run_engine.redis_connect import close_fully

    client = aioredis.Redis.from_url(redis_url)
    await client.ping()
    (conn,) = client.connection_pool._available_connections  # type: ignore[attr-defined]
    assert conn.is_connected
    closing = asyncio.ensure_future(close_fully(client))
    await asyncio.sleep(0)  # inside the pool's gather, its tasks not started yet
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not conn.is_connected  # (redis-py's aclose, cancelled there, leaves it connected)


@pytest.mark.parametrize(("pool_max", "per_env", "total"), [(8, 2, 4), (4, 1, 2), (2, 1, 1), (1, 1, 1), (32, 2, 4)])
async def test_costly_reads_take_at_most_half_of_the_pool(database_url: str, redis_url: str, key_prefix: str,
                                                          pool_max: int, per_env: int, total: int) -> None:
    """With four turns whatever the pool, a pool of four let the tenants' list and shape reads hold
    every connection: trigger, dequeue and complete waited behind them."""
    from run_engine.server import api_context

    settings = EngineSettings(database_url=database_url, redis_url=redis_url, key_prefix=f"{key_prefix}:gate",
                              db_pool_max=pool_max, db_pool_min=1)
    async with api_context(settings, secret="s", public_url="http://t") as ctx:
        assert (ctx.costly_reads.per_key, ctx.costly_reads.total) == (per_env, total)
