"""`run-engine migrate` through the real CLI, twice and concurrently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from run_engine.db.migrations import available_migrations


def cli(*args: str, database_url: str, redis_url: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
    return subprocess.Popen([sys.executable, "-m", "run_engine.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_migrate_applies_once_even_when_started_together(empty_database: str, redis_url: str) -> None:
    procs = [cli("migrate", "--json", database_url=empty_database, redis_url=redis_url) for _ in range(3)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    applied = sorted(v for out, _ in outputs for v in json.loads(out)["applied"])
    assert applied == [m.version for m in available_migrations()]
    again = cli("migrate", database_url=empty_database, redis_url=redis_url)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "up to date" in out
