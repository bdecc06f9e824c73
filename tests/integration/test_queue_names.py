"""Names chosen by tenants can never collide with another key (issue 10): queue names, task ids
and concurrency keys are encoded into Redis keys, and a dequeue never fails or half-moves a run."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from run_engine.run_queue import EnqueueItem, RunQueue
from run_engine.run_queue.keys import encode_name

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

NOW = 1_700_000_000_000


@pytest.fixture
async def q(redis_client: aioredis.Redis, key_prefix: str, unique: str) -> RunQueue:
    queue = RunQueue(redis_client, prefix=f"{key_prefix}:n{unique}", shards=1, max_deliveries=3,
                     default_env_limit=1000)
    await queue.load_scripts()
    return queue


async def _drain(q: RunQueue, group: str = "wg") -> list[tuple[str, str, str | None]]:
    out = []
    while True:
        got = await q.dequeue(group, 10, NOW)
        if not got:
            return out
        out += [(m.run_id, m.queue, m.concurrency_key) for m in got]
        await q.ack([(m.env_id, m.run_id) for m in got])


async def test_the_issue_10_collision_no_longer_stops_the_group(q: RunQueue) -> None:
    """Tasks `a:k:y` and `a` and a run keyed `y:vt` once made one key both the ready set of one
    queue and the virtual clock of another: every dequeue of the group failed from then on."""
    await q.enqueue([EnqueueItem("r1", "envP", "task/a:k:y", "wg", NOW)], NOW)
    assert [m.run_id for m in await q.dequeue("wg", 1, NOW)] == ["r1"]  # sets the queue's virtual clock
    await q.enqueue([EnqueueItem("r2", "envP", "task/a", "wg", NOW + 1, concurrency_key="y:vt"),
                     EnqueueItem("r3", "envP", "task/a:k:y", "wg", NOW + 2),
                     EnqueueItem("r4", "envProd", "task/a", "wg", NOW + 3)], NOW)
    got = await _drain(q)
    assert sorted(got) == [("r2", "task/a", "y:vt"), ("r3", "task/a:k:y", None), ("r4", "task/a", None)]


@pytest.mark.parametrize(("queue", "key"), [
    ("q:with:colons", "k:with:colons"), ("%3A", "%"), ("per%cent", "%25"), ("e:x:q:y", ":"),
    ("ünï/cødé", "🔑"), ("{braces}", "{rq:0}"), ("task/a", ""),
])
async def test_any_name_round_trips_through_every_operation(q: RunQueue, queue: str, key: str) -> None:
    await q.set_queue_limit("envN", queue, 1)
    await q.set_key_limit("envN", queue, 1)
    await q.enqueue([EnqueueItem("n1", "envN", queue, "wg", NOW, concurrency_key=key or None),
                     EnqueueItem("n2", "envN", queue, "wg", NOW + 1, concurrency_key=key or None)], NOW)
    assert (await q.queue_stats("envN", queue)).queued == 2
    [first] = await q.dequeue("wg", 10, NOW)  # the queue limit of 1 holds the second back
    assert (first.run_id, first.queue, first.concurrency_key) == ("n1", queue, key or None)
    facts = await q.inspect("envN", "n2")
    assert facts is not None and facts["message"]["queue"] == queue and facts["ahead"] == 0
    assert facts["queue_running"] == 1 and facts["key_running"] == 1
    await q.dead_letter("envN", "n1", "test", NOW)
    [entry] = await q.list_dlq("envN")
    assert (entry.run_id, entry.queue) == ("n1", queue)
    assert await q.redrive("envN", "n1", NOW)
    await q.pause("envN", queue)
    assert await q.dequeue("wg", 10, NOW) == []
    await q.resume("envN", queue)
    assert sorted(r for r, _, _ in await _drain(q)) == ["n1", "n2"]
    assert (await q.queue_stats("envN", queue)).queued == 0


async def test_a_dequeue_skips_a_broken_entry_instead_of_failing(q: RunQueue) -> None:
    await q.enqueue([EnqueueItem(f"b{i}", "envB", "task/b", "wg", NOW + i) for i in range(3)], NOW)
    await q.redis.delete(q.keys.message("envB", "b0"))
    await q.redis.set(q.keys.message("envB", "b0"), "not a hash")  # as a foreign key would have been
    got = await _drain(q)
    assert [r for r, _, _ in got] == ["b1", "b2"]
    # b0 was taken out of its ready set; its message is no hash: the reconciler sees it as not placed
    await q.redis.delete(q.keys.message("envB", "b0"))
    assert await q.placements([("envB", "b0")]) == [None]


async def test_placements_find_runs_lost_from_their_set(q: RunQueue) -> None:
    await q.enqueue([EnqueueItem("p1", "envL", "task/l", "wg", NOW), EnqueueItem("p2", "envL", "task/l", "wg", NOW),
                     EnqueueItem("p3", "envL", "task/l", "wg", NOW, available_at_ms=NOW + 60_000)], NOW)
    await q.redis.zrem(q.keys.ready("envL", "wg", "task/l", None), "p1")  # as a failed script would leave it
    await q.redis.zrem(q.keys.env_delayed("envL"), "p3")
    assert await q.placements([("envL", "p1"), ("envL", "p2"), ("envL", "p3"), ("envL", "nope")]) == \
        ["lost", "ready", "lost", None]


async def test_placements_with_a_run_being_handed_out_beside_others(q: RunQueue) -> None:
    """A run handed out within the grace is reported as such, and the runs checked after it still
    get their own answers (it once counted as checked without a command sent: the call failed)."""
    await q.enqueue([EnqueueItem(f"h{i}", "envH", "task/h", "wg", NOW + i) for i in range(3)], NOW)
    (m,) = await q.dequeue("wg", 1, NOW)
    assert m.run_id == "h0"
    await q.redis.zrem(q.keys.ready("envH", "wg", "task/h", None), "h2")  # lost, as a failed script leaves it
    items = [("envH", "h0"), ("envH", "h1"), ("envH", "h2")]
    assert await q.placements(items, now_ms=NOW + 1_000, held_grace_ms=30_000) == ["handing out", "ready", "lost"]
    assert await q.placements(items, now_ms=NOW + 60_000, held_grace_ms=30_000) == ["held", "ready", "lost"]


async def test_the_scripts_write_the_keys_that_queue_keys_builds(q: RunQueue) -> None:
    """run_queue/keys.py and lua/queue_lib.lua agree on the key layout: each key the scripts
    write for a run is the one QueueKeys builds (names with every escaped character included), and
    every key of the prefix is one of them or a group index key."""
    env, queue, ck, wg, run = "env:%a", "task/q:%\x00x", "c:k%", "wg:1", "run:1"
    k = q.keys
    await q.enqueue([EnqueueItem(run, env, queue, wg, NOW, concurrency_key=ck)], NOW)
    redis = q.redis
    assert await redis.hget(k.message(env, run), "state") in (b"ready", "ready")
    assert await redis.zscore(k.ready(env, wg, queue, ck), encode_name(run)) is not None
    assert int(await redis.hget(f"{k.env(env)}:meta", "queued")) == 1
    assert int(await redis.hget(f"{k.queue(env, queue)}:meta", "queued")) == 1
    (m,) = await q.dequeue(wg, 1, NOW)
    assert m.run_id == run and m.queue == queue and m.concurrency_key == ck and m.env_id == env
    for slots in (f"{k.env(env)}:running", f"{k.queue(env, queue)}:running", f"{k.key(env, queue, ck)}:running"):
        assert await redis.sismember(slots, encode_name(run)), slots
    assert await q.running_ids(env) == {run}
    await q.dead_letter(env, run, "test", NOW)
    assert await redis.zscore(f"{k.env(env)}:dlq", encode_name(run)) is not None
    base = k.base_for(env)
    known = (k.message(env, run), k.delayed(k.shard_of(env)), k.env(env), f"{base}:g:{encode_name(wg)}")
    async for key in redis.scan_iter(match=f"{q.prefix}:*"):
        name = key.decode() if isinstance(key, bytes) else key
        assert name.startswith(known), name
