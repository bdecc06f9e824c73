"""Packets uploaded before a trigger names them (migrations/0018_uploaded_packets.sql)."""

from __future__ import annotations

from collections.abc import Sequence

from psycopg_pool import AsyncConnectionPool

from run_engine.records import record

#: the first key of the advisory lock that makes one environment's uploads take turns
_PUT_LOCK_CLASS = 0x5041434B  # "PACK"


@record
class UploadedPacket:
    content_type: str
    data: str


class PacketRepository:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def put(self, env_id: str, path: str, content_type: str, data: str, ttl_s: float, max_bytes: int,
                  min_bytes: int) -> bool:
        """Store (or replace: an upload repeated) the environment's packet at ``path`` for
        ``ttl_s``, unless the environment's unexpired packets would then pass ``max_bytes``
        (False). A packet counts as its data and path, and as ``min_bytes`` at least: what bounds
        how many rows an environment keeps, and so what each upload's sum reads (an empty packet
        counted nothing, and the rows of a tenant uploading them had no bound). Their sizes are read
        from the values' headers, not the values. The environment's uploads take turns (a
        transaction-scoped advisory lock on it, the sum read after it is taken): two at once each
        read the sum without the other's row, not yet committed, and both were stored past the cap."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_PUT_LOCK_CLASS, env_id))
            cur = await conn.execute(
                """INSERT INTO uploaded_packet (environment_id, path, content_type, data, expires_at)
                   SELECT %(env)s, %(path)s, %(type)s, %(data)s::text, now() + make_interval(secs => %(ttl)s)
                   WHERE (SELECT coalesce(sum(greatest(octet_length(data) + octet_length(path), %(min)s)), 0)
                          FROM uploaded_packet
                          WHERE environment_id = %(env)s AND expires_at > now() AND path <> %(path)s)
                         + greatest(octet_length(%(data)s::text) + octet_length(%(path)s::text), %(min)s) <= %(max)s
                   ON CONFLICT (environment_id, path) DO UPDATE
                   SET content_type = excluded.content_type, data = excluded.data, expires_at = excluded.expires_at""",
                {"env": env_id, "path": path, "type": content_type, "data": data, "ttl": ttl_s, "max": max_bytes,
                 "min": min_bytes})
            return cur.rowcount == 1

    async def get_many(self, env_id: str, paths: Sequence[str]) -> dict[str, UploadedPacket]:
        """The environment's unexpired packets among ``paths``, by path, in one query."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """SELECT path, content_type, data FROM uploaded_packet
                   WHERE environment_id = %s AND path = ANY(%s) AND expires_at > now()""", (env_id, list(paths)))
            return {r[0]: UploadedPacket(r[1], r[2]) for r in await cur.fetchall()}

    async def delete_expired(self, limit: int) -> int:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                """DELETE FROM uploaded_packet WHERE ctid IN (
                       SELECT ctid FROM uploaded_packet WHERE expires_at <= now() LIMIT %s FOR UPDATE SKIP LOCKED)""",
                (limit,))
            return cur.rowcount
