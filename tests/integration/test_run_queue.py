"""The run queue's Lua scripts on real Redis: limits, fairness, priority, delays, pause, DLQ."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from run_engine.redis_connect import connect as connect_redis
from run_engine.run_queue import EnqueueItem, QueueSettings, RunQueue
from run_engine.run_queue.models import DequeuedMessage

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

NOW = 1_700_000_000_000


@pytest.fixture
async def q(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> RunQueue:
    queue = RunQueue(
        redis_client, prefix=f"{key_prefix}:q{unique}", shards=2, max_deliveries=3, default_env_limit=1000
    )
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


async def test_a_held_only_ack_leaves_a_message_enqueued_again(q: RunQueue) -> None:
    """A suspension acks its run after its commit; a continuation may have enqueued the run again
    in between (a restore). The suspension's ack (held only) must leave that message, or the run
    would wait for the reconciler; a message still held is deleted and its slot freed."""
    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item("r1"), item("r2", score=NOW + 1)], NOW)
    await q.dequeue("wg", 1, NOW)
    await q.enqueue([item("r1")], NOW)  # the continuation's restore: ready again, its slot freed
    await q.ack([("envA", "r1")], held_only=[True])
    assert await q.has_messages([("envA", "r1")]) == [True]
    [m] = await q.dequeue("wg", 5, NOW)
    assert m.run_id == "r1"  # the restore is handed out
    await q.ack([("envA", "r1"), ("envA", "r2")], held_only=[True, True])  # r1 held: gone; r2 ready: kept
    assert await q.has_messages([("envA", "r1"), ("envA", "r2")]) == [False, True]
    assert await q.running_ids("envA") == set()
    await q.ack([("envA", "r2")])  # a plain ack deletes it wherever it is
    assert await q.has_messages([("envA", "r2")]) == [False]
    assert (await q.queue_stats("envA", "task/a")).queued == 0


async def test_a_dequeue_says_whether_runs_it_could_hand_out_are_left(q: RunQueue) -> None:
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(3)] + [item("other", env="envB")], NOW)
    got = await q.dequeue("wg", 2, NOW, ["envA"])
    assert len(got) == 2 and got.backlog  # r2 is still ready
    got = await q.dequeue("wg", 5, NOW, ["envA"])
    assert [m.run_id for m in got] == ["r2"]
    assert not got.backlog  # envB's run is not a backlog of a worker narrowed to envA
    got = await q.dequeue("wg", 5, NOW)
    assert [m.run_id for m in got] == ["other"] and not got.backlog


async def test_a_run_is_only_handed_to_its_own_worker_group(q: RunQueue) -> None:
    await q.enqueue([EnqueueItem("r1", "envA", "task/a", "other", NOW)], NOW)
    assert await q.dequeue("wg", 5, NOW) == []
    assert [m.run_id for m in await q.dequeue("other", 5, NOW)] == ["r1"]


async def test_priority_is_a_head_start(q: RunQueue) -> None:
    await q.enqueue(
        [item("old", score=NOW), item("new", score=NOW + 5000), item("urgent", score=NOW + 6000 - 10_000)],
        NOW + 6000,
    )
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
    await q.enqueue(
        [item(f"l{i}", queue="limited", score=NOW + i) for i in range(4)]
        + [item(f"k{i}", queue="keyed", score=NOW + 10 + i, concurrency_key="same") for i in range(3)],
        NOW,
    )
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
        await q.enqueue(big[start : start + 1000], NOW)
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
        await q.enqueue(big[start : start + 1000], NOW)
    await q.enqueue(
        [item(f"small{i}", concurrency_key="small", score=NOW + 20_000 + i) for i in range(10)], NOW
    )
    order: list[str] = []
    while len(order) < 30:
        got = await q.dequeue("wg", 5, NOW + 30_000)
        order += [m.run_id for m in got]
        await q.ack([(m.env_id, m.run_id) for m in got])
    assert len([r for r in order if r.startswith("small")]) == 10, order


def _group_queue(q: RunQueue, env: str = "envA", queue: str = "task/a") -> str:
    """The prefix of a queue's keys in group wg's index (queue_lib: B:g:<wg>:e:<env>:q:<q>)."""
    return q.keys.ready(env, "wg", queue, "").rsplit(":k:", 1)[0]


async def _idle_key_times(redis_client: aioredis.Redis, group_queue: str) -> int:
    """How many idle keys' virtual times the queue keeps (:kvz; :kvt, the hash of the version before)."""
    return int(await redis_client.zcard(f"{group_queue}:kvz")) + int(await redis_client.hlen(f"{group_queue}:kvt"))


