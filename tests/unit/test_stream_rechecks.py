"""A stream's credential is checked again as it goes: refused, the stream ends; not checkable now
(PostgreSQL or Redis away), it goes on and is checked at the next chunk, but not for longer than
a few intervals (a session signed out or a key rotated during an outage was streamed to for as
long as the outage lasted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from redis.exceptions import ConnectionError as RedisConnectionError

from run_engine.api.stream import UNCHECKED_CHECKS, while_allowed


async def ticks(every_s: float) -> AsyncGenerator[bytes, None]:
    n = 0
    while True:
        await asyncio.sleep(every_s)
        n += 1
        yield f"{n}\n".encode()


async def collect(allowed: object, every_s: float, most: int = 10_000) -> list[bytes]:
    got: list[bytes] = []
    async for chunk in while_allowed(ticks(every_s / 4), allowed, every_s):  # type: ignore[arg-type]
        got.append(chunk)
        if len(got) >= most:
            break
    return got


async def test_a_credential_that_cannot_be_checked_for_a_few_intervals_ends_the_stream() -> None:
    calls = 0

    async def unreachable() -> bool:
        nonlocal calls
        calls += 1
        raise RedisConnectionError("connection refused")

    got = await asyncio.wait_for(collect(unreachable, 0.02), 10)
    assert got and calls >= 2  # went on past the first failed checks, then ended
    assert len(got) < 10_000


async def test_a_check_failing_now_and_then_keeps_the_stream_and_a_refusal_ends_it() -> None:
    answers = [RedisConnectionError("blip"), True] * (UNCHECKED_CHECKS * 10) + [False]

    async def flaky() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    got = await asyncio.wait_for(collect(flaky, 0.01), 20)
    assert answers == [] and got  # every check was made, the stream lasting until the refusal
