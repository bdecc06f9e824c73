"""Property test of the run queue on real Redis: random sequences of enqueue, dequeue, ack, nack,
release, pause and resume never hand a held run out twice, never exceed a limit, lose nothing."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from run_engine.redis_connect import connect as connect_redis
from run_engine.run_queue import EnqueueItem, RunQueue

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

ENVS = ("e1", "e2")
QUEUES = ("qa", "qb")
KEYS = (None, "k1", "k2")
NOW = 1_700_000_000_000

enqueue = st.tuples(st.just("enqueue"), st.sampled_from(ENVS), st.sampled_from(QUEUES), st.sampled_from(KEYS),
                    st.integers(0, 50), st.sampled_from([0, 0, 0, 0, 200, 3000]))
dequeue = st.tuples(st.just("dequeue"), st.integers(1, 6))
# enqueue and dequeue are drawn most often, so that limits are actually reached
op = st.one_of(
    enqueue, enqueue, enqueue, enqueue, dequeue, dequeue, dequeue,
    st.tuples(st.just("ack"), st.integers(0, 100)),
    st.tuples(st.just("nack"), st.integers(0, 100)),
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("pause"), st.sampled_from(ENVS), st.sampled_from(QUEUES)),
    st.tuples(st.just("resume"), st.sampled_from(ENVS), st.sampled_from(QUEUES)),
    st.tuples(st.just("tick"), st.integers(1, 5000)),
)


@dataclass
class Model:
    env_limit: int
    queue_limit: int  # each concurrency key's (runs without one are the key None)
    key_limit: int
    queue_cap: int  # all the queue's keys' together
    attrs: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    queued: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    dlq: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)


async def scenario(redis_url: str, prefix: str, limits: tuple[int, int, int, int], ops: list[tuple]) -> None:  # type: ignore[type-arg]
    client = await connect_redis(redis_url, max_connections=8)
    q = RunQueue(client, prefix=prefix, shards=2, max_deliveries=3, default_env_limit=100)
    m = Model(*limits)
    now = NOW
    try:
        for env in ENVS:
            await q.set_env_limit(env, m.env_limit)
            for name in QUEUES:
                await q.set_queue_limit(env, name, m.queue_limit)
                await q.set_key_limit(env, name, m.key_limit)
                await q.set_queue_cap(env, name, m.queue_cap)
        for n, step in enumerate(ops):
            kind = step[0]
            if kind == "enqueue":
                _, env, name, key, score, delay = step
                run = f"r{n}"
                m.attrs[run] = (env, name, key)
                await q.enqueue([EnqueueItem(run, env, name, "wg", now + score, now + delay, key)], now)
                m.queued.add(run)
            elif kind == "dequeue":
                for msg in await q.dequeue("wg", step[1], now):
                    assert msg.run_id not in m.held, f"{msg.run_id} handed out twice"
                    assert msg.run_id in m.queued, f"{msg.run_id} was not queued"
                    m.queued.discard(msg.run_id)
                    m.held.add(msg.run_id)
            elif kind in ("ack", "nack", "release") and m.held:
                run = sorted(m.held)[step[1] % len(m.held)]
                env = m.attrs[run][0]
                m.held.discard(run)
                if kind == "ack":
                    await q.ack([(env, run)])
                    m.acked.add(run)
                elif kind == "release":
                    await q.release(env, run)
                    m.released.add(run)
                else:
                    res = await q.nack(env, run, now)
                    (m.dlq if res.dead_lettered else m.queued).add(run)
            elif kind == "pause":
                await q.pause(step[1], step[2])
            elif kind == "resume":
                await q.resume(step[1], step[2])
            elif kind == "tick":
                now += step[1]
            # invariants: Redis's slots are exactly the model's held runs, within every limit
            for env in ENVS:
                held = {r for r in m.held if m.attrs[r][0] == env}
                assert await q.running_ids(env) == held
                assert len(held) <= m.env_limit
                for name in QUEUES:
                    in_q = [r for r in held if m.attrs[r][1] == name]
                    assert len(in_q) <= m.queue_cap
                    for key in KEYS:
                        assert len([r for r in in_q if m.attrs[r][2] == key]) <= min(m.queue_limit, m.key_limit)
                queued = {r for r in m.queued if m.attrs[r][0] == env}
                assert (await q.env_stats(env)).queued == len(queued)
                assert {e.run_id for e in await q.list_dlq(env)} == {r for r in m.dlq if m.attrs[r][0] == env}
        # nothing lost: with everything resumed and due, every queued run comes out exactly once
        for env in ENVS:
            await q.set_env_limit(env, 1000)
            for name in QUEUES:
                await q.resume(env, name)
                await q.set_queue_limit(env, name, None)
                await q.set_key_limit(env, name, None)
                await q.set_queue_cap(env, name, None)
        drained: list[str] = []
        while True:
            got = await q.dequeue("wg", 50, now + 10**9)
            if not got:
                break
            drained += [g.run_id for g in got]
        assert sorted(drained) == sorted(m.queued)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limits=st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(1, 8)),
       ops=st.lists(op, min_size=1, max_size=60))
def test_queue_invariants_hold_for_random_operation_sequences(
    redis_url: str, key_prefix: str, limits: tuple[int, int, int, int], ops: list[tuple]  # type: ignore[type-arg]
) -> None:
    asyncio.run(scenario(redis_url, f"{key_prefix}:p{secrets.token_hex(4)}", limits, ops))
