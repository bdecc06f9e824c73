"""Shared fixtures: real PostgreSQL and Redis for the whole session.

``DATABASE_URL`` / ``REDIS_URL`` pick the servers (``.ci/run`` sets them when the local servers
answer); without them the embedded servers of :mod:`run_engine.embedded` start. Every session gets
its own database and its own Redis key prefix, and removes both at the end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from run_engine.embedded import EmbeddedPostgres, EmbeddedRedis

SESSION_TAG = secrets.token_hex(4)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    data = Path(tempfile.mkdtemp(prefix="re-redis-"))
    server = EmbeddedRedis(data)
    yield server.start()
    server.stop()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix unique to this test session; its keys are deleted at the end."""
    prefix = f"ret{SESSION_TAG}"
    yield prefix
    import redis as syncredis

    client = syncredis.Redis.from_url(redis_url)
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    finally:
        client.close()


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh, migrated database for this session, dropped at the end."""
    base = os.environ.get("DATABASE_URL")
    embedded: EmbeddedPostgres | None = None
    data = Path(tempfile.mkdtemp(prefix="re-pg-"))
    if not base:
        embedded = EmbeddedPostgres(data / "pgdata")
        base = embedded.start()
    name = f"re_test_{SESSION_TAG}"
    params = conninfo_to_dict(base)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_conninfo(**{**params, "dbname": name})
    from run_engine.db.migrations import migrate_sync

    migrate_sync(url)
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if embedded is not None:
        embedded.stop()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def unique() -> str:
    """A short random tag for names that must not collide between tests."""
    return secrets.token_hex(4)


@pytest.fixture
def empty_database(database_url: str) -> Iterator[str]:
    """A new, empty (unmigrated) database on the session's server, dropped afterwards."""
    params = conninfo_to_dict(database_url)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    name = f"re_empty_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_conninfo(**{**params, "dbname": name})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
