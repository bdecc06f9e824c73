"""Bulk actions: one row per action, its filter, its cursor through the matching runs and its counts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from run_engine.db.rows import from_row, from_row_or_none


@dataclass(frozen=True, slots=True)
class BulkAction:
    id: str
    env_id: str
    kind: str  # CANCEL or REPLAY
    filter: dict[str, Any]
    status: str  # PENDING, COMPLETED or ABORTED
    cursor_created_at: datetime | None
    cursor_id: str | None
    processed: int
    succeeded: int
    idempotency_key: str | None
    created_at: datetime
    completed_at: datetime | None
    name: str | None = None


#: the first key of the advisory lock that makes one environment's creates take turns (the
#: two-key lock space: never the migrator's one-key lock)
_CREATE_LOCK_CLASS = 0x42554C4B  # "BULK"


class BulkActionRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def create(self, *, id: str, env_id: str, kind: str, filter: dict[str, Any],
                     idempotency_key: str | None, max_pending: int,
                     name: str | None = None) -> tuple[BulkAction | None, bool]:
        """The new action, or the one the same idempotency key made before (and True); None when
        the environment has ``max_pending`` actions under way already (and nothing was made). The
        environment's creates take turns (a transaction-scoped advisory lock on it): two of them
        counting at once would each see the other's action uncommitted and both pass the limit."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_CREATE_LOCK_CLASS, env_id))
            await cur.execute(
                """INSERT INTO bulk_action (id, environment_id, kind, filter, idempotency_key, name)
                   SELECT %(id)s, %(env)s, %(kind)s, %(filter)s, %(key)s, %(name)s
                   WHERE (SELECT count(*) FROM bulk_action
                          WHERE environment_id = %(env)s AND status = 'PENDING') < %(max)s
                   ON CONFLICT (environment_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                   RETURNING *""",
                {"id": id, "env": env_id, "kind": kind, "filter": Jsonb(filter), "key": idempotency_key,
                 "max": max_pending, "name": name})
            made = await cur.fetchone()
            if made is not None:
                return from_row(BulkAction, made), False
            if idempotency_key is None:
                return None, False
            await cur.execute("SELECT * FROM bulk_action WHERE environment_id = %s AND idempotency_key = %s",
                              (env_id, idempotency_key))
            found = await cur.fetchone()
            return (from_row(BulkAction, found), True) if found is not None else (None, False)

    async def get(self, action_id: str, env_id: str | None = None) -> BulkAction | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM bulk_action WHERE id = %s AND (%s::text IS NULL OR environment_id = %s)",
                              (action_id, env_id, env_id))
            return from_row_or_none(BulkAction, await cur.fetchone())

    async def page(self, env_id: str, limit: int, after: tuple[datetime, str] | None) -> list[BulkAction]:
        """The environment's actions, newest first, after ``after`` (created_at, id)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM bulk_action WHERE environment_id = %(env)s
                     AND (%(ts)s::timestamptz IS NULL OR (created_at, id) < (%(ts)s, %(id)s))
                   ORDER BY created_at DESC, id DESC LIMIT %(limit)s""",
                {"env": env_id, "ts": after[0] if after else None, "id": after[1] if after else None,
                 "limit": limit})
            return [from_row(BulkAction, r) for r in await cur.fetchall()]

    async def abort(self, action_id: str, env_id: str) -> BulkAction | None:
        """ABORTED, if it was PENDING; the action as it is then, or None."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """WITH stopped AS (
                       UPDATE bulk_action SET status = 'ABORTED', completed_at = now()
                       WHERE id = %(id)s AND environment_id = %(env)s AND status = 'PENDING' RETURNING *)
                   SELECT * FROM stopped
                   UNION ALL
                   SELECT * FROM bulk_action WHERE id = %(id)s AND environment_id = %(env)s
                     AND NOT EXISTS (SELECT 1 FROM stopped)""", {"id": action_id, "env": env_id})
            return from_row_or_none(BulkAction, await cur.fetchone())

    async def advance(self, action_id: str, *, expected: tuple[datetime | None, str | None],
                      cursor: tuple[datetime, str] | None, processed: int, succeeded: int, done: bool) -> bool:
        """Move the cursor on by one page (only from where ``expected`` says it is: a page done twice by
        two workers counts once) and add the page's counts; False when it had moved already. An
        action aborted while the page was in hand counts it still (its runs were acted on)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE bulk_action SET
                       cursor_created_at = coalesce(%(ts)s, cursor_created_at),
                       cursor_id = coalesce(%(cid)s, cursor_id),
                       processed = processed + %(processed)s, succeeded = succeeded + %(succeeded)s,
                       status = CASE WHEN %(done)s AND status = 'PENDING' THEN 'COMPLETED' ELSE status END,
                       completed_at = CASE WHEN %(done)s AND status = 'PENDING' THEN now() ELSE completed_at END
                   WHERE id = %(id)s AND status IN ('PENDING', 'ABORTED')
                     AND cursor_created_at IS NOT DISTINCT FROM %(ets)s AND cursor_id IS NOT DISTINCT FROM %(eid)s""",
                {"id": action_id, "ts": cursor[0] if cursor else None, "cid": cursor[1] if cursor else None,
                 "processed": processed, "succeeded": succeeded, "done": done, "ets": expected[0], "eid": expected[1]})
            return cur.rowcount > 0

    async def delete_finished_before(self, age_s: float, limit: int) -> int:
        """Delete up to ``limit`` actions that finished (or were aborted) more than ``age_s`` ago."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """DELETE FROM bulk_action WHERE id IN (
                       SELECT id FROM bulk_action WHERE status <> 'PENDING'
                         AND completed_at < now() - make_interval(secs => %s) LIMIT %s FOR UPDATE SKIP LOCKED)""",
                (age_s, limit))
            return cur.rowcount

    async def pending(self, after: str = "", limit: int = 1000) -> list[tuple[str, str]]:
        """(id, environment) of the actions not finished, after ``after`` in id order (the
        reconciler re-arms their jobs a page at a time)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id, environment_id FROM bulk_action WHERE status = 'PENDING' AND id > %s ORDER BY id LIMIT %s",
                (after, limit))
            return [(r[0], r[1]) for r in await cur.fetchall()]
