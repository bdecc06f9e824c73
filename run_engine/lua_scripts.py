"""Lua scripts from ``lua/*.lua``: loaded once, called by SHA, reloaded on NOSCRIPT.

One :class:`LuaScript` per file; a file may start with ``-- include: <lib>`` to share helpers.
The lock, job and rate-limit scripts are given every key they touch in ``KEYS``. The run-queue
scripts are given one key of their shard in ``KEYS`` and the shard's base (``<prefix>:{rq:N}``) in
``ARGV[1]``, and build the other keys from it, as ``lua/queue_lib.lua`` lays them out
(``run_engine/run_queue/keys.py`` builds the same names; a test checks they agree): every one of them
carries the shard's hash tag, so a script touches one cluster slot, the slot of its declared key.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from run_engine._resources import read_text
from run_engine.redis_connect import clustered

KeyOrArg = str | bytes | int | float
Call = tuple[Sequence[KeyOrArg], Sequence[KeyOrArg]]  # (keys, args)


class LuaScript:
    """A script of ``lua/<name>.lua``, executed with EVALSHA and loaded on NOSCRIPT."""

    _cache: dict[str, LuaScript] = {}
    CLUSTER_CHUNK = 32  # concurrent calls of call_many on a cluster (each needs a connection)
    source: str

    def __init__(self, name: str) -> None:
        self.name = name
        source = read_text("lua", f"{name}.lua")
        # A script may start with `-- include: <lib>`: that library file is put in front of it,
        # so scripts share helpers without copies (each file still runs as one script).
        first = source.split("\n", 1)[0]
        if first.startswith("-- include: "):
            source = read_text("lua", f"{first.removeprefix('-- include: ').strip()}.lua") + "\n" + source
        self.source = source
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    @classmethod
    def get(cls, name: str) -> LuaScript:
        script = cls._cache.get(name)
        if script is None:
            script = cls._cache[name] = cls(name)
        return script

    async def load(self, client: Redis) -> None:
        await client.script_load(self.source)

    async def __call__(self, client: Redis, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(client)
            return await client.evalsha(self.sha, len(keys), *keys, *args)

    async def call_many(self, client: Redis, calls: Sequence[Call]) -> list[Any]:
        """Many calls of this script, ``(keys, args)`` each: one pipeline on a standalone server;
        on a cluster (whose client pipelines no scripts) concurrent calls, a chunk at a time."""
        if not calls:
            return []
        if clustered(client):
            out: list[Any] = []
            for i in range(0, len(calls), self.CLUSTER_CHUNK):
                chunk = calls[i:i + self.CLUSTER_CHUNK]
                out += await asyncio.gather(*(self(client, keys, args) for keys, args in chunk))
            return out

        async def send() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(self.sha, len(keys), *keys, *args)
            return list(await pipe.execute())

        try:
            return await send()
        except NoScriptError:  # Redis restarted since the script was loaded
            await self.load(client)
            return await send()