async def test_distinct_concurrency_keys_leave_nothing_behind_once_their_runs_are_done(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """Each key's saved virtual time was written when its last ready run was handed out and deleted
    only when that key was used again: a tenant whose keys are unique (a request id, a user id)
    grew one Redis hash by one field per key, for ever, with no run left anywhere."""
    n = 500
    await q.enqueue([item(f"r{i}", concurrency_key=f"user-{i}", score=NOW + i) for i in range(n)], NOW)
    handed = []
    while len(handed) < n:
        got = await q.dequeue("wg", 100, NOW + 1)
        assert got
        handed += got
    await q.ack([("envA", m.run_id) for m in handed])
    assert (await q.env_stats("envA")).queued == 0 and not await q.running_ids("envA")
    group_queue = _group_queue(q)
    left = [suffix for suffix in ("kvt", "kvz", "ks", "heads") if await redis_client.exists(f"{group_queue}:{suffix}")]
    assert left == [], f"{await _idle_key_times(redis_client, group_queue)} idle keys' times left for {n} keys done"


async def test_a_queue_that_is_never_idle_keeps_the_times_of_a_bounded_number_of_idle_keys(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """Key "big" always has runs, so the queue is never idle; 1,500 keys of one run each go idle
    one after the other, each a run ahead of the queue's clock: at most 1,000 times are kept."""
    await q.enqueue([item(f"big{i}", concurrency_key="big", score=NOW + i) for i in range(100)], NOW)
    await q.enqueue([item(f"u{i}", concurrency_key=f"user-{i}", score=NOW + 100 + i) for i in range(1500)], NOW)
    handed = 0
    while handed < 1550:
        got = await q.dequeue("wg", min(100, 1550 - handed), NOW + 1)
        assert got
        handed += len(got)
        await q.ack([(m.env_id, m.run_id) for m in got])
    assert (await q.queue_stats("envA", "task/a")).queued == 50  # big's, still ready
    kept = await _idle_key_times(redis_client, _group_queue(q))
    assert 0 < kept <= 1000, f"{kept} idle keys' times kept"


async def test_a_key_coming_back_at_once_does_not_take_the_turns_of_another(q: RunQueue) -> None:
    """Key a has a backlog; key b has one run at a time, enqueued again as soon as the one before
    was handed out: b's time, kept while it is idle, still makes the two take turns."""
    await q.enqueue([item(f"a{i}", concurrency_key="a", score=NOW + i) for i in range(100)]
                    + [item("b0", concurrency_key="b", score=NOW)], NOW)
    order: list[str | None] = []
    for _ in range(40):
        [m] = await q.dequeue("wg", 1, NOW + 1)
        order.append(m.concurrency_key)
        await q.ack([(m.env_id, m.run_id)])
        if m.concurrency_key == "b":
            await q.enqueue([item(f"b{len(order)}", concurrency_key="b", score=NOW + len(order))], NOW)
    assert order.count("a") == order.count("b") == 20, order


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


async def test_give_back_many_puts_held_runs_back_in_place_with_their_delivery_undone(q: RunQueue) -> None:
    """Runs of environments on both shards, in one call: each held one is ready again at once, at
    its place, its slot freed and its delivery not counted; one not held is left as it is."""
    await q.enqueue([item("r1"), item("r2", score=NOW + 1), item("r3", env="envB"), item("r4", score=NOW + 2)], NOW)
    assert {q.keys.shard_of("envA"), q.keys.shard_of("envB")} == {0, 1}
    got = [*await q.dequeue("wg", 2, NOW, ["envA"]), *await q.dequeue("wg", 1, NOW, ["envB"])]
    assert [m.run_id for m in got] == ["r1", "r2", "r3"]
    given = await q.give_back_many([("envA", "r2"), ("envB", "r3"), ("envA", "r4"), ("envA", "r1")], NOW, NOW)
    assert given == [True, True, False, True]  # r4 was never handed out
    assert await q.running_ids("envA") == set() and await q.running_ids("envB") == set()
    again = await q.dequeue("wg", 4, NOW)
    assert [m.run_id for m in again if m.env_id == "envA"] == ["r1", "r2", "r4"]
    assert {m.run_id: m.deliveries for m in again} == {"r1": 1, "r2": 1, "r3": 1, "r4": 1}


def mark(m: DequeuedMessage) -> tuple[str, str, int, int]:
    assert m.held_at_ms is not None
    return m.env_id, m.run_id, m.deliveries, m.held_at_ms


async def test_reclaim_takes_back_only_a_delivery_made_ready_again_as_it_left_it(q: RunQueue) -> None:
    """A dequeue that wrote its runs after the reconciler had made them ready again (it stalled
    past the grace between its take and its write) takes each back: held, its slot counted once,
    out of the ready set, even when the slot was taken by another meanwhile (the run is handed
    out). A run held (by its own delivery or a later one), made ready afresh (a retry resets the
    count) or gone is left as it is."""
    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item("r1"), item("r2", score=NOW + 1), item("r3", env="envB")], NOW)
    [m1] = await q.dequeue("wg", 1, NOW, ["envA"])
    [m3] = await q.dequeue("wg", 1, NOW, ["envB"])
    assert await q.reclaim_many([mark(m1), mark(m3)], NOW + 1) == [False, False]  # still held: nothing to take back
    assert await q.delivery("envA", "r1") == (1, NOW) and await q.delivery("envA", "r2") is None
    await q.enqueue([item("r1"), item("r3", env="envB")], NOW + 40_000)  # the reconciler: ready again
    assert await q.delivery("envA", "r1") is None
    assert await q.running_ids("envA") == set()
    assert (await q.queue_stats("envA", "task/a")).queued == 2
    assert await q.reclaim_many([mark(m1), mark(m3)], NOW + 40_001) == [True, True]
    assert await q.running_ids("envA") == {"r1"} and await q.running_ids("envB") == {"r3"}
    assert (await q.queue_stats("envA", "task/a")).queued == 1  # r2 only
    assert (await q.queue_stats("envA", "task/a")).running == 1
    assert await q.dequeue("wg", 5, NOW + 40_001) == []  # r1's slot: the limit of 1 holds r2
    assert await q.reclaim_many([mark(m1)], NOW + 40_002) == [False]  # held again: once only
    await q.ack([("envA", "r1")])
    [m2] = await q.dequeue("wg", 5, NOW + 40_003)
    assert m2.run_id == "r2"
    # ready again and taken by another delivery since: that one's, left
    await q.enqueue([item("r2")], NOW + 80_000)
    [later] = await q.dequeue("wg", 5, NOW + 80_001)
    assert later.run_id == "r2" and later.deliveries == 2
    assert await q.reclaim_many([mark(m2)], NOW + 80_002) == [False]
    # made ready afresh (a retry: count reset): not the delivery's
    await q.enqueue([item("r2", reset_deliveries=True)], NOW + 90_000)
    assert await q.reclaim_many([mark(m2)], NOW + 90_001) == [False]
    assert await q.running_ids("envA") == set()
    # its slot taken meanwhile by another run (one with a head start): taken back all the same,
    # the queue one over its limit until one of them is done (the run is handed out)
    await q.set_queue_limit("envB", "task/a", 1)
    await q.ack([("envB", "r3")])
    await q.enqueue([item("r4", env="envB")], NOW)
    [m4] = await q.dequeue("wg", 1, NOW, ["envB"])
    await q.enqueue([item("r4", env="envB"), item("r5", env="envB", score=NOW - 10)], NOW + 40_000)
    [m5] = await q.dequeue("wg", 5, NOW + 40_000, ["envB"])
    assert m5.run_id == "r5"
    assert await q.reclaim_many([mark(m4), mark(dataclasses.replace(m4, run_id="gone"))], NOW + 40_001) == [True, False]
    assert await q.running_ids("envB") == {"r4", "r5"}
    assert (await q.queue_stats("envB", "task/a")).queued == 0


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
        client = await connect_redis(redis_url, max_connections=8)
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

    async def monitor() -> None:
        # the running sets in Redis themselves, read while the workers race
        qk = q.keys.queue("envA", "task/b")
        while not stop.is_set():
            pipe = q.redis.pipeline(transaction=False)
            pipe.scard(f"{q.keys.env('envA')}:running")
            pipe.scard(f"{q.keys.queue('envA', 'task/a')}:running")
            for k in range(3):
                pipe.scard(f"{qk}:k:k{k}:running")
            env_n, a_n, *key_ns = await pipe.execute()
            if env_n > 7 or a_n > 5 or max(key_ns) > 2:
                violations.append(f"running sets over limits: env {env_n}, task/a {a_n}, keys {key_ns}")
            await asyncio.sleep(0)

    stop = asyncio.Event()
    watcher = asyncio.create_task(monitor())
    await asyncio.gather(*(worker(i) for i in range(20)))
    stop.set()
    await watcher
    assert violations == []
    assert sorted(done) == sorted(i.run_id for i in items)


