"""``run-engine``: the command line (API.md, "CLI")."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from run_engine import cli_help, logs
from run_engine.cli_client import register as register_client_commands
from run_engine.cli_client import register_worker_groups
from run_engine.db.migrations import migrate_sync
from run_engine.dependencies import DEPENDENCY_ERRORS, unavailable_dependency, wait_until_reachable
from run_engine.services import services

if TYPE_CHECKING:
    from run_engine.jobs import DeadJob, JobQueue
    from run_engine.settings import EngineSettings

T = TypeVar("T")

app = typer.Typer(help="run-engine: trigger, queue and run background tasks.", no_args_is_help=True)
worker_groups = typer.Typer(help="Self-hosted worker groups.", no_args_is_help=True)
app.add_typer(worker_groups, name="worker-groups")
keys = typer.Typer(help="Rotate API keys and worker group tokens.", no_args_is_help=True)
app.add_typer(keys, name="keys")
jobs_app = typer.Typer(help="The job DLQ: engine jobs (timeouts, timers, bulk pages) that failed every attempt, "
                       "read and changed in Redis directly (REDIS_URL, RUN_ENGINE_KEY_PREFIX).", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
register_client_commands(app)
register_worker_groups(worker_groups)

DataDir = Annotated[Path | None, typer.Option(help="Where embedded servers keep their data (default .run-engine/).")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
JsonLogs = Annotated[bool, typer.Option("--json",
                                        help="Logs as one JSON object per line (as RUN_ENGINE_LOG_FORMAT=json).")]
DatabaseUrl = Annotated[str | None, typer.Option(envvar="DATABASE_URL", show_default=False,
                                                 help="PostgreSQL URL (default: an embedded PostgreSQL).")]
RedisUrl = Annotated[str | None, typer.Option(envvar="REDIS_URL", show_default=False,
                                              help="Redis URL (default: an embedded Redis).")]
Secret = Annotated[str | None, typer.Option(envvar="RUN_ENGINE_SECRET", show_default=False,
                                            help="Installation secret: every key and token is derived from it.")]


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"run-engine {version('run-engine')}")
        except PackageNotFoundError:
            typer.echo("run-engine (not installed: run from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    """run-engine: trigger, queue and run background tasks."""


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed (a faster loop for the server and supervisor)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _settings(database_url: str, redis_url: str) -> EngineSettings:
    """The settings from the environment, or a clear message and exit 2 (never a traceback)."""
    from run_engine.errors import ConfigurationError
    from run_engine.settings import EngineSettings

    try:
        return EngineSettings.from_env(database_url=database_url, redis_url=redis_url)
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _urls(database_url: str | None, redis_url: str | None) -> dict[str, str]:
    """The environment with the URLs given as flags (an empty one means embedded)."""
    given = {k: v for k, v in (("DATABASE_URL", database_url), ("REDIS_URL", redis_url)) if v is not None}
    return {**os.environ, **given}


def _secret(configured: str | None, data_dir: Path, *, generate: bool = False) -> str:
    """The installation secret, or a clear message and exit 2 (never a traceback)."""
    from run_engine.errors import ConfigurationError
    from run_engine.tenancy import resolve_secret

    try:
        return resolve_secret(configured, data_dir, generate=generate)
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def migrate(data_dir: DataDir = None, as_json: AsJson = False) -> None:
    """Apply pending database migrations (idempotent; safe when several processes start at once)."""
    with services(data_dir) as svc:
        applied = migrate_sync(svc.database_url)
    if as_json:
        typer.echo(json.dumps({"applied": applied}))
    elif applied:
        typer.echo(f"applied migrations: {', '.join(applied)}")
    else:
        typer.echo("database is up to date")


@app.command()
def server(
    port: Annotated[int, typer.Option(envvar="RUN_ENGINE_PORT", help="Port to listen on.")] = 3030,
    host: Annotated[str, typer.Option(envvar="RUN_ENGINE_HOST", help="Address to listen on.")] = "127.0.0.1",
    secret: Secret = None,
    database_url: DatabaseUrl = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    json_logs: JsonLogs = False,
    workers: Annotated[int, typer.Option(envvar="RUN_ENGINE_WORKERS", min=1, max=64,
                                         help="Server processes sharing the port (one per core is a good start).")]
    = 1,
    fd: Annotated[int | None, typer.Option(hidden=True, help="Accept on this inherited socket (--workers).")] = None,
) -> None:
    """Run the API server (public + worker API) with the engine and its background jobs."""
    from run_engine.server import Shutdown, serve

    if json_logs:
        logs.configure(json=True)
    shutdown = Shutdown().install()  # SIGINT/SIGTERM from here on: a graceful stop and exit 0, whenever they come
    with services(data_dir, _urls(database_url, redis_url)) as svc:
        key = _secret(secret, svc.data_dir)
        settings = _settings(svc.database_url, svc.redis_url)
        if fd is None:  # a child of --workers: its parent migrated
            _wait_for_services(svc.database_url, svc.redis_url, shutdown)
            migrate_sync(svc.database_url)
        else:
            from run_engine.server_workers import die_with_parent

            die_with_parent()
        if workers > 1 and fd is None:  # (a child serves its inherited socket, whatever its environment says)
            _serve_workers(workers, host, port, svc.database_url, svc.redis_url, key, json_logs, shutdown)
            return
        try:
            _run(serve(settings, host=host, port=port, secret=key, shutdown=shutdown, fd=fd))
        except DEPENDENCY_ERRORS as exc:  # gone again between the wait and the start
            typer.echo(f"error: {unavailable_dependency(exc) or 'a dependency'} cannot be reached: {exc}", err=True)
            raise SystemExit(1) from None


def _wait_for_services(database_url: str, redis_url: str, shutdown: Any) -> None:
    """Wait up to RUN_ENGINE_STARTUP_WAIT_S (60 s) for PostgreSQL and Redis to answer (started beside
    them, the server often comes up first); a one-line error and exit 1 if they do not."""
    try:
        wait_s = float(os.environ.get("RUN_ENGINE_STARTUP_WAIT_S", "60"))
    except ValueError:
        typer.echo("error: RUN_ENGINE_STARTUP_WAIT_S must be a number of seconds", err=True)
        raise SystemExit(2) from None
    problem = wait_until_reachable(database_url, redis_url, wait_s, stopping=lambda: shutdown.requested)
    if problem is not None:
        if shutdown.requested:
            raise SystemExit(0)
        typer.echo(f"error: {problem}", err=True)
        raise SystemExit(1)


def _serve_workers(count: int, host: str, port: int, database_url: str, redis_url: str, secret: str,
                   json_logs: bool, shutdown: Any) -> None:
    from run_engine.server_workers import Workers, bind, child_env

    try:
        sock = bind(host, port)
    except OSError as exc:
        typer.echo(f"error: cannot listen on {host}:{port}: {exc}", err=True)
        raise typer.Exit(2) from None
    argv = ["server", "--host", host, "--port", str(port), *(["--json"] if json_logs else [])]
    logging.getLogger("run_engine.server").info("run-engine server: %d processes on http://%s:%d", count, host, port)
    raise typer.Exit(Workers(count, sock, argv, child_env(database_url, redis_url, secret))
                     .run(lambda: bool(shutdown.requested)))


async def _bootstrap(database_url: str, redis_url: str, org: str, project: str, env: str, secret: str,  # type: ignore[no-untyped-def]
                     max_queue_length: int | None = None):
    from run_engine.db.repository import Repository
    from run_engine.tenancy import ensure_environment

    settings = _settings(database_url, redis_url)
    repo = await Repository.open(database_url, min_size=1, max_size=2)
    try:
        created = await ensure_environment(repo, secret=secret, org=org, project=project, env=env,
                                           concurrency_limit=settings.env_concurrency)
        if max_queue_length is not None:
            await repo.tenancy.set_env_max_queue_length(created.env_id, max_queue_length or None)
        return created
    finally:
        await repo.close()


def _credentials(e, api_url: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {"apiKey": e.api_key, "workerGroupToken": e.worker_group_token, "apiUrl": api_url,
            "environmentId": e.env_id, "projectId": e.project_id, "workerGroupId": e.worker_group_id,
            "environmentWorkerGroupToken": e.env_worker_group_token}


@app.command()
def bootstrap(
    org: Annotated[str, typer.Option(help="Organization slug.")] = "dev",
    project: Annotated[str, typer.Option(help="Project slug.")] = "dev",
    env: Annotated[str, typer.Option(help="Environment slug: dev, staging or prod.")] = "dev",
    api_url: Annotated[str, typer.Option(envvar="RUN_ENGINE_API_URL", help="URL printed as apiUrl.")] = "http://127.0.0.1:3030",
    secret: Secret = None,
    max_queue_length: Annotated[int | None, typer.Option(min=0, help="Most runs the environment may have queued; "
                                                         "triggers over it get 429 (0 = no limit).")] = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Create what is missing of org → project → environment (+ the project's worker group) and
    print JSON {apiKey, workerGroupToken, environmentWorkerGroupToken, apiUrl, ...} (always JSON;
    --json is accepted like every command's)."""
    del as_json
    with services(data_dir) as svc:
        key = _secret(secret, svc.data_dir)
        migrate_sync(svc.database_url)
        e = asyncio.run(_bootstrap(svc.database_url, svc.redis_url, org, project, env, key, max_queue_length))
    typer.echo(json.dumps(_credentials(e, api_url)))


