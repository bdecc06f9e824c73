"""Retention's walks go on from where their last batch stopped: the finished runs past the age that
must stay (here the children of a parent not finished) are not read again by every batch, and a run
that may go later, behind the walk, is deleted once the walk has started over."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from run_engine.engine import TriggerRequest

from .conftest import Harness

AGE = 300 * 86400
#: copies of a triggered run, finished ``days`` ago (a millisecond apart), children of ``parent``
_COPIES = """
INSERT INTO task_run SELECT (jsonb_populate_record(NULL::task_run, to_jsonb(t) || jsonb_build_object(
    'id', %(prefix)s || g, 'status', 'COMPLETED_SUCCESSFULLY', 'parent_run_id', %(parent)s::text,
    'finished_at', now() - make_interval(days => %(days)s) + g * interval '1 ms'))).*
FROM task_run t, generate_series(1, %(n)s) g WHERE t.id = %(template)s
"""


async def old_runs(h: Harness, unique: str, stay: int, go: int) -> tuple[str, list[str], list[str]]:
    """A parent not finished (QUEUED), ``stay`` of its children finished 400 days ago, and ``go``
    runs without a parent finished 399 days ago (after them on the walk's index)."""
    parent, template = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i)
                                                    for i in range(2)])
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute(_COPIES, {"prefix": f"run_stay{unique}_", "parent": parent.id, "days": 400, "n": stay,
                                     "template": template.id})
        await conn.execute(_COPIES, {"prefix": f"run_go{unique}_", "parent": None, "days": 399, "n": go,
                                     "template": template.id})
    return (parent.id, [f"run_stay{unique}_{i}" for i in range(1, stay + 1)],
            [f"run_go{unique}_{i}" for i in range(1, go + 1)])


async def present(h: Harness, ids: list[str]) -> int:
    async with h.engine.resources.repo.pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM task_run WHERE id = ANY(%s)", (ids,))
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def _walked(node: dict[str, Any]) -> int:
    """Rows of task_run (as ``r``: the finished runs walked) a plan's scans read."""
    n = 0
    if node.get("Relation Name") == "task_run" and node.get("Alias") == "r":
        n += (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
              + node.get("Rows Removed by Index Recheck", 0)) * node["Actual Loops"]
    return n + sum(_walked(child) for child in node.get("Plans", []))


async def test_a_batch_does_not_read_again_the_runs_that_must_stay(
        make_engine, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine()
    await h.deploy({"id": "hello"})
    _, stay, go = await old_runs(h, unique, 300, 30)
    walked: list[int] = []
    execute = psycopg.AsyncConnection.execute

    async def spy(self: psycopg.AsyncConnection[Any], query: Any, params: Any = None, **kw: Any) -> Any:
        if isinstance(query, str) and "r.finished_at < now() - make_interval" in query and "DELETE" not in query:
            # the plan a large table gets (an index scan from the walk's place), not a small one's
            await execute(self, "SET LOCAL enable_seqscan = off")
            cur = await execute(self, "EXPLAIN (ANALYZE, FORMAT JSON) " + query, params)
            row = await cur.fetchone()
            assert row is not None
            walked.append(_walked(row[0][0]["Plan"]))
        return await execute(self, query, params, **kw)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", spy)
    maintenance = h.engine.resources.repo.maintenance
    assert await maintenance.delete_finished_before(AGE, 10, h.engine.resources.queue.remove_many) >= 10
    first = sum(walked)
    assert first >= 300  # the first batch walks past every child
    walked.clear()
    assert await maintenance.delete_finished_before(AGE, 10, h.engine.resources.queue.remove_many) >= 10
    assert 0 < sum(walked) < 100  # the next goes on after them (before: ~310, every child again)
    monkeypatch.undo()
    assert await present(h, go) == 10 and await present(h, stay) == 300


async def test_a_run_that_may_go_behind_the_walk_goes_once_the_walk_starts_over(
        make_engine, unique: str) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await make_engine(retention_days=AGE / 86400, retention_batch=10)
    await h.deploy({"id": "hello"})
    parent, stay, go = await old_runs(h, unique, 20, 15)
    maintenance = h.engine.resources.repo.maintenance
    assert await maintenance.delete_finished_before(AGE, 10, h.engine.resources.queue.remove_many) >= 10
    async with h.engine.resources.repo.pool.connection() as conn:  # the parent finishes: its children may go
        await conn.execute("UPDATE task_run SET status = 'COMPLETED_SUCCESSFULLY', finished_at = now() WHERE id = %s",
                           (parent,))
    await h.engine.systems.reconciler.retention()  # goes on to the walk's end
    assert await present(h, go) == 0
    await h.engine.systems.reconciler.retention()  # starts over: finds the children behind it
    assert await present(h, stay) == 0
    assert await present(h, [parent]) == 1


async def test_finished_bulk_actions_are_found_by_their_completion(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Retention's delete of finished bulk actions read the whole table at each call (no index on
    completed_at): now a range of bulk_action_done (migration 0055)."""
    h: Harness = await make_engine()
    async with h.engine.resources.repo.pool.connection() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        cur = await conn.execute(
            "EXPLAIN SELECT id FROM bulk_action WHERE status <> 'PENDING'"
            " AND completed_at < now() - make_interval(secs => 86400) LIMIT 1000 FOR UPDATE SKIP LOCKED")
        plan = "\n".join(r[0] for r in await cur.fetchall())
    assert "bulk_action_done" in plan, plan
