"""Quick checks of the queue's pure logic on fakeredis (its Lua is lupa, not Redis's: every
script is also tested on real Redis in tests/integration)."""

from __future__ import annotations

import fakeredis

from run_engine.run_queue import EnqueueItem, QueueKeys, RunQueue, jump_hash


def test_jump_hash_is_stable_and_spreads() -> None:
    assert [jump_hash(k, 1) for k in range(100)] == [0] * 100
    counts = [0] * 4
    for k in range(4000):
        counts[jump_hash(k * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF, 4)] += 1
    assert all(800 < c < 1200 for c in counts)
    # growing the shard count moves only about 1/n of the keys
    moved = sum(jump_hash(k * 7919, 4) != jump_hash(k * 7919, 5) for k in range(5000))
    assert moved < 5000 * 0.3


def test_keys_of_one_env_share_one_hash_tag() -> None:
    keys = QueueKeys("re:q", 8)
    shard = keys.shard_of("env_1")
    tag = f"{{rq:{shard}}}"
    assert tag in keys.message("env_1", "run_1") and tag in keys.queue("env_1", "task/x")
    assert keys.delayed(shard).startswith(f"re:q:{tag}")


async def test_enqueue_dequeue_ack_on_fakeredis() -> None:
    client = fakeredis.FakeAsyncRedis()
    q = RunQueue(client, prefix="u", shards=2)
    await q.enqueue([EnqueueItem("r1", "e", "q", "wg", 10), EnqueueItem("r2", "e", "q", "wg", 5)], 100)
    got = await q.dequeue("wg", 5, 100)
    assert [m.run_id for m in got] == ["r2", "r1"]
    await q.ack([("e", "r1"), ("e", "r2")])
    assert await q.running_ids("e") == set()
    await client.aclose()


def test_public_api_is_pinned() -> None:
    import run_engine.run_queue as rq

    assert sorted(rq.__all__) == [
        "DeadMessage",
        "DequeuedMessage",
        "DequeuedRun",
        "DlqEntry",
        "EnqueueItem",
        "EnvStats",
        "Handed",
        "NackResult",
        "QueueKeys",
        "QueueSettings",
        "QueueStats",
        "RateLimit",
        "RunQueue",
        "jump_hash",
    ]
    assert rq.DequeuedRun is rq.DequeuedMessage


async def test_rate_limit_on_fakeredis() -> None:
    from run_engine.run_queue import RateLimit

    client = fakeredis.FakeAsyncRedis()
    q = RunQueue(client, prefix="u", shards=1)
    await q.set_rate_limit("e", "q", RateLimit(limit=2, period_ms=1000))
    await q.enqueue([EnqueueItem(f"r{i}", "e", "q", "wg", i) for i in range(3)], 100)
    got = await q.dequeue("wg", 5, 100)
    assert [m.run_id for m in got] == ["r0"] and got.retry_at_ms == 600
    assert [m.run_id for m in await q.dequeue("wg", 5, 600)] == ["r1"]
    await client.aclose()


async def test_parked_env_comes_back_when_a_slot_frees_on_fakeredis() -> None:
    client = fakeredis.FakeAsyncRedis()
    q = RunQueue(client, prefix="u", shards=1, default_env_limit=1)
    await q.enqueue([EnqueueItem("r1", "e", "q", "wg", 1), EnqueueItem("r2", "e", "q", "wg", 2)], 100)
    assert [m.run_id for m in await q.dequeue("wg", 5, 100)] == ["r1"]
    assert await q.dequeue("wg", 5, 100) == []
    await q.ack([("e", "r1")])
    assert [m.run_id for m in await q.dequeue("wg", 5, 100)] == ["r2"]
    await client.aclose()