async def test_blocked_tenants_do_not_starve_a_free_one(
    redis_client: aioredis.Redis, key_prefix: str, unique: str
) -> None:
    # 3,000 tenants at their limit (1) with runs still queued, more than one call's candidate
    # budget: they are parked, so a tenant with free capacity is served at once.
    q = RunQueue(redis_client, prefix=f"{key_prefix}:s{unique}", shards=1, default_env_limit=1)
    await q.set_env_limit("zz-free", 100)
    await q.enqueue([item(f"f{i}", env="zz-free", score=NOW + i) for i in range(10)], NOW)
    for m in await q.dequeue("wg", 10, NOW):
        await q.ack([(m.env_id, m.run_id)])
    envs = [f"t{i:04}" for i in range(3000)]
    await q.enqueue([item(f"{e}-{n}", env=e, score=NOW + n) for e in envs for n in range(2)], NOW)
    held = 0
    for _ in range(20):
        held += len(await q.dequeue("wg", 3000, NOW))
    assert held == 3000  # one each, the limit
    await q.enqueue([item("free-run", env="zz-free", score=NOW + 100)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["free-run"]
    # a freed slot puts a parked tenant back
    await q.ack([("t0042", "t0042-0")])
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["t0042-1"]


async def test_raising_a_limit_or_resuming_takes_effect_at_once(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 1)
    await q.set_key_limit("envA", "keyed", 1)
    await q.enqueue(
        [
            item("a1"),
            item("a2", score=NOW + 1),
            item("k1", queue="keyed", concurrency_key="c"),
            item("k2", queue="keyed", concurrency_key="c"),
        ],
        NOW,
    )
    assert {m.run_id for m in await q.dequeue("wg", 10, NOW)} == {"a1", "k1"}
    assert await q.dequeue("wg", 10, NOW) == []
    await q.set_queue_limit("envA", "task/a", None)
    await q.set_key_limit("envA", "keyed", 2)
    assert {m.run_id for m in await q.dequeue("wg", 10, NOW)} == {"a2", "k2"}
    await q.enqueue([item("p1", queue="paused")], NOW)
    await q.pause("envA", "paused")
    assert await q.dequeue("wg", 10, NOW) == []
    await q.ack([("envA", "a1")])  # a freed slot does not undo a pause
    assert await q.dequeue("wg", 10, NOW) == []
    await q.resume("envA", "paused")
    assert [m.run_id for m in await q.dequeue("wg", 10, NOW)] == ["p1"]


async def test_dead_letter_by_the_engine_and_dlq_pages(q: RunQueue) -> None:
    await q.enqueue([item(f"r{i}", task="t", score=NOW + i) for i in range(5)], NOW)
    [held] = await q.dequeue("wg", 1, NOW)
    for i in range(5):
        await q.dead_letter("envA", f"r{i}", "SYSTEM_FAILURE: gone", NOW + i)
    assert await q.running_ids("envA") == set()
    assert (await q.env_stats("envA")).queued == 0
    first = await q.list_dlq("envA", limit=2)
    assert [e.run_id for e in first] == ["r0", "r1"]
    assert (
        first[0].reason == "SYSTEM_FAILURE: gone" and first[0].dead_at_ms == NOW and first[0].deliveries == 1
    )
    rest = await q.list_dlq("envA", limit=10, after="r1")
    assert [e.run_id for e in rest] == ["r2", "r3", "r4"]
    assert await q.redrive("envA", "r3", NOW + 10)
    [m] = await q.dequeue("wg", 5, NOW + 10)
    assert (m.run_id, m.deliveries) == ("r3", 1)
    assert held.run_id == "r0"


async def test_remove_of_a_held_run_frees_its_slots(q: RunQueue) -> None:
    await q.set_env_limit("envA", 1)
    await q.enqueue([item("r1"), item("r2", score=NOW + 1)], NOW)
    [m] = await q.dequeue("wg", 5, NOW)
    assert await q.dequeue("wg", 5, NOW) == []
    assert await q.remove("envA", m.run_id)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r2"]
    assert await q.has_messages([("envA", "r1")]) == [False]


# --- random sequences with changing settings: parking never strands a run ---------------------

_ENVS, _QUEUES, _KEYS = ("e1", "e2"), ("qa", "qb"), (None, "k1", "k2")
_limit = st.one_of(st.none(), st.integers(0, 3))
_enqueue = st.tuples(
    st.just("enqueue"),
    st.sampled_from(_ENVS),
    st.sampled_from(_QUEUES),
    st.sampled_from(_KEYS),
    st.sampled_from([0, 0, 0, 500]),
)
_dequeue = st.tuples(st.just("dequeue"), st.integers(1, 5))
# enqueue and dequeue are drawn most often, so that limits are actually reached
_op = st.one_of(
    _enqueue,
    _enqueue,
    _enqueue,
    _dequeue,
    _dequeue,
    st.tuples(
        st.just("enqueue"),
        st.sampled_from(_ENVS),
        st.sampled_from(_QUEUES),
        st.sampled_from(_KEYS),
        st.sampled_from([0, 0, 0, 500]),
    ),
    st.tuples(st.just("dequeue"), st.integers(1, 5)),
    st.tuples(st.sampled_from(["ack", "nack", "release", "remove"]), st.integers(0, 99)),
    st.tuples(st.just("env_limit"), st.sampled_from(_ENVS), _limit),
    st.tuples(
        st.sampled_from(["queue_limit", "key_limit", "queue_cap"]),
        st.sampled_from(_ENVS),
        st.sampled_from(_QUEUES),
        _limit,
    ),
    st.tuples(st.sampled_from(["pause", "resume"]), st.sampled_from(_ENVS), st.sampled_from(_QUEUES)),
    st.tuples(st.just("tick"), st.integers(1, 3000)),
)


async def _settings_scenario(
    redis_url: str,
    prefix: str,
    ops: list[tuple],  # type: ignore[type-arg]
    initial: tuple[int | None, int | None, int | None] = (None, None, None),
) -> None:
    client = await connect_redis(redis_url, max_connections=8)
    q = RunQueue(client, prefix=prefix, shards=2, max_deliveries=2, default_env_limit=2)
    attrs: dict[str, tuple[str, str, str | None]] = {}
    due: dict[str, int] = {}
    queued: set[str] = set()
    held: set[str] = set()
    env_limit: dict[str, int | None] = {}
    q_limit: dict[tuple[str, str], int | None] = {}
    k_limit: dict[tuple[str, str], int | None] = {}
    q_cap: dict[tuple[str, str], int | None] = {}
    paused: set[tuple[str, str]] = set()
    now = NOW

    def count(env: str, name: str | None = None, key: object = ...) -> int:
        return sum(
            1
            for r in held
            if attrs[r][0] == env
            and (name is None or attrs[r][1] == name)
            and (key is ... or attrs[r][2] == key)
        )

    def blocked(run: str) -> bool:
        env, name, key = attrs[run]
        el = env_limit.get(env)
        ql, kl, cap = q_limit.get((env, name)), k_limit.get((env, name)), q_cap.get((env, name))
        return (
            (env, name) in paused
            or count(env) >= (2 if el is None else el)
            or (ql is not None and count(env, name, key) >= ql)  # the queue's limit holds for each key
            or (kl is not None and count(env, name, key) >= kl)
            or (cap is not None and count(env, name) >= cap)
        )

    try:
        await q.load_scripts()
        ops = [
            *(("env_limit", e, initial[0]) for e in _ENVS),
            *(
                (kind, e, name, value)
                for kind, value in (("queue_limit", initial[1]), ("key_limit", initial[2]))
                for e in _ENVS
                for name in _QUEUES
            ),
            *ops,
        ]
        for n, step in enumerate(ops):
            kind = step[0]
            if kind == "enqueue":
                _, env, name, key, delay = step
                run = f"r{n}"
                attrs[run], due[run] = (env, name, key), now + delay
                await q.enqueue([EnqueueItem(run, env, name, "wg", now + n, now + delay, key)], now)
                queued.add(run)
            elif kind == "dequeue":
                got = await q.dequeue("wg", step[1], now)
                for m in got:
                    assert m.run_id in queued and due[m.run_id] <= now, m
                    env, name, key = attrs[m.run_id]
                    held.add(m.run_id)
                    queued.discard(m.run_id)
                    el, ql, kl = env_limit.get(env), q_limit.get((env, name)), k_limit.get((env, name))
                    cap = q_cap.get((env, name))
                    assert count(env) <= (2 if el is None else el)
                    assert ql is None or count(env, name, key) <= ql
                    assert kl is None or count(env, name, key) <= kl
                    assert cap is None or count(env, name) <= cap
                    assert (env, name) not in paused
                if len(got) < step[1]:  # nothing dequeueable may be left behind (parking strands nothing)
                    stranded = [r for r in queued if due[r] <= now and not blocked(r)]
                    assert stranded == [], stranded
            elif kind in ("ack", "nack", "release", "remove") and held:
                run = sorted(held)[step[1] % len(held)]
                env = attrs[run][0]
                held.discard(run)
                if kind == "ack":
                    await q.ack([(env, run)])
                elif kind == "release":
                    await q.release(env, run)
                elif kind == "remove":
                    assert await q.remove(env, run)
                else:
                    res = await q.nack(env, run, now)
                    if not res.dead_lettered:
                        assert res.available_at_ms is not None
                        due[run] = res.available_at_ms
                        queued.add(run)
            elif kind == "env_limit":
                env_limit[step[1]] = step[2]
                await q.set_env_limit(step[1], step[2])
            elif kind == "queue_limit":
                q_limit[(step[1], step[2])] = step[3]
                await q.set_queue_limit(step[1], step[2], step[3])
            elif kind == "key_limit":
                k_limit[(step[1], step[2])] = step[3]
                await q.set_key_limit(step[1], step[2], step[3])
            elif kind == "queue_cap":
                q_cap[(step[1], step[2])] = step[3]
                await q.set_queue_cap(step[1], step[2], step[3])
            elif kind == "pause":
                paused.add((step[1], step[2]))
                await q.pause(step[1], step[2])
            elif kind == "resume":
                paused.discard((step[1], step[2]))
                await q.resume(step[1], step[2])
            elif kind == "tick":
                now += step[1]
            for env in _ENVS:
                assert await q.running_ids(env) == {r for r in held if attrs[r][0] == env}
                assert (await q.env_stats(env)).queued == len([r for r in queued if attrs[r][0] == env])
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(_op, min_size=20, max_size=60),
    initial=st.tuples(
        st.integers(1, 3), st.one_of(st.none(), st.integers(1, 2)), st.one_of(st.none(), st.just(1))
    ),
)
def test_random_operations_with_changing_settings_keep_every_invariant(
    redis_url: str,
    key_prefix: str,
    ops: list[tuple],  # type: ignore[type-arg]
    initial: tuple[int | None, int | None, int | None],
) -> None:
    asyncio.run(_settings_scenario(redis_url, f"{key_prefix}:h{secrets.token_hex(4)}", ops, initial))


async def test_a_freed_slot_puts_a_parked_queue_or_key_back(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "capped", 1)
    await q.set_key_limit("envA", "keyed", 1)
    await q.enqueue(
        [item(f"c{i}", queue="capped", score=NOW + i) for i in range(2)]
        + [item(f"k{i}", queue="keyed", concurrency_key="c", score=NOW + i) for i in range(2)],
        NOW,
    )
    assert {m.run_id for m in await q.dequeue("wg", 10, NOW)} == {"c0", "k0"}
    assert await q.dequeue("wg", 10, NOW) == []
    await q.ack([("envA", "c0"), ("envA", "k0")])
    assert {m.run_id for m in await q.dequeue("wg", 10, NOW)} == {"c1", "k1"}


async def test_rate_limit_spaces_runs_and_allows_bursts(q: RunQueue) -> None:
    from run_engine.run_queue import RateLimit

    await q.set_rate_limit("envA", "task/a", RateLimit(limit=10, period_ms=1000, burst=3))
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(20)], NOW)
    got = await q.dequeue("wg", 20, NOW)
    assert [m.run_id for m in got] == ["r0", "r1", "r2"]  # the burst
    assert got.retry_at_ms == NOW + 100  # one more every 100 ms
    assert list(await q.dequeue("wg", 20, NOW + 99)) == []
    assert [m.run_id for m in await q.dequeue("wg", 20, NOW + 100)] == ["r3"]
    # steady polling: with r3, exactly 10 runs in the second [NOW + 100, NOW + 1100)
    handed = []
    for t in range(101, 1100, 10):
        handed += [m.run_id for m in await q.dequeue("wg", 20, NOW + t)]
    assert handed == [f"r{i}" for i in range(4, 13)]
    # other queues of the env are not held back by the rate-limited one
    await q.enqueue([item("other", queue="task/b", score=NOW + 50)], NOW + 1095)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 1095)] == ["other"]  # task/a is not due
    await q.set_rate_limit("envA", "task/a", None)
    assert len(await q.dequeue("wg", 20, NOW + 1102)) == 7  # r13..r19 at once


