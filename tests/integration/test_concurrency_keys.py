"""A queue's concurrency limit holds for each concurrency key, as Trigger.dev's concurrencyLimit:
a queue of limit 1 with concurrencyKey = a user id runs one run of each user at once, any number of
users together. Runs without a concurrency key are one key of their own (at most the limit at
once, as before); the environment's limit is the cap over all; a cap over all the queue's keys
together is an optional setting of the run queue (none by default)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from run_engine.engine import TriggerRequest
from run_engine.run_queue import EnqueueItem, RunQueue

from .conftest import Harness

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

NOW = 1_700_000_000_000


@pytest.fixture
async def q(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> RunQueue:
    queue = RunQueue(redis_client, prefix=f"{key_prefix}:ck{unique}", shards=2, default_env_limit=1000)
    await queue.load_scripts()
    return queue


def item(run: str, key: str | None = None, score: float = NOW, queue: str = "task/a") -> EnqueueItem:
    return EnqueueItem(run_id=run, env_id="envA", queue=queue, worker_group="wg", score_ms=score,
                       concurrency_key=key)


def req(h: Harness, task: str = "limited", **kw: Any) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)


async def handed(q: RunQueue, now: int = NOW) -> list[str]:
    return sorted(m.run_id for m in await q.dequeue("wg", 10, now))


# --- the run queue -------------------------------------------------------------------------------

async def test_two_keys_under_a_limit_of_one_run_one_each_and_a_key_waits_for_its_own_slot(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item("a1", "A"), item("b1", "B", NOW + 1), item("a2", "A", NOW + 2)], NOW)
    assert await handed(q) == ["a1", "b1"]  # one run of each key at once
    assert await handed(q) == []  # a2 waits: its key A is at the limit
    await q.ack([("envA", "b1")])  # B's slot frees: not A's
    assert await handed(q) == []
    await q.ack([("envA", "a1")])  # A's slot frees: its key, parked at its limit, is put back
    assert await handed(q) == ["a2"]
    stats = await q.queue_stats("envA", "task/a")
    assert (stats.running, stats.limit, stats.cap) == (1, 1, None)


async def test_runs_without_a_key_are_still_capped_at_the_limit_beside_keyed_runs(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 2)
    await q.enqueue([item(f"n{i}", None, NOW + i) for i in range(4)]
                    + [item(f"k{i}", "k", NOW + 10 + i) for i in range(3)], NOW)
    assert await handed(q) == ["k0", "k1", "n0", "n1"]  # 2 without a key, 2 of key k
    assert await handed(q) == []
    assert (await q.queue_stats("envA", "task/a")).running == 4  # all the queue's keys together
    await q.ack([("envA", "k0")])
    assert await handed(q) == ["k2"]  # a freed slot of key k is not one of the runs without a key
    await q.ack([("envA", "n0")])
    assert await handed(q) == ["n2"]


async def test_a_key_limit_lower_than_the_queues_limit_holds_for_each_key(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 3)
    await q.set_key_limit("envA", "task/a", 1)
    await q.enqueue([item("a1", "A"), item("a2", "A", NOW + 1), item("b1", "B", NOW + 2)], NOW)
    assert await handed(q) == ["a1", "b1"]
    await q.set_key_limit("envA", "task/a", None)  # back to the queue's limit: A's parked key is put back
    assert await handed(q) == ["a2"]


async def test_an_optional_cap_holds_over_all_keys_together(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 2)
    await q.set_queue_cap("envA", "task/a", 3)
    await q.enqueue([item(f"{k}{i}", k, NOW + i) for k in "ab" for i in range(3)], NOW)
    got = await handed(q)
    assert len(got) == 3 and sum(r.startswith("a") for r in got) <= 2 and sum(r.startswith("b") for r in got) <= 2
    assert await handed(q) == []  # the queue is at its cap
    await q.ack([("envA", got[0])])  # a freed slot puts the queue back
    assert len(await handed(q)) == 1
    await q.set_queue_cap("envA", "task/a", None)  # no cap: each key up to the limit
    await handed(q)
    assert len(await q.running_ids("envA")) == 4  # 2 of a, 2 of b


async def test_a_limit_of_0_holds_every_key_until_it_is_raised(q: RunQueue) -> None:
    await q.set_queue_limit("envA", "task/a", 0)
    await q.enqueue([item(f"r{i}", f"k{i}", NOW + i) for i in range(50)] + [item("none", None, NOW)], NOW)
    assert await handed(q) == []
    await q.set_queue_limit("envA", "task/a", 1)
    assert len(await q.dequeue("wg", 100, NOW)) == 51  # one of each key


async def parked_keys(q: RunQueue, redis_client: aioredis.Redis, queue: str = "task/a") -> set[str]:
    """The concurrency keys of envA's queue parked at their limit in group wg (out of its index)."""
    from run_engine.run_queue.keys import encode_name

    base = q._shard_args("envA")[1]
    qk = f"{base}:e:{encode_name('envA')}:q:{encode_name(queue)}"
    keys = {k.decode() for k in await redis_client.sunion([f"{qk}:pk", f"{qk}:upk"])}  # :upk: a raise's
    return {k for k in keys if await redis_client.sismember(f"{qk}:k:{k}:parked", "wg")}


