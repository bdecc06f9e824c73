"""Deployments, the tasks they declare, and task queues."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from run_engine.db.rows import from_row, from_row_or_none
from run_engine.errors import ConflictError, UnprocessableError

#: rounds of :meth:`DeploymentRepository.queue_names` (metrics): environments of few queues leave their
#: share to the others, read in the next round
QUEUE_SHARE_ROUNDS = 4

#: the first key of the advisory lock that makes one environment's deployment registrations take
#: turns (the second is the environment id's hash)
_DEPLOY_LOCK_CLASS = 0x4445504C  # "DEPL"


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """``limit`` runs per ``period_ms``, at most ``burst`` back to back."""

    limit: int
    period_ms: int
    burst: int = 1

    def stored(self) -> dict[str, int]:
        """The form task_queue.rate_limit holds."""
        return {"limit": self.limit, "periodMs": self.period_ms, "burst": self.burst}

    @classmethod
    def from_stored(cls, data: Mapping[str, Any] | None) -> RateLimitSpec | None:
        return None if not data else cls(int(data["limit"]), int(data["periodMs"]), int(data.get("burst", 1)))


def queue_type(name: str) -> str:
    """A task's own queue (``task/<id>``) is ``task``; any queue a user names is ``custom``."""
    return "task" if name.startswith("task/") else "custom"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue as a deployment declares it (``type``: see :func:`queue_type`)."""

    name: str
    type: str = "task"
    concurrency_limit: int | None = None
    rate_limit: RateLimitSpec | None = None


@dataclass(frozen=True, slots=True)
class CronSpec:
    pattern: str
    timezone: str = "UTC"


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A task as a deployment declares it; ``retry`` is a retry policy's stored options (see
    :meth:`RetryPolicy.from_json`)."""

    id: str
    queue: str | None = None
    retry: dict[str, Any] | None = None
    max_duration_s: int | None = None
    machine: str | None = None
    cron: CronSpec | None = None

    @property
    def queue_name(self) -> str:
        """Its queue: the declared one, else its own ``task/<id>``."""
        return self.queue or f"task/{self.id}"


@dataclass(frozen=True, slots=True)
class DeploymentTask:
    """A task of a deployment (``version``: the deployment's, when read as the current one)."""

    deployment_id: str
    env_id: str
    task_id: str
    queue_name: str
    retry: dict[str, Any] | None
    max_duration_s: int | None
    machine: str | None
    version: str | None = None


@dataclass(frozen=True, slots=True)
class TaskQueue:
    id: str
    env_id: str
    name: str
    type: str
    concurrency_limit: int | None
    concurrency_limit_override: int | None
    concurrency_key_limit: int | None
    rate_limit: RateLimitSpec | None
    paused: bool
    created_at: datetime
    #: moved on by every change of the settings above (PostgreSQL's clock in µs, and always more than
    #: the one before: migration 0034's trigger); the run queue keeps the newest copy it was given
    settings_version: int = 0

    @property
    def effective_limit(self) -> int | None:
        """The override when one is set, else the deployed limit."""
        return self.concurrency_limit if self.concurrency_limit_override is None else self.concurrency_limit_override


def _queue(row: Mapping[str, Any]) -> TaskQueue:
    return from_row(TaskQueue, {**row, "rate_limit": RateLimitSpec.from_stored(row["rate_limit"])})


@dataclass(frozen=True, slots=True)
class DeploymentDecl:
    """A deployment as it was declared (its tasks with their settings and crons, its queues)."""

    id: str
    worker_group_id: str
    version: str
    is_current: bool
    tasks: tuple[TaskSpec, ...]
    queues: tuple[QueueSpec, ...]