async def _handed_in_one_second(q: RunQueue, start: int = NOW) -> int:
    """Runs a poller that dequeues every millisecond for one second is handed (acked at once)."""
    handed = 0
    for t in range(1000):
        got = await q.dequeue("wg", 100, start + t)
        handed += len(got)
        if got:
            await q.ack([(m.env_id, m.run_id) for m in got])
    return handed


async def test_a_rate_limit_of_600_a_second_never_hands_out_more_than_600_a_second(q: RunQueue) -> None:
    """GCRA's emission interval was period // limit in whole ms: 1000 // 600 = 1 ms, so a queue
    limited to 600 runs a second (an external API's quota) was handed 1,000 a second."""
    from run_engine.run_queue import RateLimit

    await q.set_rate_limit("envA", "task/a", RateLimit(limit=600, period_ms=1000, burst=1))
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(2000)], NOW)
    handed = await _handed_in_one_second(q)
    assert 599 <= handed <= 601, f"{handed} runs handed out in one second under a limit of 600/s"


@pytest.mark.parametrize("limit", [501, 999, 2500])
async def test_a_rate_limit_holds_to_its_rate_above_500_a_second(q: RunQueue, limit: int) -> None:
    """From 501 to 999 a second a queue was handed 1,000 a second (up to twice its rate), and above
    1,000 a second 1,000 (its rate silently capped): now its rate, polled every millisecond."""
    from run_engine.run_queue import RateLimit

    await q.set_rate_limit("envA", "task/a", RateLimit(limit=limit, period_ms=1000, burst=1))
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(limit + 100)], NOW)
    handed = await _handed_in_one_second(q)
    assert limit - 1 <= handed <= limit + 1, f"{handed} runs handed out in one second under a limit of {limit}/s"


