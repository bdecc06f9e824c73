"""RUN_ENGINE_LOCK_REDIS_URLS: the run locks on three independent redis-server processes (RedLock,
a majority of them); one node is killed while runs go through trigger → dequeue → start →
complete, and the locks go on: every run finishes once, in its first attempt. And the locker alone
over two live nodes and a dead one. (Not run on the Redis Cluster: the nodes are independent.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from run_engine.embedded import EmbeddedRedis
from run_engine.engine import TriggerRequest
from run_engine.errors import ConfigurationError, LockTimeoutError
from run_engine.locking import LockSettings, RunLocker
from run_engine.settings import EngineSettings, lock_nodes

from .conftest import Harness

RUNS = 150
FAST = LockSettings(duration_s=0.3, extend_before_s=0.15, max_attempts=4, base_delay_s=0.01, max_delay_s=0.05,
                    max_total_wait_s=0.2)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[EmbeddedRedis]]:
    started = [EmbeddedRedis(tmp_path / f"lock-{i}") for i in range(3)]
    for node in started:
        node.start()
    yield started
    for node in started:
        node.stop()


async def _lock_keys(url: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return len([k async for k in client.scan_iter(match="*:{lock}:*")])
    finally:
        await client.aclose()


async def test_locks_go_on_when_one_of_three_nodes_dies(make_engine: Callable[..., Any],
                                                        nodes: list[EmbeddedRedis]) -> None:
    h: Harness = await make_engine(lock_redis_urls=tuple(n.url for n in nodes))
    await h.deploy({"id": "hello"})
    assert len(h.engine.resources.locker.nodes) == 3
    finished: dict[str, int] = {}
    killed = asyncio.Event()
    seen_on_nodes: list[int] = []
    probed = False

    async def worker() -> None:
        nonlocal probed
        while len(finished) < RUNS:
            got = await h.engine.dequeue(h.env.worker_group_id, 5)
            if not got:
                await asyncio.sleep(0.01)
                continue
            for d in got:
                started = await h.engine.start_attempt(d.run.id, d.snapshot.id)
                if not killed.is_set() and not probed:
                    probed = True
                    async with h.engine.resources.locker.lock("probe", d.run.id):  # held on every node
                        seen_on_nodes.extend([await _lock_keys(n.url) for n in nodes])
                await h.engine.complete_attempt(d.run.id, started.snapshot.id, ok=True, output=d.run.payload)
                finished[d.run.id] = started.attempt_number
                if len(finished) == RUNS // 3 and not killed.is_set():
                    nodes[2].stop()  # one of three: a majority is still there
                    killed.set()

    ids = [(await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i))).id
           for i in range(RUNS)]
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(4))), timeout=120)
    assert killed.is_set() and all(count >= 1 for count in seen_on_nodes) and len(seen_on_nodes) == 3
    assert sorted(finished) == sorted(ids) and set(finished.values()) == {1}
    for run_id in ids[:10] + ids[-10:]:
        assert await h.statuses(run_id) == ["QUEUED", "PENDING_EXECUTING", "EXECUTING", "FINISHED"]


def test_the_setting_refuses_an_even_count_and_bad_urls() -> None:
    assert lock_nodes("redis://a:1, redis://b:2,redis://c:3") == ("redis://a:1", "redis://b:2", "redis://c:3")
    for raw, reason in (("redis://a:1,redis://b:2", "odd number"), ("http://a:1", "not a redis:// URL"),
                        ("redis://a:1,redis://a:1,redis://b:1", "listed twice")):
        with pytest.raises(ConfigurationError, match=reason):
            lock_nodes(raw)
    settings = EngineSettings.from_env({"RUN_ENGINE_LOCK_REDIS_URLS": "redis://a:1,redis://b:2,redis://c:3"})
    assert settings.lock_redis_urls == ("redis://a:1", "redis://b:2", "redis://c:3")
    assert EngineSettings.from_env({}).lock_redis_urls == ()


async def test_quorum_over_three_nodes_with_one_down(redis_url: str, key_prefix: str, unique: str) -> None:
    up1, up2 = aioredis.Redis.from_url(redis_url, db=1), aioredis.Redis.from_url(redis_url, db=2)
    down = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    try:
        lk = RunLocker([up1, up2, down], prefix=f"{key_prefix}:lq{unique}", settings=FAST)
        async with lk.lock("q", "run_q"):
            assert await up1.exists(f"{key_prefix}:lq{unique}:{{lock}}:run_q") == 1
        two_down = RunLocker([up1, down, aioredis.Redis(host="127.0.0.1", port=2, socket_connect_timeout=0.2)],
                             prefix=f"{key_prefix}:lq{unique}", settings=FAST)
        with pytest.raises(LockTimeoutError):
            async with two_down.lock("q", "run_q"):
                pass
        assert await up1.exists(f"{key_prefix}:lq{unique}:{{lock}}:run_q") == 0  # the minority grant was undone
    finally:
        for c in (up1, up2, down):
            await c.aclose()
