"""The DLQ after Redis lost its data (a flush, a restart without persistence): the reconciler's
restore rebuilds each environment's entries from PostgreSQL (the runs ending SYSTEM_FAILURE), a
budget a pass, and never brings back a run redriven or deleted while it ran."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.tenancy import ensure_environment
from tests.conftest import delete_keys

from .conftest import Harness, api_client

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def dead_letter(h: Harness, count: int, task: str = "hello") -> list[str]:
    """``count`` runs of ``task`` in the DLQ (max_deliveries=1: one dequeue never started each)."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id=task, payload=i)
                                        for i in range(count)])
    got = await h.engine.dequeue(h.env.worker_group_id, count, environments=[h.env.env_id])
    assert {d.run.id for d in got} == {r.id for r in runs}
    await h.advance(61)  # PENDING_EXECUTING timed out: past the delivery limit → DLQ
    for run in runs:
        assert (await h.engine.get_run(run.id)).status == "SYSTEM_FAILURE"  # type: ignore[union-attr]
    return sorted(r.id for r in runs)


async def other_environment(h: Harness, unique: str) -> Harness:
    """A second tenant on the same engine, with the same tasks deployed."""
    env = await ensure_environment(h.engine.resources.repo, secret="test-secret", org=f"org-b-{unique}",
                                   project="proj", env="dev")
    other = Harness(h.engine, h.clock, env)
    await other.deploy({"id": "hello"}, {"id": "other"})
    return other


def lose_redis(h: Harness, redis_url: str) -> None:
    """What a FLUSHALL does to this engine (its keys only: the session's Redis is shared)."""
    delete_keys(redis_url, f"{h.engine.resources.settings.key_prefix}*")


async def listed(h: Harness) -> list[dict[str, Any]]:
    """The environment's DLQ as the API lists it, every page."""
    out: list[dict[str, Any]] = []
    after: str | None = None
    async with api_client(h) as client:
        while True:
            params = {"page[size]": "100"} | ({"page[after]": after} if after else {})
            body = (await client.get("/api/v1/dlq", params=params)).json()
            out += body["data"]
            after = body["pagination"].get("next")
            if not after:
                return out


async def dead_runs(h: Harness, ids: list[str]) -> dict[str, Any]:
    return {i: await h.engine.get_run(i) for i in ids}


@pytest.fixture
async def h(make_engine: Callable[..., Awaitable[Harness]]) -> Harness:
    harness = await make_engine(max_deliveries=1)
    await harness.deploy({"id": "hello"}, {"id": "other"})
    return harness


async def test_the_dlq_is_rebuilt_per_environment_after_redis_lost_its_data(
        h: Harness, redis_url: str, unique: str) -> None:
    """Before: the runs stayed SYSTEM_FAILURE in PostgreSQL but the restore after the loss rebuilt
    no DLQ entry: the listing (API, dashboard, CLI) and redrive-all saw an empty DLQ."""
    b = await other_environment(h, unique)
    mine = await dead_letter(h, 3) + await dead_letter(h, 1, "other")
    theirs = await dead_letter(b, 2)
    before = await listed(h)
    assert sorted(e["run"]["id"] for e in before) == sorted(mine)
    lose_redis(h, redis_url)
    assert await listed(h) == []
    await h.engine.systems.reconciler.reconcile(grace_s=-1)  # the pass that finds the epoch gone
    after = await listed(h)
    runs = await dead_runs(h, mine)
    # each environment's own entries, ordered by their time of death (in ms, as the DLQ keeps it;
    # runs that died in the same ms by id), with their reason and count
    assert [e["run"]["id"] for e in after] == sorted(
        mine, key=lambda i: (int(runs[i].finished_at.timestamp() * 1000), i))
    for e in after:
        run = runs[e["run"]["id"]]
        assert e["reason"] == "max deliveries reached" and e["deliveries"] == 1
        assert e["deadAt"][:23] == run.finished_at.isoformat(timespec="milliseconds")[:23]
        assert e["run"]["status"] == "SYSTEM_FAILURE"
    assert sorted(e["run"]["id"] for e in await listed(b)) == theirs
    # the entries are whole messages: redrive-all puts them back in their queues, which hand them out
    count, _ = await h.engine.redrive_all(h.env.env_id, tasks=["hello"])
    assert count == 3
    got = await h.engine.dequeue(h.env.worker_group_id, 10, environments=[h.env.env_id])
    assert sorted(d.run.id for d in got) == sorted(mine[:3])
    assert [e["run"]["id"] for e in await listed(h)] == mine[3:]


