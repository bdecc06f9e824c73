"""`run-engine migrate` through the real CLI, twice and concurrently."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from run_engine.db.migrations import available_migrations


@pytest.fixture
def fresh_db(database_url: str) -> Iterator[str]:
    params = conninfo_to_dict(database_url)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    name = f"re_cli_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_conninfo(**{**params, "dbname": name})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cli(*args: str, database_url: str, redis_url: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
    return subprocess.Popen([sys.executable, "-m", "run_engine.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_migrate_applies_once_even_when_started_together(fresh_db: str, redis_url: str) -> None:
    procs = [cli("migrate", "--json", database_url=fresh_db, redis_url=redis_url) for _ in range(3)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    applied = sorted(v for out, _ in outputs for v in json.loads(out)["applied"])
    assert applied == [m.version for m in available_migrations()]
    again = cli("migrate", database_url=fresh_db, redis_url=redis_url)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "up to date" in out
