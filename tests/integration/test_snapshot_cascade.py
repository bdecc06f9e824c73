"""A run's snapshots go with the run (migration 0017: a statement trigger, not a foreign key whose
check cost a look-up and a row lock per snapshot appended): deleting runs, one or many, or their
environment deletes their snapshots and no one else's."""

from __future__ import annotations

import asyncio

from run_engine.db.runs import Transition
from run_engine.engine import TriggerRequest
from run_engine.ids import new_id

from .conftest import Harness


async def snapshot_counts(h: Harness, run_ids: list[str]) -> dict[str, int]:
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT run_id, count(*) FROM task_run_execution_snapshot WHERE run_id = ANY(%s) "
                                 "GROUP BY run_id", (run_ids,))
        return dict(await cur.fetchall())  # type: ignore[arg-type]


async def test_deleting_runs_or_their_environment_deletes_their_snapshots(h: Harness) -> None:
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                        for i in range(5)])
    await h.engine.dequeue(h.env.worker_group_id, 5, start=True)
    ids = [r.id for r in runs]
    async with h.engine.resources.repo.pool.connection() as conn:  # nothing checks a key per snapshot appended
        cur = await conn.execute("SELECT count(*) FROM pg_constraint WHERE contype = 'f' "
                                 "AND conrelid = 'task_run_execution_snapshot'::regclass")
        assert await cur.fetchone() == (0,)
    assert await snapshot_counts(h, ids) == {i: 3 for i in ids}  # QUEUED, PENDING_EXECUTING, EXECUTING
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("DELETE FROM task_run WHERE id = %s", (ids[0],))
        await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", (ids[1:3],))
    assert await snapshot_counts(h, ids) == {i: 3 for i in ids[3:]}
    async with h.engine.resources.repo.pool.connection() as conn:  # cascades to the runs, then their snapshots
        await conn.execute("DELETE FROM runtime_environment WHERE id = %s", (h.env.env_id,))
    assert await snapshot_counts(h, ids) == {}


async def test_a_transition_that_races_its_runs_delete_leaves_no_snapshot_and_reports_it_gone(h: Harness) -> None:
    """The delete's trigger runs before it commits; a transition that read the run's latest
    snapshot meanwhile appends after it and then finds no run to update: that snapshot is taken
    back and the run answered as gone (a foreign key made the whole statement fail here)."""
    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    other = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello"))
    latest = await h.engine.latest_snapshot(run.id)
    other_latest = await h.engine.latest_snapshot(other.id)
    moves = [Transition(run_id=r, new_snapshot_id=new_id("snapshot"), engine_status="QUEUED", run_status="QUEUED",
                        from_statuses=("QUEUED",), expected_snapshot_id=s, description="racing the delete")
             for r, s in ((run.id, latest.id), (other.id, other_latest.id))]
    async with h.engine.resources.repo.pool.connection() as conn:
        async with conn.transaction():
            await conn.execute("DELETE FROM task_run WHERE id = %s", (run.id,))  # its trigger ran; not committed
            racing = asyncio.ensure_future(h.engine.resources.repo.runs.transition_many(moves))
            await asyncio.sleep(0.3)
            assert not racing.done()  # its update waits for the deleted row
    gone, moved = await racing
    assert not gone.applied and gone.latest_snapshot_id is None and gone.run is None
    assert moved.applied and moved.run is not None  # the statement's other run moved all the same
    assert await snapshot_counts(h, [run.id, other.id]) == {other.id: 2}
