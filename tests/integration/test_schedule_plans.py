"""The planner's due query (every second on every engine process) reads each environment's due
ticks as the head of that environment's range of task_schedule_due_by_environment: by next tick
alone, each environment's look-up walked every environment's due schedules, (environments with due
ticks) x (due ticks) rows a poll. Checked on the plan of the real statement (EXPLAIN ANALYZE): no
timings."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from run_engine.db import schedules as s
from tests.conftest import fresh_database

BIG, BIG_DUE, SMALL, SMALL_DUE = 10, 2_000, 50, 2
PER_ENVIRONMENT, LIMIT = 20, 200


@pytest.fixture(scope="module")
def backlog(database_server: str) -> Iterator[str]:
    """Ten environments with 2,000 ticks due each (five minutes late), fifty with two (ten seconds
    late), and as many schedules not due yet."""
    with fresh_database(database_server, f"re_sched_plans_{secrets.token_hex(4)}") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET session_replication_role = replica")  # the fixture's rows need no parents
            insert = """INSERT INTO task_schedule (id, environment_id, task_identifier, cron, timezone, active,
                                                   next_run_at, type)
                        SELECT %(prefix)s || g, %(env)s || (g %% %(envs)s), 'hello', '* * * * *', 'UTC', true,
                               now() + %(late)s * interval '1 s' + (g %% 600) * interval '1 ms', 'IMPERATIVE'
                        FROM generate_series(1, %(n)s) g"""
            conn.execute(insert, {"prefix": "sched_big_", "env": "env_big_", "envs": BIG, "late": -300,
                                  "n": BIG * BIG_DUE})
            conn.execute(insert, {"prefix": "sched_small_", "env": "env_small_", "envs": SMALL, "late": -10,
                                  "n": SMALL * SMALL_DUE})
            conn.execute(insert, {"prefix": "sched_later_", "env": "env_big_", "envs": BIG + SMALL, "late": 3600,
                                  "n": BIG * BIG_DUE})
            conn.execute("ANALYZE task_schedule")
        yield url


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]


def test_the_due_query_reads_each_environments_due_ticks_through_its_own_range(backlog: str) -> None:
    with psycopg.connect(backlog, autocommit=True) as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + s._DUE_SQL,
                            {"now": now, "per": PER_ENVIRONMENT, "limit": LIMIT}).fetchone()[0][0]["Plan"]  # type: ignore[index]
        rows = conn.execute("SELECT count(*) FROM task_schedule").fetchone()[0]  # type: ignore[index]
    assert plan["Actual Rows"] == LIMIT
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "task_schedule"]
    per_environment = [n for n in scans if n["Actual Loops"] > 1]
    assert per_environment, plan
    assert {n.get("Index Name") for n in per_environment} == {"task_schedule_due_by_environment"}, plan

    def read(n: dict[str, Any]) -> int:
        return int(n["Actual Loops"] * (n["Actual Rows"] + n.get("Rows Removed by Filter", 0)))

    environments = BIG + SMALL
    # each environment's look-up reads its own due ticks only, at most PER_ENVIRONMENT of them
    assert sum(read(n) for n in per_environment) <= environments * PER_ENVIRONMENT, plan
    # finding the environments reads the table (its due rows) once at most: linear, not a product
    assert sum(read(n) for n in scans) <= rows + environments * PER_ENVIRONMENT, plan
