"""Organizations, projects, environments, worker groups, their credentials and instances."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from run_engine.db.rows import from_row, from_row_or_none


@dataclass(frozen=True, slots=True)
class Project:
    id: str
    organization_id: str
    slug: str
    title: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Environment:
    id: str
    project_id: str
    organization_id: str
    type: str
    slug: str
    api_key_hash: str
    api_key_generation: int
    concurrency_limit: int
    max_queue_length: int | None
    default_worker_group_id: str  # the column allows NULL only while ensure_environment creates the rows
    created_at: datetime


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    id: str
    name: str
    project_id: str | None  # None: the shared group
    token_generation: int
    master_queue: str
    created_at: datetime
    # set when the group was found by an environment-scoped token: the one environment it serves
    scoped_env_id: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker group as an environment sees it: its current deployment there and its instances
    (``{"name", "concurrency", "lastHeartbeatAt"}``, the most recently heard first)."""
    id: str
    name: str
    shared: bool
    version: str | None
    deployed_at: datetime | None
    tasks: list[str]
    instances: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class GroupListing:
    """A worker group runs of an environment may be sent to, with its instances
    (``{"name", "concurrency", "lastHeartbeatAt"}``, the most recently heard first)."""
    id: str
    name: str
    shared: bool
    is_default: bool
    instances: list[dict[str, Any]]


#: a worker group's (``g``) most recently heard instances (at most %(limit)s) as a JSON array
#: a group's instances as an environment (``%(env)s``) sees them: not those of a token scoped to
#: another environment of the group (named ``<environment id>/<name>``, see api/worker.py), which
#: would show that environment's id, its supervisors' names and their concurrency
_INSTANCES = """coalesce((SELECT jsonb_agg(jsonb_build_object('name', i.name, 'concurrency', i.concurrency,
                                                       'lastHeartbeatAt', i.last_heartbeat_at)
                                    ORDER BY i.last_heartbeat_at DESC)
                  FROM (SELECT * FROM worker_instance WHERE worker_group_id = g.id
                          AND (split_part(name, '/', 1) !~ '^env_[a-z0-9]{1,64}$' OR split_part(name, '/', 1) = %(env)s)
                        ORDER BY last_heartbeat_at DESC LIMIT %(limit)s) i), '[]') AS instances"""
_ENVIRONMENT = "SELECT e.*, p.organization_id FROM runtime_environment e JOIN project p ON p.id = e.project_id"


@dataclass(frozen=True, slots=True)
class EnsuredEnvironment:
    """The rows :meth:`TenancyRepository.ensure_environment` found or made."""
    org_id: str
    project_id: str
    worker_group_id: str
    token_generation: int
    env_id: str
    concurrency_limit: int
    api_key_generation: int
    env_type: str


class TenancyRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

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

    async def environment(self, env_id: str) -> Environment | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_ENVIRONMENT + " WHERE e.id = %s", (env_id,))
            return from_row_or_none(Environment, await cur.fetchone())

    async def environment_by_key_hash(self, key_hash: str) -> Environment | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_ENVIRONMENT + " WHERE e.api_key_hash = %s", (key_hash,))
            return from_row_or_none(Environment, await cur.fetchone())

    async def environment_by_slugs(self, org_slug: str, project_slug: str, env_slug: str) -> Environment | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                _ENVIRONMENT + """ JOIN organization o ON o.id = p.organization_id
                   WHERE o.slug = %s AND p.slug = %s AND e.slug = %s""", (org_slug, project_slug, env_slug))
            return from_row_or_none(Environment, await cur.fetchone())

    async def project_by_slug(self, org_slug: str, project_slug: str) -> Project | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT p.* FROM project p JOIN organization o ON o.id = p.organization_id
                   WHERE o.slug = %s AND p.slug = %s""",
                (org_slug, project_slug),
            )
            return from_row_or_none(Project, await cur.fetchone())

    async def set_env_max_queue_length(self, env_id: str, limit: int | None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE runtime_environment SET max_queue_length = %s WHERE id = %s", (limit, env_id))

    async def rotate_api_key(self, env_id: str, key_hash: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE runtime_environment SET api_key_hash = %s WHERE id = %s", (key_hash, env_id))

    async def bump_api_key_generation(self, env_id: str) -> tuple[int, str] | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                """UPDATE runtime_environment SET api_key_generation = api_key_generation + 1
                   WHERE id = %s RETURNING api_key_generation, type""", (env_id,))).fetchone()
            return (int(row[0]), str(row[1])) if row else None

    async def worker_group_by_token_hash(self, token_hash: str) -> WorkerGroup | None:
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
            return from_row_or_none(WorkerGroup, await cur.fetchone())

    async def worker_group_by_name(self, project_id: str, name: str) -> WorkerGroup | None:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM worker_group WHERE project_id = %s AND name = %s", (project_id, name))
            return from_row_or_none(WorkerGroup, await cur.fetchone())

    async def routable_worker_group(self, project_id: str, default_group_id: str, name: str) -> str | None:
        """The id of the worker group ``name`` a run of the project may be sent to: a group of the
        project, or the environment's default group (which may be shared)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id FROM worker_group WHERE name = %s AND (project_id = %s OR id = %s) "
                "ORDER BY project_id IS NULL LIMIT 1", (name, project_id, default_group_id))
            row = await cur.fetchone()
            return None if row is None else str(row[0])

    async def set_default_worker_group(self, project_id: str, name: str, env_id: str | None = None) -> int | None:
        """Make the project's group ``name`` the default of its environments (or of ``env_id``
        only): how many environments it is now the default of; None when there is no such group."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """WITH g AS (SELECT id FROM worker_group WHERE project_id = %(p)s AND name = %(n)s),
                        moved AS (UPDATE runtime_environment e SET default_worker_group_id = g.id FROM g
                                  WHERE e.project_id = %(p)s AND (%(e)s::text IS NULL OR e.id = %(e)s) RETURNING 1)
                   SELECT (SELECT count(*) FROM g), (SELECT count(*) FROM moved)""",
                {"p": project_id, "n": name, "e": env_id})
            row = await cur.fetchone()
            assert row is not None
            return None if not row[0] else int(row[1])

    async def routable_worker_groups(self, env_id: str, instances: int = 50) -> list[GroupListing]:
        """The groups a run of the environment may be sent to (those of its project and its
        default group), each with its most recently heard instances."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """SELECT g.id, g.name, g.project_id IS NULL AS shared, g.id = e.default_worker_group_id AS is_default,
                          """ + _INSTANCES + """
                   FROM runtime_environment e
                   JOIN worker_group g ON g.project_id = e.project_id OR g.id = e.default_worker_group_id
                   WHERE e.id = %(env)s ORDER BY g.name""", {"env": env_id, "limit": instances})
            return [GroupListing(**r) for r in await cur.fetchall()]

    async def environments_of_worker_group(self, worker_group_id: str) -> list[Environment]:
        """Environments a group serves: those whose default group it is, or every environment of
        its project."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                _ENVIRONMENT + """ JOIN worker_group g ON g.id = %s
                   WHERE e.default_worker_group_id = g.id OR e.project_id = g.project_id
                   ORDER BY e.created_at""",
                (worker_group_id,),
            )
            return [from_row(Environment, r) for r in await cur.fetchall()]

    async def create_worker_group(self, group_id: str, name: str, project_id: str | None, token_hash: str,
                                  make_default: bool) -> WorkerGroup:
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
            return from_row(WorkerGroup, row)

    async def rotate_worker_group_token(self, group_id: str, token_hash: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("UPDATE worker_group SET token_hash = %s WHERE id = %s", (token_hash, group_id))

    async def bump_worker_group_token_generation(self, group_id: str) -> int | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                "UPDATE worker_group SET token_generation = token_generation + 1 WHERE id = %s "
                "RETURNING token_generation", (group_id,))).fetchone()
            return int(row[0]) if row else None

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

    async def upsert_worker_instance(self, instance_id: str, worker_group_id: str, name: str,
                                     concurrency: int | None = None) -> str:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """INSERT INTO worker_instance (id, worker_group_id, name, concurrency) VALUES (%s, %s, %s, %s)
                   ON CONFLICT (worker_group_id, name) DO UPDATE
                   SET last_heartbeat_at = now(),
                       concurrency = coalesce(excluded.concurrency, worker_instance.concurrency)
                   RETURNING id""",
                (instance_id, worker_group_id, name, concurrency),
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

    async def workers_of_environment(self, env_id: str, limit: int = 200) -> list[WorkerView]:
        """The worker groups that serve an environment (its default group and every group with a
        current deployment for it), each with its instances and the tasks of that deployment."""
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                """WITH groups AS (
                       SELECT default_worker_group_id AS id FROM runtime_environment WHERE id = %(env)s
                       UNION SELECT worker_group_id FROM deployment WHERE environment_id = %(env)s AND is_current)
                   SELECT g.id, g.name, g.project_id IS NULL AS shared, d.version, d.created_at AS deployed_at,
                          coalesce((SELECT array_agg(dt.task_identifier ORDER BY dt.task_identifier)
                                    FROM deployment_task dt WHERE dt.deployment_id = d.id), '{}') AS tasks,
                          """ + _INSTANCES + """
                   FROM groups JOIN worker_group g ON g.id = groups.id
                   LEFT JOIN deployment d ON d.worker_group_id = g.id AND d.environment_id = %(env)s AND d.is_current
                   ORDER BY g.name""",
                {"env": env_id, "limit": limit})
            return [WorkerView(**r) for r in await cur.fetchall()]

    async def environment_ids(self, limit: int) -> list[str]:
        """The first ``limit`` environment ids, in id order (metrics)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM runtime_environment ORDER BY id LIMIT %s", (limit,))
            return [str(r[0]) for r in await cur.fetchall()]

    async def connected_worker_instances(self, within_s: float, limit: int) -> list[tuple[str, int]]:
        """(worker group, instances heard from in the last ``within_s`` seconds), at most ``limit``
        groups (metrics)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT worker_group_id, count(*) FROM worker_instance
                   WHERE last_heartbeat_at > now() - make_interval(secs => %s)
                   GROUP BY worker_group_id ORDER BY worker_group_id LIMIT %s""", (within_s, limit))
            return [(str(r[0]), int(r[1])) for r in await cur.fetchall()]
