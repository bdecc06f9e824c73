"""Migrations: the whole data model, idempotent, safe with concurrent migrators."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from run_engine.db import migrations
from run_engine.db.migrations import Migration, available_migrations, migrate_sync

TABLES = {
    "organization", "project", "runtime_environment", "worker_group", "worker_instance", "deployment",
    "deployment_task", "task_queue", "task_run", "task_run_execution_snapshot", "waitpoint",
    "task_run_waitpoint", "batch_task_run", "task_run_checkpoint", "task_run_journal", "task_schedule",
    "engine_lease", "engine_setting", "schema_migration", "worker_group_env_token", "bulk_action", "uploaded_packet",
    "cancel_cascade",
}


def test_migrated_database_has_the_whole_data_model(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert tables == TABLES
        persistence = conn.execute(
            "SELECT relpersistence FROM pg_class WHERE relname = 'engine_lease'").fetchone()
        assert persistence == ("u",)  # unlogged, dex-style
        cols = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'task_run_journal'")}
        assert {"run_id", "sequence", "kind", "key", "result"} <= cols
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migration ORDER BY version")]
        assert versions == [m.version for m in available_migrations()]


def test_journal_sequence_is_unique_per_run(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        indexes = [r[0] for r in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'task_run_journal'")]
        assert any("(run_id, sequence)" in d for d in indexes)


def test_migrate_twice_applies_nothing_the_second_time(empty_database: str) -> None:
    assert migrate_sync(empty_database) == [m.version for m in available_migrations()]
    assert migrate_sync(empty_database) == []


def test_concurrent_migrators_apply_each_file_once(empty_database: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(migrate_sync(empty_database))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    applied = sorted(v for r in results for v in r)
    assert applied == [m.version for m in available_migrations()]


@pytest.mark.parametrize(("index", "version"), [
    ("task_run_env_tags", "0019"), ("batch_done_unkeyed", "0030"), ("batch_done_keyed", "0030"),
    ("task_schedule_due_by_environment", "0032"), ("task_queue_settings_version", "0038"),
    ("task_schedule_worker_group", "0038"), ("task_run_dead", "0042")])
def test_an_index_built_concurrently_is_valid_and_rebuilt_when_left_invalid(empty_database: str, index: str,
                                                                            version: str) -> None:
    """These migrations run outside a transaction (CREATE INDEX CONCURRENTLY: no write waits); an
    interrupted build leaves an invalid index, which the next migrate drops and builds again."""
    migrate_sync(empty_database)

    def valid(name: str = index) -> list[bool]:
        with psycopg.connect(empty_database) as conn:
            return [r[0] for r in conn.execute(
                """SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE c.relname = %s""", (name,))]

    assert valid() == [True]
    assert valid("task_run_tags") == []  # 0012's index, which 0019's replaces, is gone
    with psycopg.connect(empty_database, autocommit=True) as conn:  # as an interrupted build leaves it
        conn.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass", (index,))
        conn.execute("DELETE FROM schema_migration WHERE version = %s", (version,))
    assert valid() == [False]
    assert migrate_sync(empty_database) == [version]
    assert valid() == [True]


def test_snapshot_chain_migration_keeps_the_latest_of_a_forked_chain(empty_database: str) -> None:
    """An upgrade over snapshots that an earlier version forked (two transitions after the same
    snapshot): the newest branch stays valid, so every run's latest snapshot is what it was, and
    the unique index that forbids forks from then on is built."""
    migrate_sync(empty_database)
    with psycopg.connect(empty_database, autocommit=True) as conn:
        conn.execute("DROP INDEX snapshot_chain_uq")  # the database as it was before 0013
        conn.execute("DELETE FROM schema_migration WHERE version = '0013'")
        conn.execute("SET session_replication_role = replica")  # snapshots of runs this test does not make
        chain = [("s1", None), ("s2", "s1"), ("s3a", "s2"), ("s3b", "s2"), ("s4", "s3a"), ("s5a", "s4"), ("s5b", "s4")]
        for sid, prev in chain:
            conn.execute("INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, "
                         "previous_snapshot_id) VALUES (%s, 'run_forked', 'EXECUTING', 'EXECUTING', %s)", (sid, prev))
        conn.execute("INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, "
                     "previous_snapshot_id) VALUES ('t1', 'run_plain', 'QUEUED', 'QUEUED', NULL)")
    assert migrate_sync(empty_database) == ["0013"]
    with psycopg.connect(empty_database) as conn:
        valid = [r[0] for r in conn.execute("SELECT id FROM task_run_execution_snapshot WHERE run_id = 'run_forked' "
                                            "AND is_valid ORDER BY seq")]
        assert valid == ["s1", "s2", "s3b", "s4", "s5b"]  # the newest of each fork; the latest (s5b) unchanged
        assert conn.execute("SELECT is_valid FROM task_run_execution_snapshot WHERE id = 't1'").fetchone() == (True,)
        index = conn.execute("SELECT i.indisunique, i.indisvalid FROM pg_index i JOIN pg_class c "
                             "ON c.oid = i.indexrelid WHERE c.relname = 'snapshot_chain_uq'").fetchone()
        assert index == (True, True)
        conn.execute("SET session_replication_role = replica")
        with pytest.raises(psycopg.errors.UniqueViolation):  # a second snapshot after s4
            conn.execute("INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, "
                         "previous_snapshot_id) VALUES ('s6', 'run_forked', 'FINISHED', 'COMPLETED', 's4')")


def test_deployments_from_before_0051_were_made_current_when_they_were_created(empty_database: str) -> None:
    """made_current_at (the order a connect makes a deployment current again by): rows from before
    take created_at, the order until then; a row a process of the version before inserts (a rolling
    upgrade, no such column in its INSERT) takes the clock of its insert."""
    migrate_sync(empty_database)
    with psycopg.connect(empty_database, autocommit=True) as conn:
        conn.execute("ALTER TABLE deployment DROP COLUMN made_current_at")  # the database as it was before 0051
        conn.execute("DELETE FROM schema_migration WHERE version = '0051'")
        conn.execute("SET session_replication_role = replica")  # deployments of no environment
        for dep, created in (("d1", "2026-01-01T00:00:00Z"), ("d2", "2026-02-01T00:00:00Z")):
            conn.execute("INSERT INTO deployment (id, environment_id, worker_group_id, version, content_hash, "
                         "is_current, created_at) VALUES (%s, 'env', 'wg', %s, %s, %s, %s)",
                         (dep, dep, dep, dep == "d1", created))
    assert migrate_sync(empty_database) == ["0051"]
    with psycopg.connect(empty_database, autocommit=True) as conn:
        rows = conn.execute("SELECT id FROM deployment WHERE made_current_at = created_at ORDER BY id").fetchall()
        assert rows == [("d1",), ("d2",)]
        conn.execute("SET session_replication_role = replica")
        conn.execute("INSERT INTO deployment (id, environment_id, worker_group_id, version, content_hash, is_current)"
                     " VALUES ('d3', 'env', 'wg2', 'd3', 'd3', true)")
        stamped = conn.execute("SELECT made_current_at >= created_at FROM deployment WHERE id = 'd3'").fetchone()
        assert stamped == (True,)


def test_the_cancel_cascades_unfinished_before_0052_are_noted(empty_database: str) -> None:
    """The cancels whose cascade was left unfinished before the table that notes them (their jobs
    dead in the job DLQ, or lost) are noted by the migration, for the reconciler to arm again: a
    cancelled run with a child it waits on not finished; not one whose children finished, nor a
    run not cancelled, nor one whose unfinished child it does not wait on."""
    migrate_sync(empty_database)
    with psycopg.connect(empty_database, autocommit=True) as conn:
        conn.execute("DROP TABLE cancel_cascade")  # the database as it was before 0052
        conn.execute("DELETE FROM schema_migration WHERE version = '0052'")
        conn.execute("SET session_replication_role = replica")  # runs of no environment
        runs = [("p_left", "CANCELED", None, False, None), ("c_left", "QUEUED", "p_left", True, None),
                ("p_done", "CANCELED", None, False, None), ("c_done", "CANCELED", "p_done", True, "now"),
                ("p_live", "EXECUTING", None, False, None), ("c_live", "QUEUED", "p_live", True, None),
                ("p_nowait", "CANCELED", None, False, None), ("c_nowait", "QUEUED", "p_nowait", False, None)]
        for run_id, status, parent, waited, finished in runs:
            conn.execute("INSERT INTO task_run (id, environment_id, worker_group_id, task_identifier, status, queue, "
                         "parent_run_id, resume_parent_on_completion, finished_at) "
                         "VALUES (%s, 'env', 'wg', 't', %s, 'q', %s, %s, %s::timestamptz)",
                         (run_id, status, parent, waited, finished))
    assert migrate_sync(empty_database) == ["0052"]
    with psycopg.connect(empty_database, autocommit=True) as conn:
        assert conn.execute("SELECT run_id FROM cancel_cascade").fetchall() == [("p_left",)]
        conn.execute("DELETE FROM task_run WHERE id = 'p_left'")  # retention: the note goes with its run
        assert conn.execute("SELECT run_id FROM cancel_cascade").fetchall() == []


def test_a_runs_snapshots_are_found_by_index_for_its_delete_and_its_latest(database_url: str) -> None:
    """Retention deletes runs, which cascades to their snapshots by run_id: an index must serve
    that for every snapshot (valid or not), not a scan of the whole table per run; the latest
    snapshot of a run is read through the same index. Nothing indexes snapshots by creation."""
    with psycopg.connect(database_url) as conn:
        conn.execute("SET enable_seqscan = off")  # what the planner picks once the table is large
        cascade = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN DELETE FROM task_run_execution_snapshot WHERE run_id = 'run_x'"))
        assert "Seq Scan" not in cascade and "snapshot_run_seq" in cascade
        latest = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT id FROM task_run_execution_snapshot WHERE run_id = 'run_x' AND is_valid "
            "ORDER BY seq DESC LIMIT 1"))
        assert "snapshot_run_seq" in latest
        names = {r[0] for r in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'task_run_execution_snapshot'")}
        assert names == {"task_run_execution_snapshot_pkey", "snapshot_run_seq", "snapshot_chain_uq"}
        conn.rollback()


def test_a_migration_that_cannot_take_its_lock_gives_way_and_names_who_holds_it(
        empty_database: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Behind an ALTER TABLE waiting on a long transaction every query of that table would queue: the
    migration waits a bounded time for its lock, rolls back, tries again, and at last says which
    session holds it; once that session is gone it applies."""
    migrate_sync(empty_database)
    probe = tmp_path / "9999_probe.sql"
    probe.write_text("ALTER TABLE bulk_action ADD COLUMN probe integer;\n")
    shipped = migrations.available_migrations()
    monkeypatch.setattr(migrations, "available_migrations", lambda: [*shipped, Migration("9999", "probe", probe)])
    monkeypatch.setattr(migrations, "LOCK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(migrations, "LOCK_RETRY_S", 0.05)
    monkeypatch.setattr(migrations, "LOCK_ATTEMPTS", 3)
    with psycopg.connect(empty_database) as holder:
        holder.execute("SELECT count(*) FROM bulk_action")  # a transaction left open: its lock stays
        with pytest.raises(RuntimeError, match=r"9999_probe could not take its locks .* pid \d+ .*bulk_action"):
            migrate_sync(empty_database)
        monkeypatch.setattr(migrations, "LOCK_ATTEMPTS", 100)
        release = threading.Timer(0.5, holder.rollback)  # the long transaction ends meanwhile
        release.start()
        try:
            assert migrate_sync(empty_database) == ["9999"]
        finally:
            release.join()