async def test_a_rate_limit_set_by_the_version_before_still_holds(q: RunQueue, redis_client: aioredis.Redis) -> None:
    """A rolling upgrade: a queue whose rate the version before set has only its fields in whole ms
    (rate_t, rate_tau, tat); they hold, and what this version hands out moves the version before's
    `tat` too (its dequeues run beside this one's until every process is upgraded)."""
    meta = f"{q.keys.queue('envA', 'task/a')}:meta"
    await redis_client.hset(meta, mapping={"rate_t": 100, "rate_tau": 0, "tat": NOW + 50})  # 10 a second
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(5)], NOW)
    got = await q.dequeue("wg", 5, NOW)
    assert list(got) == [] and got.retry_at_ms == NOW + 50  # its tat, written by a dequeue of that version
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 50)] == ["r0"]
    tat, tat_us = await redis_client.hmget(meta, "tat", "tat_us")
    assert (int(tat), int(tat_us)) == (NOW + 150, (NOW + 150) * 1000)
    got = await q.dequeue("wg", 5, NOW + 100)
    assert list(got) == [] and got.retry_at_ms == NOW + 150


# queue_config's rate_limit op as the version before rate limits in µs ran it, on this version's
# queue_lib (its unpark_queue is that version's): it writes and deletes the fields in ms alone
_RATE_LIMIT_OF_THE_VERSION_BEFORE = """
local env, q, value = ARGV[3], ARGV[4], ARGV[5]
local qm = qkey(env, q) .. ':meta'
if value == '' then
  redis.call('HDEL', qm, 'rate_t', 'rate_tau', 'tat')
else
  local t, tau = string.match(value, '^(%d+),(%d+)$')
  local was = redis.call('HMGET', qm, 'rate_t', 'rate_tau')
  redis.call('HSET', qm, 'rate_t', t, 'rate_tau', tau)
  if was[1] ~= t or was[2] ~= tau then redis.call('HDEL', qm, 'tat') end
end
unpark_queue(env, q)
return 1
"""


async def _rate_limit_of_the_version_before(q: RunQueue, redis_client: aioredis.Redis, value: str) -> None:
    """A process of the version before sets envA's task/a's rate limit ("T,tau" in ms; '' = none)."""
    from run_engine._resources import read_text
    from run_engine.run_queue.keys import encode_name

    keys, base = q._shard_args("envA")
    await redis_client.eval(read_text("lua", "queue_lib.lua") + "\n" + _RATE_LIMIT_OF_THE_VERSION_BEFORE,
                            len(keys), *keys, base, "rate_limit", encode_name("envA"), encode_name("task/a"), value)


async def test_a_rate_limit_removed_by_the_version_before_holds_no_more(q: RunQueue,
                                                                         redis_client: aioredis.Redis) -> None:
    """A rolling upgrade: a rate limit this version set (its µs fields beside those in ms) and a
    process of the version before removed (the fields in ms alone) kept holding the queue in this
    version's dequeues, at the old rate, as long as the µs fields were there."""
    from run_engine.run_queue import RateLimit

    meta = f"{q.keys.queue('envA', 'task/a')}:meta"
    await q.set_rate_limit("envA", "task/a", RateLimit(limit=1, period_ms=60_000))  # one a minute
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(3)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r0"]
    await _rate_limit_of_the_version_before(q, redis_client, "")
    got = await q.dequeue("wg", 5, NOW + 10)
    assert [m.run_id for m in got] == ["r1", "r2"]
    assert not {b"rate_t_us", b"rate_tau_us", b"rate_us_for", b"tat_us"} & set(await redis_client.hkeys(meta))


