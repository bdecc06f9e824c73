"""Numbered SQL migrations from ``migrations/NNNN_name.sql``, applied in order.

Each file runs in its own transaction and is recorded in ``schema_migration``; a file whose first
line is ``-- no-transaction`` runs its statements (separated by lines ``-- next``) one by one outside
a transaction (``CREATE INDEX CONCURRENTLY``), so each must be safe to run again. A session-level
advisory lock serialises concurrent migrators (two processes starting at once), so running
``run-engine migrate`` any number of times, in parallel or not, applies each file once.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from run_engine._resources import data_dir

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same for every run-engine process.
_ADVISORY_LOCK_ID = 0x52554E454E47  # "RUNENG"
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
NO_TRANSACTION = "-- no-transaction\n"


@dataclass(frozen=True, slots=True)
class Migration:
    version: str
    name: str
    path: Path


def available_migrations() -> list[Migration]:
    found = []
    for path in sorted(data_dir("migrations").iterdir()):
        match = _FILE.match(path.name)
        if match:
            found.append(Migration(match.group(1), match.group(2), path))
    return found


def migrate_sync(database_url: str) -> list[str]:
    """Apply every pending migration; return the versions applied by this call."""
    applied_now: list[str] = []
    with psycopg.connect(database_url, autocommit=True) as conn:
        # polled, not waited for in a statement: a session waiting inside pg_advisory_lock holds a
        # snapshot that CREATE INDEX CONCURRENTLY (a no-transaction migration) would wait on: deadlock
        while not conn.execute("SELECT pg_try_advisory_lock(%s)", (_ADVISORY_LOCK_ID,)).fetchone()[0]:  # type: ignore[index]
            time.sleep(0.05)
        try:
            conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migration (
                       version text PRIMARY KEY,
                       name text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migration")}
            for migration in available_migrations():
                if migration.version in done:
                    continue
                sql = migration.path.read_text(encoding="utf-8")
                if sql.startswith(NO_TRANSACTION):
                    for statement in re.split(r"^-- next$", sql, flags=re.MULTILINE):
                        conn.execute(statement)
                    conn.execute("INSERT INTO schema_migration (version, name) VALUES (%s, %s)",
                                 (migration.version, migration.name))
                else:
                    with conn.transaction():
                        conn.execute(sql)
                        conn.execute(
                            "INSERT INTO schema_migration (version, name) VALUES (%s, %s)",
                            (migration.version, migration.name),
                        )
                log.info("applied migration %s_%s", migration.version, migration.name)
                applied_now.append(migration.version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_ADVISORY_LOCK_ID,))
    return applied_now