async def test_keys_parked_at_their_limit_stay_parked_when_the_limit_is_written_again_or_lowered(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """A queue's settings written again (at each deploy, by a repair) or lowered put back every key
    parked at its limit, so that the group's next dequeue calls spent their budget parking them
    again (bench/settings_stall.py: 10,000 keys, 6 calls of ~50 ms handing nothing to anyone). They
    stay parked now; a raise, or no limit, puts them back, and a freed slot its own key."""
    from run_engine.run_queue import QueueSettings

    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item(f"{k}{i}", k, NOW + i) for k in "abc" for i in range(2)], NOW)
    assert await handed(q) == ["a0", "b0", "c0"]
    assert await handed(q) == []  # each key at its limit: parked
    assert await parked_keys(q, redis_client) == {"a", "b", "c"}
    await q.set_queue_limit("envA", "task/a", 1)
    await q.configure_queues([QueueSettings("envA", "task/a", limit=1)])
    await q.set_key_limit("envA", "task/a", 1)
    assert await parked_keys(q, redis_client) == {"a", "b", "c"}  # still blocked: left parked
    await q.configure_queues([QueueSettings("envA", "task/a", limit=5, key_limit=1)])  # each key's: still 1
    assert await parked_keys(q, redis_client) == {"a", "b", "c"}
    await q.ack([("envA", "a0")])  # a freed slot puts its own key back
    assert await handed(q) == ["a1"]
    await q.configure_queues([QueueSettings("envA", "task/a", limit=2)])  # raised: every key back
    assert await parked_keys(q, redis_client) == set()
    assert await handed(q) == ["b1", "c1"]


