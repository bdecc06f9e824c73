"""From a review of waitpoints and waitpoint tokens: each test shows a bug of the code before it
(a waiting run resumed with the wrong result, or never resumed)."""

from __future__ import annotations

from typing import Any

import pytest

from run_engine.engine import TriggerRequest
from run_engine.statuses import RunStatus

from .conftest import Harness


def req(h: Harness, task: str = "hello", **kw: object) -> TriggerRequest:
    return TriggerRequest(env_id=h.env.env_id, task_id=task, **kw)  # type: ignore[arg-type]


async def start(h: Harness, *run_ids: str) -> list:  # type: ignore[type-arg]
    """Dequeue and start ``run_ids`` (their attempts, in that order)."""
    got = {d.run.id: d for d in await h.engine.dequeue(h.env.worker_group_id, 10)}
    return [await h.engine.start_attempt(run_id, got[run_id].snapshot.id) for run_id in run_ids]


async def test_a_wait_on_a_run_redriven_from_the_dlq_waits_for_its_new_outcome(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A run that went to the DLQ completed the RUN waitpoint its waiters share with its failure.
    Redriven, it runs again; a run that waits on it afterwards must wait for how it ends now, not
    be resumed at once with the failure of the run's earlier life (the waitpoint found by its key
    ``run:<id>`` was the completed one)."""
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    target = await h.engine.trigger(req(h))
    await h.engine.run_waitpoint(h.env.env_id, target.id)  # someone waits on it (its finish completes it)
    assert len(await h.engine.dequeue(h.env.worker_group_id, 1)) == 1
    await h.advance(61)  # handed out and never started: to the DLQ
    dead = await h.engine.get_run(target.id)
    assert dead is not None and dead.status == RunStatus.SYSTEM_FAILURE
    await h.engine.redrive(h.env.env_id, target.id)

    waiter = await h.engine.trigger(req(h))
    started, again = await start(h, waiter.id, target.id)
    wp = await h.engine.run_waitpoint(h.env.env_id, target.id)
    outcome = await h.engine.block(waiter.id, started.snapshot.id, sequence=0, kind="token", key=target.id,
                                   waitpoint_ids=[wp.id])
    assert outcome.blocked, outcome.entry  # before: resumed at once with the DLQ's SYSTEM_FAILURE

    await h.engine.complete_attempt(target.id, again.snapshot.id, ok=True, output={"second": "life"})
    entry = await h.engine.waitpoints.resolved_entry(waiter.id, 0)
    assert entry is not None and entry["resolved"] and entry["result"] == {"ok": True, "output": {"second": "life"}}
    assert (await h.engine.latest_snapshot(waiter.id)).engine_status == "EXECUTING"


async def test_retention_deletes_the_run_waitpoint_of_a_run_it_deleted(make_engine) -> None:  # type: ignore[no-untyped-def]
    """``wait.for_run`` makes a RUN waitpoint keyed ``run:<id>`` whose key never expires: retention,
    which keeps a keyed waitpoint until its key expires, kept every one for ever (and walked them
    all again at every batch of every pass), long after the run it named was deleted."""
    h: Harness = await make_engine(retention_days=1e-9)
    await h.deploy({"id": "hello"})
    target = await h.engine.trigger(req(h))
    (started,) = await start(h, target.id)
    await h.engine.complete_attempt(target.id, started.snapshot.id, ok=True, output=1)
    wp = await h.engine.run_waitpoint(h.env.env_id, target.id)  # a wait on it, answered at once
    assert (await h.engine.get_waitpoint(wp.id)).status == "COMPLETED"  # type: ignore[union-attr]
    await h.engine.systems.reconciler.retention()
    assert await h.engine.get_run(target.id) is None
    assert await h.engine.get_waitpoint(wp.id) is None  # before: kept for ever


async def test_a_wait_on_a_run_of_a_batch_resumes_when_that_run_finishes(h: Harness) -> None:
    """``wait.for_run`` on a run that belongs to a batch: its finish counted it in its batch and
    completed no RUN waitpoint (only runs outside batches did), so the waiter stayed blocked until
    the sweeper's walk came upon that waitpoint (a pass every few seconds, 5,000 waitpoints a
    pass: minutes behind many waiting runs)."""
    batch_id = h.engine.new_batch_id()
    (item, other) = await h.engine.trigger_batch(h.env.env_id, batch_id,
                                                 [req(h, batch_id=batch_id), req(h, batch_id=batch_id)])
    waiter = await h.engine.trigger(req(h))
    started_waiter, started_item = await start(h, waiter.id, item.id)
    wp = await h.engine.run_waitpoint(h.env.env_id, item.id)
    outcome = await h.engine.block(waiter.id, started_waiter.snapshot.id, sequence=0, kind="token", key=item.id,
                                   waitpoint_ids=[wp.id])
    assert outcome.blocked
    await h.engine.complete_attempt(item.id, started_item.snapshot.id, ok=True, output="done")
    latest = await h.engine.latest_snapshot(waiter.id)
    assert latest.engine_status == "EXECUTING"  # before: EXECUTING_WITH_WAITPOINTS until a sweep
    entry = await h.engine.waitpoints.resolved_entry(waiter.id, 0)
    assert entry is not None and entry["result"] == {"ok": True, "output": "done"}


async def test_a_batch_whose_created_runs_all_finished_before_it_shrank_for_a_joined_run_completes(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """batchTriggerAndWait with an item whose key names an existing run: the batch is shrunk to the
    runs it created after they are made. Those that finished before the shrink were counted against
    the batch's first size, short of it; nothing counted again after, and the parent stayed
    blocked until the sweeper found the batch (every few seconds) instead of resuming at once."""
    holder = await h.engine.trigger(req(h, payload="held", idempotency_key="held-1"))
    (st,) = await start(h, holder.id)
    await h.engine.complete_attempt(holder.id, st.snapshot.id, ok=True, output="held done")
    parent = await h.engine.trigger(req(h))
    (ps,) = await start(h, parent.id)
    repo = h.engine.resources.repo.waitpoints
    real = repo.repoint

    async def child_finishes_first(run_id: str, sequence: int, waitpoint_id: str | None, key: str,
                                   result: Any, batch_shrink: tuple[str, int] | None = None) -> None:
        (made,) = [r for r in result["runIds"] if r != holder.id]
        (cs,) = await start(h, made)  # a worker ran it faster than the parent's call went on
        await h.engine.complete_attempt(made, cs.snapshot.id, ok=True, output="fast done")
        await real(run_id, sequence, waitpoint_id, key, result, batch_shrink)

    monkeypatch.setattr(repo, "repoint", child_finishes_first)
    ids, out = await h.engine.trigger_and_wait(parent.id, ps.snapshot.id, 0,
                                               [req(h, payload="held", idempotency_key="held-1"),
                                                req(h, payload="fast")], batch=True)
    assert ids[0] == holder.id
    # before: blocked (EXECUTING_WITH_WAITPOINTS) until a sweep
    assert not out.blocked and (await h.engine.latest_snapshot(parent.id)).engine_status == "EXECUTING"
    assert out.entry is not None and [r["output"] for r in out.entry["result"]] == ["held done", "fast done"]


async def test_the_last_finish_of_a_batch_counted_behind_another_completes_it(h: Harness, database_url: str) -> None:
    """Two runs of a batch finish at once and count themselves in it. The count that waited on the
    batch's row behind the other's (here: B's, behind a transaction that counts A) read the
    batch's finished runs in the snapshot its statement began with, from before A finished: it
    found the batch short, and the batch (and the parent waiting on it) stayed pending until the
    sweeper found it. The row is locked first now, and its runs are counted after."""
    import asyncio

    import psycopg

    batch_id = h.engine.new_batch_id()
    a, b = await h.engine.trigger_batch(h.env.env_id, batch_id, [req(h, batch_id=batch_id), req(h, batch_id=batch_id)])
    repo = h.engine.resources.repo.waitpoints

    async def finished(run_id: str) -> None:  # the run's finish, committed
        async with h.engine.resources.repo.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET finished_at = now() WHERE id = %s", (run_id,))

    await finished(b.id)
    other = await psycopg.AsyncConnection.connect(database_url)
    try:
        await other.execute("SELECT 1 FROM batch_task_run WHERE id = %s FOR UPDATE", (batch_id,))
        pid = other.info.backend_pid
        counting = asyncio.create_task(repo.count_finished_children({batch_id: 1}))  # B's count
        deadline = asyncio.get_running_loop().time() + 60
        async with h.engine.resources.repo.pool.connection() as conn:
            while not (await (await conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (pid,))).fetchone())[0]:  # type: ignore[index]
                assert asyncio.get_running_loop().time() < deadline, "B's count never waited on the row"
                await asyncio.sleep(0.02)
        await finished(a.id)
        # A's count, ahead of B's: one of two, the batch not complete yet
        await other.execute("UPDATE batch_task_run SET completed_count = completed_count + 1 WHERE id = %s",
                            (batch_id,))
        await other.commit()
        assert await counting == [batch_id]  # before: [] (PENDING, both runs finished)
    finally:
        await other.close()