async def test_the_rebuild_reads_a_budget_a_pass_one_redis_call_a_batch(
        make_engine: Callable[..., Awaitable[Harness]], redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DLQ of a million runs is rebuilt over many passes, each bounded, going on where the last
    stopped (also after the pass that marked the epoch), one Redis call for each batch."""
    h = await make_engine(max_deliveries=1, reconcile_budget=2)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, 5)
    lose_redis(h, redis_url)
    queue, reconciler = h.engine.resources.queue, h.engine.systems.reconciler
    monkeypatch.setattr(reconciler, "DLQ_BUDGET_FACTOR", 1)
    calls: list[int] = []
    real = queue.restore_dead

    async def counted(entries: Any) -> Any:
        calls.append(len(entries))
        return await real(entries)

    monkeypatch.setattr(queue, "restore_dead", counted)
    await reconciler.reconcile(grace_s=-1)
    assert await queue.has_epoch()  # the queue's restore is through; the DLQ's goes on
    assert calls and max(calls) <= 2 and sum(calls) <= 2
    passes = 1
    while await queue.dlq_rebuild_after() is not None:  # (the session's other tests' dead runs too)
        assert passes < 100, "the rebuild does not go on"
        await reconciler.reconcile(grace_s=-1)
        passes += 1
    assert passes >= 3 and max(calls) <= 2
    assert sorted(e.run_id for e in await queue.list_dlq(h.env.env_id, limit=100)) == ids
    done = len(calls)
    await reconciler.reconcile(grace_s=-1)  # through: the next passes read no dead run
    assert len(calls) == done


async def test_a_run_dead_lettered_as_redis_lost_its_data_is_brought_back_a_grace_later(
        h: Harness, redis_url: str) -> None:
    """The nack moved the run to the DLQ, Redis lost it, and the run's SYSTEM_FAILURE was written
    after the rebuild's walk had gone past it (a writer in flight at the loss): the pass a grace
    after the loss, which reads everything once more, walks the dead runs again."""
    reconciler, queue = h.engine.systems.reconciler, h.engine.resources.queue
    await reconciler.reconcile(grace_s=-1)  # a running system: the epochs are marked
    lose_redis(h, redis_url)
    await reconciler.reconcile()  # as the leader calls it (with the grace): the walk is through at once
    assert await queue.dlq_rebuild_after() is None
    (late,) = await dead_letter(h, 1)  # (the fake clock passes the grace meanwhile)
    assert await queue.forget_dead(h.env.env_id, late)  # its entry as the loss left it: never there
    assert await listed(h) == []
    await reconciler.reconcile()
    assert [e["run"]["id"] for e in await listed(h)] == [late]


async def race(h: Harness, monkeypatch: pytest.MonkeyPatch, victim: str,
               meanwhile: Callable[[], Awaitable[None]]) -> None:
    """Rebuild the DLQ with ``meanwhile`` started between the read of its runs and the write of
    their entries, and let it finish (or wait on the rebuild's locks) before the write goes on."""
    queue = h.engine.resources.queue
    real = queue.restore_dead
    task: asyncio.Task[None] | None = None

    async def waits_on_a_lock() -> bool:
        async with h.engine.resources.repo.pool.connection() as conn:
            cur = await conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                     " AND wait_event_type = 'Lock'")
            row = await cur.fetchone()
            return bool(row and row[0])

    async def racing(entries: Any) -> Any:
        nonlocal task
        if task is None and any(e.item.run_id == victim for e in entries):
            task = asyncio.create_task(meanwhile())
            deadline = time.monotonic() + 20
            while not task.done() and not await waits_on_a_lock():
                assert time.monotonic() < deadline, "neither done nor waiting"
                await asyncio.sleep(0.01)
        return await real(entries)

    monkeypatch.setattr(queue, "restore_dead", racing)
    await h.engine.systems.reconciler.reconcile(grace_s=-1)
    assert task is not None
    await task


async def test_a_run_redriven_and_finished_while_the_rebuild_runs_is_not_brought_back(
        h: Harness, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = await dead_letter(h, 3)
    victim = ids[1]
    lose_redis(h, redis_url)

    async def redrive_and_run() -> None:
        await h.engine.redrive(h.env.env_id, victim)
        (d,) = await h.engine.dequeue(h.env.worker_group_id, 1, environments=[h.env.env_id])
        started = await h.engine.start_attempt(d.run.id, d.snapshot.id)
        await h.engine.complete_attempt(started.run.id, started.snapshot.id, ok=True)

    await race(h, monkeypatch, victim, redrive_and_run)
    assert (await h.engine.get_run(victim)).status == "COMPLETED"  # type: ignore[union-attr]
    assert sorted(e["run"]["id"] for e in await listed(h)) == [ids[0], ids[2]]
    assert await h.engine.resources.queue.placements([(h.env.env_id, victim)]) == [None]


async def test_a_run_deleted_by_retention_while_the_rebuild_runs_leaves_no_entry(
        h: Harness, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = await dead_letter(h, 3)
    victim = ids[0]
    lose_redis(h, redis_url)
    r = h.engine.resources
    async with r.repo.pool.connection() as conn:  # only the victim is old enough for retention
        await conn.execute("UPDATE task_run SET finished_at = finished_at - interval '400 days' WHERE id = %s",
                           (victim,))

    async def retention() -> None:
        await r.repo.maintenance.delete_finished_before(300 * 86400, 100, r.queue.remove_many)

    await race(h, monkeypatch, victim, retention)
    r.repo.maintenance.rewind()  # the next retention pass: its walks start over
    await retention()  # (a retention that found the run locked by the rebuild deletes it now)
    assert await h.engine.get_run(victim) is None
    dlq = f"{r.queue.keys.env(h.env.env_id)}:dlq"
    members = {m.decode() if isinstance(m, bytes) else m for m in await h.engine.redis.zrange(dlq, 0, -1)}
    assert members == {ids[1], ids[2]}  # no entry of the deleted run, not even one the listing would drop
    assert await r.queue.placements([(h.env.env_id, victim)]) == [None]
