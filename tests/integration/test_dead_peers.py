"""The engine's connections to PostgreSQL and Redis notice a peer gone without a word (its host
powered off, a partition, a failover that moved the address): TCP keep-alives and a bound on
unacknowledged bytes (TCP_USER_TIMEOUT) on every socket. Before, a statement or a command on such
a connection waited for the kernel's retransmissions to give up, about 15 minutes, or for ever
(an idle connection), the engine's loops and every request stalled behind it."""

from __future__ import annotations

import socket

import psycopg

from run_engine.db.repository import dead_peer_options
from run_engine.redis_connect import DEAD_PEER_S

from .conftest import Harness


def _tcp(sock: socket.socket) -> tuple[int, int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))


async def test_the_engines_sockets_notice_a_peer_gone_silent(h: Harness) -> None:
    async with h.engine.resources.repo.pool.connection() as conn:
        if not conn.pgconn.host.startswith(b"/"):  # (a Unix socket, the embedded PostgreSQL's, has no peer to lose)
            pg = socket.socket(fileno=conn.pgconn.socket)
            try:
                assert _tcp(pg) == (1, 30, 30_000)
            finally:
                pg.detach()
    redis = h.engine.redis
    await redis.ping()
    pool = redis.connection_pool
    connection = next(iter(pool._available_connections), None) or next(iter(pool._in_use_connections))
    sock = connection._writer.transport.get_extra_info("socket")
    assert sock is not None and _tcp(sock) == (1, DEAD_PEER_S, DEAD_PEER_S * 1000)


def test_what_the_database_url_sets_itself_is_kept() -> None:
    assert dead_peer_options("postgresql://u@h/db?keepalives_idle=5")["keepalives_count"] == "3"
    assert "keepalives_idle" not in dead_peer_options("postgresql://u@h/db?keepalives_idle=5")
    assert dead_peer_options("not a url at all =") == {}
    psycopg.conninfo.make_conninfo("postgresql://u@h/db", **dead_peer_options("postgresql://u@h/db"))
