"""The embedded default: real PostgreSQL and Redis from wheels, nothing else needed."""

from __future__ import annotations

from pathlib import Path

import psycopg
import redis

from run_engine.db.migrations import migrate_sync
from run_engine.services import services


def test_embedded_servers_start_migrate_and_stop(tmp_path: Path) -> None:
    with services(tmp_path / ".run-engine", environ={"RUN_ENGINE_REDIS_PORT": "0"}) as svc:
        assert svc.embedded
        assert migrate_sync(svc.database_url)
        with psycopg.connect(svc.database_url) as conn:
            assert conn.execute("SELECT count(*) FROM task_run").fetchone() == (0,)
        client = redis.Redis.from_url(svc.redis_url)
        assert client.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, "k", "v") == b"OK"
        client.close()
        redis_url = svc.redis_url
    # stopped on exit
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=0.5).ping()
        stopped = False
    except redis.ConnectionError:
        stopped = True
    assert stopped
    assert (tmp_path / ".run-engine" / "pgdata" / "PG_VERSION").exists()


def test_configured_servers_are_used_as_they_are(database_url: str, redis_url: str) -> None:
    with services(environ={"DATABASE_URL": database_url, "REDIS_URL": redis_url}) as svc:
        assert (svc.database_url, svc.redis_url, svc.embedded) == (database_url, redis_url, False)


def test_the_embedded_redis_keeps_its_data_across_a_restart_and_a_kill(tmp_path: Path) -> None:
    """What `run-engine dev` had in Redis (queue, engine jobs) is still there after Ctrl-C or a
    crash: the embedded server writes an append-only file (issue 11)."""
    from run_engine.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    client = redis.Redis.from_url(server.start())
    client.set("survives-stop", "1")
    client.close()
    server.stop()
    server = EmbeddedRedis(tmp_path / "redis")
    client = redis.Redis.from_url(server.start())
    assert client.get("survives-stop") == b"1"
    client.set("survives-kill", "2")  # in the append-only file (the kernel's) before the reply
    assert server._proc is not None
    server._proc.kill()
    server._proc.wait()
    client.close()
    server = EmbeddedRedis(tmp_path / "redis")
    client = redis.Redis.from_url(server.start())
    try:
        assert client.get("survives-kill") == b"2"
    finally:
        client.close()
        server.stop()
