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