async def test_a_raise_puts_back_thousands_of_parked_keys_a_bounded_number_a_call(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """A raise of a queue's limit put back every parked key in one call (100,000 keys: 2.2 s of
    Redis serving no one else; bench/settings_stall.py). It puts back 1,000 now and the shard's
    next dequeue calls the rest, a few hundred each: every key runs again, none twice."""
    from run_engine.run_queue import QueueSettings

    keys = 2_500
    await q.set_env_limit("envA", 10_000)
    await q.set_queue_limit("envA", "task/a", 1)
    await q.enqueue([item(f"r{k}_{i}", f"k{k}", NOW + i) for k in range(keys) for i in range(2)], NOW)
    first: list[str] = []
    for _ in range(200):  # every key's first run, then calls that park the keys at their limit
        got = [m.run_id for m in await q.dequeue("wg", 500, NOW)]
        first += got
        if not got and len(await parked_keys(q, redis_client)) == keys:
            break
    assert sorted(first) == sorted(f"r{k}_0" for k in range(keys))
    await q.configure_queues([QueueSettings("envA", "task/a", limit=2)])
    assert 0 < len(await parked_keys(q, redis_client)) < keys  # some put back at once, not all
    second: list[str] = []
    for _ in range(200):
        second += [m.run_id for m in await q.dequeue("wg", 500, NOW)]
        if len(second) >= keys:
            break
    assert sorted(second) == sorted(f"r{k}_1" for k in range(keys))  # each key's second run, once
    assert await parked_keys(q, redis_client) == set()
    assert await q.dequeue("wg", 500, NOW) == []


async def test_keys_parked_again_at_the_raised_limit_are_not_put_back_on_every_dequeue(
        q: RunQueue, redis_client: aioredis.Redis) -> None:
    """A raise puts back the keys parked at the old limit, 1,000 at once and the rest by the
    shard's next dequeue calls (B:unpark). Keys still blocked at the new limit park again, and
    only their own freed slot may put them back; but they went back into the same set, so with
    more than ~500 of them B:unpark never emptied: every dequeue call of the shard, of every group,
    put back 500 keys still at their limit and parked them again, for as long as they had runs
    waiting. Here a limit of 2 lowered to 1 and raised back to 2 (a deploy and its revert), every
    key holding 2 runs."""
    from run_engine.run_queue import QueueSettings

    keys = 1_600
    await q.set_env_limit("envA", 100_000)
    await q.configure_queues([QueueSettings("envA", "task/a", limit=2)])
    await q.enqueue([item(f"r{k}_{i}", f"k{k}", NOW + i) for k in range(keys) for i in range(3)], NOW)
    held: list[str] = []
    for _ in range(200):  # two runs of every key, then calls that park the keys at their limit
        got = await q.dequeue("wg", 1_000, NOW)
        held += [m.run_id for m in got]
        if not got and len(await parked_keys(q, redis_client)) == keys:
            break
    assert len(held) == 2 * keys
    await q.configure_queues([QueueSettings("envA", "task/a", limit=1)])
    await q.configure_queues([QueueSettings("envA", "task/a", limit=2)])  # raised: keys put back
    base = q._shard_args("envA")[1]
    for _ in range(10):  # every key is still at its limit: nothing runs, and the raise's work ends
        assert await q.dequeue("wg", 1_000, NOW) == []
    assert await redis_client.scard(f"{base}:unpark") == 0
    assert len(await parked_keys(q, redis_client)) == keys
    await q.ack([("envA", "r0_0")])  # a freed slot still puts its own key back
    assert [m.run_id for m in await q.dequeue("wg", 1_000, NOW)] == ["r0_2"]


# --- the engine: the deployed limit, or the operator's override, for each key ----------------------

async def test_each_concurrency_key_gets_the_queues_limit_as_in_trigger_dev(h: Harness) -> None:
    """Trigger.dev's concurrencyKey ("a separate queue per key, each with the queue's
    concurrencyLimit": one run per user at once with a limit of 1) — the queue's limit was one cap
    over all keys: a queue of limit 1 ran one user at a time in all (from a review of queue
    semantics)."""
    for user in ("alice", "bob"):
        await h.engine.trigger(req(h, concurrency_key=user))
    got = await h.engine.dequeue(h.env.worker_group_id, 5)
    assert sorted(d.run.concurrency_key for d in got) == ["alice", "bob"]
    later = await h.engine.trigger(req(h, concurrency_key="alice"))
    assert await h.engine.dequeue(h.env.worker_group_id, 5) == []  # alice's one run is running
    (alice,) = [d for d in got if d.run.concurrency_key == "alice"]
    s = await h.engine.start_attempt(alice.run.id, alice.snapshot.id)
    await h.engine.complete_attempt(alice.run.id, s.snapshot.id, ok=True, output={})
    assert [d.run.id for d in await h.engine.dequeue(h.env.worker_group_id, 5)] == [later.id]


async def test_an_override_is_the_limit_of_each_key_and_the_queue_shows_all_its_runs(
        h: Harness, api: httpx.AsyncClient) -> None:
    await h.engine.trigger(req(h))  # the queue is copied to Redis on first use
    await h.engine.set_queue_concurrency_override(h.env.env_id, "limited", 2)
    for user in ("alice", "alice", "alice", "bob"):
        await h.engine.trigger(req(h, concurrency_key=user))
    got = await h.engine.dequeue(h.env.worker_group_id, 10)
    keys = sorted(d.run.concurrency_key or "" for d in got)
    assert keys == ["", "alice", "alice", "bob"]  # two of alice's three; the run without a key
    shown = (await api.get("/api/v1/queues/limited")).json()
    assert (shown["running"], shown["queued"], shown["concurrencyLimit"]) == (4, 1, 2)


async def test_explain_says_which_key_is_at_the_queues_limit(h: Harness) -> None:
    from run_engine.api.serialize import explanation_object

    first = await h.engine.trigger(req(h, concurrency_key="alice"))
    (d,) = await h.engine.dequeue(h.env.worker_group_id, 5)
    await h.engine.start_attempt(first.id, d.snapshot.id)
    alice = await h.engine.trigger(req(h, concurrency_key="alice"))
    bob = await h.engine.trigger(req(h, concurrency_key="bob"))
    (r,) = explanation_object(await h.engine.explain(h.env.env_id, alice.id))["reasons"]
    assert (r["code"], r["running"], r["limit"], r["concurrencyKey"]) == ("QUEUE_AT_LIMIT", 1, 1, "alice")
    (r,) = explanation_object(await h.engine.explain(h.env.env_id, bob.id))["reasons"]
    assert r["code"] == "READY"  # bob's key runs nothing: the queue's limit does not hold it back
