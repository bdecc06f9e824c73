"""Shared set-up of the benchmarks: a fresh database and key prefix on the real servers."""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import time
from collections.abc import Iterator

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
