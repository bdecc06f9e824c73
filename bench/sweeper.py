"""One pass of the waitpoint sweeper when a tenant keeps many runs waiting: what its statements cost
PostgreSQL (the sweeper runs every few seconds, whatever else the machine does).

    python bench/sweeper.py [--waiting 300000] [--passes 5]

Fills a fresh database with N runs WAITING, each blocked on its own pending token, and N / 3
pending RUN waitpoints (children still running), then times each statement of one sweeper pass
(``WaitpointRepository.sweep_candidates``: a slice of the waiting runs, a slice of the RUN
waitpoints, the pending batches), from the start of the walk and from the middle, median of
``--passes``. Last line: ``sweeper pass ms: <n>`` (the slowest start, summed over the statements).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import fresh_database  # noqa: E402
from run_engine.db import waitpoints as w  # noqa: E402
from run_engine.db.repository import Repository  # noqa: E402
from run_engine.tenancy import ensure_environment  # noqa: E402


async def _environment(url: str) -> tuple[str, str]:
    repo = await Repository.open(url)
    try:
        env = await ensure_environment(repo, secret="bench", org="bench", project="bench")
    finally:
        await repo.close()
    return env.env_id, env.worker_group_id


def fill(url: str, waiting: int) -> None:
    env_id, group_id = asyncio.run(_environment(url))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("""INSERT INTO task_run (id, environment_id, worker_group_id, task_identifier, status, queue,
                                              updated_at)
                        SELECT 'run_' || lpad(g::text, 9, '0'), %s, %s, 't', 'WAITING', 'q', now() - interval '1 hour'
                        FROM generate_series(1, %s) g""", (env_id, group_id, waiting))
        conn.execute("""INSERT INTO waitpoint (id, environment_id, type, status)
                        SELECT 'waitpoint_' || lpad(g::text, 9, '0'), %s, 'MANUAL', 'PENDING'
                        FROM generate_series(1, %s) g""", (env_id, waiting))
        conn.execute("""INSERT INTO task_run_waitpoint (run_id, waitpoint_id)
                        SELECT 'run_' || lpad(g::text, 9, '0'), 'waitpoint_' || lpad(g::text, 9, '0')
                        FROM generate_series(1, %s) g""", (waiting,))
        conn.execute("""INSERT INTO waitpoint (id, environment_id, type, status, completed_by_run_id, created_at)
                        SELECT 'waitpoint_r' || lpad(g::text, 9, '0'), %s, 'RUN', 'PENDING',
                               'run_' || lpad(g::text, 9, '0'), now() - interval '1 hour'
                        FROM generate_series(1, %s) g""", (env_id, waiting // 3))
        conn.execute("ANALYZE")


def time_statements(url: str, waiting: int, passes: int) -> dict[str, dict[str, float]]:
    middle_run = f"run_{waiting // 2:09d}"
    middle_wp = f"waitpoint_r{waiting // 6:09d}"
    statements: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
        "waiting runs": (w._SWEEP_STUCK_RUNS, {"after": ""}, {"after": middle_run}),
        "RUN waitpoints": (w._SWEEP_RUN_WAITPOINTS, {"after": ""}, {"after": middle_wp}),
        "batches": (w._SWEEP_BATCHES, {}, {}),
    }
    if hasattr(w, "_SWEEP_ORPHANED_RUN_WAITPOINTS"):  # before the walks (commit a82cf34 and earlier)
        statements["orphaned RUN"] = (w._SWEEP_ORPHANED_RUN_WAITPOINTS, {}, {})
    out: dict[str, dict[str, float]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for name, (sql, start, middle) in statements.items():
            out[name] = {}
            for where, params in (("start", start), ("middle", middle)):
                times = []
                for _ in range(passes):
                    t = time.perf_counter()
                    conn.execute(sql, {"walk": getattr(w, "SWEEP_WALK", 0), "grace_s": 30, "limit": 500,
                                       **params}).fetchall()
                    times.append((time.perf_counter() - t) * 1000)
                out[name][where] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=300_000)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    with fresh_database() as url:
        began = time.perf_counter()
        fill(url, args.waiting)
        print(f"filled {args.waiting} waiting runs in {time.perf_counter() - began:.1f} s")
        timed = time_statements(url, args.waiting, args.passes)
    print(f"{'statement':<16}{'from start ms':>15}{'from middle ms':>16}")
    for name, t in timed.items():
        print(f"{name:<16}{t['start']:>15.1f}{t['middle']:>16.1f}")
    print(f"sweeper pass ms: {sum(t['start'] for t in timed.values()):.1f}")


if __name__ == "__main__":
    main()
