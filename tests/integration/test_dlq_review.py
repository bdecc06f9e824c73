"""From a review of the dead-letter queue, redrive, bulk actions and cancellation: each test
shows a bug of the code before it (a wrong answer, a run lost or a tenant's runs affected)."""

from __future__ import annotations

from run_engine.engine import TriggerRequest

from .conftest import Harness


async def dead_letter(h: Harness, count: int) -> list[str]:
    """``count`` runs of ``hello`` in the DLQ (each dequeued once and never started), in DLQ order."""
    runs = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello")
                                        for _ in range(count)])
    assert len(await h.engine.dequeue(h.env.worker_group_id, count)) == count
    await h.advance(61)
    return [e.run_id for e in await h.engine.resources.queue.list_dlq(h.env.env_id)
            if e.run_id in {r.id for r in runs}]


async def delete_rows(h: Harness, run_ids: list[str]) -> None:
    """Rows gone while their DLQ entries stay (a retention of an older version, or a crash)."""
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", (run_ids,))


async def test_a_dlq_page_whose_first_entries_are_of_deleted_runs_does_not_say_the_dlq_ended(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    """A page measured one more run than it could take; when those were all of deleted runs
    (dropped on the way), the next entry was taken for one past the page's end and the page
    ended with no run and no cursor: the DLQ read as empty with runs in it."""
    h: Harness = await make_engine(max_deliveries=1)
    await h.deploy({"id": "hello"})
    ids = await dead_letter(h, 4)
    await delete_rows(h, ids[:2])
    dead, after = await h.engine.list_dead(h.env.env_id, 1)
    seen = [d.run.id for d in dead]
    while after is not None:
        dead, after = await h.engine.list_dead(h.env.env_id, 1, after)
        seen += [d.run.id for d in dead]
    assert seen == ids[2:]
