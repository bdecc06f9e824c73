"""The leader's tables and scans: the engine lease, the reconciler's pages, retention."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from run_engine.db.rows import from_prefixed, select_as
from run_engine.db.runs import LIGHT_RUN_COLUMNS, RunRow, Snapshot, run_row

#: a parent that may still replay its journal: not finished, or in the DLQ (SYSTEM_FAILURE: a redrive
#: reopens it, and it replays its journal then, as a restored run does)
_PARENT_LIVE = "(p.finished_at IS NULL OR p.status = 'SYSTEM_FAILURE')"
#: the conditions under which a finished run stays (see delete_finished_before): a run waits on its
#: batch (its BATCH waitpoint is pending: the status in a CASE, not the partial index of pending
#: waitpoints, see waitpoints._IS_PENDING); its batch's idempotency key holds (a retried batch request
#: answers with the batch's runs, and makes those it lacks again); or its parent may still replay its
#: journal (_PARENT_LIVE)
_BATCH_WAITED = ("EXISTS (SELECT 1 FROM waitpoint w WHERE w.completed_by_batch_id = {batch}"
                 " AND CASE WHEN w.status = 'PENDING' THEN true ELSE false END)")
_RUN_STAYS = "NOT " + _BATCH_WAITED.format(batch="r.batch_id") + """
                 AND NOT EXISTS (SELECT 1 FROM batch_task_run b WHERE b.id = r.batch_id
                                   AND b.idempotency_key IS NOT NULL
                                   AND coalesce(b.idempotency_key_expires_at > now(), true))
                 AND NOT EXISTS (SELECT 1 FROM task_run p WHERE p.id = r.parent_run_id AND """ + _PARENT_LIVE + ")"
_DOOMED_RUNS = f"""
SELECT id, environment_id FROM task_run WHERE id IN (
    (SELECT r.id FROM task_run r WHERE r.finished_at IS NOT NULL AND r.idempotency_key IS NULL
       AND r.finished_at < now() - make_interval(secs => %(age)s) AND {_RUN_STAYS}
     ORDER BY r.finished_at LIMIT %(limit)s)
    UNION ALL
    (SELECT r.id FROM task_run r WHERE r.finished_at IS NOT NULL AND r.idempotency_key IS NOT NULL
       AND r.idempotency_key_expires_at <= now() AND r.finished_at < now() - make_interval(secs => %(age)s)
       AND {_RUN_STAYS}
     ORDER BY r.idempotency_key_expires_at LIMIT %(limit)s))
-- again on the row as it is when locked: a run a redrive reopened after this statement's snapshot
-- was taken is locked in its new version, and PostgreSQL checks only these conditions again, not
-- those of the subqueries above
  AND finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => %(age)s)
  AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now())
