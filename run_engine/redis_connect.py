"""One Redis client for ``REDIS_URL``, a standalone server or any node of a Redis Cluster.

The URL alone decides nothing: :func:`connect` asks the server (``INFO cluster``) and, on a cluster,
returns redis-py's cluster client, which learns the other nodes from the one named and follows
slot moves and failovers by itself. The rest of the engine uses the commands both clients share:
every multi-key call (a Lua script, a pipeline's command) names keys of one hash slot (the queue's
``{rq:N}``, the jobs' ``{jobs}``, the locks' ``{lock}``, the rate limits' ``{rl}``), and pub/sub
works on any node (a cluster forwards PUBLISH to every node).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from run_engine.errors import ConfigurationError


async def is_cluster(url: str, *, connect_timeout_s: float = 5.0) -> bool:
    probe = aioredis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=connect_timeout_s)
    try:
        info = await probe.info("cluster")
    finally:
        await close_fully(probe)
    return str(info.get("cluster_enabled", 0)) == "1"


async def close_fully(client: aioredis.Redis) -> None:
    """``client.aclose()``, carried to its end even when the caller is cancelled meanwhile (a stop
    signal during start-up): redis-py closes the pool's connections in tasks of a ``gather``, and a
    cancel that reaches the gather before they start leaves their sockets open. The cancel goes on
    once the client is closed."""
    closing = asyncio.ensure_future(client.aclose())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        await asyncio.wait([closing])
        raise


async def connect(url: str, *, max_connections: int = 64, connect_timeout_s: float = 5.0,
                  socket_timeout_s: float | None = None) -> aioredis.Redis:
    """A client for ``url``: a blocking pool of ``max_connections`` (callers wait for a connection
    under a burst instead of failing), or on a cluster a client with that many per node."""
    if await is_cluster(url, connect_timeout_s=connect_timeout_s):
        if _db_of(url) not in (None, 0):
            raise ConfigurationError(f"REDIS_URL names database {_db_of(url)}, but a Redis Cluster has only "
                                     "database 0: drop the /N from the URL")
        # redis-py's cluster pools fail a command when a node's pool is full; callers wait instead
        # (as on the standalone pool), with room left for pipelines and pub/sub connections
        cluster = cast(BoundedRedisCluster, BoundedRedisCluster.from_url(
            url, max_connections=2 * max_connections, socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s))
        cluster.bound(max_connections)
        await cluster.initialize()
        # The cluster client answers every command the engine sends under the same name and
        # signature; the engine is typed against the standalone client.
        return cast(aioredis.Redis, cluster)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30,
                                                    socket_connect_timeout=connect_timeout_s,
                                                    socket_timeout=socket_timeout_s)
    return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it


class BoundedRedisCluster(RedisCluster):
    """A cluster client on which at most N commands are in flight at once; the others wait."""

    _gate: asyncio.Semaphore | None = None

    def bound(self, in_flight: int) -> None:
        self._gate = asyncio.Semaphore(in_flight)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._gate is None:
            return await super().execute_command(*args, **kwargs)
        async with self._gate:
            return await super().execute_command(*args, **kwargs)


def clustered(client: aioredis.Redis) -> bool:
    return isinstance(client, RedisCluster)


def _db_of(url: str) -> int | None:
    from urllib.parse import urlparse

    path = urlparse(url).path.strip("/")
    return int(path) if path.isdigit() else None