async def test_a_rate_limit_changed_by_the_version_before_holds_at_its_new_rate(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """A rolling upgrade: a rate limit this version set and a process of the version before changed
    (the fields in ms alone, its `tat` deleted: a new rate starts afresh) held the queue at the old
    rate in this version's dequeues, from the arrival time the old one reached (an hour ahead, for
    one an hour). The new rate holds, in ms, until this version sets it again (in µs, its arrival
    time kept); that version's dequeues still move the arrival time."""
    from run_engine.run_queue import RateLimit

    meta = f"{q.keys.queue('envA', 'task/a')}:meta"
    await q.set_rate_limit("envA", "task/a", RateLimit(limit=1, period_ms=3_600_000))  # one an hour
    await q.enqueue([item(f"r{i}", score=NOW + i) for i in range(4)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r0"]
    await _rate_limit_of_the_version_before(q, redis_client, "100,0")  # ten a second
    got = await q.dequeue("wg", 5, NOW + 1000)
    assert [m.run_id for m in got] == ["r1"] and got.retry_at_ms == NOW + 1100
    assert await redis_client.hmget(meta, "rate_t_us", "tat", "tat_us") == [
        None, str(NOW + 1100).encode(), str((NOW + 1100) * 1000).encode()]
    await q.set_rate_limit("envA", "task/a", RateLimit(limit=10, period_ms=1000))  # the same rate: tat kept
    await redis_client.hset(meta, "tat", NOW + 1200)  # a dequeue of the version before hands out a run
    got = await q.dequeue("wg", 5, NOW + 1150)
    assert list(got) == [] and got.retry_at_ms == NOW + 1200
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 1200)] == ["r2"]
    await _rate_limit_of_the_version_before(q, redis_client, "100,0")  # the same rate set again by it
    assert await redis_client.hmget(meta, "rate_t_us", "rate_us_for", "tat_us") == [
        b"100000", b"100,0", str((NOW + 1300) * 1000).encode()]  # this version's fields still hold
    assert list(await q.dequeue("wg", 5, NOW + 1299)) == []
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 1300)] == ["r3"]


async def test_environments_on_different_shards_get_even_shares(redis_client: aioredis.Redis, key_prefix: str,
                                                                unique: str) -> None:
    """Eight environments over four shards (two, three, one and two of them): the dequeues visit the
    shards by smooth weighted round robin, weights = their environments with ready runs, so the lone
    environment of a shard gets no more than the others (visiting shards in turn gave it more)."""
    from run_engine.run_queue.keys import QueueKeys

    keys = QueueKeys("x", 4)
    by_shard: dict[int, list[str]] = {}
    n = 0
    while sorted(len(v) for v in by_shard.values()) != [1, 2, 2, 3]:  # a deterministic search
        env = f"env{n}"
        n += 1
        shard = keys.shard_of(env)
        if len(by_shard.get(shard, [])) < {0: 2, 1: 3, 2: 1, 3: 2}[shard]:
            by_shard.setdefault(shard, []).append(env)
    envs = [e for group in by_shard.values() for e in group]
    q = RunQueue(redis_client, prefix=f"{key_prefix}:sh{unique}", shards=4, default_env_limit=100_000)
    await q.load_scripts()
    await q.enqueue([item(f"{env}-{i}", env=env, score=NOW + i) for env in envs for i in range(150)], NOW)
    handed: dict[str, int] = dict.fromkeys(envs, 0)
    while sum(handed.values()) < 400:
        for m in await q.dequeue("wg", 4, NOW + 1000):
            handed[m.env_id] += 1
    shares = list(handed.values())
    jain = sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))
    assert jain >= 0.97, sorted(handed.items())
    assert max(shares) <= 1.2 * min(shares), sorted(handed.items())


async def test_many_rate_limited_queues_of_one_environment_do_not_stall_the_others(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """Seventy queues of one environment, each ahead of its rate, at the front of its list: every
    dequeue rescanned them from the start for each one skipped, spent its whole budget on that
    environment and handed nothing out, so the other environments of its shard were not served."""
    from run_engine.run_queue import RateLimit

    q = RunQueue(redis_client, prefix=f"{key_prefix}:q{unique}", shards=1, max_deliveries=3,
                 default_env_limit=1000)
    await q.load_scripts()
    for i in range(70):
        await q.set_rate_limit("noisy", f"rl{i}", RateLimit(limit=1, period_ms=3_600_000, burst=1))
    await q.enqueue([item(f"n{i}-{j}", env="noisy", queue=f"rl{i}", score=NOW - 1000 + i)
                     for i in range(70) for j in range(2)], NOW)
    first = await q.dequeue("wg", 100, NOW)  # one run of each queue: every queue is now ahead of its rate
    assert len(first) == 70
    await q.enqueue([item("quiet-1", env="quiet", queue="task/q", score=NOW)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 10, NOW + 1)] == ["quiet-1"]


async def test_a_thousand_queues_ahead_of_their_rate_cost_later_dequeues_nothing(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """1,100 queues of one environment, each ahead of its rate: skipped, each took two candidates of
    a dequeue's budget of 2,000, so every dequeue spent it all on that environment (never served, it
    stayed first) and handed nothing out to any tenant of the group. Parked until their rate lets
    them serve, they are left out of later dequeues, and listed again then."""
    from run_engine.run_queue import RateLimit

    q = RunQueue(redis_client, prefix=f"{key_prefix}:q{unique}", shards=1, max_deliveries=3,
                 default_env_limit=100_000)
    await q.load_scripts()
    n, hour = 1100, 3_600_000
    await asyncio.gather(*(q.set_rate_limit("noisy", f"rl{i}", RateLimit(limit=1, period_ms=hour, burst=1))
                           for i in range(n)))
    await q.enqueue([item(f"n{i}-{j}", env="noisy", queue=f"rl{i}", score=NOW - 10_000 + i)
                     for i in range(n) for j in range(2)], NOW)
    first: list[str] = []
    while len(first) < n:  # one run of each queue: every queue is now ahead of its rate
        got = await q.dequeue("wg", 100, NOW)
        assert got, len(first)
        first += [m.run_id for m in got]
    await q.enqueue([item("quiet-1", env="quiet", queue="task/q", score=NOW)], NOW)
    got = await q.dequeue("wg", 10, NOW + 1)
    assert [m.run_id for m in got] == ["quiet-1"]
    assert got.retry_at_ms == NOW + hour  # a long-poll wakes when the first parked queue may serve
    assert list(await q.dequeue("wg", 10, NOW + 2)) == []
    later: list[str] = []  # an hour on: listed again, one run each
    while len(later) < n:
        got = await q.dequeue("wg", 100, NOW + hour)
        assert got, len(later)
        later += [m.run_id for m in got]
    assert sorted(later) == sorted(f"n{i}-1" for i in range(n))


async def test_a_queue_parked_for_its_rate_is_listed_again_when_its_rate_changes(q: RunQueue) -> None:
    """Parked until its old rate let it serve (a day for a limit of one a day), a queue whose limit
    is raised or removed serves at once, as a raised concurrency limit does."""
    from run_engine.run_queue import RateLimit

    day = 86_400_000
    await q.set_rate_limit("envA", "task/a", RateLimit(limit=1, period_ms=day, burst=1))
    await q.enqueue([item("r1"), item("r2", score=NOW + 1)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW)] == ["r1"]
    assert list(await q.dequeue("wg", 5, NOW + 1)) == []  # parked until NOW + a day
    await q.set_rate_limit("envA", "task/a", RateLimit(limit=100, period_ms=1000, burst=10))
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 2)] == ["r2"]


