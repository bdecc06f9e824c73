"""The waits' statements find a run's waitpoints through the run's own rows and primary keys, even
when the table grew faster than its statistics (a burst of tokens in a young database): they must
never read the pending waitpoints through their partial index, which the planner then believes
tiny, and which made each block, suspend, continue and completion read every pending waitpoint."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from run_engine.db import waitpoints as w
from tests.conftest import fresh_database

STATEMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "complete": (w._COMPLETE, {"rows": Jsonb([{"id": "waitpoint_5"}, {"run_id": "run_7"}])}),
    "block": (w._BLOCK, {"rows": Jsonb([{"run_id": f"run_{i}", "expected": "snapshot_1", "seq": 0, "kind": "token",
                                          "key": "k", "result": None, "wp": f"waitpoint_{i}",
                                          "wps": [f"waitpoint_{i}"], "new": f"snapshot_{i}", "description": "d"}
                                         for i in (5, 6)])}),
    "suspend": (w._SUSPEND, {"rows": Jsonb([{"run_id": f"run_{i}", "expected": "snapshot_1",
                                            "checkpoint": f"checkpoint_{i}", "new": f"snapshot_{i}"}
                                           for i in (5, 6)])}),
    "pending of runs": (w._PENDING_OF_RUNS, {"runs": ["run_5", "run_6"]}),
    "continue": (w._CONTINUE, {"runs": ["run_5", "run_6"], "news": ["snapshot_2", "snapshot_3"]}),
    "sweep stuck runs": (w._SWEEP_STUCK_RUNS, {"after": "", "walk": 100, "grace_s": 30}),
    "sweep run waitpoints": (w._SWEEP_RUN_WAITPOINTS, {"after": "", "walk": 100, "grace_s": 30}),
    "batch waitpoints": (w._BATCH_WAITPOINTS, {"batches": ["batch_1"]}),
}


@pytest.fixture(scope="module")
def young_database(database_server: str) -> Iterator[str]:
    """10,000 pending waitpoints and their blocking rows, inserted at once and never analysed."""
    with fresh_database(database_server, f"re_plans_{secrets.token_hex(4)}") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET session_replication_role = replica")  # the fixture's rows need no parents
            for table in ("waitpoint", "task_run_waitpoint"):  # the statistics stay those of empty tables
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            conn.execute("INSERT INTO waitpoint (id, environment_id, type) "
                         "SELECT 'waitpoint_' || g, 'env', 'MANUAL' FROM generate_series(1, 10000) g")
            conn.execute("INSERT INTO task_run_waitpoint (run_id, waitpoint_id) "
                         "SELECT 'run_' || g, 'waitpoint_' || g FROM generate_series(1, 10000) g")
        yield url


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_no_statement_reads_the_pending_waitpoints_by_their_index(young_database: str, name: str) -> None:
    sql, params = STATEMENTS[name]
    with psycopg.connect(young_database, autocommit=True) as conn:
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + sql, params).fetchall())
    assert "waitpoint_pending" not in plan, plan
    assert "Seq Scan on waitpoint" not in plan, plan


@pytest.mark.parametrize(("name", "indexes"), [("sweep stuck runs", ("task_run_waiting", "task_run_unfinished")),
                                               ("sweep run waitpoints", ("waitpoint_runs_to_sweep",))])
def test_the_sweeper_walks_a_slice_by_an_index(young_database: str, name: str, indexes: tuple[str, ...]) -> None:
    """A pass of the sweeper reads a slice from where the last one stopped, not every waiting run or
    pending RUN waitpoint of every tenant (1.4 s with 300,000 waiting runs, every 5 s)."""
    sql, params = STATEMENTS[name]
    with psycopg.connect(young_database, autocommit=True) as conn:
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + sql, params).fetchall())
    assert any(index in plan for index in indexes) and "Limit" in plan, plan


def test_the_token_list_reads_the_environments_tokens_by_their_own_index(young_database: str) -> None:
    """A run's wait.for leaves a DATETIME waitpoint: the token list must not walk those."""
    with psycopg.connect(young_database, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("INSERT INTO waitpoint (id, environment_id, type) "
                     "SELECT 'waitpoint_d' || g, 'env', 'DATETIME' FROM generate_series(1, 20000) g")
        conn.execute("ANALYZE waitpoint")
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + w._TOKEN_PAGE, {
            "env": "env", "statuses": None, "timed_out": None, "tags": None, "key": None, "from": None, "to": None,
            "after_ts": None, "after_id": None,
            "limit": 26, "max_bytes": 16 * 1024 * 1024}).fetchall())
    assert "waitpoint_tokens_env_created" in plan, plan


def test_the_runs_a_completion_unblocked_are_read_by_waitpoint(young_database: str) -> None:
    """A completion's look-up of the runs it unblocked reads a range of the (waitpoint, run) index
    per waitpoint in its generic plan too (the one a prepared statement runs after its sixth call):
    written as one condition on the table, it walked the primary key in run order instead, reading
    every blocked run of every tenant to find the few blocked on these waitpoints."""
    sql = w._BLOCKED_RUNS.replace("%(ids)s", "$1").replace("%(after)s", "$2").replace("%(limit)s", "$3")
    with psycopg.connect(young_database, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE blocked_runs(text[], text, bigint) AS {sql}")
        plan = "\n".join(row[0] for row in conn.execute(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "
            "EXECUTE blocked_runs(ARRAY['waitpoint_5', 'waitpoint_7'], '', 201)").fetchall())
        runs = [r[0] for r in conn.execute("EXECUTE blocked_runs(ARRAY['waitpoint_7', 'waitpoint_5'], '', 201)")]
        after = [r[0] for r in conn.execute("EXECUTE blocked_runs(ARRAY['waitpoint_7', 'waitpoint_5'], 'run_5', 1)")]
    assert runs == ["run_5", "run_7"] and after == ["run_7"]
    assert "task_run_waitpoint_pkey" not in plan and "Rows Removed by Filter" not in plan, plan
    assert "task_run_waitpoint_by_waitpoint_run" in plan, plan
