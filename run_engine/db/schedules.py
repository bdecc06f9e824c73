"""Cron schedules (task_schedule)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from run_engine.db.rows import from_row, from_row_or_none

_CREATE_LOCK_CLASS = 0x53434844  # "SCHD": an environment's capped schedule upserts take turns


@dataclass(frozen=True, slots=True)
class Schedule:
    id: str
    env_id: str
    task_id: str
    cron: str
    timezone: str
    external_id: str | None
    deduplication_key: str | None
    active: bool
    next_run_at: datetime | None
    last_run_at: datetime | None
    type: str  # IMPERATIVE (made through the API) or DECLARATIVE (a task's cron)
    created_at: datetime
    updated_at: datetime
    # a declarative schedule's: the group whose deployment declared it, where its runs go (None: the
    # environment's default group, as for an imperative schedule)
    worker_group_id: str | None = None


# Each environment's due ticks are the head of its range of task_schedule_due_by_environment
# (environment, next tick) WHERE active: per_environment rows read for each environment with due
# ticks (by next tick alone, each environment's look-up walked every environment's due schedules).
# The environments are found by task_schedule_due (next tick): the due rows are read once.
_DUE_SQL = """
SELECT * FROM (
    SELECT s.*, row_number() OVER (PARTITION BY s.environment_id ORDER BY s.next_run_at, s.id) AS turn
    FROM (SELECT DISTINCT environment_id FROM task_schedule WHERE active AND next_run_at <= %(now)s) e
    CROSS JOIN LATERAL (
        SELECT * FROM task_schedule t
        WHERE t.environment_id = e.environment_id AND t.active AND t.next_run_at <= %(now)s
        ORDER BY t.next_run_at LIMIT %(per)s) s) due
