"""The API's request rate limit (GCRA in Redis, one Lua call for concurrent requests) and the
per-credential caps on open long-lived requests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from run_engine.ratelimit import ConnectionCaps, RequestLimiter, TooMany

pytestmark = pytest.mark.cluster  # also on a Redis Cluster (tests/conftest.py)


async def test_a_bucket_gets_its_burst_then_waits_and_others_are_untouched(
        redis_client: aioredis.Redis, key_prefix: str, unique: str) -> None:
    limiter = RequestLimiter(redis_client, prefix=f"{key_prefix}:{unique}", rate_per_s=10, burst=5)
    answers = await asyncio.gather(*(limiter.retry_after_s("env:a") for _ in range(8)))
    assert answers[:5] == [None] * 5 and all(a is not None and a >= 1 for a in answers[5:])
    assert await limiter.retry_after_s("env:b") is None  # another credential's budget
    await asyncio.sleep(0.25)  # two emission intervals later: two more
    assert [await limiter.retry_after_s("env:a") for _ in range(3)][:2] == [None, None]


async def test_no_rate_means_no_limit_and_a_redis_failure_lets_requests_through(
        redis_client: aioredis.Redis, key_prefix: str) -> None:
    off = RequestLimiter(redis_client, prefix=key_prefix, rate_per_s=0)
    assert all([await off.retry_after_s("x") is None for _ in range(100)])
    broken = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    limiter = RequestLimiter(broken, prefix=key_prefix, rate_per_s=1, burst=1)
    assert [await limiter.retry_after_s("x") for _ in range(3)] == [None, None, None]
    await broken.aclose()


def test_caps_count_open_requests_per_credential() -> None:
    caps = ConnectionCaps({"streams": 2})
    with caps.hold("streams", "env:a"), caps.hold("streams", "env:a"):
        with pytest.raises(TooMany):
            with caps.hold("streams", "env:a"):
                pass
        with caps.hold("streams", "env:b"):  # another credential
            assert caps.open("streams", "env:b") == 1
        assert caps.open("streams", "env:a") == 2
    assert caps.open("streams", "env:a") == 0 and caps._open == {}


async def test_grants_spend_locally_and_the_limit_holds(redis_client: aioredis.Redis, key_prefix: str,
                                                        unique: str) -> None:
    limiter = RequestLimiter(redis_client, prefix=f"{key_prefix}:{unique}", rate_per_s=500, burst=50)
    assert limiter.grant == 10
    calls = 0
    decide = limiter._decide

    async def counting(keys: list[str]) -> list[int]:
        nonlocal calls
        calls += 1
        return await decide(keys)

    limiter._decide = counting  # type: ignore[method-assign]
    limiter._batcher._flush = counting
    allowed = 0
    for _ in range(30):  # one after another: grants of 10 spent locally
        allowed += await limiter.retry_after_s("env:g") is None
    assert allowed == 30 and calls <= 4
    burst = await asyncio.gather(*(limiter.retry_after_s("env:g") for _ in range(200)))
    granted = sum(a is None for a in burst)
    assert 10 <= granted <= 50 and granted < 200  # never more than the bucket holds


async def test_grants_taken_by_overlapping_calls_are_all_spent(redis_client: aioredis.Redis, key_prefix: str,
                                                                 unique: str) -> None:
    """Two calls of one bucket overlapped, each took a grant: the later one replaced what was left
    of the other's, and requests the bucket had paid for were refused."""
    limiter = RequestLimiter(redis_client, prefix=f"{key_prefix}:{unique}", rate_per_s=500, burst=50)
    grants = iter([10, 10])

    async def two_grants(keys: list[str]) -> list[int]:
        return [next(grants) for _ in keys]

    limiter._decide = two_grants  # type: ignore[method-assign]
    limiter._batcher = type(limiter._batcher)(two_grants, max_batch=1, max_in_flight=2, split=False)
    assert await asyncio.gather(limiter.retry_after_s("env:a"), limiter.retry_after_s("env:a")) == [None, None]
    assert limiter._local["env:a"][0] == 18  # both grants, less the two requests they let in


async def test_a_key_that_matched_nothing_is_refused_for_a_while_without_a_look_up(h: Any) -> None:
    """A client left with a wrong or rotated key retries at full speed: two queries a request."""
    import httpx

    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    looked = 0
    real = h.engine.environment_by_key_hash

    async def counting(key_hash: str) -> Any:
        nonlocal looked
        looked += 1
        return await real(key_hash)

    h.engine.environment_by_key_hash = counting
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t",
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t") as c:
        for _ in range(5):
            r = await c.get("/api/v1/runs", headers={"Authorization": "Bearer tr_dev_wrong"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
        assert looked == 1
        ok = await c.get("/api/v1/runs", headers={"Authorization": f"Bearer {h.env.api_key}"})
        assert ok.status_code == 200


async def test_a_public_token_naming_an_unknown_environment_is_looked_up_once_and_few_at_a_time(h: Any) -> None:
    """A JWT is read before its signature can be checked: anyone could send one naming a new
    environment id each time, each a query of its own beside every tenant's work."""
    import base64
    import json
    import secrets

    import httpx

    from run_engine.api import context as context_module
    from run_engine.api.app import create_app
    from run_engine.api.context import ApiContext
    from run_engine.run_tokens import RunTokens
    from run_engine.wakeups import WakeUps

    looked = at_once = most = 0
    real = h.engine.environment

    async def counting(env_id: str) -> Any:
        nonlocal looked, at_once, most
        looked += 1
        at_once += 1
        most = max(most, at_once)
        try:
            await asyncio.sleep(0.01)
            return await real(env_id)
        finally:
            at_once -= 1

    def forged(env_id: str) -> str:
        def part(data: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
        return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part({'sub': env_id, 'scopes': ['read:runs']})}.x"

    h.engine.environment = counting
    ctx = ApiContext(engine=h.engine, tokens=RunTokens("test-secret"), public_url="http://t",
                     wakeups=WakeUps(h.engine.redis, channel=f"{h.engine.resources.settings.key_prefix}:wake"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://t") as c:
        unknown = f"env_{secrets.token_hex(12)}"
        for _ in range(5):
            r = await c.get("/api/v1/runs", headers={"Authorization": f"Bearer {forged(unknown)}"})
            assert r.status_code == 401
        assert looked == 1  # refused for a while without another query
        answers = await asyncio.gather(*(
            c.get("/api/v1/runs", headers={"Authorization": f"Bearer {forged(f'env_{secrets.token_hex(12)}')}"})
            for _ in range(40)))
        assert {a.status_code for a in answers} == {401}
        assert most <= context_module.LOOKUPS_AT_ONCE  # never more queries at once than that