async def _rotate(database_url: str, secret: str, org: str, project: str, env: str | None,
                  worker_group: str | None) -> dict[str, str]:
    from run_engine.db.repository import Repository
    from run_engine.tenancy import rotate_api_key, rotate_worker_group_token

    repo = await Repository.open(database_url, min_size=1, max_size=2)
    try:
        proj = await repo.tenancy.project_by_slug(org, project)
        env_row = await repo.tenancy.environment_by_slugs(org, project, env) if env else None
        if proj is None or (env and env_row is None):
            raise typer.BadParameter(f"no environment {org}/{project}/{env}; run `run-engine bootstrap` first")
        if worker_group is None:
            assert env_row is not None
            return {"environmentId": env_row.id,
                    "apiKey": await rotate_api_key(repo, secret=secret, env_id=env_row.id)}
        group = await repo.tenancy.worker_group_by_name(proj.id, worker_group)
        if group is None:
            raise typer.BadParameter(f"no worker group {worker_group!r} in {org}/{project}")
        token = await rotate_worker_group_token(repo, secret=secret, group_id=group.id,
                                                env_id=env_row.id if env_row else None)
        out = {"workerGroupId": group.id, "workerGroupToken": token}
        if env_row is not None:
            out["environmentId"] = env_row.id
        return out
    finally:
        await repo.close()


