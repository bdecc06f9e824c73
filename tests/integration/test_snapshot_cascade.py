"""A run's snapshots go with the run (migration 0017: a statement trigger, not a foreign key whose
check cost a look-up and a row lock per snapshot appended): deleting runs, one or many, or their
environment deletes their snapshots and no one else's."""

from __future__ import annotations

from run_engine.engine import TriggerRequest

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
