"""All SQL of the engine: named, parameterised queries mapped to dataclasses.

The hot path is :meth:`Repository.transition_many`: one statement that, for many runs at once,
checks each run's latest valid snapshot against the caller's expectation, appends the new
snapshot and updates the run row. It runs in its own transaction (autocommit), so a state change
is one round trip and one commit, however many runs a batch carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from psycopg_pool import AsyncConnectionPool

from run_engine.db.waitpoints import WaitpointRepository
from run_engine.errors import ConflictError


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


set_json_dumps(_dumps)
set_json_loads(orjson.loads)


@dataclass(frozen=True, slots=True)
class Snapshot:
    id: str
    run_id: str
    engine_status: str
    run_status: str
    attempt_number: int
    description: str
    previous_snapshot_id: str | None
    checkpoint_id: str | None
    worker_id: str | None
    completed_waitpoint_ids: list[str]
    is_valid: bool
    error: dict[str, Any] | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    environment_id: str
    worker_group_id: str
    task_identifier: str
    payload: Any
    payload_type: str
    status: str
    queue: str
    concurrency_key: str | None
    priority_ms: int
    idempotency_key: str | None
    ttl_s: int | None
    delay_until: datetime | None
    tags: list[str]
    metadata: Any
    max_attempts: int | None
    retry: dict[str, Any] | None
    max_duration_s: int | None
    machine: str | None
    attempt_number: int
    output: Any
    output_type: str | None
    error: dict[str, Any] | None
    locked_to_deployment_id: str | None
    parent_run_id: str | None
    root_run_id: str | None
    depth: int
    batch_id: str | None
    trigger_function: str
    resume_parent_on_completion: bool
    created_at: datetime
    updated_at: datetime
    queued_at: datetime | None
    queue_timestamp: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


_RUN_FIELDS = RunRow.__slots__
_SNAPSHOT_FIELDS = Snapshot.__slots__


def _run(row: dict[str, Any]) -> RunRow:
    return RunRow(**{name: row[name] for name in _RUN_FIELDS})


def _snapshot(row: dict[str, Any]) -> Snapshot:
    return Snapshot(**{name: row[name] for name in _SNAPSHOT_FIELDS})


@dataclass(frozen=True, slots=True)
class Transition:
    """One requested state change of one run.

    Applied only if the run's latest valid snapshot has an ``engine_status`` in ``from_statuses``
    and, when ``expected_snapshot_id`` is given, that id.
    """

    run_id: str
    new_snapshot_id: str
    engine_status: str
    run_status: str
    from_statuses: tuple[str, ...]
    expected_snapshot_id: str | None = None
    description: str = ""
    attempt_delta: int = 0
    set_started: bool = False
    set_finished: bool = False
    reopen: bool = False  # clear finished_at, output and error (DLQ redrive)
    output: Any = None
    output_type: str | None = None
    error: dict[str, Any] | None = None
    worker_id: str | None = None
    # the snapshot's checkpoint; PENDING_EXECUTING and QUEUED_EXECUTING carry the previous one's
    checkpoint_id: str | None = None
    completed_waitpoint_ids: tuple[str, ...] = ()
    # a start that resumes a checkpointed run (the latest snapshot has one) keeps its attempt
    resume_checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class TransitionResult:
    """``applied`` with the new snapshot and run; otherwise the latest snapshot's id and status
    (``None`` when the run does not exist)."""

    run_id: str
    applied: bool
    latest_snapshot_id: str | None
    latest_status: str | None
    snapshot: Snapshot | None = None
    run: RunRow | None = None


_TRANSITION_SQL = """
-- transition_many: per input row, append a snapshot if the latest valid one matches, update the run.
-- params: rows, a JSON array with one object per transition (see Transition); one orjson dump
-- is far cheaper than adapting fifteen parallel arrays
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
        ord int, run_id text, new_id text, engine_status text, run_status text, froms text,
        expected text, description text, attempt_delta int, set_started bool, set_finished bool,
        reopen bool, output jsonb, output_type text, error jsonb, worker_id text, checkpoint_id text,
        completed text[], resume bool)
), latest AS (
    SELECT i.ord, i.run_id, i.new_id, i.engine_status, i.run_status, i.froms, i.expected, i.description,
           CASE WHEN i.resume AND l.checkpoint_id IS NOT NULL THEN 0 ELSE i.attempt_delta END AS attempt_delta,
           i.set_started, i.set_finished, i.reopen, i.output, i.output_type, i.error, i.worker_id,
           i.checkpoint_id, i.completed, i.resume,
           l.id AS latest_id, l.engine_status AS latest_status, l.attempt_number AS latest_attempt,
           l.checkpoint_id AS latest_checkpoint
    FROM input i
    LEFT JOIN LATERAL (
        SELECT s.id, s.engine_status, s.attempt_number, s.checkpoint_id
        FROM task_run_execution_snapshot s
        WHERE s.run_id = i.run_id AND s.is_valid
        ORDER BY s.seq DESC
        LIMIT 1
    ) l ON true
), allowed AS (
    SELECT * FROM latest
    WHERE latest_id IS NOT NULL
      AND (expected IS NULL OR latest_id = expected)
      AND latest_status = ANY(string_to_array(froms, ','))
), ins AS (
    INSERT INTO task_run_execution_snapshot (
        id, run_id, engine_status, run_status, attempt_number, description,
        previous_snapshot_id, worker_id, error, checkpoint_id, completed_waitpoint_ids)
    SELECT new_id, run_id, engine_status, run_status, latest_attempt + attempt_delta, description,
           latest_id, worker_id, error,
           CASE WHEN engine_status IN ('PENDING_EXECUTING', 'QUEUED_EXECUTING') OR resume
                THEN coalesce(checkpoint_id, latest_checkpoint) ELSE checkpoint_id END,
           coalesce(completed, '{}')
    FROM allowed
    ORDER BY ord
    RETURNING *
), upd AS (
    UPDATE task_run r SET
        status = a.run_status,
        updated_at = now(),
        attempt_number = r.attempt_number + a.attempt_delta,
        started_at = CASE WHEN a.set_started THEN coalesce(r.started_at, now()) ELSE r.started_at END,
        finished_at = CASE WHEN a.set_finished THEN now() WHEN a.reopen THEN NULL ELSE r.finished_at END,
        output = CASE WHEN a.reopen THEN NULL WHEN a.output IS NOT NULL THEN a.output ELSE r.output END,
        output_type = CASE WHEN a.output IS NOT NULL THEN a.output_type ELSE r.output_type END,
        error = CASE WHEN a.reopen THEN NULL WHEN a.error IS NOT NULL THEN a.error ELSE r.error END,
        queued_at = CASE WHEN a.engine_status = 'QUEUED' THEN now() ELSE r.queued_at END
    FROM allowed a
    WHERE r.id = a.run_id
    RETURNING r.*
)
SELECT l.run_id AS t_run_id, l.latest_id AS t_latest_id, l.latest_status AS t_latest_status,
       to_jsonb(ins.*) AS t_snapshot, to_jsonb(upd.*) AS t_run