@keys.command("rotate")
def keys_rotate(
    env: Annotated[str | None, typer.Option(help="Environment slug whose API key to rotate.")] = None,
    org: Annotated[str, typer.Option(help="Organization slug.")] = "dev",
    project: Annotated[str, typer.Option(help="Project slug.")] = "dev",
    worker_group: Annotated[str | None, typer.Option(
        help="Rotate this worker group's token instead (with --env: its token for that environment).")] = None,
    secret: Secret = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Replace a key: the environment's API key (--env), or a worker group's token (--worker-group).
    The new one is printed; the old one is refused from now on (servers cache keys up to 5 s)."""
    if env is None and worker_group is None:
        typer.echo("error: give --env (rotate its API key) or --worker-group (rotate its token)", err=True)
        raise typer.Exit(2)
    with services(data_dir) as svc:
        key = _secret(secret, svc.data_dir)
        migrate_sync(svc.database_url)
        out = asyncio.run(_rotate(svc.database_url, key, org, project, env, worker_group))
    if as_json:
        typer.echo(json.dumps(out))
    else:
        typer.echo(out.get("apiKey") or out["workerGroupToken"])


async def _create_group(database_url: str, name: str, org: str, project: str | None, default: bool,
                        secret: str) -> tuple[str, str]:
    from run_engine.db.repository import Repository
    from run_engine.tenancy import create_worker_group

    repo = await Repository.open(database_url, min_size=1, max_size=2)
    try:
        project_id = None
        if project:
            row = await repo.tenancy.project_by_slug(org, project)
            if row is None:
                raise typer.BadParameter(f"no project {org}/{project}; run `run-engine bootstrap` first")
            project_id = row.id
        return await create_worker_group(repo, secret=secret, name=name, project_id=project_id,
                                         make_default=default)
    finally:
        await repo.close()


@worker_groups.command("create")
def worker_groups_create(
    name: str,
    org: Annotated[str, typer.Option(help="Organization slug of the project.")] = "dev",
    project: Annotated[str | None, typer.Option(help="Project slug (none: a shared group).")] = "dev",
    default: Annotated[bool, typer.Option("--default", help="Make it the default group of the project.")] = False,
    secret: Secret = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Create a self-hosted worker group and print its token."""
    with services(data_dir) as svc:
        key = _secret(secret, svc.data_dir)
        migrate_sync(svc.database_url)
        group_id, token = asyncio.run(_create_group(svc.database_url, name, org, project, default, key))
    if as_json:
        typer.echo(json.dumps({"id": group_id, "name": name, "token": token}))
    else:
        typer.echo(token)


@worker_groups.command("set-default")
def worker_groups_set_default(
    name: str,
    org: Annotated[str, typer.Option(help="Organization slug of the project.")] = "dev",
    project: Annotated[str, typer.Option(help="Project slug.")] = "dev",
    env: Annotated[str | None, typer.Option("--env", help="Only this environment (slug; default: all of them).")]
    = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Make a worker group of the project the default of its environments (new runs go to it)."""
    with services(data_dir) as svc:
        migrate_sync(svc.database_url)
        moved = asyncio.run(_set_default_group(svc.database_url, name, org, project, env))
    if as_json:
        typer.echo(json.dumps({"name": name, "environments": moved}))
    else:
        typer.echo(f"{name} is now the default worker group of {moved} environment(s) of {org}/{project}")


async def _set_default_group(database_url: str, name: str, org: str, project: str, env: str | None) -> int:
    from run_engine.db.repository import Repository

    repo = await Repository.open(database_url, min_size=1, max_size=2)
    try:
        row = await repo.tenancy.project_by_slug(org, project)
        if row is None:
            raise typer.BadParameter(f"no project {org}/{project}; run `run-engine bootstrap` first")
        env_id = None
        if env is not None:
            found = await repo.tenancy.environment_by_slugs(org, project, env)
            if found is None:
                raise typer.BadParameter(f"no environment {env} in {org}/{project}")
            env_id = found.id
        moved = await repo.tenancy.set_default_worker_group(row.id, name, env_id)
        if moved is None:
            raise typer.BadParameter(f"no worker group {name!r} in {org}/{project}; create it with "
                                     "`run-engine worker-groups create`")
        return moved
    finally:
        await repo.close()


#: entries of the job DLQ read per HSCAN page by ``jobs`` commands
JOB_DLQ_PAGE = 200
#: how ``jobs retry`` reports each outcome (run_engine.jobs), and its key in --json
_RETRY_SAYS = {
    "retried": ("retried", "retried: due now, its attempts reset"),
    "not dead": ("notDead", "not in the job DLQ (retried or dropped already, or never dead): nothing done"),
    "scheduled": ("scheduled", "scheduled already (armed again): its dead copy dropped, the job left as it is"),
    "unreadable": ("unreadable", "not retried: its entry is not a job's (see `run-engine jobs dead`); drop it"),
    "changed": ("changed", "not retried: its entry kept changing while read; run the command again"),
}


def _with_jobs(data_dir: Path | None, redis_url: str | None, work: Callable[[JobQueue], Awaitable[T]]) -> T:
    """``work`` on the engine's job queue, in the Redis of ``REDIS_URL`` (or the embedded one) under
    ``RUN_ENGINE_KEY_PREFIX``; a Redis that cannot be reached is one line and exit 1."""
    from run_engine.clock import SystemClock
    from run_engine.dependencies import redacted_url
    from run_engine.jobs import JobQueue
    from run_engine.redis_connect import close_fully
    from run_engine.redis_connect import connect as connect_redis

    with services(data_dir, _urls(None, redis_url), database=False) as svc:
        settings = _settings(svc.database_url, svc.redis_url)

        async def run() -> T:
            client = await connect_redis(svc.redis_url, max_connections=4)
            try:
                return await work(JobQueue(client, prefix=f"{settings.key_prefix}:jobs", clock=SystemClock()))
            finally:
                await close_fully(client)

        try:
            return asyncio.run(run())
        except DEPENDENCY_ERRORS as exc:
            typer.echo(f"error: Redis cannot be reached at {redacted_url(svc.redis_url)}: {exc}", err=True)
            raise typer.Exit(1) from None


def _when(dead_at: float | None) -> str | None:
    return None if dead_at is None else datetime.fromtimestamp(dead_at, UTC).isoformat(timespec="milliseconds")


def _dead_json(d: DeadJob) -> dict[str, Any]:
    return {"id": d.id, "kind": d.kind, "lane": d.lane, "attempts": d.attempt, "error": d.error,
            "deadAt": _when(d.dead_at), "payload": d.payload, "readable": d.readable}


@jobs_app.command("dead")
def jobs_dead(
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Show at most this many.")] = 50,
    kind: Annotated[str | None, typer.Option(help="Only jobs of this kind (e.g. bulk_action).")] = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """List the engine jobs that failed every attempt (the job DLQ).

    Each with its id, kind, lane (its environment, or the default lane), attempts, last error and
    when it died; read a page (HSCAN) at a time, in no order, never the whole DLQ at once. --json:
    {"data": [{id, kind, lane, attempts, error, deadAt, payload, readable}], "total": N}."""

    async def read(q: JobQueue) -> tuple[list[DeadJob], int]:
        found: list[DeadJob] = []
        cursor = 0
        while True:
            cursor, page = await q.dead_page(cursor, min(JOB_DLQ_PAGE, limit))
            found += [d for d in page if kind is None or d.kind == kind]
            if len(found) >= limit or cursor == 0:
                break
        return found[:limit], await q.dead_count()

    found, total = _with_jobs(data_dir, redis_url, read)
    if as_json:
        typer.echo(json.dumps({"data": [_dead_json(d) for d in found], "total": total}))
        return
    from run_engine.cli_client import ResultTable, console

    table = ResultTable("id", "kind", "lane", "attempts", "dead at", "error")
    for d in found:
        table.add_row(d.id, d.kind or "(not a job)", d.lane or "(default)", str(d.attempt),
                      _when(d.dead_at) or "(before dead_at)", d.error)
    if found:
        console.print(table)
    shown = f"{len(found)} shown of {total} in the job DLQ" + (f" (kind {kind})" if kind else "")
    console.print(shown, markup=False, highlight=False)


@jobs_app.command("retry")
def jobs_retry(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Ids of dead jobs; omit with --all.",
                                                        show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every dead job (that was dead when the command started).")]
    = False,
    kind: Annotated[str | None, typer.Option(help="With --all: only jobs of this kind.")] = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Put dead jobs back to run now, their attempts reset.

    Each leaves the job DLQ atomically as it is scheduled, only while its entry is the one read, so
    running this twice retries a job once; one line per id says what was done (--all: the counts)."""
    if bool(job_ids) == all_ or (kind is not None and not all_):
        typer.echo("error: give job ids, or --all [--kind K]", err=True)
        raise typer.Exit(2)

    async def retry(q: JobQueue) -> dict[str, str] | dict[str, int]:
        if job_ids:
            return dict(zip(job_ids, await q.retry_dead(job_ids), strict=True))
        counts = dict.fromkeys(_RETRY_SAYS, 0)
        started = q.clock.now()  # a job retried here that dies again meanwhile is not retried twice
        cursor = 0
        while True:
            cursor, page = await q.dead_page(cursor, JOB_DLQ_PAGE)
            page = [d for d in page if (kind is None or d.kind == kind) and (d.dead_at is None or d.dead_at <= started)]
            for outcome in await q.retry_entries(page):
                counts[outcome] += 1
            if cursor == 0:
                return counts

    done = _with_jobs(data_dir, redis_url, retry)
    if job_ids:
        outcomes = {job_id: str(outcome) for job_id, outcome in done.items()}
        counts = {o: sum(1 for x in outcomes.values() if x == o) for o in _RETRY_SAYS}
    else:
        outcomes, counts = {}, {o: int(n) for o, n in done.items()}
    if as_json:
        out: dict[str, Any] = {_RETRY_SAYS[o][0]: n for o, n in counts.items()}
        if job_ids:
            out["jobs"] = {job_id: _RETRY_SAYS[o][0] for job_id, o in outcomes.items()}
        typer.echo(json.dumps(out))
        return
    for job_id, outcome in outcomes.items():
        typer.echo(f"{job_id}: {_RETRY_SAYS[outcome][1]}")
    if not job_ids:
        left = [f"{n} {_RETRY_SAYS[o][0]}" for o, n in counts.items() if n and o != "retried"]
        typer.echo(f"retried {counts['retried']} dead jobs" + (f" ({', '.join(left)})" if left else ""))


@jobs_app.command("drop")
def jobs_drop(
    job_ids: Annotated[list[str], typer.Argument(help="Ids of dead jobs.", show_default=False)],
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Delete entries of the job DLQ (their jobs are not run)."""
    dropped = _with_jobs(data_dir, redis_url, lambda q: q.drop_dead(job_ids))
    if as_json:
        said = {j: "dropped" if d else "notDead" for j, d in zip(job_ids, dropped, strict=True)}
        typer.echo(json.dumps({"dropped": sum(dropped), "notDead": len(dropped) - sum(dropped), "jobs": said}))
        return
    for job_id, gone in zip(job_ids, dropped, strict=True):
        typer.echo(f"{job_id}: " + ("dropped" if gone else "not in the job DLQ: nothing done"))


@app.command("supervisor")
def supervisor_cmd(
    token: Annotated[str, typer.Option(envvar="RUN_ENGINE_WORKER_TOKEN", help="Worker group token (tr_wgt_…).")],
    tasks: Annotated[str, typer.Option(help="Python module with your @task functions, e.g. my_app.tasks.")],
    api_url: Annotated[str, typer.Option(envvar="RUN_ENGINE_API_URL", help="URL of the run-engine server.")] = "http://127.0.0.1:3030",
    concurrency: Annotated[int, typer.Option(min=1, max=1000, help="Runs at once (one warm executor each).")] = 4,
    name: Annotated[str, typer.Option(help="Worker instance name (default host-pid).")] = "",
    heartbeat_interval: Annotated[float, typer.Option(envvar="RUN_ENGINE_HEARTBEAT_INTERVAL_S",
                                                      help="Seconds between run heartbeats.")] = 20.0,
    env: Annotated[list[str] | None, typer.Option("--env", help="Serve only these environments (slug or id).")] = None,
    suspend_after: Annotated[float, typer.Option(envvar="RUN_ENGINE_SUSPEND_AFTER_S", min=0,
                                                 help="Seconds a blocked run waits in its executor before it is "
                                                      "checkpointed and its executor and slot released.")] = 5.0,
    metrics_port: Annotated[int | None, typer.Option(envvar="RUN_ENGINE_SUPERVISOR_METRICS_PORT", min=0, max=65535,
                                                     help="Serve Prometheus metrics on this port (default: off).")]
    = None,
    metrics_host: Annotated[str, typer.Option(envvar="RUN_ENGINE_SUPERVISOR_METRICS_HOST",
                                              help="Address of the metrics port.")] = "127.0.0.1",
    json_logs: JsonLogs = False,
    die_with_parent: Annotated[bool, typer.Option(hidden=True, help="Stop when the parent process dies (dev).")]
    = False,
) -> None:
    """Serve a worker group: pull its runs and execute them in warm executor processes."""
    import sys

    if die_with_parent:  # `dev`'s: a `dev` killed with SIGKILL must not leave it running its tasks
        from run_engine.server_workers import die_with_parent as _die_with_parent

        _die_with_parent()
    if json_logs:
        logs.configure(json=True)
    from supervisor.supervisor import SupervisorConfig, run_supervisor

    sys.path.insert(0, os.getcwd())
    run_supervisor(SupervisorConfig(api_url=api_url, token=token, tasks_module=tasks, concurrency=concurrency,
                                    name=name, heartbeat_interval_s=heartbeat_interval,
                                    environments=tuple(env or ()), suspend_after_s=suspend_after,
                                    metrics_port=metrics_port, metrics_host=metrics_host))


@app.command()
def dev(
    tasks: Annotated[str, typer.Option(help="Module with your @task functions.")] = "examples.tasks",
    port: Annotated[int, typer.Option(envvar="RUN_ENGINE_PORT", help="API port.")] = 3030,
    concurrency: Annotated[int, typer.Option(min=1, help="Runs at once on the local supervisor.")] = 4,
    database_url: DatabaseUrl = None,
    redis_url: RedisUrl = None,
    data_dir: DataDir = None,
    json_logs: Annotated[bool, typer.Option("--json", help="Print the credentials as one JSON line and log "
                                                           "as JSON lines.")] = False,
) -> None:
    """Everything on one machine: embedded PostgreSQL and Redis (unless DATABASE_URL / REDIS_URL
    are set), migrations, a dev environment, the API server and one supervisor. Ctrl-C stops all."""
    import signal
    import subprocess
    import sys

    from rich.console import Console

    from run_engine.server import Shutdown, serve

    if json_logs:
        logs.configure(json=True)
    console = Console(soft_wrap=True)  # lines to copy (export, curl) are never wrapped
    url = f"http://127.0.0.1:{port}"
    if not _port_free("127.0.0.1", port):
        typer.echo(f"error: port {port} is in use (is another `run-engine dev` running?); stop it, or start "
                   f"this one with --port N", err=True)
        raise typer.Exit(1)
    if not json_logs:
        console.print("starting run-engine dev…")
    shutdown = Shutdown().install()  # Ctrl-C at any moment from here on stops everything, once
    with services(data_dir, _urls(database_url, redis_url)) as svc:
        # dev may generate its own secret, kept (0600) in the data folder; production sets RUN_ENGINE_SECRET
        secret = _secret(os.environ.get("RUN_ENGINE_SECRET"), svc.data_dir, generate=True)
        migrate_sync(svc.database_url)
        creds = asyncio.run(_bootstrap(svc.database_url, svc.redis_url, "dev", "dev", "dev", secret))
        sys.path.insert(0, os.getcwd())
        if shutdown.requested:
            return
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "run_engine.cli", "supervisor",  # the token by environment: not in `ps`
             "--tasks", tasks, "--api-url", url, "--concurrency", str(concurrency), "--name", "dev",
             "--die-with-parent", *(["--json"] if json_logs else [])],
            env={**os.environ, "RUN_ENGINE_WORKER_TOKEN": creds.worker_group_token,
                 "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])})

        def announce() -> None:  # once the API answers
            if json_logs:
                typer.echo(json.dumps({"event": "up", **_credentials(creds, url), "dashboard": f"{url}/dashboard",
                                       "tasks": tasks, "embedded": svc.embedded}))
                return
            console.print(f"""
[bold green]run-engine dev is up[/bold green]   ({'embedded' if svc.embedded else 'configured'} PostgreSQL + Redis)
  API URL   {url}
  API key   {creds.api_key}
  dashboard {url}/dashboard   (sign in with the API key)
  tasks     {tasks} on one supervisor ({concurrency} at once)

  export RUN_ENGINE_API_URL={url} RUN_ENGINE_API_KEY={creds.api_key}
  curl -s -X POST {url}/api/v1/tasks/hello-world/trigger \\
       -H "Authorization: Bearer {creds.api_key}" -H "Content-Type: application/json" \\
       -d '{{"payload": {{"name": "Ada"}}}}'

Ctrl-C stops everything.""", highlight=False)

        try:
            _run(serve(_settings(svc.database_url, svc.redis_url), host="127.0.0.1", port=port, secret=secret,
                       shutdown=shutdown, on_started=announce))
        except KeyboardInterrupt:  # a second Ctrl-C
            pass
        finally:
            if supervisor.poll() is None:
                supervisor.send_signal(signal.SIGTERM)
                try:
                    supervisor.wait(30)
                except subprocess.TimeoutExpired:
                    supervisor.kill()
        if not json_logs:
            console.print("stopped")


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def main() -> None:
    from run_engine.db.migrations import MigrationError

    logs.configure()
    cli_help.tidy(app)
    try:
        app()
    except MigrationError as exc:  # every command that touches the database migrates first
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