ORDER BY turn, next_run_at, id LIMIT %(limit)s
"""


@dataclass(frozen=True, slots=True)
class DroppedDeclarative:
    """A declarative schedule a group's deployment no longer declares, and the declaration of its
    task's cron by another group's current deployment, if one has it (else the four are None)."""

    schedule_id: str
    cron: str
    timezone: str
    deployment_id: str | None
    worker_group_id: str | None
    declared_cron: str | None
    declared_timezone: str | None


# The cron of schedule s's task that the current deployments of s's environment by groups other than
# %(group)s declare (deployment.tasks: a task's "cron" is {"pattern", "timezone"}; the versions before
# 059ff40 kept the worker's own declaration, a pattern alone as a string; "" declares none).
_DECLARED_ELSEWHERE = """
    SELECT d.id AS deployment_id, d.worker_group_id, c.pattern, c.tz
    FROM deployment d
    CROSS JOIN LATERAL jsonb_array_elements(d.tasks) t
    CROSS JOIN LATERAL (
        SELECT CASE jsonb_typeof(t->'cron') WHEN 'string' THEN t->>'cron'
                                            WHEN 'object' THEN t->'cron'->>'pattern' END AS pattern,
               CASE WHEN jsonb_typeof(t->'cron') = 'object'
                    THEN coalesce(t->'cron'->>'timezone', 'UTC') ELSE 'UTC' END AS tz) c
    WHERE d.environment_id = s.environment_id AND d.is_current AND d.worker_group_id <> %(group)s
      AND t->>'id' = s.task_identifier AND c.pattern <> ''"""


class ScheduleRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def upsert(self, *, id: str, env_id: str, task_id: str, cron: str, timezone: str,
                     external_id: str | None, deduplication_key: str | None, next_run_at: datetime,
                     type: str, max_schedules: int | None = None,
                     worker_group_id: str | None = None) -> Schedule | None:
        """Insert a schedule, or update the one with the same (environment, deduplication key): its
        next tick becomes ``next_run_at`` only if it is active and its cron or time zone changed (a
        deactivated one has none until activated, as :meth:`update` leaves it). None when it would
        be new and the environment has ``max_schedules`` already (the environment's capped upserts
        take turns: a transaction-scoped advisory lock on it)."""
        async with self.pool.connection() as conn, conn.transaction():
            if max_schedules is not None:
                await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_CREATE_LOCK_CLASS, env_id))
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """INSERT INTO task_schedule (id, environment_id, task_identifier, cron, timezone, external_id,
                                              deduplication_key, active, next_run_at, type, worker_group_id)
                   SELECT %(id)s, %(environment_id)s, %(task_identifier)s, %(cron)s, %(timezone)s, %(external_id)s,
                          %(deduplication_key)s, true, %(next_run_at)s, %(type)s, %(worker_group_id)s
                   WHERE %(max)s::int IS NULL
                      OR EXISTS (SELECT 1 FROM task_schedule WHERE environment_id = %(environment_id)s
                                   AND deduplication_key = %(deduplication_key)s)
                      OR (SELECT count(*) FROM (SELECT 1 FROM task_schedule WHERE environment_id = %(environment_id)s
                                                LIMIT %(max)s) s) < %(max)s
                   ON CONFLICT (environment_id, deduplication_key) WHERE deduplication_key IS NOT NULL DO UPDATE
                       SET task_identifier = EXCLUDED.task_identifier, cron = EXCLUDED.cron,
                           timezone = EXCLUDED.timezone, external_id = EXCLUDED.external_id,
                           worker_group_id = EXCLUDED.worker_group_id,
                           next_run_at = CASE WHEN NOT task_schedule.active
                                                OR (task_schedule.cron = EXCLUDED.cron
                                                    AND task_schedule.timezone = EXCLUDED.timezone)
                                              THEN task_schedule.next_run_at ELSE EXCLUDED.next_run_at END,
                           updated_at = now()
                   RETURNING *""",
                {"id": id, "environment_id": env_id, "task_identifier": task_id, "cron": cron,
                 "timezone": timezone, "external_id": external_id, "deduplication_key": deduplication_key,
                 "next_run_at": next_run_at, "type": type, "max": max_schedules, "worker_group_id": worker_group_id})
            return from_row_or_none(Schedule, await cur.fetchone())

    async def get(self, schedule_id: str, env_id: str | None = None) -> Schedule | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_schedule WHERE id = %s AND (%s::text IS NULL OR environment_id = %s)",
                              (schedule_id, env_id, env_id))
            return from_row_or_none(Schedule, await cur.fetchone())

    async def get_by_deduplication_key(self, env_id: str, deduplication_key: str) -> Schedule | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_schedule WHERE environment_id = %s AND deduplication_key = %s",
                              (env_id, deduplication_key))
            return from_row_or_none(Schedule, await cur.fetchone())

    async def page(self, env_id: str, limit: int, after: tuple[datetime, str] | None,
                   offset: int = 0) -> list[Schedule]:
        """Newest first; ``after`` is the (created_at, id) of the last schedule of the previous page
        (or ``offset`` schedules are skipped: page numbers)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_schedule WHERE environment_id = %(env)s
                     AND (%(ts)s::timestamptz IS NULL OR (created_at, id) < (%(ts)s, %(id)s))
                   ORDER BY created_at DESC, id DESC LIMIT %(limit)s OFFSET %(offset)s""",
                {"env": env_id, "ts": after[0] if after else None, "id": after[1] if after else None, "limit": limit,
                 "offset": offset})
            return [from_row(Schedule, r) for r in await cur.fetchall()]

    async def count(self, env_id: str, after: tuple[datetime, str] | None = None) -> tuple[int, int]:
        """(schedules of the environment, how many of them come before ``after`` in page order)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT count(*), count(*) FILTER (WHERE (created_at, id) >= (%(ts)s, %(id)s))
                   FROM task_schedule WHERE environment_id = %(env)s""",
                {"env": env_id, "ts": after[0] if after else None, "id": after[1] if after else None})
            row = await cur.fetchone()
            assert row is not None
            return int(row[0]), int(row[1] or 0)

    async def delete(self, schedule_id: str, env_id: str) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute("DELETE FROM task_schedule WHERE id = %s AND environment_id = %s",
                                     (schedule_id, env_id))
            return cur.rowcount > 0

    async def set_active(self, schedule_id: str, env_id: str, active: bool,
                         next_run_at: datetime | None) -> Schedule | None:
        """Activate (from ``next_run_at``) or deactivate; activating an active schedule keeps its
        next tick (one due and not yet fired is not skipped)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE task_schedule
                      SET next_run_at = CASE WHEN active AND %(active)s THEN next_run_at ELSE %(next)s END,
                          active = %(active)s, updated_at = now()
                   WHERE id = %(id)s AND environment_id = %(env)s RETURNING *""",
                {"active": active, "next": next_run_at, "id": schedule_id, "env": env_id})
            return from_row_or_none(Schedule, await cur.fetchone())

    async def update(self, schedule_id: str, env_id: str, *, task_id: str, cron: str, timezone: str,
                     external_id: str | None, next_run_at: datetime | None) -> Schedule | None:
        """Change an imperative schedule's task, cron, time zone and external id; its next tick
        becomes ``next_run_at`` only if the cron or the time zone changed (a tick due and not yet
        fired is not skipped by a change of its task or external id)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE task_schedule
                      SET next_run_at = CASE WHEN NOT active OR (cron = %(cron)s AND timezone = %(tz)s)
                                             THEN next_run_at ELSE %(next)s END,
                          task_identifier = %(task)s, cron = %(cron)s, timezone = %(tz)s, external_id = %(ext)s,
                          updated_at = now()
                   WHERE id = %(id)s AND environment_id = %(env)s AND type = 'IMPERATIVE' RETURNING *""",
                {"task": task_id, "cron": cron, "tz": timezone, "ext": external_id, "next": next_run_at,
                 "id": schedule_id, "env": env_id})
            return from_row_or_none(Schedule, await cur.fetchone())

    async def dropped_declarative(self, env_id: str, worker_group_id: str,
                                  keep: Sequence[str]) -> list[DroppedDeclarative]:
        """The declarative schedules the group's deployment no longer declares (the group's, or of no
        group: one deleted), each with the declaration of another group's current deployment of the
        environment that still declares its task's cron, if one does: the one that declares the
        schedule's cron and zone first, then the environment's default group's, then the newest."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                f"""SELECT s.id AS schedule_id, s.cron, s.timezone, o.deployment_id, o.worker_group_id,
                           o.pattern AS declared_cron, o.tz AS declared_timezone
                    FROM task_schedule s
                    LEFT JOIN LATERAL ({_DECLARED_ELSEWHERE}
                        ORDER BY (c.pattern = s.cron AND c.tz = s.timezone) DESC,
                                 d.worker_group_id = (SELECT default_worker_group_id FROM runtime_environment
                                                      WHERE id = s.environment_id) DESC NULLS LAST,
                                 d.created_at DESC, d.id
                        LIMIT 1) o ON true
                    WHERE s.environment_id = %(env)s AND s.type = 'DECLARATIVE'
                      AND (s.worker_group_id = %(group)s OR s.worker_group_id IS NULL)
                      AND NOT (s.deduplication_key = ANY(%(keep)s))""",
                {"env": env_id, "group": worker_group_id, "keep": list(keep)})
            return [from_row(DroppedDeclarative, r) for r in await cur.fetchall()]

    async def drop_declarative(self, env_id: str, worker_group_id: str, keep: Sequence[str],
                               handoffs: Sequence[tuple[DroppedDeclarative, datetime | None]]) -> tuple[int, int]:
        """In one statement: hand each of ``handoffs`` (from :meth:`dropped_declarative`, with its
        next tick when the declared cron or zone is not the schedule's) to the group that declares
        it, with its cron and zone, if that deployment is still current and the schedule still as
        read; and delete the group's (or group-less) declarative schedules not in ``keep`` that are
        not handed and that no other group's current deployment of the environment declares.
        Returns (handed, deleted)."""
        rows = [{"id": d.schedule_id, "cron": d.cron, "timezone": d.timezone, "deployment_id": d.deployment_id,
                 "worker_group_id": d.worker_group_id, "new_cron": d.declared_cron,
                 "new_timezone": d.declared_timezone, "next_run_at": nxt.isoformat() if nxt else None}
                for d, nxt in handoffs]
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                f"""WITH handoff AS (
                        SELECT * FROM jsonb_to_recordset(%(handoffs)s) AS h(
                            id text, cron text, timezone text, deployment_id text, worker_group_id text,
                            new_cron text, new_timezone text, next_run_at timestamptz)),
                    handed AS (
                        UPDATE task_schedule s
                           SET worker_group_id = h.worker_group_id, cron = h.new_cron, timezone = h.new_timezone,
                               next_run_at = CASE WHEN s.active THEN coalesce(h.next_run_at, s.next_run_at)
                                                  ELSE s.next_run_at END,
                               updated_at = now()
                          FROM handoff h
                         WHERE s.id = h.id AND s.environment_id = %(env)s AND s.type = 'DECLARATIVE'
                           AND (s.worker_group_id = %(group)s OR s.worker_group_id IS NULL)
                           AND NOT (s.deduplication_key = ANY(%(keep)s))
                           AND s.cron = h.cron AND s.timezone = h.timezone
                           AND EXISTS (SELECT 1 FROM deployment d WHERE d.id = h.deployment_id AND d.is_current)
                        RETURNING s.id),
                    deleted AS (
                        DELETE FROM task_schedule s
                         WHERE s.environment_id = %(env)s AND s.type = 'DECLARATIVE'
                           AND (s.worker_group_id = %(group)s OR s.worker_group_id IS NULL)
                           AND NOT (s.deduplication_key = ANY(%(keep)s))
                           AND s.id NOT IN (SELECT id FROM handed)
                           AND NOT EXISTS ({_DECLARED_ELSEWHERE})
                        RETURNING s.id)
                    SELECT (SELECT count(*) FROM handed), (SELECT count(*) FROM deleted)""",
                {"env": env_id, "group": worker_group_id, "keep": list(keep), "handoffs": Jsonb(rows)})
            row = await cur.fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

    async def now(self) -> datetime:
        """The database's time: every process plans by it, whatever its own clock says."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT now()")
            row = await cur.fetchone()
            assert row is not None
            return row[0]  # type: ignore[no-any-return]

    async def due(self, now: datetime, limit: int, per_environment: int) -> list[Schedule]:
        """The schedules due at ``now``, at most ``per_environment`` of each environment (its oldest
        ticks), taken in turns: every environment's oldest due tick first (the oldest of them
        first), then every environment's second, and so on up to ``limit``. A tenant with one due
        tick has it in the next poll, however many others have due, as long as fewer than
        ``limit`` environments have due ticks."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_DUE_SQL, {"now": now, "per": per_environment, "limit": limit})
            return [from_row(Schedule, r) for r in await cur.fetchall()]

    async def deactivate(self, schedule_id: str, fired_at: datetime) -> bool:
        """Stop a schedule whose next tick cannot be worked out (only if still at ``fired_at``)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE task_schedule SET active = false, next_run_at = NULL, updated_at = now()
                   WHERE id = %s AND next_run_at = %s""", (schedule_id, fired_at))
            return cur.rowcount > 0

    async def take_tick(self, conn: AsyncConnection[Any], schedule: Schedule, next_run_at: datetime) -> bool:
        """In the caller's transaction (the one that inserts the tick's run): move ``schedule`` past
        its due tick to ``next_run_at``, only if it is still as read (active, at that tick, the same
        task, cron, zone, external id and worker group) and no other transaction holds it (another
        process firing it, an edit or a delete under way: SKIP LOCKED, tried again at the next
        poll). Held until the transaction ends: an edit or delete of the schedule waits for the run
        made with it."""
        cur = await conn.execute(
            """UPDATE task_schedule SET last_run_at = next_run_at, next_run_at = %(next)s
               WHERE id = (SELECT id FROM task_schedule
                           WHERE id = %(id)s AND active AND next_run_at = %(tick)s AND task_identifier = %(task)s
                             AND cron = %(cron)s AND timezone = %(tz)s AND external_id IS NOT DISTINCT FROM %(ext)s
                             AND worker_group_id IS NOT DISTINCT FROM %(group)s
                           FOR UPDATE SKIP LOCKED)""",
            {"next": next_run_at, "id": schedule.id, "tick": schedule.next_run_at, "task": schedule.task_id,
             "cron": schedule.cron, "tz": schedule.timezone, "ext": schedule.external_id,
             "group": schedule.worker_group_id})
        return cur.rowcount > 0

    async def advance(self, schedule_id: str, skipped: datetime, next_run_at: datetime) -> bool:
        """Move the schedule past ``skipped``, a tick that made no run (only if nobody did yet):
        compare-and-set. ``last_run_at`` stays the last tick that made one (the run's
        ``lastTimestamp``, the API's ``lastRun``), as Trigger.dev's skip carries it forward."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE task_schedule SET next_run_at = %s
                   WHERE id = %s AND next_run_at = %s""", (next_run_at, schedule_id, skipped))
            return cur.rowcount > 0