ORDER BY finished_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED
"""

#: batches past retention that none of their runs is left in (deleted, they would show a batch short of
#: its runs), that nobody waits on and whose parent, if any, has finished and is not in the DLQ (it
#: reads its batch when it replays its journal). A batch nobody waits on is never marked completed: its
#: age is its creation's.
_BATCH_GOES = """NOT EXISTS (SELECT 1 FROM task_run r WHERE r.batch_id = b.id)
           AND NOT """ + _BATCH_WAITED.format(batch="b.id") + """
           AND NOT EXISTS (SELECT 1 FROM task_run p WHERE p.id = b.parent_run_id AND """ + _PARENT_LIVE + ")"
_DOOMED_BATCHES = f"""
WITH doomed AS (
    SELECT id FROM batch_task_run WHERE id IN (
        (SELECT b.id FROM batch_task_run b WHERE b.idempotency_key IS NULL
           AND coalesce(b.completed_at, b.created_at) < now() - make_interval(secs => %(age)s) AND {_BATCH_GOES}
         ORDER BY coalesce(b.completed_at, b.created_at) LIMIT %(limit)s)
        UNION ALL
        (SELECT b.id FROM batch_task_run b WHERE b.idempotency_key IS NOT NULL
           AND b.idempotency_key_expires_at <= now()
           AND coalesce(b.completed_at, b.created_at) < now() - make_interval(secs => %(age)s) AND {_BATCH_GOES}
         ORDER BY b.idempotency_key_expires_at LIMIT %(limit)s))
    -- again on the row as locked: a key set again meanwhile holds
    AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now())
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
DELETE FROM batch_task_run WHERE id IN (SELECT id FROM doomed)
"""


class MaintenanceRepository:
    """What only the leader reads in bulk or deletes: scans by id cursor, old runs."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> tuple[bool, float]:
        """Take the lease if free or expired, or extend it if ours (dex). Returns (held, seconds
        until the current holder's lease expires)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """INSERT INTO engine_lease AS l (name, holder, acquired_at, expires_at)
                   VALUES (%(name)s, %(holder)s, now(), now() + make_interval(secs => %(ttl)s))
                   ON CONFLICT (name) DO UPDATE
                       SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at,
                           acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE now() END
                       WHERE l.holder = EXCLUDED.holder OR l.expires_at < now()
                   RETURNING holder""", {"name": name, "holder": holder, "ttl": ttl_s})
            if await cur.fetchone() is not None:
                return True, ttl_s
            cur = await conn.execute(
                "SELECT extract(epoch FROM expires_at - now()) FROM engine_lease WHERE name = %s", (name,))
            row = await cur.fetchone()
        return False, max(0.0, float(row[0])) if row else 0.0

    async def release_lease(self, name: str, holder: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM engine_lease WHERE name = %s AND holder = %s", (name, holder))

    async def lease_holder(self, name: str) -> str | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT holder FROM engine_lease WHERE name = %s AND expires_at > now()", (name,))
            row = await cur.fetchone()
        return row[0] if row else None

    async def active_runs_page(self, after_id: str, older_than_s: float, limit: int) -> list[tuple[RunRow, Snapshot]]:
        """Runs a worker holds or that wait (DEQUEUED, EXECUTING, WAITING), untouched for
        ``older_than_s``, with their latest snapshot, by id after ``after_id``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT " + select_as("r", RunRow, "r") + ", " + select_as("s", Snapshot, "s") + """
                   FROM task_run r CROSS JOIN LATERAL (SELECT * FROM task_run_execution_snapshot
                                       WHERE run_id = r.id AND is_valid ORDER BY seq DESC LIMIT 1) s
                   WHERE r.status IN ('DEQUEUED', 'EXECUTING', 'WAITING') AND r.id > %s
                     AND r.updated_at < now() - make_interval(secs => %s)
                   ORDER BY r.id LIMIT %s""", (after_id, older_than_s, limit))
            return [(from_prefixed(RunRow, row, "r"), from_prefixed(Snapshot, row, "s"))  # type: ignore[misc]
                    for row in await cur.fetchall()]

    async def not_started_runs_page(self, after_id: str, limit: int) -> list[RunRow]:
        """DELAYED runs, and runs with a TTL that have not started (their engine jobs)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run
                   WHERE id > %s AND (status = 'DELAYED' OR (ttl_s IS NOT NULL AND attempt_number = 0
                         AND status IN ('QUEUED', 'PENDING_VERSION')))
                   ORDER BY id LIMIT %s""", (after_id, limit))
            return [run_row(r) for r in await cur.fetchall()]

    async def cancel_cascades_page(self, after_id: str, older_than_s: float, limit: int) -> list[tuple[str, str]]:
        """(run, environment) of the cancels whose way down their runs' children is not through
        (migration 0052), noted more than ``older_than_s`` ago, by run id after ``after_id``."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT c.run_id, r.environment_id FROM cancel_cascade c JOIN task_run r ON r.id = c.run_id
                   WHERE c.run_id > %s AND c.created_at < now() - make_interval(secs => %s)
                   ORDER BY c.run_id LIMIT %s""", (after_id, older_than_s, limit))
            return [(r[0], r[1]) for r in await cur.fetchall()]

    async def queued_runs_page(self, after_id: str, older_than_s: float, limit: int) -> list[RunRow]:
        """Runs the API shows as QUEUED (latest snapshot QUEUED or QUEUED_EXECUTING), untouched for
        ``older_than_s``, by id after ``after_id``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run
                   WHERE status = 'QUEUED' AND id > %s AND updated_at < now() - make_interval(secs => %s)
                   ORDER BY id LIMIT %s""", (after_id, older_than_s, limit))
            return [run_row(r) for r in await cur.fetchall()]

    async def dead_runs_page(self, after_id: str, limit: int,
                             restore: Callable[[list[RunRow]], Awaitable[None]]) -> tuple[int, str]:
        """The next ``limit`` runs in the DLQ (status SYSTEM_FAILURE: see migration 0042) by id
        after ``after_id``, read light and handed to ``restore`` (which writes their DLQ entries in
        Redis) while they are locked FOR SHARE. A redrive (which updates the row) or retention
        (which deletes it, its Redis entries first) of one of them waits until ``restore`` is
        through, and then finds the entry to move or drop; one that got in first changed the row
        before the lock, and the run is left out. Returns how many runs the page read before the
        lock (fewer than ``limit``: the end) and the last id it read (``after_id`` if none)."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT id FROM task_run WHERE status = 'SYSTEM_FAILURE' AND id > %s ORDER BY id LIMIT %s",
                (after_id, limit))
            ids = [r[0] for r in await cur.fetchall()]
            if not ids:
                return 0, after_id
            rows = conn.cursor(row_factory=dict_row)
            # again on the row as it is when locked: a run redriven or deleted meanwhile is not read
            await rows.execute(f"SELECT {LIGHT_RUN_COLUMNS} FROM task_run WHERE id = ANY(%s)"
                               " AND status = 'SYSTEM_FAILURE' ORDER BY id FOR SHARE", (ids,))
            runs = [run_row(r) for r in await rows.fetchall()]
            if runs:
                await restore(runs)
            return len(ids), ids[-1]

    async def deployable_pending_runs(self, older_than_s: float, limit: int) -> list[tuple[str, str, str, str]]:
        """PENDING_VERSION runs, untouched for ``older_than_s``, whose task the current deployment
        of their environment and worker group has: (run id, deployment id, task, its queue there).
        A deployment's registration promotes the runs waiting for it; these are the ones it missed
        (a run created from a stale cache while it registered)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT r.id, d.id, r.task_identifier, dt.queue_name FROM task_run r
                   JOIN deployment d ON d.environment_id = r.environment_id
                                    AND d.worker_group_id = r.worker_group_id AND d.is_current
                   JOIN deployment_task dt ON dt.deployment_id = d.id AND dt.task_identifier = r.task_identifier
                   WHERE r.status = 'PENDING_VERSION' AND r.updated_at < now() - make_interval(secs => %s)
                   ORDER BY r.id LIMIT %s""", (older_than_s, limit))
            return [(r[0], r[1], r[2], r[3]) for r in await cur.fetchall()]

    async def due_delayed_runs(self, older_than_s: float, limit: int) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id FROM task_run WHERE status = 'DELAYED'
                   AND delay_until < now() - make_interval(secs => %s) ORDER BY delay_until LIMIT %s""",
                (older_than_s, limit))
            return [r[0] for r in await cur.fetchall()]

    async def environment_ids(self) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM runtime_environment ORDER BY id")
            return [r[0] for r in await cur.fetchall()]

    async def delete_finished_before(self, age_s: float, limit: int,
                                     forget: Callable[[list[tuple[str, str]]], Awaitable[None]]) -> int:
        """Delete up to ``limit`` runs finished more than ``age_s`` ago (their snapshots, journals,
        checkpoints and blocking rows go with them) and as many completed waitpoints as old that no
        journal or blocking row still needs. ``forget((env_id, run_id) ...)`` is awaited with the
        doomed runs locked and before their rows go: it removes what Redis holds of them (a DLQ
        entry, a message), so a crash in between leaves runs that are still whole, never Redis
        entries of runs that are gone."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                # A child of a batch still pending stays: the batch counts its children to end its
                # parent's wait, and one deleted would make it look short of runs (failed). So does
                # a child of a run not finished or in the DLQ: a batch's results are read from its
                # children's rows whenever the parent replays its journal (restored, retried,
                # redriven), and a child gone would read as never created. And a run whose
                # idempotency key has not expired: deleted, it would free the key, and the same
                # trigger would run the work again.
                # The runs without a key by their finish, those with one by their key's expiry (each
                # its own partial index: the runs kept for their keys are never walked again).
                _DOOMED_RUNS, {"age": age_s, "limit": limit})
            doomed = [(env_id, run_id) for run_id, env_id in await cur.fetchall()]
            if doomed:
                await forget(doomed)
                await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", ([run_id for _, run_id in doomed],))
        async with self.pool.connection() as conn, conn.transaction():
            # Two statements: the waitpoints locked first, then deleted only if, read again after
            # the lock (a snapshot of its own), no journal entry or blocking row names them. A block
            # journaling a wait locks the waitpoint it names FOR KEY SHARE until it commits (see
            # waitpoints._BLOCK): one holding it now is passed over (SKIP LOCKED), one that committed
            # before the lock is seen by the second statement (a single statement's snapshot, taken
            # before that commit, saw no entry and deleted the waitpoint its entry names: a wait that
            # never resolved), and one that comes after waits for this commit and finds it gone.
            cur = await conn.execute(
                """SELECT id FROM waitpoint w WHERE status = 'COMPLETED'
                     AND completed_at < now() - make_interval(secs => %s)
                     -- a token's key kept for its TTL (a new token would take it); a RUN waitpoint's
                     -- (run:<id>, no expiry) is no caller's: a wait on that run made later makes
                     -- another, completed at once
                     AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now() OR type = 'RUN')
                     AND NOT EXISTS (SELECT 1 FROM task_run_journal j WHERE j.waitpoint_id = w.id)
                     AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint b WHERE b.waitpoint_id = w.id)
                   LIMIT %s FOR UPDATE SKIP LOCKED""", (age_s, limit))
            locked = [r[0] for r in await cur.fetchall()]
            if not locked:
                return len(doomed)
            cur = await conn.execute(
                """DELETE FROM waitpoint w WHERE w.id = ANY(%s)
                     AND NOT EXISTS (SELECT 1 FROM task_run_journal j WHERE j.waitpoint_id = w.id)
                     AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint b WHERE b.waitpoint_id = w.id)""", (locked,))
            return len(doomed) + max(cur.rowcount, 0)

    async def delete_finished_batches_before(self, age_s: float, limit: int) -> int:
        """Delete up to ``limit`` batches done more than ``age_s`` ago whose runs retention has deleted
        and whose idempotency key, if any, has expired (see _DOOMED_BATCHES)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_DOOMED_BATCHES, {"age": age_s, "limit": limit})
            return cur.rowcount
