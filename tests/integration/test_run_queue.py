"""The run queue's Lua scripts on real Redis: limits, fairness, priority, delays, pause, DLQ."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from run_engine.run_queue import EnqueueItem, RunQueue

NOW = 1_700_000_000_000


@pytest.fixture
async def q(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> RunQueue:
    queue = RunQueue(redis_client, prefix=f"{key_prefix}:q{unique}", shards=2, max_deliveries=3,
                     default_env_limit=1000)
    await queue.load_scripts()
    return queue


def item(run: str, env: str = "envA", queue: str = "task/a", score: float = NOW, **kw: object) -> EnqueueItem:
    return EnqueueItem(run_id=run, env_id=env, queue=queue, worker_group="wg", score_ms=score, **kw)  # type: ignore[arg-type]


async def test_enqueue_dequeue_ack_frees_the_slot(q: RunQueue) -> None:
    await q.enqueue([item("r1"), item("r2", score=NOW + 1)], NOW)
    assert (await q.queue_stats("envA", "task/a")).queued == 2
    got = await q.dequeue("wg", 1, NOW)
    assert [m.run_id for m in got] == ["r1"] and got[0].deliveries == 1 and got[0].queue == "task/a"
    assert await q.running_ids("envA") == {"r1"}
    await q.ack([("envA", "r1")])
    assert await q.running_ids("envA") == set()
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r2"]
    assert await q.dequeue("wg", 5, NOW) == []
    assert await q.has_messages([("envA", "r1"), ("envA", "r2")]) == [False, True]


async def test_a_run_is_only_handed_to_its_own_worker_group(q: RunQueue) -> None:
    await q.enqueue([EnqueueItem("r1", "envA", "task/a", "other", NOW)], NOW)
    assert await q.dequeue("wg", 5, NOW) == []
    assert [m.run_id for m in await q.dequeue("other", 5, NOW)] == ["r1"]


async def test_priority_is_a_head_start(q: RunQueue) -> None:
    await q.enqueue([item("old", score=NOW), item("new", score=NOW + 5000),
                     item("urgent", score=NOW + 6000 - 10_000)], NOW + 6000)
    assert [m.run_id for m in await q.dequeue("wg", 3, NOW + 6000)] == ["urgent", "old", "new"]


async def test_not_due_runs_are_invisible_until_due(q: RunQueue) -> None:
    await q.enqueue([item("later", available_at_ms=NOW + 1000)], NOW)
    assert await q.dequeue("wg", 5, NOW + 999) == []
    assert (await q.queue_stats("envA", "task/a")).queued == 1
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 1000)] == ["later"]


async def test_env_queue_and_key_limits(q: RunQueue) -> None:
    await q.set_env_limit("envA", 3)
    await q.set_queue_limit("envA", "limited", 2)
    await q.set_key_limit("envA", "keyed", 1)
    await q.enqueue([item(f"l{i}", queue="limited", score=NOW + i) for i in range(4)]
                    + [item(f"k{i}", queue="keyed", score=NOW + 10 + i, concurrency_key="same") for i in range(3)], NOW)
    got = await q.dequeue("wg", 10, NOW)
    runs = {m.run_id for m in got}
    assert len(got) == 3  # the env limit
    assert len(runs & {"l0", "l1", "l2", "l3"}) <= 2 and len(runs & {"k0", "k1", "k2"}) <= 1
    await q.set_env_limit("envA", 100)
    more = {m.run_id for m in await q.dequeue("wg", 10, NOW)}
    assert len((runs | more) & {"l0", "l1", "l2", "l3"}) == 2 and len((runs | more) & {"k0", "k1", "k2"}) == 1


async def test_pause_stops_dequeue_and_resume_restarts_it(q: RunQueue) -> None:
    await q.enqueue([item("r1"), item("o1", queue="other")], NOW)
    await q.pause("envA", "task/a")
    assert (await q.queue_stats("envA", "task/a")).paused
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["o1"]
    assert await q.dequeue("wg", 5, NOW) == []
    await q.resume("envA", "task/a")
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r1"]


async def test_env_fairness_small_tenant_is_not_starved(q: RunQueue) -> None:
    big = [item(f"a{i}", env="envBig", score=NOW + i) for i in range(10_000)]
    for start in range(0, len(big), 1000):
        await q.enqueue(big[start:start + 1000], NOW)
    # the big tenant has already been served a while
    for _ in range(20):
        got = await q.dequeue("wg", 10, NOW + 20_000)
        await q.ack([(m.env_id, m.run_id) for m in got])
    await q.enqueue([item(f"b{i}", env="envSmall", score=NOW + 10_000 + i) for i in range(10)], NOW + 20_000)
    order: list[str] = []
    while len(order) < 30:
        got = await q.dequeue("wg", 5, NOW + 20_000)
        order += [m.run_id for m in got]
        await q.ack([(m.env_id, m.run_id) for m in got])
    small = [r for r in order if r.startswith("b")]
    assert len(small) == 10, order


async def test_key_fairness_inside_one_queue(q: RunQueue) -> None:
    big = [item(f"big{i}", concurrency_key="big", score=NOW + i) for i in range(10_000)]
    for start in range(0, len(big), 1000):
        await q.enqueue(big[start:start + 1000], NOW)
    await q.enqueue([item(f"small{i}", concurrency_key="small", score=NOW + 20_000 + i) for i in range(10)], NOW)
    order: list[str] = []
    while len(order) < 30:
        got = await q.dequeue("wg", 5, NOW + 30_000)
        order += [m.run_id for m in got]
        await q.ack([(m.env_id, m.run_id) for m in got])
    assert len([r for r in order if r.startswith("small")]) == 10, order


async def test_nack_backs_off_then_dead_letters_and_redrive_resets(q: RunQueue) -> None:
    await q.enqueue([item("r1", task="t")], NOW)
    now = NOW
    for delivery in (1, 2):
        [m] = await q.dequeue("wg", 1, now)
        assert m.deliveries == delivery
        res = await q.nack("envA", "r1", now)
        assert not res.dead_lettered and res.available_at_ms is not None
        backoff = res.available_at_ms - now
        assert 1000 * 2 ** (delivery - 1) <= backoff <= 2 * 1000 * 2 ** (delivery - 1)
        assert await q.running_ids("envA") == set()
        assert await q.dequeue("wg", 1, res.available_at_ms - 1) == []
        now = res.available_at_ms
    await q.dequeue("wg", 1, now)
    res = await q.nack("envA", "r1", now)
    assert res.dead_lettered and res.deliveries == 3
    [entry] = await q.list_dlq("envA")
    assert (entry.run_id, entry.task, entry.deliveries, entry.queue) == ("r1", "t", 3, "task/a")
    assert await q.dequeue("wg", 5, now + 10**7) == []
    assert await q.redrive("envA", "r1", now) is True
    assert await q.list_dlq("envA") == []
    [m] = await q.dequeue("wg", 1, now)
    assert m.run_id == "r1" and m.deliveries == 1
    assert await q.redrive("envA", "r1", now) is False  # not in the DLQ any more


async def test_release_frees_slots_and_reenqueue_of_held_run_frees_them(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item("r1"), item("r2", score=NOW + 1)], NOW)
    await q.dequeue("wg", 5, NOW)
    await q.release("envA", "r1")
    assert await q.running_ids("envA") == set()
    [m] = await q.dequeue("wg", 5, NOW)
    assert m.run_id == "r2"
    # re-enqueue of a held run (a retry) frees its slot and keeps it out until due
    await q.enqueue([item("r2", available_at_ms=NOW + 500)], NOW)
    assert await q.running_ids("envA") == set()
    assert await q.dequeue("wg", 5, NOW) == []
    [m] = await q.dequeue("wg", 5, NOW + 500)
    assert m.run_id == "r2" and m.deliveries == 2
    await q.enqueue([item("r2", reset_deliveries=True)], NOW + 500)
    [m] = await q.dequeue("wg", 5, NOW + 500)
    assert m.deliveries == 1


async def test_remove_takes_a_run_out_from_anywhere(q: RunQueue) -> None:
    await q.enqueue([item("ready"), item("delayed", available_at_ms=NOW + 10)], NOW)
    assert await q.remove("envA", "ready") and await q.remove("envA", "delayed")
    assert not await q.remove("envA", "never")
    assert await q.dequeue("wg", 5, NOW + 100) == []
    assert (await q.queue_stats("envA", "task/a")).queued == 0


async def test_limits_hold_under_many_concurrent_dequeuers(q: RunQueue, redis_url: str) -> None:
    await q.set_env_limit("envA", 7)
    await q.set_queue_limit("envA", "task/a", 5)
    await q.set_key_limit("envA", "task/b", 2)
    items = [item(f"a{i}", score=NOW + i) for i in range(150)]
    items += [item(f"b{i}", queue="task/b", concurrency_key=f"k{i % 3}", score=NOW + i) for i in range(150)]
    await q.enqueue(items, NOW)
    held: dict[str, str] = {}
    violations: list[str] = []
    done: list[str] = []

    async def worker(n: int) -> None:
        client = aioredis.Redis.from_url(redis_url)
        mine = RunQueue(client, prefix=q.keys.prefix, shards=2, default_env_limit=1000)
        try:
            idle = 0
            while idle < 5:
                got = await mine.dequeue("wg", 3, NOW)
                if not got:
                    idle += 1
                    await asyncio.sleep(0.005)
                    continue
                idle = 0
                for m in got:
                    if m.run_id in held:
                        violations.append(f"{m.run_id} handed out twice")
                    held[m.run_id] = m.queue
                a = sum(1 for v in held.values() if v == "task/a")
                if len(held) > 7 or a > 5:
                    violations.append(f"limits exceeded: {len(held)} held, {a} in task/a")
                await asyncio.sleep(0)
                for m in got:
                    del held[m.run_id]
                    done.append(m.run_id)
                await mine.ack([(m.env_id, m.run_id) for m in got])
        finally:
            await client.aclose()

    await asyncio.gather(*(worker(i) for i in range(20)))
    assert violations == []
    assert sorted(done) == sorted(i.run_id for i in items)
