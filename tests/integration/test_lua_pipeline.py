"""Lua calls made in one event-loop tick on one client go out as one pipeline; each caller gets its
own reply or error, and a script the server has not loaded is loaded on the way (real Redis)."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from run_engine.lua_scripts import LuaScript


def script(source: str) -> LuaScript:
    """A script of its own (a unique comment, so the server has never loaded it)."""
    s = LuaScript.__new__(LuaScript)
    s.name = "test"
    s.source = f"-- {secrets.token_hex(8)}\n{source}"
    import hashlib

    s.sha = hashlib.sha1(s.source.encode()).hexdigest()
    return s


async def test_calls_of_one_tick_share_a_round_trip_and_keep_their_own_results(
        redis_client: aioredis.Redis, key_prefix: str) -> None:
    echo = script("return ARGV[1]")
    incr = script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    fail = script("return redis.call('INCR', KEYS[1])")  # on a key holding a string: an error
    key, text = f"{key_prefix}:lp:{secrets.token_hex(4)}", f"{key_prefix}:lp:{secrets.token_hex(4)}"
    await redis_client.set(text, "not a number")
    sent: list[int] = []
    execute = aioredis.client.Pipeline.execute

    async def counting(self: aioredis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        sent.append(len(self.command_stack))
        return await execute(self, raise_on_error=raise_on_error)

    aioredis.client.Pipeline.execute = counting  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(
            echo(redis_client, [], ["a"]), incr(redis_client, [key], [2]), fail(redis_client, [text], []),
            incr(redis_client, [key], [3]), echo(redis_client, [], ["b"]), return_exceptions=True)
    finally:
        aioredis.client.Pipeline.execute = execute  # type: ignore[method-assign]
    assert results[0] == b"a" and results[4] == b"b"
    assert sorted([results[1], results[3]]) == [2, 5]  # type: ignore[type-var]
    assert isinstance(results[2], ResponseError)  # the failing call fails alone
    assert sent and sent[0] == 5  # the five calls went out together (then NOSCRIPT loads, one by one)
    # a lone call is a plain EVALSHA, and the scripts are loaded now
    assert await echo(redis_client, [], ["c"]) == b"c"
    with pytest.raises(ResponseError):
        await fail(redis_client, [text], [])
    await redis_client.delete(key, text)