def _stored_cron(value: Any) -> CronSpec | None:
    """A task's cron as deployment.tasks holds it: ``{"pattern", "timezone"}``, or (written by the
    versions before 059ff40) the pattern alone; "" declares none."""
    if isinstance(value, dict) and value.get("pattern"):
        return CronSpec(str(value["pattern"]), str(value.get("timezone") or "UTC"))
    if isinstance(value, str) and value:
        return CronSpec(value)
    return None


def _stored_queue(value: Mapping[str, Any]) -> QueueSpec:
    """A queue as deployment.queues holds it (the fields of :class:`QueueSpec`; the versions before
    059ff40 kept the worker's camelCase declaration)."""
    name = str(value["name"])
    limit = value.get("concurrency_limit", value.get("concurrencyLimit"))
    rate = value.get("rate_limit") or value.get("rateLimit")
    return QueueSpec(
        name, str(value.get("type") or queue_type(name)), None if limit is None else int(limit),
        None if not isinstance(rate, dict) else RateLimitSpec(
            int(rate["limit"]), int(rate.get("period_ms") or rate.get("periodMs") or 0), int(rate.get("burst", 1))))


class DeploymentRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def register_deployment(
        self,
        *,
        deployment_id: str,
        env_id: str,
        worker_group_id: str,
        version: str,
        content_hash: str,
        tasks: Sequence[TaskSpec],
        queues: Sequence[QueueSpec],
        queue_ids: Sequence[str],
        max_queues: int | None = None,
    ) -> tuple[str, bool, str, bool]:
        """Record a deployment and upsert its queues; make it current when it is new, or when no
        current deployment was made current after it was. Returns (id, created, its version,
        current).

        Registering the same content again returns the existing deployment (with the version it
        was registered with, whatever ``version`` this call gives). It is current again only when no
        deployment made current at or after it was is current (or none is): a worker of the version
        before connecting again during a rolling deploy (a restart, a dropped connection) leaves the
        newer deployment current, and a worker of a newer version connecting again leaves a
        deployment :meth:`make_current` promoted since current; in both cases its queues' settings
        stay as they are (it adds the queues the environment lacks, no more) and its crons to the
        current one. That order is ``made_current_at`` (migration 0051), the clock read under the
        lock below whenever a deployment becomes current. The registrations (and promotes) of one
        environment take turns (a transaction-scoped advisory lock on it), so that two at once both
        succeed, the later one current, and count each other's queues. A deployment whose queues
        the environment does not have would take it past ``max_queues`` is refused
        (:class:`UnprocessableError` ``too_many_queues``) with nothing written."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_DEPLOY_LOCK_CLASS, env_id))
            await self._check_queue_room(conn, env_id, [q.name for q in queues], max_queues)
            existing = await (
                await conn.execute(
                    """SELECT d.id, d.version, d.is_current OR NOT EXISTS (
                                  SELECT 1 FROM deployment c
                                  WHERE c.environment_id = d.environment_id AND c.worker_group_id = d.worker_group_id
                                    AND c.is_current AND c.id <> d.id AND c.made_current_at >= d.made_current_at)
                       FROM deployment d
                       WHERE d.environment_id = %s AND d.worker_group_id = %s AND d.content_hash = %s
                       ORDER BY d.created_at DESC LIMIT 1""",
                    (env_id, worker_group_id, content_hash),
                )
            ).fetchone()
            created = existing is None
            dep_id = deployment_id if existing is None else existing[0]
            version = version if existing is None else existing[1]
            current = True if existing is None else bool(existing[2])
            if created and await (await conn.execute(
                    "SELECT 1 FROM deployment WHERE environment_id = %s AND worker_group_id = %s AND version = %s",
                    (env_id, worker_group_id, version))).fetchone():
                raise ConflictError("deployment.version", f"version {version!r} is already deployed with other "
                                                          "tasks; give this deployment a new version")
            if current:
                await conn.execute(
                    "UPDATE deployment SET is_current = false"
                    " WHERE environment_id = %s AND worker_group_id = %s AND is_current AND id <> %s",
                    (env_id, worker_group_id, dep_id),
                )
            cur = conn.cursor()
            if created:
                # the clock read now, under the lock: the order deployments were made current in
                # (now() is the transaction's start, and one that started first may take the lock last)
                await conn.execute(
                    """INSERT INTO deployment (id, environment_id, worker_group_id, version, content_hash, tasks,
                                               queues, is_current, created_at, made_current_at)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, true, clock_timestamp(), clock_timestamp())""",
                    (dep_id, env_id, worker_group_id, version, content_hash,
                     Jsonb([dataclasses.asdict(t) for t in tasks]), Jsonb([dataclasses.asdict(q) for q in queues])),
                )
                await cur.executemany(
                    """INSERT INTO deployment_task (deployment_id, environment_id, task_identifier, queue_name, retry,
                                                    max_duration_s, machine)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                    [
                        (dep_id, env_id, t.id, t.queue_name, Jsonb(t.retry) if t.retry else None,
                         t.max_duration_s, t.machine)
                        for t in tasks
                    ],
                )
            elif current:
                await conn.execute("UPDATE deployment SET is_current = true, made_current_at = clock_timestamp()"
                                   " WHERE id = %s AND NOT is_current", (dep_id,))
            # a deployment that is not current sets no queue's settings: those are the current one's
            await self._upsert_queues(conn, env_id, queues, queue_ids, settings=current)
        return dep_id, created, version, current

    @staticmethod
    async def _upsert_queues(conn: AsyncConnection[Any], env_id: str, queues: Sequence[QueueSpec],
                             queue_ids: Sequence[str], *, settings: bool) -> None:
        """The queues made where missing; with ``settings``, their declared settings (type, limit,
        rate limit) written over those of queues that exist (an override or a pause is kept)."""
        await conn.cursor().executemany(
            """INSERT INTO task_queue (id, environment_id, name, type, concurrency_limit, rate_limit)
               VALUES (%s, %s, %s, %s, %s, %s)
               ON CONFLICT (environment_id, name) DO UPDATE
                   SET type = EXCLUDED.type, concurrency_limit = EXCLUDED.concurrency_limit,
                       rate_limit = EXCLUDED.rate_limit
                   WHERE %s""",
            [
                (queue_id, env_id, queue.name, queue.type, queue.concurrency_limit,
                 Jsonb(queue.rate_limit.stored()) if queue.rate_limit else None, settings)
                for queue, queue_id in zip(queues, queue_ids, strict=True)
            ],
        )

    async def current_version(self, env_id: str, worker_group_id: str) -> tuple[str, str] | None:
        """(id, version) of the current deployment of (environment, worker group), or None."""
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                "SELECT id, version FROM deployment WHERE environment_id = %s AND worker_group_id = %s AND is_current",
                (env_id, worker_group_id))).fetchone()
        return None if row is None else (row[0], row[1])

    async def deployments_of_version(self, env_id: str, version: str,
                                     worker_group_id: str | None = None) -> list[DeploymentDecl]:
        """The environment's deployments of ``version`` (one per worker group that has it; of
        ``worker_group_id`` only when given), as they were declared, the environment's default
        group's first."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT d.id, d.worker_group_id, d.version, d.is_current, d.tasks, d.queues
                   FROM deployment d JOIN runtime_environment e ON e.id = d.environment_id
                   WHERE d.environment_id = %s AND d.version = %s
                     AND (%s::text IS NULL OR d.worker_group_id = %s)
                   ORDER BY d.worker_group_id = e.default_worker_group_id DESC, d.worker_group_id""",
                (env_id, version, worker_group_id, worker_group_id))
            found = await cur.fetchall()
            if not found:
                return []
            await cur.execute(
                """SELECT deployment_id, task_identifier, queue_name, retry, max_duration_s, machine
                   FROM deployment_task WHERE deployment_id = ANY(%s) ORDER BY deployment_id, task_identifier""",
                ([r["id"] for r in found],))
            task_rows = await cur.fetchall()
        out = []
        for r in found:
            crons = {str(t.get("id")): _stored_cron(t.get("cron")) for t in r["tasks"] or [] if isinstance(t, dict)}
            tasks = tuple(
                TaskSpec(id=t["task_identifier"], queue=t["queue_name"], retry=t["retry"],
                         max_duration_s=t["max_duration_s"], machine=t["machine"], cron=crons.get(t["task_identifier"]))
                for t in task_rows if t["deployment_id"] == r["id"])
            queues = tuple(_stored_queue(q) for q in r["queues"] or [] if isinstance(q, dict) and q.get("name"))
            out.append(DeploymentDecl(r["id"], r["worker_group_id"], r["version"], r["is_current"], tasks, queues))
        return out

    async def make_current(self, env_id: str, deployments: Sequence[tuple[str, Sequence[QueueSpec], Sequence[str]]],
                           max_queues: int | None = None) -> dict[str, bool]:
        """Make each of ``deployments`` (id, its queues, an id for each queue should it be made) of
        ``env_id`` the current one of its worker group (a promote), in one transaction: its queues'
        declared settings written (made where missing) and ``made_current_at`` set, so that a
        worker of the deployment it replaces connecting again leaves it current. Returns, for each
        deployment still there, whether it was made current (False: it was current already, left
        as it was but for its queues' settings, written again). Takes turns with registrations (the
        same lock); refused as they are (``too_many_queues``, nothing written) when its queues
        that the environment lacks would take it past ``max_queues``."""
        out: dict[str, bool] = {}
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_DEPLOY_LOCK_CLASS, env_id))
            await self._check_queue_room(conn, env_id, sorted({q.name for _, qs, _ in deployments for q in qs}),
                                         max_queues)
            for dep_id, queues, queue_ids in deployments:
                row = await (await conn.execute(
                    "SELECT worker_group_id, is_current FROM deployment WHERE id = %s AND environment_id = %s",
                    (dep_id, env_id))).fetchone()
                if row is None:  # deleted with its environment or group meanwhile
                    continue
                worker_group_id, was_current = row
                if not was_current:
                    await conn.execute(
                        "UPDATE deployment SET is_current = false"
                        " WHERE environment_id = %s AND worker_group_id = %s AND is_current AND id <> %s",
                        (env_id, worker_group_id, dep_id))
                    await conn.execute(
                        "UPDATE deployment SET is_current = true, made_current_at = clock_timestamp() WHERE id = %s",
                        (dep_id,))
                await self._upsert_queues(conn, env_id, queues, queue_ids, settings=True)
                out[dep_id] = not was_current
        return out

    @staticmethod
    async def _check_queue_room(conn: AsyncConnection[Any], env_id: str, names: Sequence[str],
                                max_queues: int | None) -> None:
        if max_queues is None or not names:
            return
        row = await (await conn.execute(
            """SELECT count(*), count(*) FILTER (WHERE name = ANY(%s))
               FROM task_queue WHERE environment_id = %s""", (list(names), env_id))).fetchone()
        assert row is not None
        have, declared_have = int(row[0]), int(row[1])
        new = len(set(names)) - declared_have  # a queue it has already costs nothing
        if new > 0 and have + new > max_queues:
            raise UnprocessableError(
                "too_many_queues",
                f"deployment.queues: this deployment declares {new} queues environment {env_id} does not have, "
                f"and it has {have} of the {max_queues} it may have (RUN_ENGINE_MAX_QUEUES_PER_ENV); "
                "nothing was deployed: declare fewer queues or let tasks share them")

    async def current_task(self, env_id: str, worker_group_id: str, task_id: str) -> DeploymentTask | None:
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
            return from_row_or_none(DeploymentTask, await cur.fetchone())

    async def version_task(self, env_id: str, worker_group_id: str, version: str,
                           task_id: str) -> DeploymentTask | None:
        """The task as the deployment of (env, group) with ``version`` declares it (current or
        not), or None when no such deployment has it."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT dt.*, d.version FROM deployment_task dt
                   JOIN deployment d ON d.id = dt.deployment_id
                   WHERE d.environment_id = %s AND d.worker_group_id = %s AND d.version = %s
                     AND dt.task_identifier = %s""",
                (env_id, worker_group_id, version, task_id),
            )
            return from_row_or_none(DeploymentTask, await cur.fetchone())

    async def deployment_tasks(self, deployment_ids: Sequence[str]) -> dict[str, tuple[str, frozenset[str]]]:
        """deployment id → (environment id, the tasks it has)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT deployment_id, environment_id, array_agg(task_identifier) FROM deployment_task
                   WHERE deployment_id = ANY(%s) GROUP BY deployment_id, environment_id""", (list(deployment_ids),))
            return {r[0]: (r[1], frozenset(r[2])) for r in await cur.fetchall()}

    async def task_queues(self, deployment_id: str, *, current: bool = False) -> dict[str, str]:
        """The deployment's tasks, each with the queue it declares for it ({} for none; with
        ``current``, {} too when the deployment is not current)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT dt.task_identifier, dt.queue_name FROM deployment_task dt
                   WHERE dt.deployment_id = %s
                     AND (NOT %s OR EXISTS (SELECT 1 FROM deployment d
                                            WHERE d.id = dt.deployment_id AND d.is_current))""",
                (deployment_id, current))
            return {r[0]: r[1] for r in await cur.fetchall()}

    async def deployment_task(self, deployment_id: str, task_id: str) -> DeploymentTask | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT * FROM deployment_task WHERE deployment_id = %s AND task_identifier = %s",
                (deployment_id, task_id),
            )
            return from_row_or_none(DeploymentTask, await cur.fetchone())

    async def ensure_queue(self, queue_id: str, env_id: str, name: str, concurrency_limit: int | None,
                           max_queues: int | None = None) -> TaskQueue | None:
        """The environment's queue ``name``, made when missing (its limit set when given); None
        when it is missing and the environment has ``max_queues`` already (a soft bound: racing
        creations may pass it by what they add at that moment)."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """INSERT INTO task_queue (id, environment_id, name, type, concurrency_limit)
                   SELECT %(id)s, %(env)s, %(name)s, 'custom', %(limit)s
                   WHERE %(max)s::int IS NULL
                      OR EXISTS (SELECT 1 FROM task_queue WHERE environment_id = %(env)s AND name = %(name)s)
                      OR (SELECT count(*) FROM (SELECT 1 FROM task_queue WHERE environment_id = %(env)s
                                                LIMIT %(max)s) q) < %(max)s
                   ON CONFLICT (environment_id, name) DO UPDATE
                       SET concurrency_limit = coalesce(EXCLUDED.concurrency_limit, task_queue.concurrency_limit)
                   RETURNING *""",
                {"id": queue_id, "env": env_id, "name": name, "limit": concurrency_limit, "max": max_queues},
            )
            row = await cur.fetchone()
            return None if row is None else _queue(row)

    async def task_queue(self, env_id: str, name: str) -> TaskQueue | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE environment_id = %s AND name = %s", (env_id, name))
            row = await cur.fetchone()
            return None if row is None else _queue(row)

    async def queue_by_id(self, env_id: str, queue_id: str) -> TaskQueue | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE id = %s AND environment_id = %s", (queue_id, env_id))
            row = await cur.fetchone()
            return None if row is None else _queue(row)

    async def queues_named(self, env_id: str, names: Sequence[str]) -> list[TaskQueue]:
        """The environment's queues of ``names`` (those it has), by name."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE environment_id = %s AND name = ANY(%s) ORDER BY name",
                              (env_id, list(names)))
            return [_queue(r) for r in await cur.fetchall()]

    async def list_queues(self, env_id: str) -> list[TaskQueue]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE environment_id = %s ORDER BY name", (env_id,))
            return [_queue(r) for r in await cur.fetchall()]

    async def queue_names(self, env_ids: Sequence[str], limit: int) -> tuple[list[tuple[str, str]], bool]:
        """(environment, queue name) of the queues of ``env_ids``, at most ``limit``, shared out
        among the environments: each one's first queues (by name) before any one's next, so that
        an environment of thousands of queues does not crowd the others out (metrics); and whether
        queues were left out. Read in at most :data:`QUEUE_SHARE_ROUNDS` rounds, each of about
        ``limit`` rows plus two per environment still being read."""
        taken: dict[str, list[str]] = {e: [] for e in env_ids}
        reading = list(taken)
        budget = limit
        async with self.pool.connection() as conn:
            for _ in range(QUEUE_SHARE_ROUNDS):
                if not reading or budget <= 0:
                    break
                share = -(-budget // len(reading))  # one more is read: whether there are more
                cur = await conn.execute(
                    """SELECT e.env, q.name FROM unnest(%s::text[], %s::text[]) AS e(env, after)
                       CROSS JOIN LATERAL (SELECT name FROM task_queue
                                           WHERE environment_id = e.env AND (e.after IS NULL OR name > e.after)
                                           ORDER BY name LIMIT %s) q""",
                    (reading, [taken[e][-1] if taken[e] else None for e in reading], share + 1))
                got: dict[str, list[str]] = {}
                for env, name in await cur.fetchall():
                    got.setdefault(str(env), []).append(str(name))
                still = []
                for e in reading:
                    names = got.get(e, [])
                    taken[e] += names[:share]
                    budget -= min(len(names), share)
                    if len(names) > share:
                        still.append(e)
                reading = still
        ranked = sorted((rank, i, env, name) for i, (env, names) in enumerate(taken.items())
                        for rank, name in enumerate(names))
        return [(env, name) for _, _, env, name in ranked[:limit]], bool(reading) or len(ranked) > limit

    async def set_queue_paused(self, env_id: str, name: str, paused: bool) -> TaskQueue | None:
        """The queue as it is once paused (or resumed), with its settings' version; None if missing."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "UPDATE task_queue SET paused = %s WHERE environment_id = %s AND name = %s RETURNING *",
                (paused, env_id, name))
            row = await cur.fetchone()
            return None if row is None else _queue(row)

    async def set_queue_override(self, env_id: str, name: str, limit: int | None) -> TaskQueue | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """UPDATE task_queue SET concurrency_limit_override = %s
                   WHERE environment_id = %s AND name = %s RETURNING *""",
                (limit, env_id, name),
            )
            row = await cur.fetchone()
            return None if row is None else _queue(row)

    async def clock_us(self) -> int:
        """PostgreSQL's clock in µs, the clock of the queues' settings versions."""
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")).fetchone()
            assert row is not None
            return int(row[0])

    async def queues_changed_since(self, since_us: int, after: tuple[int, str] | None,
                                   limit: int) -> list[TaskQueue]:
        """Queues of every environment whose settings changed at or after ``since_us`` (by their
        version), ordered by (version, id), after ``after``."""
        after_version, after_id = after if after is not None else (since_us - 1, "")
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT * FROM task_queue
                   WHERE settings_version >= %s AND (settings_version, id) > (%s, %s)
                   ORDER BY settings_version, id LIMIT %s""", (since_us, after_version, after_id, limit))
            return [_queue(r) for r in await cur.fetchall()]

    async def queues_page(self, after_id: str, limit: int) -> list[TaskQueue]:
        """Queues of every environment, by id after ``after_id``."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM task_queue WHERE id > %s ORDER BY id LIMIT %s", (after_id, limit))
            return [_queue(r) for r in await cur.fetchall()]
