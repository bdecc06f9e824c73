"""The leader's tables and scans: the engine lease, the reconciler's pages, retention."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime

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
#: journal (_PARENT_LIVE; the parent looked up by its id for the runs that have one: as an anti join the
#: planner may read every unfinished run of the table to hash them, for each batch)
_BATCH_WAITED = ("EXISTS (SELECT 1 FROM waitpoint w WHERE w.completed_by_batch_id = {batch}"
                 " AND CASE WHEN w.status = 'PENDING' THEN true ELSE false END)")
_RUN_STAYS = "NOT " + _BATCH_WAITED.format(batch="r.batch_id") + """
                 AND NOT EXISTS (SELECT 1 FROM batch_task_run b WHERE b.id = r.batch_id
                                   AND b.idempotency_key IS NOT NULL
                                   AND coalesce(b.idempotency_key_expires_at > now(), true))
                 AND (r.parent_run_id IS NULL
                      OR NOT EXISTS (SELECT 1 FROM task_run p WHERE p.id = r.parent_run_id AND """ + _PARENT_LIVE + "))"
#: one walk of retention over finished runs, from the position after which it stopped (see Walk): the
#: first ``limit`` runs past the age that may go, by (position, id), read without a lock; then those of
#: them locked (SKIP LOCKED) and checked again on the row as it is when locked: a run a redrive reopened
#: after this statement's snapshot was taken is locked in its new version, and PostgreSQL checks only
#: these conditions again, not those of the walk's subqueries. Answers every run walked, by position,
#: with its environment if it is to go (NULL: left). {pos} is the walk's index's column, {range} its
#: part of the finished runs (each a partial index of migration 0024).
_RUN_WALK = """
WITH walked AS MATERIALIZED (
    SELECT r.id, {pos} AS pos FROM task_run r
    WHERE r.finished_at IS NOT NULL AND {range}
      AND r.finished_at < now() - make_interval(secs => %(age)s)
      AND ({pos}, r.id) > (%(after_pos)s::timestamptz, %(after_id)s::text)
      AND """ + _RUN_STAYS + """
    ORDER BY {pos}, r.id LIMIT %(limit)s),
doomed AS (
    SELECT id, environment_id FROM task_run WHERE id IN (SELECT id FROM walked)
      AND finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => %(age)s)
      AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now())
    FOR UPDATE SKIP LOCKED)
SELECT w.pos, w.id, d.environment_id FROM walked w LEFT JOIN doomed d ON d.id = w.id ORDER BY w.pos, w.id
"""
#: the runs without a key by their finish, those with one by their key's expiry: the runs kept for
#: their keys are never walked while their keys hold
_RUN_WALKS = {
    "runs": _RUN_WALK.format(pos="r.finished_at", range="r.idempotency_key IS NULL"),
    "keyed runs": _RUN_WALK.format(pos="r.idempotency_key_expires_at",
                                   range="r.idempotency_key IS NOT NULL AND r.idempotency_key_expires_at <= now()"),
}
#: what a walk answers when it deletes in its statement: how many rows it walked, the last one's
#: position and id, and how many it deleted
_WALK_ANSWER = """
SELECT (SELECT count(*) FROM walked), l.pos, l.id, (SELECT count(*) FROM gone)
FROM (SELECT 1) one LEFT JOIN (SELECT pos, id FROM walked ORDER BY pos DESC, id DESC LIMIT 1) l ON true
"""
#: completed waitpoints past the age that no journal entry or blocking row names, by their
#: completion (waitpoint_completed_at, migration 0024), walked and locked (deleted by _WAITPOINT_DELETE)
_WAITPOINT_WALK = """
WITH walked AS MATERIALIZED (
    SELECT w.id, w.completed_at AS pos FROM waitpoint w WHERE w.status = 'COMPLETED'
      AND w.completed_at < now() - make_interval(secs => %(age)s)
      AND (w.completed_at, w.id) > (%(after_pos)s::timestamptz, %(after_id)s::text)
      -- a token's key kept for its TTL (a new token would take it); a RUN waitpoint's (run:<id>,
      -- no expiry) is no caller's: a wait on that run made later makes another, completed at once
      AND (w.idempotency_key IS NULL OR w.idempotency_key_expires_at <= now() OR w.type = 'RUN')
      AND NOT EXISTS (SELECT 1 FROM task_run_journal j WHERE j.waitpoint_id = w.id)
      AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint b WHERE b.waitpoint_id = w.id)
    ORDER BY w.completed_at, w.id LIMIT %(limit)s),
