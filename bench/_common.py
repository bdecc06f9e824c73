"""Shared set-up of the benchmarks: a fresh database and key prefix on the real servers."""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from run_engine.db.migrations import migrate_sync

DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    base = os.environ.get("DATABASE_URL", DEFAULT_DB)
    params = conninfo_to_dict(base)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    name = f"re_bench_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_conninfo(**{**params, "dbname": name})
    try:
        migrate_sync(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def delete_prefix(redis_url: str, prefix: str) -> None:
    """Delete the keys of ``prefix`` (on every master when ``redis_url`` names a Redis Cluster)."""
    from run_engine.redis_connect import connect

    client = await connect(redis_url, max_connections=8)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            pipe = client.pipeline(transaction=False)
            for key in keys[start:start + 1000]:
                pipe.delete(key)  # one key a command: a cluster's keys are in several slots
            await pipe.execute()
    finally:
        await client.aclose()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def wait_healthy(url: str, timeout_s: float = 60) -> None:
    """Until the server at ``url`` answers /healthz with 200; SystemExit after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("server did not start")
        time.sleep(0.1)


# --- CPU of processes, read from /proc ---------------------------------------------------------

def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, children: bool = False) -> float:
    """utime + stime of a process (and, with ``children``, of its children it has reaped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return total / TICK


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children_of(p)
    return out


def pids_named(name: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def executor_pids(supervisor: int) -> list[int]:
    """The supervisor's executors: its descendants but multiprocessing's helpers (the fork server
    the executors are forked from, the resource tracker)."""
    helpers = set()
    for p in children_of(supervisor):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline or b"resource_tracker" in cmdline:
            helpers.add(p)
    return [p for p in descendants(supervisor)[1:] if p not in helpers]


def tree_cpu(pid: int) -> float:
    return sum(cpu_s(p, children=True) for p in descendants(pid) if Path(f"/proc/{p}").exists())


def postgres_cpu() -> float:
    """Every postgres process, and the backends the postmaster has reaped."""
    return sum(cpu_s(p, children=True) for p in pids_named("postgres"))


def machine_busy_s() -> float:
    """CPU seconds all CPUs have been busy (not idle or waiting for I/O), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


async def noop_engine(label: str, database_url: str, redis_url: str) -> tuple[Any, Any]:
    """An engine of its own key prefix (``bench-<label>-<hex>``, no engine jobs run) and an environment
    with a deployment of one task, ``noop``: (engine, environment). The caller closes the engine."""
    from run_engine.engine import RunEngine, TaskSpec
    from run_engine.settings import EngineSettings
    from run_engine.tenancy import ensure_environment

    engine = await RunEngine.create(EngineSettings(database_url=database_url, redis_url=redis_url,
                                                   key_prefix=f"bench-{label}-{secrets.token_hex(4)}",
                                                   max_queue_length=None), run_jobs=False)
    try:
        env = await ensure_environment(engine.resources.repo, secret="bench-secret", org="bench", project="p",
                                       env="dev")
        await engine.register_deployment(env_id=env.env_id, worker_group_id=env.worker_group_id, version="1",
                                         content_hash="h", tasks=[TaskSpec("noop")], queues=[])
    except BaseException:
        await engine.close()
        raise
    return engine, env

