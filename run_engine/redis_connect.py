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
import codecs
import socket
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection

from run_engine.errors import ConfigurationError

_c_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _c_pack
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency; without it redis-py's packer stays
    _c_pack = None

C = TypeVar("C", bound=AbstractConnection)


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


#: a peer gone without a word (its host powered off, a network partition, a failover that moved
#: the address): an idle connection is probed after 30 s, every 10 s, dropped after 3 probes
#: unanswered; a command's bytes unacknowledged for 30 s drop it too (TCP_USER_TIMEOUT). Without
#: them a command on such a connection waited for the kernel's retransmissions to give up (~15
#: minutes) or for ever, the engine stalled behind it. A peer alive but slow (a long script, a
#: Redis stopped for a while) is not cut: its kernel acknowledges.
DEAD_PEER_S = 30
KEEPALIVE_OPTIONS: dict[int, int] = {
    option: value for option, value in ((getattr(socket, "TCP_KEEPIDLE", None), DEAD_PEER_S),
                                        (getattr(socket, "TCP_KEEPINTVL", None), 10),
                                        (getattr(socket, "TCP_KEEPCNT", None), 3),
                                        (getattr(socket, "TCP_USER_TIMEOUT", None), DEAD_PEER_S * 1000))
    if option is not None}


def _tcp_options(url: str) -> dict[str, Any]:
    """redis-py's keep-alive arguments for ``url`` (none for a Unix socket, which has no peer to lose)."""
    if url.startswith("unix:"):
        return {}
    return {"socket_keepalive": True, "socket_keepalive_options": KEEPALIVE_OPTIONS}


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
            socket_timeout=socket_timeout_s, **_tcp_options(url)))
        cluster.bound(max_connections)
        cluster.pack_in_c()
        await cluster.initialize()
        # The cluster client answers every command the engine sends under the same name and
        # signature; the engine is typed against the standalone client.
        return cast(aioredis.Redis, cluster)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30,
                                                    socket_connect_timeout=connect_timeout_s,
                                                    socket_timeout=socket_timeout_s, **_tcp_options(url))
    pool.connection_class = packing_in_c(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it


class _PackInC:
    """redis-py's asyncio connections pack every command in Python, joining bytes argument by
    argument (a Lua call with a batch's hundreds of arguments cost ~0.8 ms of CPU); its sync client
    hands the arguments to hiredis's C packer, as this does. Same bytes on the wire: hiredis writes
    text as strict UTF-8, so a connection told another encoding (``?encoding=`` in the URL) keeps
    redis-py's packer."""

    _in_c: bool | None = None  # whether this connection's text encoding is hiredis's

    def pack_command(self, *args: Any) -> list[bytes]:
        if self._in_c is None:
            encoder = self.encoder  # type: ignore[attr-defined]
            self._in_c = encoder.encoding_errors == "strict" and codecs.lookup(encoder.encoding).name == "utf-8"
        if not self._in_c:
            return cast(list[bytes], super().pack_command(*args))  # type: ignore[misc]
        head = args[0]
        if isinstance(head, str):
            args = tuple(head.encode().split()) + args[1:]
        elif b" " in head:
            args = tuple(head.split()) + args[1:]
        try:
            return [_c_pack(args)]  # type: ignore[misc]  # only on classes made when it is there
        except TypeError:  # a value hiredis does not take: redis-py's packer sends it or raises its DataError
            return cast(list[bytes], super().pack_command(*args))  # type: ignore[misc]


_c_packed: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def packing_in_c(cls: type[C]) -> type[C]:
    """``cls`` (plain, TLS or Unix socket) with commands packed by hiredis, when it is installed."""
    if _c_pack is None:
        return cls
    packed = _c_packed.get(cls)
    if packed is None:
        packed = _c_packed[cls] = type(f"CPacked{cls.__name__}", (_PackInC, cls), {})
    return cast(type[C], packed)


class BoundedRedisCluster(RedisCluster):
    """A cluster client on which at most N commands are in flight at once; the others wait."""

    _gate: asyncio.Semaphore | None = None

    def bound(self, in_flight: int) -> None:
        self._gate = asyncio.Semaphore(in_flight)

    def pack_in_c(self) -> None:
        """Connections to every node, those it knows and those it will learn of, pack in C
        (:func:`packing_in_c`); called before :meth:`initialize` opens any."""
        kwargs = self.nodes_manager.connection_kwargs
        kwargs["connection_class"] = packing_in_c(kwargs.get("connection_class", aioredis.Connection))
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = packing_in_c(node.connection_class)

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
    return int(path) if path.isascii() and path.isdigit() else None