FROM latest l
LEFT JOIN ins ON ins.run_id = l.run_id
LEFT JOIN upd ON upd.id = l.run_id
ORDER BY l.ord
"""


def _parse_ts(value: Any) -> Any:
    if isinstance(value, str):
        return datetime.fromisoformat(value)
    return value


_RUN_TS = ("created_at", "updated_at", "queued_at", "queue_timestamp", "started_at", "finished_at", "delay_until")


def _run_from_json(data: dict[str, Any]) -> RunRow:
    for key in _RUN_TS:
        data[key] = _parse_ts(data.get(key))
    return _run(data)


def _snapshot_from_json(data: dict[str, Any]) -> Snapshot:
    data["created_at"] = _parse_ts(data["created_at"])
    return _snapshot(data)


@dataclass(frozen=True, slots=True)
class NewRun:
    """A run to insert together with its first snapshot."""

    id: str
    snapshot_id: str
    environment_id: str
    worker_group_id: str
    task_identifier: str
    payload: Any
    payload_type: str
    status: str
    engine_status: str
    queue: str
    concurrency_key: str | None = None
    priority_ms: int = 0
    idempotency_key: str | None = None
    idempotency_key_expires_at: datetime | None = None
    ttl_s: int | None = None
    delay_until: datetime | None = None
    tags: tuple[str, ...] = ()
    metadata: Any = None
    max_attempts: int | None = None
    retry: dict[str, Any] | None = None
    max_duration_s: int | None = None
    machine: str | None = None
    locked_to_deployment_id: str | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    batch_id: str | None = None
    trigger_function: str = "trigger"
    resume_parent_on_completion: bool = False
    queue_timestamp: datetime | None = None
    description: str = "Run was created"


_INSERT_RUNS_SQL = """
-- insert_runs: many runs and their first snapshots in one statement.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
        id text, snapshot_id text, environment_id text, worker_group_id text, task_identifier text,
        payload jsonb, payload_type text, status text, engine_status text, queue text,
        concurrency_key text, priority_ms bigint, idempotency_key text,
        idempotency_key_expires_at timestamptz, ttl_s int, delay_until timestamptz, tags text[],
        metadata jsonb, max_attempts int, retry jsonb, max_duration_s int, machine text,
        locked_to_deployment_id text, parent_run_id text, root_run_id text, depth int,
        batch_id text, trigger_function text, resume_parent_on_completion bool,
        queue_timestamp timestamptz, description text)
), runs AS (
    INSERT INTO task_run (
        id, environment_id, worker_group_id, task_identifier, payload, payload_type, status, queue,
        concurrency_key, priority_ms, idempotency_key, idempotency_key_expires_at, ttl_s,
        delay_until, tags, metadata, max_attempts, retry, max_duration_s, machine,
        locked_to_deployment_id, parent_run_id, root_run_id, depth, batch_id, trigger_function,
        resume_parent_on_completion, queued_at, queue_timestamp)
    SELECT id, environment_id, worker_group_id, task_identifier, payload, payload_type, status, queue,
        concurrency_key, priority_ms, idempotency_key, idempotency_key_expires_at, ttl_s,
        delay_until, coalesce(tags, '{}'), metadata, max_attempts, retry, max_duration_s, machine,
        locked_to_deployment_id, parent_run_id, root_run_id, depth, batch_id, trigger_function,
        coalesce(resume_parent_on_completion, false), CASE WHEN engine_status = 'QUEUED' THEN now() END,
        coalesce(queue_timestamp, now())
    FROM input
    ON CONFLICT (environment_id, task_identifier, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, created_at
)
INSERT INTO task_run_execution_snapshot (id, run_id, engine_status, run_status, description)
SELECT i.snapshot_id, i.id, i.engine_status, i.status, i.description
FROM input i JOIN runs r ON r.id = i.id
RETURNING run_id
"""


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return list(value)
    return value



@dataclass(frozen=True, slots=True)
class EnsuredEnvironment:
    """The rows :meth:`Repository.ensure_environment` found or made."""
    org_id: str
    project_id: str
    worker_group_id: str
    token_generation: int
    env_id: str
    concurrency_limit: int
    api_key_generation: int
    env_type: str

class Repository:
    """Queries over one psycopg connection pool."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.waitpoints = WaitpointRepository(pool)

    @classmethod
    async def open(cls, database_url: str, *, min_size: int = 2, max_size: int = 8,
                   acquire_timeout_s: float = 10.0) -> Repository:
        """A pool of ``max_size`` connections. A caller waits at most ``acquire_timeout_s`` for
        one (PostgreSQL down: PoolTimeout, answered 503 by the API, never a hang), and a new
        connection gives up after 5 s (a host that drops packets)."""
        pool = AsyncConnectionPool(
            database_url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True, "prepare_threshold": 0, "connect_timeout": 5},
            timeout=acquire_timeout_s,
            open=False,
        )
        try:
            await pool.open(wait=True, timeout=30)
        except BaseException:  # cancelled or unreachable: no pool workers left behind
            await asyncio.shield(pool.close())
            raise
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("SELECT 1")

    # --- runs -------------------------------------------------------------------------------

    async def insert_runs(self, runs: Sequence[NewRun]) -> set[str]:
        """Insert runs with their first snapshots; the ids inserted. A run whose idempotency key
        (environment, task, key) is taken is skipped: see :meth:`runs_by_idempotency_key`."""
        rows = [{name: _jsonable(getattr(r, name)) for name in NewRun.__slots__} for r in runs]
        async with self.pool.connection() as conn:
            cur = await conn.execute(_INSERT_RUNS_SQL, {"rows": Jsonb(rows)})
            return {r[0] for r in await cur.fetchall()}

    async def release_expired_idempotency_keys(self, env_id: str, keys: Sequence[tuple[str, str]],
                                               now: datetime) -> None:
        """Free (task, key) pairs whose runs' idempotency TTL has passed, so a new run may take them."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """UPDATE task_run r SET idempotency_key = NULL
                   FROM (SELECT unnest(%s::text[]) AS task, unnest(%s::text[]) AS key) k
                   WHERE r.environment_id = %s AND r.task_identifier = k.task AND r.idempotency_key = k.key
                     AND r.idempotency_key_expires_at <= %s""",
                ([t for t, _ in keys], [k for _, k in keys], env_id, now))

    async def runs_by_idempotency_key(self, env_id: str,
                                      keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], RunRow]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT r.* FROM task_run r
                   JOIN (SELECT unnest(%s::text[]) AS task, unnest(%s::text[]) AS key) k
                     ON r.task_identifier = k.task AND r.idempotency_key = k.key
                   WHERE r.environment_id = %s""",
                ([t for t, _ in keys], [k for _, k in keys], env_id))
            return {(r["task_identifier"], r["idempotency_key"]): _run(r) for r in await cur.fetchall()}

    # --- schedules ------------------------------------------------------------------------------

    async def upsert_schedule(self, row: dict[str, Any]) -> dict[str, Any]:
        """Insert a schedule, or update the one with the same (environment, deduplication key)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """INSERT INTO task_schedule (id, environment_id, task_identifier, cron, timezone, external_id,
                                              deduplication_key, active, next_run_at, type)
                   VALUES (%(id)s, %(environment_id)s, %(task_identifier)s, %(cron)s, %(timezone)s, %(external_id)s,
                           %(deduplication_key)s, true, %(next_run_at)s, %(type)s)
                   ON CONFLICT (environment_id, deduplication_key) WHERE deduplication_key IS NOT NULL DO UPDATE
                       SET task_identifier = EXCLUDED.task_identifier, cron = EXCLUDED.cron,
                           timezone = EXCLUDED.timezone, external_id = EXCLUDED.external_id,
                           next_run_at = CASE WHEN task_schedule.cron = EXCLUDED.cron
                                               AND task_schedule.timezone = EXCLUDED.timezone
                                              THEN task_schedule.next_run_at ELSE EXCLUDED.next_run_at END,
                           updated_at = now()
                   RETURNING *""", row)
            out = await cur.fetchone()
        assert out is not None
        return out

    async def get_schedule(self, schedule_id: str, env_id: str | None = None) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_schedule WHERE id = %s AND (%s::text IS NULL OR environment_id = %s)",
                              (schedule_id, env_id, env_id))
            return await cur.fetchone()

    async def list_schedules(self, env_id: str, limit: int, after: tuple[datetime, str] | None) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_schedule WHERE environment_id = %(env)s
                     AND (%(ts)s::timestamptz IS NULL OR (created_at, id) < (%(ts)s, %(id)s))
                   ORDER BY created_at DESC, id DESC LIMIT %(limit)s""",
                {"env": env_id, "ts": after[0] if after else None, "id": after[1] if after else None, "limit": limit})
            return list(await cur.fetchall())

    async def delete_schedule(self, schedule_id: str, env_id: str) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute("DELETE FROM task_schedule WHERE id = %s AND environment_id = %s",
                                     (schedule_id, env_id))
            return cur.rowcount > 0

    async def set_schedule_active(self, schedule_id: str, env_id: str, active: bool,
                                  next_run_at: datetime | None) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE task_schedule SET active = %s, next_run_at = %s, updated_at = now()
                   WHERE id = %s AND environment_id = %s RETURNING *""",
                (active, next_run_at, schedule_id, env_id))
            return await cur.fetchone()

    async def delete_declarative_schedules(self, env_id: str, keep: Sequence[str]) -> None:
        """Remove the declarative schedules of tasks that no longer declare a cron."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """DELETE FROM task_schedule WHERE environment_id = %s AND type = 'DECLARATIVE'
                     AND NOT (deduplication_key = ANY(%s))""", (env_id, list(keep)))

    async def due_schedules(self, now: datetime, limit: int) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT * FROM task_schedule WHERE active AND next_run_at <= %s ORDER BY next_run_at LIMIT %s",
                (now, limit))
            return list(await cur.fetchall())

    async def advance_schedule(self, schedule_id: str, fired_at: datetime, next_run_at: datetime) -> bool:
        """Move the schedule past ``fired_at`` (only if nobody did yet): compare-and-set."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE task_schedule SET last_run_at = %s, next_run_at = %s
                   WHERE id = %s AND next_run_at = %s""", (fired_at, next_run_at, schedule_id, fired_at))
            return cur.rowcount > 0

    # --- leader lease, reconciler, retention ---------------------------------------------------

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
                """SELECT to_jsonb(r.*) AS run, to_jsonb(s.*) AS snapshot FROM task_run r
                   CROSS JOIN LATERAL (SELECT * FROM task_run_execution_snapshot
                                       WHERE run_id = r.id AND is_valid ORDER BY seq DESC LIMIT 1) s
                   WHERE r.status IN ('DEQUEUED', 'EXECUTING', 'WAITING') AND r.id > %s
                     AND r.updated_at < now() - make_interval(secs => %s)
                   ORDER BY r.id LIMIT %s""", (after_id, older_than_s, limit))
            return [(_run_from_json(row["run"]), _snapshot_from_json(row["snapshot"])) for row in await cur.fetchall()]

    async def not_started_runs_page(self, after_id: str, limit: int) -> list[RunRow]:
        """DELAYED runs, and runs with a TTL that have not started (their engine jobs)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run
                   WHERE id > %s AND (status = 'DELAYED' OR (ttl_s IS NOT NULL AND attempt_number = 0
                         AND status IN ('QUEUED', 'PENDING_VERSION')))
                   ORDER BY id LIMIT %s""", (after_id, limit))
            return [_run(r) for r in await cur.fetchall()]

    async def queued_runs_page(self, after_id: str, older_than_s: float, limit: int) -> list[RunRow]:
        """Runs the API shows as QUEUED (latest snapshot QUEUED or QUEUED_EXECUTING), untouched for
        ``older_than_s``, by id after ``after_id``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_run
                   WHERE status = 'QUEUED' AND id > %s AND updated_at < now() - make_interval(secs => %s)
                   ORDER BY id LIMIT %s""", (after_id, older_than_s, limit))
            return [_run(r) for r in await cur.fetchall()]

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

    async def slot_holders(self, run_ids: Sequence[str]) -> dict[str, str]:
        """run id → latest execution status, for runs that may hold a queue slot."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT r.id, s.engine_status FROM task_run r
                   CROSS JOIN LATERAL (SELECT engine_status FROM task_run_execution_snapshot
                                       WHERE run_id = r.id AND is_valid ORDER BY seq DESC LIMIT 1) s
                   WHERE r.id = ANY(%s)""", (list(run_ids),))
            return {r[0]: r[1] for r in await cur.fetchall()}

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
                """SELECT id, environment_id FROM task_run WHERE finished_at < now() - make_interval(secs => %s)
                   ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED""", (age_s, limit))
            doomed = [(env_id, run_id) for run_id, env_id in await cur.fetchall()]
            if doomed:
                await forget(doomed)
                await conn.execute("DELETE FROM task_run WHERE id = ANY(%s)", ([run_id for _, run_id in doomed],))
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """WITH doomed AS (SELECT id FROM waitpoint w WHERE status = 'COMPLETED'
                                     AND completed_at < now() - make_interval(secs => %s)
                                     AND NOT EXISTS (SELECT 1 FROM task_run_journal j WHERE j.waitpoint_id = w.id)
                                     AND NOT EXISTS (SELECT 1 FROM task_run_waitpoint b WHERE b.waitpoint_id = w.id)
                                   LIMIT %s FOR UPDATE SKIP LOCKED)
                   DELETE FROM waitpoint WHERE id IN (SELECT id FROM doomed)""", (age_s, limit))
            return len(doomed) + cur.rowcount

    async def set_env_max_queue_length(self, env_id: str, limit: int | None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE runtime_environment SET max_queue_length = %s WHERE id = %s", (limit, env_id))

    async def set_metadata(self, run_id: str, metadata: Any) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET metadata = %s, updated_at = now() WHERE id = %s",
                               (Jsonb(metadata), run_id))

    async def add_tags(self, run_id: str, tags: Sequence[str], limit: int) -> list[str] | None:
        """Add tags (kept once, in order); ``None`` if the run would have more than ``limit``."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """UPDATE task_run SET tags = merged.tags, updated_at = now()
                   FROM (SELECT array(SELECT t FROM unnest(r.tags || %s::text[]) WITH ORDINALITY u(t, n)
                                      GROUP BY t ORDER BY min(n)) AS tags
                         FROM task_run r WHERE r.id = %s) merged
                   WHERE id = %s AND cardinality(merged.tags) <= %s
                   RETURNING task_run.tags""", (list(tags), run_id, run_id, limit))
            row = await cur.fetchone()
        return list(row[0]) if row else None

    async def set_delay_until(self, run_id: str, when: datetime) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE task_run SET delay_until = %s, queue_timestamp = %s, updated_at = now() "
                               "WHERE id = %s", (when, when, run_id))

    async def transition_many(self, transitions: Sequence[Transition]) -> list[TransitionResult]:
        rows = [
            {"ord": i, "run_id": x.run_id, "new_id": x.new_snapshot_id, "engine_status": x.engine_status,
             "run_status": x.run_status, "froms": ",".join(x.from_statuses), "expected": x.expected_snapshot_id,
             "description": x.description, "attempt_delta": x.attempt_delta, "set_started": x.set_started,
             "set_finished": x.set_finished, "reopen": x.reopen, "output": x.output, "output_type": x.output_type,
             "error": x.error, "worker_id": x.worker_id, "checkpoint_id": x.checkpoint_id,
             "completed": list(x.completed_waitpoint_ids) or None, "resume": x.resume_checkpoint}
            for i, x in enumerate(transitions)
        ]
        params = {"rows": Jsonb(rows)}
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_TRANSITION_SQL, params)
            rows = await cur.fetchall()
        results = []
        for row in rows:
            snap = row["t_snapshot"]
            run = row["t_run"]
            results.append(
                TransitionResult(
                    run_id=row["t_run_id"],
                    applied=snap is not None,
                    latest_snapshot_id=snap["id"] if snap else row["t_latest_id"],
                    latest_status=snap["engine_status"] if snap else row["t_latest_status"],
                    snapshot=_snapshot_from_json(snap) if snap else None,
                    run=_run_from_json(run) if run else None,
                )
            )
        return results

    async def get_run(self, run_id: str, env_id: str | None = None) -> RunRow | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            if env_id is None:
                await cur.execute("SELECT * FROM task_run WHERE id = %s", (run_id,))
            else:
                await cur.execute(
                    "SELECT * FROM task_run WHERE id = %s AND environment_id = %s", (run_id, env_id)
                )
            row = await cur.fetchone()
        return _run(row) if row else None

    async def latest_snapshot(self, run_id: str) -> Snapshot | None:
        async with self.pool.connection() as conn:
            return await self._latest_snapshot(conn, run_id)

    @staticmethod
    async def _latest_snapshot(conn: AsyncConnection[Any], run_id: str) -> Snapshot | None:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(
            """SELECT * FROM task_run_execution_snapshot
               WHERE run_id = %s AND is_valid ORDER BY seq DESC LIMIT 1""",
            (run_id,),
        )
        row = await cur.fetchone()
        return _snapshot(row) if row else None

    async def snapshots(self, run_id: str) -> list[Snapshot]:
        """Every snapshot of a run, oldest first (the audit log)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT * FROM task_run_execution_snapshot WHERE run_id = %s ORDER BY seq", (run_id,)
            )
            return [_snapshot(r) for r in await cur.fetchall()]

    async def pending_version_runs(self, env_id: str, worker_group_id: str, tasks: Sequence[str]) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id FROM task_run
                   WHERE environment_id = %s AND worker_group_id = %s
                     AND status = 'PENDING_VERSION' AND task_identifier = ANY(%s)
                   ORDER BY created_at""",
                (env_id, worker_group_id, list(tasks)),
            )
            return [r[0] for r in await cur.fetchall()]

    # --- tenancy and deployments ------------------------------------------------------------

    async def ensure_environment(
        self,
        *,
        org_slug: str,
        project_slug: str,
        env_slug: str,
        env_type: str,
        api_key_hash: str,
        worker_group_token_hash: str,
        concurrency_limit: int,
        ids: dict[str, str],
    ) -> EnsuredEnvironment:
        """Create what is missing of org → project → env (+ the project's default worker group);
        return their ids. ``ids`` holds fresh ids to use for rows that get created."""
        async with self.pool.connection() as conn, conn.transaction():
            org = await (
                await conn.execute(
                    """INSERT INTO organization (id, slug, title) VALUES (%s, %s, %s)
                       ON CONFLICT (slug) DO UPDATE SET slug = EXCLUDED.slug RETURNING id""",
                    (ids["org"], org_slug, org_slug),
                )
            ).fetchone()
            assert org is not None
            project = await (
                await conn.execute(
                    """INSERT INTO project (id, organization_id, slug, title) VALUES (%s, %s, %s, %s)
                       ON CONFLICT (organization_id, slug) DO UPDATE SET slug = EXCLUDED.slug RETURNING id""",
                    (ids["project"], org[0], project_slug, project_slug),
                )
            ).fetchone()
            assert project is not None
            wg = await (
                await conn.execute(
                    "SELECT id, token_generation FROM worker_group WHERE project_id = %s AND name = 'main'",
                    (project[0],)
                )
            ).fetchone()
            if wg is None:
                wg = await (
                    await conn.execute(
                        """INSERT INTO worker_group (id, name, project_id, token_hash, master_queue)
                           VALUES (%s, 'main', %s, %s, %s) RETURNING id, token_generation""",
                        (ids["worker_group"], project[0], worker_group_token_hash, ids["worker_group"]),
                    )
                ).fetchone()
            assert wg is not None
            env = await (
                await conn.execute(
                    """INSERT INTO runtime_environment
                           (id, project_id, type, slug, api_key_hash, concurrency_limit, default_worker_group_id)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)
                       ON CONFLICT (project_id, slug) DO UPDATE SET slug = EXCLUDED.slug
                       RETURNING id, concurrency_limit, api_key_generation, type""",
                    (ids["env"], project[0], env_type, env_slug, api_key_hash, concurrency_limit, wg[0]),
                )
            ).fetchone()
            assert env is not None
        return EnsuredEnvironment(org_id=org[0], project_id=project[0], worker_group_id=wg[0],
                                  token_generation=int(wg[1]), env_id=env[0], concurrency_limit=int(env[1]),
                                  api_key_generation=int(env[2]), env_type=env[3])

    async def environment(self, env_id: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM runtime_environment WHERE id = %s", (env_id,))
            return await cur.fetchone()

    async def register_deployment(
        self,
        *,
        deployment_id: str,
        env_id: str,
        worker_group_id: str,
        version: str,
        content_hash: str,
        tasks: Sequence[dict[str, Any]],
        queues: Sequence[dict[str, Any]],
        queue_ids: Sequence[str],
    ) -> tuple[str, bool]:
        """Record a deployment and make it current; upsert its queues. Returns (id, created).

        Registering the same content again returns the existing deployment."""
        async with self.pool.connection() as conn, conn.transaction():
            existing = await (
                await conn.execute(
                    """SELECT id, version FROM deployment
                       WHERE environment_id = %s AND worker_group_id = %s AND content_hash = %s
                       ORDER BY created_at DESC LIMIT 1""",
                    (env_id, worker_group_id, content_hash),
                )
            ).fetchone()
            created = existing is None
            dep_id = deployment_id if existing is None else existing[0]
            if created and await (await conn.execute(
                    "SELECT 1 FROM deployment WHERE environment_id = %s AND worker_group_id = %s AND version = %s",
                    (env_id, worker_group_id, version))).fetchone():
                raise ConflictError("deployment.version", f"version {version!r} is already deployed with other "
                                                          "tasks; give this deployment a new version")
            await conn.execute(
                "UPDATE deployment SET is_current = false"
                " WHERE environment_id = %s AND worker_group_id = %s AND is_current AND id <> %s",
                (env_id, worker_group_id, dep_id),
            )
            if created:
                await conn.execute(
                    """INSERT INTO deployment (id, environment_id, worker_group_id, version, content_hash, tasks,
                                               queues, is_current)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, true)""",
                    (dep_id, env_id, worker_group_id, version, content_hash, Jsonb(list(tasks)), Jsonb(list(queues))),
                )
                cur = conn.cursor()
                await cur.executemany(
                    """INSERT INTO deployment_task (deployment_id, environment_id, task_identifier, queue_name, retry,
                                                    max_duration_s, machine)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                    [
                        (dep_id, env_id, t["id"], t["queue"], Jsonb(t.get("retry")) if t.get("retry") else None,
                         t.get("maxDuration"), t.get("machine"))
                        for t in tasks
                    ],
                )
            else:
                await conn.execute("UPDATE deployment SET is_current = true WHERE id = %s", (dep_id,))
            for queue, queue_id in zip(queues, queue_ids, strict=True):
                await conn.execute(
                    """INSERT INTO task_queue (id, environment_id, name, type, concurrency_limit, rate_limit)
                       VALUES (%s, %s, %s, %s, %s, %s)
                       ON CONFLICT (environment_id, name) DO UPDATE
                           SET concurrency_limit = EXCLUDED.concurrency_limit, rate_limit = EXCLUDED.rate_limit""",
                    (queue_id, env_id, queue["name"], queue.get("type", "task"), queue.get("concurrencyLimit"),
                     Jsonb(queue["rateLimit"]) if queue.get("rateLimit") else None),
                )
        return dep_id, created

    async def current_task(self, env_id: str, worker_group_id: str, task_id: str) -> dict[str, Any] | None:
        """The task as the current deployment of (env, group) declares it, or None."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT dt.*, d.version FROM deployment_task dt
                   JOIN deployment d ON d.id = dt.deployment_id
                   WHERE d.environment_id = %s AND d.worker_group_id = %s AND d.is_current
                     AND dt.task_identifier = %s""",
                (env_id, worker_group_id, task_id),
            )
            return await cur.fetchone()

    async def deployment_tasks(self, deployment_ids: Sequence[str]) -> dict[str, tuple[str, frozenset[str]]]:
        """deployment id → (environment id, the tasks it has)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT deployment_id, environment_id, array_agg(task_identifier) FROM deployment_task
                   WHERE deployment_id = ANY(%s) GROUP BY deployment_id, environment_id""", (list(deployment_ids),))
            return {r[0]: (r[1], frozenset(r[2])) for r in await cur.fetchall()}

    async def deployment_task(self, deployment_id: str, task_id: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT * FROM deployment_task WHERE deployment_id = %s AND task_identifier = %s",
                (deployment_id, task_id),
            )
            return await cur.fetchone()

    async def task_queue(self, env_id: str, name: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE environment_id = %s AND name = %s", (env_id, name))
            return await cur.fetchone()

    async def ensure_queue(self, queue_id: str, env_id: str, name: str,
                           concurrency_limit: int | None) -> dict[str, Any]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """INSERT INTO task_queue (id, environment_id, name, type, concurrency_limit)
                   VALUES (%s, %s, %s, 'custom', %s)
                   ON CONFLICT (environment_id, name) DO UPDATE
                       SET concurrency_limit = coalesce(EXCLUDED.concurrency_limit, task_queue.concurrency_limit)
                   RETURNING *""",
                (queue_id, env_id, name, concurrency_limit),
            )
            row = await cur.fetchone()
            assert row is not None
            return row

    async def set_queue_paused(self, env_id: str, name: str, paused: bool) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE task_queue SET paused = %s WHERE environment_id = %s AND name = %s", (paused, env_id, name)
            )
            return cur.rowcount > 0

    async def assign_deployment(self, run_ids: Sequence[str], deployment_id: str, queue_of: dict[str, str]) -> None:
        """Lock PENDING_VERSION (or due DELAYED) runs to the deployment that can run them; runs put in
        their task's default queue move to the queue the deployment declares for the task."""
        async with self.pool.connection() as conn:
            await conn.execute(
                """UPDATE task_run r SET locked_to_deployment_id = %(dep)s,
                       queue = CASE WHEN r.queue = 'task/' || r.task_identifier
                                    THEN coalesce((%(queues)s::jsonb) ->> r.task_identifier, r.queue)
                                    ELSE r.queue END
                   WHERE r.id = ANY(%(ids)s) AND r.status IN ('PENDING_VERSION', 'DELAYED')""",
                {"dep": deployment_id, "queues": Jsonb(queue_of), "ids": list(run_ids)},
            )

    # --- API support ----------------------------------------------------------------------

    async def environment_by_key_hash(self, key_hash: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT e.*, p.organization_id FROM runtime_environment e
                   JOIN project p ON p.id = e.project_id WHERE e.api_key_hash = %s""",
                (key_hash,),
            )
            return await cur.fetchone()

    async def worker_group_by_token_hash(self, token_hash: str) -> dict[str, Any] | None:
        """The worker group of a token, with ``scoped_environment_id``: the one environment an
        environment-scoped token serves, or None for the group's own token."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT g.*, NULL::text AS scoped_environment_id FROM worker_group g WHERE g.token_hash = %(h)s
                   UNION ALL
                   SELECT g.*, t.environment_id FROM worker_group_env_token t
                   JOIN worker_group g ON g.id = t.worker_group_id WHERE t.token_hash = %(h)s
                   LIMIT 1""", {"h": token_hash})
            return await cur.fetchone()

    async def env_worker_token_generation(self, group_id: str, env_id: str) -> int:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                "SELECT generation FROM worker_group_env_token WHERE worker_group_id = %s AND environment_id = %s",
                (group_id, env_id))).fetchone()
            return int(row[0]) if row else 0

    async def set_env_worker_token(self, group_id: str, env_id: str, generation: int, token_hash: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(
                """INSERT INTO worker_group_env_token (worker_group_id, environment_id, generation, token_hash)
                   VALUES (%s, %s, %s, %s)
                   ON CONFLICT (worker_group_id, environment_id) DO UPDATE
                       SET generation = EXCLUDED.generation, token_hash = EXCLUDED.token_hash""",
                (group_id, env_id, generation, token_hash))

    async def bump_api_key_generation(self, env_id: str) -> tuple[int, str] | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                """UPDATE runtime_environment SET api_key_generation = api_key_generation + 1
                   WHERE id = %s RETURNING api_key_generation, type""", (env_id,))).fetchone()
            return (int(row[0]), str(row[1])) if row else None

    async def bump_worker_group_token_generation(self, group_id: str) -> int | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                "UPDATE worker_group SET token_generation = token_generation + 1 WHERE id = %s "
                "RETURNING token_generation", (group_id,))).fetchone()
            return int(row[0]) if row else None

    async def environment_by_slugs(self, org_slug: str, project_slug: str, env_slug: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT e.* FROM runtime_environment e JOIN project p ON p.id = e.project_id
                   JOIN organization o ON o.id = p.organization_id
                   WHERE o.slug = %s AND p.slug = %s AND e.slug = %s""", (org_slug, project_slug, env_slug))
            return await cur.fetchone()

    async def worker_group_by_name(self, project_id: str, name: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM worker_group WHERE project_id = %s AND name = %s", (project_id, name))
            return await cur.fetchone()

    async def environments_of_worker_group(self, worker_group_id: str) -> list[dict[str, Any]]:
        """Environments a group serves: those whose default group it is, or every environment of
        its project."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT e.* FROM runtime_environment e
                   JOIN worker_group g ON g.id = %s
                   WHERE e.default_worker_group_id = g.id OR e.project_id = g.project_id
                   ORDER BY e.created_at""",
                (worker_group_id,),
            )
            return list(await cur.fetchall())

    async def create_worker_group(self, group_id: str, name: str, project_id: str | None, token_hash: str,
                                  make_default: bool) -> dict[str, Any]:
        async with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """INSERT INTO worker_group (id, name, project_id, token_hash, master_queue)
                   VALUES (%s, %s, %s, %s, %s) RETURNING *""",
                (group_id, name, project_id, token_hash, group_id),
            )
            row = await cur.fetchone()
            assert row is not None
            if make_default and project_id:
                await conn.execute(
                    "UPDATE runtime_environment SET default_worker_group_id = %s WHERE project_id = %s",
                    (group_id, project_id),
                )
            return row

    async def project_by_slug(self, org_slug: str, project_slug: str) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT p.* FROM project p JOIN organization o ON o.id = p.organization_id
                   WHERE o.slug = %s AND p.slug = %s""",
                (org_slug, project_slug),
            )
            return await cur.fetchone()

    async def rotate_api_key(self, env_id: str, key_hash: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE runtime_environment SET api_key_hash = %s WHERE id = %s", (key_hash, env_id))

    async def rotate_worker_group_token(self, group_id: str, token_hash: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE worker_group SET token_hash = %s WHERE id = %s", (token_hash, group_id))

    async def upsert_worker_instance(self, instance_id: str, worker_group_id: str, name: str) -> str:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """INSERT INTO worker_instance (id, worker_group_id, name) VALUES (%s, %s, %s)
                   ON CONFLICT (worker_group_id, name) DO UPDATE SET last_heartbeat_at = now()
                   RETURNING id""",
                (instance_id, worker_group_id, name),
            )
            row = await cur.fetchone()
            assert row is not None
            return str(row[0])

    async def touch_worker_instance(self, worker_group_id: str, name: str) -> bool:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE worker_instance SET last_heartbeat_at = now() WHERE worker_group_id = %s AND name = %s",
                (worker_group_id, name),
            )
            return cur.rowcount > 0

    async def list_runs(self, env_id: str, *, statuses: Sequence[str] = (), tasks: Sequence[str] = (),
                        tags: Sequence[str] = (), queues: Sequence[str] = (), batches: Sequence[str] = (),
                        limit: int = 25, after: tuple[datetime, str] | None = None) -> list[RunRow]:
        """Newest first; ``after`` is the (created_at, id) of the last run of the previous page."""
        where = ["environment_id = %(env)s"]
        params: dict[str, Any] = {"env": env_id, "limit": limit}
        for column, values, name in (("status", statuses, "st"), ("task_identifier", tasks, "tk"),
                                     ("queue", queues, "qu"), ("batch_id", batches, "ba")):
            if values:
                where.append(f"{column} = ANY(%({name})s)")
                params[name] = list(values)
        if tags:
            where.append("tags && %(tags)s")
            params["tags"] = list(tags)
        if after is not None:
            where.append("(created_at, id) < (%(after_ts)s, %(after_id)s)")
            params["after_ts"], params["after_id"] = after
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                f"SELECT * FROM task_run WHERE {' AND '.join(where)} ORDER BY created_at DESC, id DESC LIMIT %(limit)s",
                params,
            )
            return [_run(r) for r in await cur.fetchall()]

    async def child_runs(self, run_id: str) -> list[str]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id FROM task_run WHERE parent_run_id = %s ORDER BY created_at LIMIT 100", (run_id,))
            return [r[0] for r in await cur.fetchall()]

    async def list_queues(self, env_id: str) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE environment_id = %s ORDER BY name", (env_id,))
            return list(await cur.fetchall())

    async def set_queue_override(self, env_id: str, name: str, limit: int | None) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE task_queue SET concurrency_limit_override = %s
                   WHERE environment_id = %s AND name = %s RETURNING *""",
                (limit, env_id, name),
            )
            return await cur.fetchone()

    async def insert_batch(self, batch_id: str, env_id: str, size: int, parent_run_id: str | None = None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO batch_task_run (id, environment_id, size, parent_run_id) VALUES (%s, %s, %s, %s)",
                (batch_id, env_id, size, parent_run_id))

    async def waiting_children(self, run_id: str) -> list[str]:
        """Unfinished children whose completion the run waits for (cancel cascades to them)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT id FROM task_run WHERE parent_run_id = %s AND resume_parent_on_completion
                     AND finished_at IS NULL""", (run_id,))
            return [r[0] for r in await cur.fetchall()]