doomed AS (SELECT id FROM waitpoint WHERE id IN (SELECT id FROM walked) AND status = 'COMPLETED'
             AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now() OR type = 'RUN')
           FOR UPDATE SKIP LOCKED)
SELECT (SELECT count(*) FROM walked), l.pos, l.id, (SELECT array_agg(id) FROM doomed)
FROM (SELECT 1) one LEFT JOIN (SELECT pos, id FROM walked ORDER BY pos DESC, id DESC LIMIT 1) l ON true
"""
#: the waitpoints _WAITPOINT_WALK locked that no journal entry or blocking row names, read again
#: after the lock (see MaintenanceRepository._delete_waitpoints)
_WAITPOINT_DELETE = """DELETE FROM waitpoint w WHERE w.id = ANY(%s)
  AND NOT EXISTS (SELECT 1 FROM task_run_journal j WHERE j.waitpoint_id = w.id)
  AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint b WHERE b.waitpoint_id = w.id)"""

#: batches past retention that none of their runs is left in (deleted, they would show a batch short of
#: its runs), that nobody waits on and whose parent, if any, has finished and is not in the DLQ (it
#: reads its batch when it replays its journal). A batch nobody waits on is never marked completed: its
#: age is its creation's.
_BATCH_GOES = """NOT EXISTS (SELECT 1 FROM task_run r WHERE r.batch_id = b.id)
           AND NOT """ + _BATCH_WAITED.format(batch="b.id") + """
           AND NOT EXISTS (SELECT 1 FROM task_run p WHERE p.id = b.parent_run_id AND """ + _PARENT_LIVE + ")"
#: one walk over batches past the age that may go, as _RUN_WALK's: those without a key by their
#: completion (or creation: a batch nobody waits on is never marked completed), those with one by the
#: key's expiry (migration 0030); each locked and checked again (a key set again meanwhile holds)
_BATCH_WALK = """
WITH walked AS MATERIALIZED (
    SELECT b.id, {pos} AS pos FROM batch_task_run b WHERE {range}
      AND coalesce(b.completed_at, b.created_at) < now() - make_interval(secs => %(age)s)
      AND ({pos}, b.id) > (%(after_pos)s::timestamptz, %(after_id)s::text)
      AND """ + _BATCH_GOES + """
    ORDER BY {pos}, b.id LIMIT %(limit)s),
doomed AS (SELECT id FROM batch_task_run WHERE id IN (SELECT id FROM walked)
             AND (idempotency_key IS NULL OR idempotency_key_expires_at <= now())
           FOR UPDATE SKIP LOCKED),
gone AS (DELETE FROM batch_task_run WHERE id IN (SELECT id FROM doomed) RETURNING id)
""" + _WALK_ANSWER
_BATCH_WALKS = {
    "batches": _BATCH_WALK.format(pos="coalesce(b.completed_at, b.created_at)", range="b.idempotency_key IS NULL"),
    "keyed batches": _BATCH_WALK.format(
        pos="b.idempotency_key_expires_at",
        range="b.idempotency_key IS NOT NULL AND b.idempotency_key_expires_at <= now()"),
}


class Walk:
    """Where one of retention's walks over an index stands (leader-local: a new leader starts over).
    A walk's batch reads the rows that may go after ``after`` (the last position an earlier batch
    walked past: rows deleted, or rows that must stay, such as the children of a live parent or the
    runs of a batch whose key holds), so a batch never reads again the rows the batches before it
    found must stay; before, each began at the index's oldest row and read all of them again (~0.65
    µs each: 10 million, ~7 s a batch). A walk that reaches its end (a batch walked fewer rows than
    it asked) waits until ``MaintenanceRepository.rewind`` (the next retention pass) and then starts
    over: the rows behind it that became deletable since are found on that round."""

    __slots__ = ("after", "ended")

    def __init__(self) -> None:
        self.after: tuple[datetime, str] | None = None
        self.ended = False

    def params(self) -> dict[str, object]:
        pos, last = self.after if self.after is not None else ("-infinity", "")
        return {"after_pos": pos, "after_id": last}

    def walked(self, count: int, asked: int, last: tuple[datetime, str] | None) -> None:
        if count < asked or last is None:
            self.after, self.ended = None, True
        else:
            self.after = last


class MaintenanceRepository:
    """What only the leader reads in bulk or deletes: scans by id cursor, old runs."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        #: retention's walks (see Walk), by name
        self.walks = {name: Walk() for name in (*_RUN_WALKS, "waitpoints", *_BATCH_WALKS)}

    def rewind(self) -> None:
        """The walks that reached their end start over from their index's oldest row (retention
        calls it at the start of each pass: a walk is read through at most once a pass)."""
        for walk in self.walks.values():
            walk.ended = False

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
        journal or blocking row still needs, each walk on from where its last batch stopped (Walk).
        ``forget((env_id, run_id) ...)`` is awaited with the doomed runs locked and before their rows
        go: it removes what Redis holds of them (a DLQ entry, a message), so a crash in between leaves
        runs that are still whole, never Redis entries of runs that are gone.
        A child of a batch still pending stays: the batch counts its children to end its parent's
        wait, and one deleted would make it look short of runs (failed). So does a child of a run not
        finished or in the DLQ: a batch's results are read from its children's rows whenever the
        parent replays its journal (restored, retried, redriven), and a child gone would read as never
        created. And a run whose idempotency key has not expired: deleted, it would free the key, and
        the same trigger would run the work again."""
        doomed: list[tuple[str, str]] = []
        async with self.pool.connection() as conn, conn.transaction():
            # the runs without a key first, then (what a batch has room for) those with one
            for name, sql in _RUN_WALKS.items():
                walk, asked = self.walks[name], limit - len(doomed)
                if walk.ended or asked <= 0:
                    continue
                cur = await conn.execute(sql, {"age": age_s, "limit": asked, **walk.params()})
                rows = await cur.fetchall()
                walk.walked(len(rows), asked, (rows[-1][0], rows[-1][1]) if rows else None)
                doomed += [(env_id, run_id) for _, run_id, env_id in rows if env_id is not None]
            if doomed:
                await forget(doomed)
                await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", ([run_id for _, run_id in doomed],))
        return len(doomed) + await self._delete_waitpoints(age_s, limit)

    async def _delete_waitpoints(self, age_s: float, limit: int) -> int:
        """One batch of the completed waitpoints' walk; how many it deleted. Two statements: the
        waitpoints walked and locked first, then deleted only if, read again after the lock (a
        snapshot of its own), no journal entry or blocking row names them. A block journaling a
        wait locks the waitpoint it names FOR KEY SHARE until it commits (see waitpoints._BLOCK):
        one holding it now is passed over (SKIP LOCKED), one that committed before the lock is seen
        by the second statement (a single statement's snapshot, taken before that commit, saw no
        entry and deleted the waitpoint its entry names: a wait that never resolved), and one that
        comes after waits for this commit and finds it gone."""
        walk = self.walks["waitpoints"]
        if walk.ended or limit <= 0:
            return 0
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(_WAITPOINT_WALK, {"age": age_s, "limit": limit, **walk.params()})
            row = await cur.fetchone()
            assert row is not None
            count, pos, last, locked = row
            walk.walked(count, limit, (pos, last) if last is not None else None)
            if not locked:
                return 0
            cur = await conn.execute(_WAITPOINT_DELETE, (locked,))
            return max(cur.rowcount, 0)

    async def _walk_and_delete(self, name: str, sql: str, age_s: float, limit: int) -> int:
        """One batch of a walk that deletes in its own statement; how many rows it deleted."""
        walk = self.walks[name]
        if walk.ended or limit <= 0:
            return 0
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, {"age": age_s, "limit": limit, **walk.params()})
            row = await cur.fetchone()
        assert row is not None
        count, pos, last, gone = row
        walk.walked(count, limit, (pos, last) if last is not None else None)
        return int(gone)

    async def delete_finished_batches_before(self, age_s: float, limit: int) -> int:
        """Delete up to ``limit`` batches done more than ``age_s`` ago whose runs retention has deleted
        and whose idempotency key, if any, has expired (see _BATCH_WALK), those without a key first."""
        gone = 0
        for name, sql in _BATCH_WALKS.items():
            gone += await self._walk_and_delete(name, sql, age_s, limit - gone)
        return gone
