"""Numbered SQL migrations from ``migrations/NNNN_name.sql``, applied in order.

Each file runs in its own transaction and is recorded in ``schema_migration``; a file whose first
line is ``-- no-transaction`` runs its statements (separated by lines ``-- next``) one by one outside
a transaction (``CREATE INDEX CONCURRENTLY``), so each must be safe to run again. A session-level
advisory lock serialises concurrent migrators (two processes starting at once), so running
``run-engine migrate`` any number of times, in parallel or not, applies each file once.

A file in a transaction waits at most :data:`LOCK_TIMEOUT_S` for each lock it takes, then rolls back
and is tried again (up to :data:`LOCK_ATTEMPTS` times): behind an ALTER TABLE waiting on a long
transaction, every query of that table would queue (the engine's hot path stalled by a migration);
this way it stalls for seconds at most, and the migration says which session held the lock.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from run_engine._resources import data_dir
from run_engine.dependencies import redacted_url

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same for every run-engine process.
_ADVISORY_LOCK_ID = 0x52554E454E47  # "RUNENG"
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
NO_TRANSACTION = "-- no-transaction\n"
#: how long a migration in a transaction waits for a lock before it gives way (and tries again)
LOCK_TIMEOUT_S = 3.0
LOCK_ATTEMPTS = 40
LOCK_RETRY_S = 2.0


class MigrationError(RuntimeError):
    """Migrations could not be applied: the database cannot be reached, a file failed (its
    transaction rolled back) or could not take its locks. The message says which, for a person."""


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
    try:
        conn = psycopg.connect(database_url, autocommit=True)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # refused, unknown database, bad URL
        raise MigrationError(f"cannot connect to PostgreSQL at {redacted_url(database_url)!r}: "
                             f"{str(exc).strip()}") from None
    with conn:
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
                    try:
                        _apply_in_transaction(conn, migration, sql)
                    except psycopg.Error as exc:
                        raise MigrationError(f"migration {migration.version}_{migration.name} failed and was rolled "
                                             f"back: {str(exc).strip()}") from exc
                log.info("applied migration %s_%s", migration.version, migration.name)
                applied_now.append(migration.version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_ADVISORY_LOCK_ID,))
    return applied_now


def _apply_in_transaction(conn: psycopg.Connection, migration: Migration, sql: str) -> None:
    """Apply one file in a transaction whose lock waits are bounded (:data:`LOCK_TIMEOUT_S`), tried
    again while another session holds a lock it needs; MigrationError naming that session at last."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with conn.transaction():
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(LOCK_TIMEOUT_S * 1000)}ms",))
                conn.execute(sql)
                conn.execute("INSERT INTO schema_migration (version, name) VALUES (%s, %s)",
                             (migration.version, migration.name))
            return
        except psycopg.errors.LockNotAvailable:
            holders = _lock_holders(conn)
            if attempt == LOCK_ATTEMPTS:
                raise MigrationError(
                    f"migration {migration.version}_{migration.name} could not take its locks in {attempt} "
                    f"attempts of {LOCK_TIMEOUT_S:g} s: held by {holders or 'sessions that have since ended'}; "
                    "end those transactions (or wait for them) and start again") from None
            log.warning("migration %s_%s waited %g s for a lock held by %s; trying again in %g s (%d/%d)",
                        migration.version, migration.name, LOCK_TIMEOUT_S, holders or "another session",
                        LOCK_RETRY_S, attempt, LOCK_ATTEMPTS)
            time.sleep(LOCK_RETRY_S)


def _lock_holders(conn: psycopg.Connection) -> str:
    """The other sessions of this database in a transaction for longer than the lock timeout, as an
    operator would look for them (pid, state, since when, the start of their query)."""
    rows = conn.execute(
        """SELECT pid, state, now() - xact_start, left(query, 80) FROM pg_stat_activity
           WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
             AND now() - xact_start > make_interval(secs => %s)
           ORDER BY xact_start LIMIT 3""", (LOCK_TIMEOUT_S,)).fetchall()
    return "; ".join(f"pid {pid} ({state}, in a transaction for {age}: {query!r})"
                     for pid, state, age, query in rows)
