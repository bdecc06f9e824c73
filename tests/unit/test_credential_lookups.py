"""Credential look-ups that miss the caches: at most LOOKUPS_AT_ONCE in flight per process (a flood
of unknown keys takes a bounded share of the database pool), and a worker token that matched
nothing is refused for a few seconds without another look-up, as an API key is."""

from __future__ import annotations

import asyncio
import secrets
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from run_engine.api.context import LOOKUPS_AT_ONCE, ApiContext
from run_engine.api.http import ApiError
from run_engine.run_tokens import RunTokens


class SlowDirectory:
    """An engine whose credential look-ups wait until released, counting how many run at once."""

    async def _find(self, key_hash: str) -> None:
        self.calls += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1

    environment_by_key_hash = worker_group_by_token_hash = _find

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = self.most = self.calls = 0
        self.redis = Marks()
        self.settings = SimpleNamespace(key_prefix="t")

    def now(self) -> float:
        return 0.0


class Marks:
    """What the look-ups keep in Redis (the installation's, shared by its processes)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    async def exists(self, key: str) -> int:
        return int(key in self.data)

    async def set(self, key: str, value: object, ex: int | None = None) -> None:
        self.data[key] = value


def context(engine: Any) -> ApiContext:
    return ApiContext(engine=engine, tokens=RunTokens("s"), wakeups=None, public_url="http://t")  # type: ignore[arg-type]


def request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


async def test_lookups_of_unknown_keys_are_bounded_in_flight() -> None:
    engine = SlowDirectory()
    ctx = context(engine)
    calls = [asyncio.ensure_future(ctx.environment_by_key(secrets.token_hex(8))) for _ in range(20)]
    for _ in range(50):  # every call has run as far as it can (no look-up ever finishes)
        await asyncio.sleep(0)
    assert engine.running == engine.most == LOOKUPS_AT_ONCE  # the others wait their turn
    engine.release.set()
    assert await asyncio.gather(*calls) == [None] * 20
    assert engine.most == LOOKUPS_AT_ONCE and engine.calls == 20


async def test_a_worker_token_that_matched_nothing_is_refused_without_looking_again() -> None:
    engine = SlowDirectory()
    engine.release.set()
    ctx = context(engine)
    token = secrets.token_hex(16)
    for _ in range(3):
        with pytest.raises(ApiError) as refused:
            await ctx.worker_group(request(token))
        assert refused.value.status == 401
    assert engine.calls == 2  # the first try: the group, then an environment; none after


def directory_knowing(good: str) -> SlowDirectory:
    """A SlowDirectory in which the key ``good`` matches an environment (found at once)."""
    from run_engine.tenancy import hash_secret

    engine = SlowDirectory()
    real_find = engine._find

    async def find(key_hash: str) -> object:
        if key_hash == hash_secret(good):
            return "the environment"
        return await real_find(key_hash)

    engine.environment_by_key_hash = find  # type: ignore[method-assign]
    return engine


async def test_a_key_that_matched_lately_is_not_held_behind_a_flood() -> None:
    engine = directory_knowing(good := "good-key")
    ctx = context(engine)
    assert await ctx.environment_by_key(good) == "the environment"
    ctx._envs = type(ctx._envs)()  # its 5 s cache expired
    flood = [asyncio.ensure_future(ctx.environment_by_key(secrets.token_hex(8))) for _ in range(20)]
    for _ in range(50):
        await asyncio.sleep(0)
    assert engine.running == LOOKUPS_AT_ONCE  # the flood holds every slot
    assert await asyncio.wait_for(ctx.environment_by_key(good), 5) == "the environment"
    engine.release.set()
    await asyncio.gather(*flood)


async def test_a_key_that_matched_lately_in_another_process_is_not_held_behind_a_flood() -> None:
    """A process just started (a restart, a deploy) knows no key yet: a key that matched in the
    process before (or another one) is not held behind a flood of unknown keys, which took every
    look-up slot (each tenant's first request waited behind the whole flood)."""
    engine = directory_knowing(good := "good-key")
    assert await context(engine).environment_by_key(good) == "the environment"  # the process before
    from run_engine.tenancy import hash_secret

    assert not any(hash_secret(good) in k for k in engine.redis.data)  # no credential's hash in Redis
    restarted = context(engine)
    flood = [asyncio.ensure_future(restarted.environment_by_key(secrets.token_hex(8))) for _ in range(20)]
    for _ in range(50):
        await asyncio.sleep(0)
    assert engine.running == LOOKUPS_AT_ONCE  # the flood holds every slot
    assert await asyncio.wait_for(restarted.environment_by_key(good), 5) == "the environment"
    waiting = asyncio.ensure_future(restarted.environment_by_key("never-matched"))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not waiting.done()  # behind the flood, as before
    engine.release.set()
    await asyncio.gather(*flood)
    assert await waiting is None
