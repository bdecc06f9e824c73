"""The runs of a tag are found through the environment's own entries of the tag index: another
tenant's runs of the same tag (one with a million runs tagged "prod") are never read for this
tenant's query. Checked on the plan of the real listing statement (EXPLAIN ANALYZE): no timings."""

from __future__ import annotations

from typing import Any

from run_engine.db.runs import RunRepository
from run_engine.engine import TriggerRequest
from run_engine.tenancy import ensure_environment

from .conftest import Harness


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]


async def test_a_tag_query_reads_none_of_another_tenants_runs_of_that_tag(h: Harness) -> None:
    noisy = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="noisy-org", project="p",
                                     env="dev")
    await h.deploy({"id": "hello"})
    await h.engine.trigger_many([TriggerRequest(env_id=noisy.env_id, task_id="hello", payload=i, tags=("prod",))
                                 for i in range(400)])
    mine = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i,
                                                       tags=("prod", "x") if i < 3 else ())
                                        for i in range(200)])
    found = await h.engine.list_runs(h.env.env_id, tags=["prod"], limit=100, light=True)
    assert sorted(r.id for r in found) == sorted(t.id for t in mine[:3])
    where, params = RunRepository._run_filter(h.env.env_id, (), (), ["prod"], (), (), None, None, None, None)
    async with h.engine.resources.repo.pool.connection() as conn:
        await conn.execute("ANALYZE task_run")
        cur = await conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) SELECT id FROM task_run WHERE {where} "
                                 "ORDER BY created_at DESC, id DESC LIMIT 100", params)
        plan = (await cur.fetchone())[0][0]["Plan"]  # type: ignore[index]
    scans = [n for n in nodes(plan) if n.get("Index Name") == "task_run_env_tags"]
    assert scans, plan
    assert sum(n["Actual Rows"] for n in scans) == 3  # this environment's three, none of the noisy 400
    assert all(n.get("Rows Removed by Index Recheck", 0) == 0 for n in nodes(plan))


async def test_a_tag_shapes_first_read_walks_when_the_tag_is_common_and_finds_the_same_runs(
        h: Harness, monkeypatch: Any) -> None:
    """A tag shape's first read walks the environment's newest runs when enough of them have the
    tag (its index would fetch and sort every run of the tag), and asks the index otherwise: the
    same runs, in the same order, either way, and none of another environment's."""
    from run_engine.db import runs as runs_module

    monkeypatch.setattr(runs_module, "SHAPE_WALK_ROWS", 12)
    other = await ensure_environment(h.engine.resources.repo, secret="test-secret", org="other-org", project="p",
                                     env="dev")
    await h.engine.trigger_many([TriggerRequest(env_id=other.env_id, task_id="hello", payload=i, tags=("dense",))
                                 for i in range(5)])
    # 30 runs, newest last: every run `dense`, every 10th `sparse`, the 3 oldest `old`
    for i in range(30):
        tags = ("dense",) + (("sparse",) if i % 10 == 0 else ()) + (("old",) if i < 3 else ())
        await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload=i, tags=tags)])
    repo = h.engine.resources.repo.runs
    walks: list[bool] = []
    real = repo._shape_walk

    async def spy(*args: Any, **kwargs: Any) -> Any:
        got = await real(*args, **kwargs)
        walks.append(got is not None)
        return got

    monkeypatch.setattr(repo, "_shape_walk", spy)
    for tag, limit, walked in (("dense", 5, True),   # 5 of the newest 12 have it: the walk answers
                               ("sparse", 5, False),  # 1 of 12: the index
                               ("old", 5, False),
                               ("dense", 50, False)):  # fewer than the limit in 12, and more runs than 12
        read = await h.engine.shape_runs(h.env.env_id, tags=[tag], limit=limit)
        listed = await h.engine.list_runs(h.env.env_id, tags=[tag], limit=limit, light=True)
        assert [r.id for r in read.runs] == [r.id for r in listed], tag
        assert set(read.xmins) == {r.id for r in read.runs} and read.snapshot_xmin is not None
        assert all(r.env_id == h.env.env_id and r.payload is None for r in read.runs)
        assert walks.pop() is walked, (tag, limit)
    monkeypatch.setattr(runs_module, "SHAPE_WALK_ROWS", 100)  # the walk sees the whole window: its answer
    for tag in ("dense", "sparse", "old", "none"):
        read = await h.engine.shape_runs(h.env.env_id, tags=[tag], limit=500)
        listed = await h.engine.list_runs(h.env.env_id, tags=[tag], limit=500, light=True)
        assert [r.id for r in read.runs] == [r.id for r in listed] and walks.pop() is True, tag
    assert walks == []


async def test_tags_added_while_another_add_holds_the_run_are_all_kept(h: Harness) -> None:
    """Two adds of tags to one run at once keep both's tags: the second, held up behind the first's
    row lock, merges its tags into the run's tags as the first left them. It merged them into the
    tags its statement had read before it waited (a subquery of the run's row: PostgreSQL re-reads
    the row it updates after the wait, not that subquery), and the first add's tags were lost."""
    import asyncio

    run = await h.engine.trigger(TriggerRequest(env_id=h.env.env_id, task_id="hello", tags=("start",)))
    repo = h.engine.resources.repo.runs
    async with repo.pool.connection() as holder:
        async with holder.transaction():
            first = await holder.execute("UPDATE task_run SET tags = tags || '{first}'::text[] WHERE id = %s "
                                         "RETURNING tags", (run.id,))
            assert (await first.fetchone())[0] == ["start", "first"]  # type: ignore[index]
            second = asyncio.create_task(h.engine.add_tags(h.env.env_id, run.id, ["second"], 10))
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # the second add waits for the run's row now
                cur = await holder.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                           "AND pid <> pg_backend_pid() AND query LIKE 'UPDATE task_run SET tags = %%'")
                if (await cur.fetchone())[0]:  # type: ignore[index]
                    break
                assert asyncio.get_running_loop().time() < deadline and not second.done()
                await asyncio.sleep(0.01)
        assert await second == ["start", "first", "second"]
    after = await h.engine.get_run(run.id)
    assert after is not None and after.tags == ["start", "first", "second"]
    # each tag once, in the order added; past the limit nothing is added
    assert await h.engine.add_tags(h.env.env_id, run.id, ["second", "a", "a"], 4) == ["start", "first", "second", "a"]
    assert await h.engine.add_tags(h.env.env_id, run.id, ["a", "b"], 4) is None
    assert await h.engine.add_tags(h.env.env_id, run.id, ["a", "start"], 4) == ["start", "first", "second", "a"]