async def _parked_queues_of_one_env(redis_client: aioredis.Redis, key_prefix: str, unique: str,
                                    settings: Callable[[str], QueueSettings], n: int = 2500) -> RunQueue:
    """``n`` queues of env "noisy" with ``settings``, one run ready in each: more than one
    dequeue's budget of candidates (2,000). The dequeues that follow park them all."""
    q = RunQueue(redis_client, prefix=f"{key_prefix}:q{unique}", shards=1, default_env_limit=100_000)
    await q.load_scripts()
    await q.configure_queues([settings(f"n{i}") for i in range(n)])
    await q.enqueue([item(f"n{i}-0", env="noisy", queue=f"n{i}", score=NOW - 10_000 + i) for i in range(n)], NOW)
    envs = f"{q.keys.base(0)}:g:wg:envs"
    for _ in range(10):
        assert list(await q.dequeue("wg", 10, NOW)) == []
        if await redis_client.zscore(envs, "noisy") is None:  # every queue parked: the env too
            return q
    raise AssertionError("the blocked queues were not all parked")


async def _served_before(q: RunQueue, env: str, n: int, now: int) -> None:
    """``n`` runs of ``env`` handed out: its virtual time is ahead of the others' (served more)."""
    await q.enqueue([item(f"{env}-before-{i}", env=env, queue="task/q", score=now + i) for i in range(n)], now)
    handed = 0
    while got := await q.dequeue("wg", 500, now):
        handed += len(got)
    assert handed == n


async def _calls_until_served(q: RunQueue, run_id: str, now: int) -> int:
    """Dequeue calls of the group until ``run_id`` (another tenant's) is handed out."""
    for calls in range(1, 20):
        if any(m.run_id == run_id for m in await q.dequeue("wg", 10, now)):
            return calls
    return 20


@pytest.mark.parametrize("blocked", ["paused", "limit 0"])
async def test_a_change_of_settings_that_leaves_queues_blocked_does_not_put_them_back(
        redis_client: aioredis.Redis, key_prefix: str, unique: str, blocked: str) -> None:
    """2,500 queues of one environment, each blocked (paused, or of limit 0) with a run ready, are
    parked. A deploy changes a setting of each and leaves it blocked (a paused queue's limit, a
    queue of limit 0's rate): each was put back in the group's index anyway, and the next dequeue
    calls parked them again, one candidate of their budget each, first in the group (the
    environment was never served, the other one was): two calls handed no tenant of the group
    anything (10,000 such queues: five calls of ~65 ms). Still blocked, they stay parked; the other
    tenant is served by the first call."""
    from run_engine.run_queue import RateLimit

    def settings(version: int) -> Callable[[str], QueueSettings]:
        if blocked == "paused":
            return lambda name: QueueSettings("noisy", name, limit=version, paused=True, version=version)
        return lambda name: QueueSettings("noisy", name, limit=0, version=version,
                                          rate_limit=RateLimit(limit=version, period_ms=1000))

    q = await _parked_queues_of_one_env(redis_client, key_prefix, unique, settings(1))
    await _served_before(q, "quiet", 3000, NOW)
    assert await q.configure_queues([settings(2)(f"n{i}") for i in range(2500)]) == [True] * 2500
    await q.enqueue([item("quiet-1", env="quiet", queue="task/q", score=NOW)], NOW)
    assert await _calls_until_served(q, "quiet-1", NOW) == 1
    # unblocked, they serve at once
    if blocked == "paused":
        await asyncio.gather(*(q.resume("noisy", f"n{i}") for i in range(3)))
    else:
        await asyncio.gather(*(q.set_queue_limit("noisy", f"n{i}", 1) for i in range(3)))
    assert sorted(m.run_id for m in await q.dequeue("wg", 10, NOW)) == ["n0-0", "n1-0", "n2-0"]


