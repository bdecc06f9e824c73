"""``run-engine``: the command line (API.md, "CLI")."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Coroutine
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
    from run_engine.settings import EngineSettings

T = TypeVar("T")

app = typer.Typer(help="run-engine: trigger, queue and run background tasks.", no_args_is_help=True)
worker_groups = typer.Typer(help="Self-hosted worker groups.", no_args_is_help=True)
app.add_typer(worker_groups, name="worker-groups")
keys = typer.Typer(help="Rotate API keys and worker group tokens.", no_args_is_help=True)
app.add_typer(keys, name="keys")
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
