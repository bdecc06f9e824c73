"""The engine's Redis client packs commands with hiredis's C packer: the same bytes as redis-py's own
packer, the same DataError for what cannot be sent, on a standalone server and on a cluster."""

from __future__ import annotations

import re

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from run_engine.redis_connect import clustered, packing_in_c

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)

COMMANDS = [
    ("SET", "k", "v"),
    ("CONFIG GET", "maxmemory"),  # a two-word command name is split, as redis-py does
    (b"CLIENT LIST",),
    ("EVALSHA", "0" * 40, 2, "{rq:1}:a", "{rq:1}:b", -7, 2**70, 0.1, 1e-07, -1.5e300, "é\u2603", b"\x00\xff",
     memoryview(b"view"), bytearray(b"arr")),  # hiredis takes no bytearray: redis-py's packer sends it
    ("HSET", "h", *(f"f{i}" for i in range(500)), "x" * 70_000),  # past redis-py's 6,000-byte chunking
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_the_c_packer_writes_the_bytes_redis_py_writes(args: tuple[object, ...]) -> None:
    ours = packing_in_c(Connection)()
    theirs = Connection()
    assert ours is not theirs and type(ours).__name__ == "CPackedConnection"
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


@pytest.mark.parametrize("encoding", [("latin-1", "strict"), ("utf-8", "surrogateescape")], ids=str)
def test_a_connection_told_another_text_encoding_keeps_redis_py_s_packer(encoding: tuple[str, str]) -> None:
    args = ("SET", "k", "é\udcff" if encoding[1] == "surrogateescape" else "é")
    ours = packing_in_c(Connection)(encoding=encoding[0], encoding_errors=encoding[1])
    theirs = Connection(encoding=encoding[0], encoding_errors=encoding[1])
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


@pytest.mark.parametrize("bad", [None, True, {"a": 1}, [1], "\ud800"], ids=repr)
def test_what_redis_py_refuses_the_c_packer_refuses_with_the_same_error(bad: object) -> None:
    with pytest.raises((DataError, UnicodeEncodeError)) as theirs:
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(theirs.type, match=re.escape(str(theirs.value))):
        packing_in_c(Connection)().pack_command("SET", "k", bad)


async def test_the_engine_client_packs_in_c_and_round_trips_every_kind_of_value(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    if clustered(redis_client):
        node = redis_client.get_default_node()  # type: ignore[attr-defined]
        assert node.connection_class.__name__.startswith("CPacked")
    else:
        assert redis_client.connection_pool.connection_class.__name__.startswith("CPacked")
    key = f"{key_prefix}:pack{unique}"
    values = ["plain", "é\u2603", b"\x00\xff\r\n$3\r\n", 42, -1.5, 2**70, "x" * 70_000]
    try:
        await redis_client.rpush(key, *values)  # type: ignore[misc]
        got = await redis_client.lrange(key, 0, -1)  # type: ignore[misc]
        assert got == [v if isinstance(v, bytes) else str(v).encode() for v in values]
        with pytest.raises(DataError):
            await redis_client.set(key + ":none", None)  # type: ignore[arg-type]
        assert await redis_client.ping()  # the refused command left the connection usable
    finally:
        await redis_client.delete(key)