async def test_a_change_of_settings_that_keeps_the_rate_leaves_queues_waiting_for_it(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """2,500 queues of one environment ahead of a rate of one an hour are parked until the hour is
    up. A deploy raises each one's limit and keeps the rate: each was put back, and the next
    dequeue calls found each ahead of its rate and parked it again, two calls that served no one.
    They wait for their rate; the other tenant (served more than that environment lately, so
    after it in fair order) is served by the first call, and the hour on, every queue serves its
    next run."""
    from run_engine.run_queue import RateLimit

    hour, n = 3_600_000, 2500

    def settings(version: int) -> Callable[[str], QueueSettings]:
        return lambda name: QueueSettings("noisy", name, limit=version, version=version,
                                          rate_limit=RateLimit(limit=1, period_ms=hour))

    q = RunQueue(redis_client, prefix=f"{key_prefix}:q{unique}", shards=1, default_env_limit=100_000)
    await q.load_scripts()
    await q.configure_queues([settings(1)(f"n{i}") for i in range(n)])
    await q.enqueue([item(f"n{i}-{j}", env="noisy", queue=f"n{i}", score=NOW - 10_000 + i)
                     for i in range(n) for j in range(2)], NOW)
    first = 0
    while got := await q.dequeue("wg", 500, NOW):  # one run each; then each is ahead of its rate
        first += len(got)
    assert first == n
    await _served_before(q, "quiet", 3000, NOW)  # served more than the noisy one since
    assert await q.configure_queues([settings(2)(f"n{i}") for i in range(n)]) == [True] * n
    await q.enqueue([item("quiet-1", env="quiet", queue="task/q", score=NOW)], NOW)
    assert await _calls_until_served(q, "quiet-1", NOW + 1) == 1
    later = 0
    while got := await q.dequeue("wg", 500, NOW + hour):
        later += len(got)
    assert later == n


async def test_the_loss_of_any_one_shard_is_seen(q: RunQueue) -> None:
    """On a Redis Cluster each shard may live on another master: one epoch key for all was seen
    only when the master holding it lost its data, and another master's loss went unrepaired."""
    assert not await q.has_epoch()
    await q.mark_epoch()
    assert await q.has_epoch()
    await q.redis.delete(f"{q.keys.base(1)}:epoch")  # the master of shard 1 restarted empty
    assert not await q.has_epoch()


async def test_an_epoch_says_when_everything_is_to_be_read_once_more(q: RunQueue) -> None:
    await q.mark_epoch(recheck_at=1_700_000_030.5)  # restored with a grace: once more from then on
    assert await q.epoch() == 1_700_000_030.5
    await q.mark_epoch()
    assert await q.epoch() == 0
    await q.redis.delete(f"{q.keys.base(0)}:epoch")
    assert await q.epoch() is None


async def _small_promote_queue(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> RunQueue:
    queue = RunQueue(redis_client, prefix=f"{key_prefix}:p{unique}", shards=1, default_env_limit=10_000,
                     promote_limit=5)
    await queue.load_scripts()
    return queue


async def test_one_tenants_flood_of_retries_does_not_hold_back_anothers(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """Runs not yet due wait in their own environment's set; a dequeue promotes the due ones a fair
    share per environment. Before, all tenants' waited in one set per shard, promoted oldest first
    a batch at a time: 100,000 retries of one tenant due together held another's run, due a moment
    later, back for 201 dequeue calls (here 50 behind a promotion of 5: ten calls)."""
    q = await _small_promote_queue(redis_client, key_prefix, unique)
    await q.enqueue([item(f"a{i}", env="envA", available_at_ms=NOW + 10) for i in range(50)], NOW)
    await q.enqueue([item("b0", env="envB", available_at_ms=NOW + 20)], NOW)
    got = await q.dequeue("wg", 10, NOW + 100)
    assert "b0" in [m.run_id for m in got]
    assert len([m for m in got if m.env_id == "envA"]) >= 2  # the flood still moves, its share a call
    seen = {m.run_id for m in got}
    for _ in range(20):  # and every run of it is handed out, each once
        more = await q.dequeue("wg", 10, NOW + 100)
        assert not seen & {m.run_id for m in more}
        seen |= {m.run_id for m in more}
    assert seen == {f"a{i}" for i in range(50)} | {"b0"}
    assert await redis_client.exists(q.keys.delayed_envs(0), q.keys.env_delayed("envA")) == 0


async def test_a_run_delayed_by_the_version_before_is_promoted_and_can_be_removed(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """The version before kept every environment's delayed runs in the shard's one set: in a
    rolling upgrade such runs are still promoted, and a run taken out of the queue leaves it."""
    q = await _small_promote_queue(redis_client, key_prefix, unique)
    await q.enqueue([item("old1", available_at_ms=NOW + 10), item("old2", available_at_ms=NOW + 10)], NOW)
    for run in ("old1", "old2"):  # as the version before wrote them
        await redis_client.zrem(q.keys.env_delayed("envA"), run)
        await redis_client.zadd(q.keys.delayed(0), {run: NOW + 10})
    await redis_client.zrem(q.keys.delayed_envs(0), "envA")
    assert await q.placements([("envA", "old1")]) == ["delayed"]
    assert await q.remove("envA", "old2")
    assert await redis_client.zscore(q.keys.delayed(0), "old2") is None
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 10)] == ["old1"]
    assert (await q.env_stats("envA")).queued == 0


async def test_a_stale_delayed_entry_is_not_handed_out_again(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """An entry left in a delayed set for a run that moved on (a process of the version before
    takes runs out of its own set only) is dropped, not made ready a second time."""
    q = await _small_promote_queue(redis_client, key_prefix, unique)
    await q.enqueue([item("r1")], NOW)
    [m] = await q.dequeue("wg", 1, NOW)
    await redis_client.zadd(q.keys.env_delayed("envA"), {"r1": NOW})
    await redis_client.zadd(q.keys.delayed_envs(0), {"envA": NOW})
    await redis_client.zadd(q.keys.delayed(0), {"r1": NOW})
    assert await q.dequeue("wg", 5, NOW + 1) == []
    assert await q.running_ids("envA") == {"r1"}
    assert await q.message_states([("envA", "r1")]) == ["held"]
    assert await redis_client.exists(q.keys.delayed_envs(0), q.keys.env_delayed("envA"), q.keys.delayed(0)) == 0
    # delayed again by the version before (its back-off in the shard's set), its old entry left behind
    await q.enqueue([item("r2", available_at_ms=NOW + 5)], NOW)
    await redis_client.zadd(q.keys.delayed(0), {"r2": NOW + 5_000})
    await redis_client.hset(q.keys.message("envA", "r2"), "due", NOW + 5_000)
    assert await q.dequeue("wg", 5, NOW + 10) == []  # not before its back-off is over
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 5_000)] == ["r2"]


async def test_a_delayed_run_whose_environment_left_the_index_is_found_lost(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    """The promotion looks only at indexed environments: a run in its set whose environment is not
    indexed (a partial loss) would wait for ever, so the reconciler is told it is lost, and its
    enqueue again indexes it."""
    q = await _small_promote_queue(redis_client, key_prefix, unique)
    await q.enqueue([item("r1", available_at_ms=NOW + 10)], NOW)
    await redis_client.zrem(q.keys.delayed_envs(0), "envA")
    assert await q.placements([("envA", "r1")]) == ["lost"]
    await q.enqueue([item("r1", available_at_ms=NOW + 10)], NOW)
    assert await q.placements([("envA", "r1")]) == ["delayed"]
    assert [m.run_id for m in await q.dequeue("wg", 5, NOW + 10)] == ["r1"]
