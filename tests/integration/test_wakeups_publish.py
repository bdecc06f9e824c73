"""Wake-ups across server processes: a server alone on its channel stops publishing (only its own
subscription would hear), and starts again once another process subscribes, whose waiters are
then woken."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis

from run_engine.wakeups import ALONE_RECHECK_S, WakeUps


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def _ticks() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_lone_server_skips_publish_until_another_process_listens(redis_client: Redis, unique: str) -> None:
    channel = f"test-wake-{unique}"
    alone, other = WakeUps(redis_client, channel=channel), WakeUps(redis_client, channel=channel)
    await alone.start()
    try:
        await _until("subscribed", lambda: alone._subscription.subscribed)
        alone.notify("g")
        await _until("the first wake-up published", lambda: alone.published == 1)
        for _ in range(5):  # only its own subscription heard that one: these are not published
            alone.notify("g")
            await _ticks()
        assert alone.published == 1
        await other.start()
        await _until("the other process subscribed", lambda: other._subscription.subscribed)
        woken = asyncio.ensure_future(other.wait("g", 30))
        # within ALONE_RECHECK_S the lone server publishes again, hears of the other, and keeps on
        began = time.monotonic()
        while not woken.done():
            assert time.monotonic() - began < ALONE_RECHECK_S + 5, "the other process was never woken"
            alone.notify("g")
            await asyncio.sleep(0.05)
        assert await woken
        published = alone.published
        alone.notify("g")
        await _until("published at once now", lambda: alone.published == published + 1)
    finally:
        await alone.stop()
        await other.stop()
