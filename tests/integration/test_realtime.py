"""RealtimeHub across two "processes" (two hubs on one Redis): a watched run's changes published by
one reach the watcher on the other; unwatched runs publish nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from run_engine.events import RunEvent
from run_engine.realtime import RealtimeHub
from run_engine.redis_connect import clustered
from run_engine.redis_connect import connect as connect_redis

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def _until(predicate, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_change_on_one_process_wakes_the_watcher_on_another(redis_url: str, key_prefix: str,
                                                                    unique: str) -> None:
    ra, rb = await connect_redis(redis_url), await connect_redis(redis_url)
    engine_side, sse_side = (RealtimeHub(ra, prefix=f"{key_prefix}:{unique}"),
                             RealtimeHub(rb, prefix=f"{key_prefix}:{unique}"))
    await engine_side.start()
    await sse_side.start()
    published: list[str] = []
    real_publish = ra.publish

    async def spy(channel, message):  # type: ignore[no-untyped-def]
        if channel == engine_side.channel:
            published.append(message)
        return await real_publish(channel, message)

    ra.publish = spy  # type: ignore[method-assign]
    try:
        async def subscribers() -> int:
            on = {"target_nodes": "all"} if clustered(ra) else {}  # a cluster counts per node
            counts = dict(await ra.pubsub_numsub(engine_side.ctl, engine_side.channel, **on))
            return min(int(n) for n in counts.values())

        deadline = time.monotonic() + 10
        while await subscribers() < 2:  # both hubs listen on both channels
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        engine_side.on_event(RunEvent("run_dequeued", "run_unwatched", "env"))
        await asyncio.sleep(0.1)
        assert published == []  # nobody watches it: no PUBLISH at all
        async with sse_side.watch("run_w") as changed:
            await _until(lambda: "run_w" in engine_side._watched)  # the announcement arrived
            engine_side.on_event(RunEvent("attempt_started", "run_w", "env"))
            await asyncio.wait_for(changed.wait(), 10)
        assert published == ["run_w"]
        # a process started later learns the watched runs from Redis
        late = RealtimeHub(ra, prefix=f"{key_prefix}:{unique}")
        await late.start()
        assert "run_w" in late._watched
        await late.stop()
    finally:
        for hub in (engine_side, sse_side):
            await hub.stop()
        await ra.aclose()
        await rb.aclose()


async def test_watches_nobody_renews_are_forgotten_in_memory_and_in_redis(
        redis_url: str, key_prefix: str, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run ever streamed stayed watched: in each process's memory and in Redis, for good."""
    from run_engine import realtime

    monkeypatch.setattr(realtime, "WATCH_TTL_S", 0.2)
    redis = await connect_redis(redis_url)
    hub = RealtimeHub(redis, prefix=f"{key_prefix}:{unique}")
    try:
        async with hub.watch("run_gone"):
            pass
        assert "run_gone" in hub._watched
        deadline = time.monotonic() + 10
        while "run_gone" in hub._watched or await redis.zscore(hub.watch_key, "run_gone") is not None:
            assert time.monotonic() < deadline, "the expired watch is still there"
            async with hub.watch("run_live"):  # someone streams another run: the prune comes with it
                pass
            await asyncio.sleep(0.05)
        assert "run_live" in hub._watched
    finally:
        await hub.stop()
        await redis.delete(hub.watch_key)
        await redis.aclose()
