"""The statements that change many runs at once read each of their CTEs' rows a bounded number of
times per run. The planner expects one row from a CTE filtered on its columns (which is what makes
it find the runs by primary key), so a join of two such CTEs became a nested loop that read n^2
rows: 40,000 for a completion batch of 200, most of the statement's time. Each statement runs
here for real on 300 runs (EXPLAIN ANALYZE, rolled back) and its plan's CTE scans are counted: rows
returned plus rows filtered out, over all loops. No timings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from run_engine.db import runs as r
from run_engine.db import waitpoints as w
from run_engine.engine import TriggerRequest
from run_engine.ids import new_id
from run_engine.tenancy import ensure_environment
from tests.integration.conftest import Harness

N = 300
BOUND = 30 * N  # linear: each CTE read a few times over; the nested loops read N * N = 90,000


@pytest.fixture
async def h(make_engine: Callable[..., Any], unique: str) -> Harness:
    """An engine and an environment that may hold all N runs started at once."""
    harness: Harness = await make_engine()
    harness.env = await ensure_environment(harness.engine.resources.repo, secret="test-secret",
                                           org=f"org-plans-{unique}", project="proj", env="dev",
                                           concurrency_limit=2 * N)
    await harness.deploy({"id": "hello"})
    return harness


def cte_rows_read(node: dict[str, Any]) -> int:
    own = 0
    if node["Node Type"] == "CTE Scan":
        own = node["Actual Loops"] * (node["Actual Rows"] + node.get("Rows Removed by Filter", 0))
    return own + sum(cte_rows_read(child) for child in node.get("Plans", []))


async def explain(h: Harness, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """``sql`` run for real and its plan with actual rows, in a transaction rolled back."""
    async with h.engine.resources.repo.runs.pool.connection() as conn:
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            row = await cur.fetchone()
            assert row is not None
            plan: dict[str, Any] = row[0][0]["Plan"]
            return plan


async def queued_runs(h: Harness) -> list[str]:
    triggered = await h.engine.trigger_many([TriggerRequest(env_id=h.env.env_id, task_id="hello", payload={"i": i})
                                             for i in range(N)])
    return [t.id for t in triggered]


async def test_completing_many_runs_reads_each_cte_row_a_bounded_number_of_times(h: Harness) -> None:
    runs = await queued_runs(h)
    transitions = [r.Transition(run_id=run, new_snapshot_id=new_id("snapshot"), engine_status="FINISHED",
                                run_status="CANCELED", from_statuses=("QUEUED",), set_finished=True,
                                output={"i": i}, output_type="application/json")
                   for i, run in enumerate(runs)]
    plan = await explain(h, r._TRANSITION_SQL, r.RunRepository._transition_params(transitions))
    assert plan["Actual Rows"] == N  # every run changed
    assert cte_rows_read(plan) <= BOUND


async def test_dequeuing_and_starting_many_runs_reads_each_cte_row_a_bounded_number_of_times(h: Harness) -> None:
    runs = await queued_runs(h)
    rows = [{"ord": i, "run_id": run, "pending_id": new_id("snapshot"), "executing_id": new_id("snapshot"),
             "worker_id": None} for i, run in enumerate(runs)]
    plan = await explain(h, r._DEQUEUE_START_SQL, {"rows": Jsonb(rows), "pending_description": "dequeued",
                                                   "start_description": "started"})
    assert plan["Actual Rows"] == N
    assert cte_rows_read(plan) <= BOUND


async def test_blocking_and_suspending_many_runs_reads_each_cte_row_a_bounded_number_of_times(h: Harness) -> None:
    await queued_runs(h)
    started = []
    while len(started) < N:
        got = await h.engine.dequeue(h.env.worker_group_id, 100, start=True)
        assert got, f"dequeued {len(started)} of {N}"
        started += [d.started for d in got if d.started]
    tokens = [(await h.engine.create_token(h.env.env_id))[0] for _ in range(N)]
    rows = [{"run_id": s.run.id, "expected": s.snapshot.id, "seq": 0, "kind": "token", "key": t.id, "result": None,
             "wp": t.id, "wps": [t.id], "new": new_id("snapshot"), "description": "waiting",
             "suspend_new": new_id("snapshot"), "checkpoint": new_id("checkpoint")}
            for s, t in zip(started, tokens, strict=True)]
    plan = await explain(h, w._BLOCK, {"rows": Jsonb(rows)})
    assert plan["Actual Rows"] == N
    assert cte_rows_read(plan) <= BOUND
