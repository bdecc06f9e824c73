"""The API's limits per credential (API.md, "Limits"), so that one tenant cannot slow another:

* :class:`RequestLimiter`: requests per second per API key (its environment, run tokens included)
  and per worker group token, a GCRA in Redis (``lua/ratelimit_gcra.lua``) shared by every server
  process; concurrent requests are decided in one Lua call.
* :class:`ConnectionCaps`: open long-polls and realtime streams per credential in this process, so
  that idle or slow clients cannot hold the server's memory and connections.
* :class:`ReadGate`: reads in flight at once per environment and in all, in this process, for reads
  whose cost a tenant's own data decides (a realtime shape over a million tagged runs): they wait
  their turn instead of taking the database pool every tenant's work needs.

Over a limit the API answers 429 with ``Retry-After``. A Redis error lets the request through (a
limiter must not take the API down with it) and is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator

from redis.asyncio import Redis

from run_engine.batching import Batcher
from run_engine.lua_scripts import LuaScript

log = logging.getLogger(__name__)


class RequestLimiter:
    """Requests per second per bucket, shared by every server process through Redis. A process
    takes a *grant* of ``rate / 50`` requests at a time (one for low rates) and spends it locally
    within a second, so a busy credential costs one Redis call per grant, not per request; the
    limit may be exceeded by at most one grant per server process."""

    GRANT_SHARE = 50  # a grant is 1/50 of a second's rate
    GRANT_TTL_S = 1.0  # unspent requests of a grant lapse after this

    def __init__(self, redis: Redis, *, prefix: str, rate_per_s: float | None, burst: int | None = None) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:{{rl}}"
        self.rate = rate_per_s if rate_per_s and rate_per_s > 0 else None
        self.burst = max(1, int(burst if burst else (self.rate or 1)))
        self.grant = max(1, min(self.burst, int((self.rate or 0) / self.GRANT_SHARE)))
        self._script = LuaScript.get("ratelimit_gcra")
        self._batcher: Batcher[str, int] = Batcher(self._decide, max_batch=500, split=False)
        self._local: dict[str, tuple[int, float]] = {}  # bucket -> (requests left of its grant, lapse time)
        self._warned = 0.0

    async def retry_after_s(self, bucket: str) -> int | None:
        """None when a request of ``bucket`` may go ahead; else whole seconds to wait."""
        if self.rate is None:
            return None
        now = time.monotonic()
        left, lapse = self._local.get(bucket, (0, 0.0))
        if left > 0 and now < lapse:
            self._local[bucket] = (left - 1, lapse)
            return None
        try:
            granted = await self._batcher.submit(f"{self.prefix}:{bucket}")
        except Exception:
            if time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                log.warning("request rate limiter unavailable; letting requests through", exc_info=True)
            return None
        if granted > 0:
            if granted > 1:
                if len(self._local) > 100_000:
                    self._local.clear()
                # added to what is left of a grant another call took meanwhile (calls overlap: up
                # to four batches at once), not in its place: a grant thrown away refused a busy
                # tenant below its own rate
                now = time.monotonic()
                left, lapse = self._local.get(bucket, (0, 0.0))
                self._local[bucket] = ((left if now < lapse else 0) + granted - 1, now + self.GRANT_TTL_S)
            return None
        return max(1, math.ceil(-granted / 1000))

    async def _decide(self, keys: list[str]) -> list[int]:
        assert self.rate is not None
        interval = 1000 / self.rate
        # one grant per bucket and call; a bucket asked for again in the same call gets single requests
        wants, seen = [], set()
        for key in keys:
            wants.append(self.grant if key not in seen else 1)
            seen.add(key)
        replies = await self._script(self.redis, keys, [int(time.time() * 1000), interval,
                                                        interval * (self.burst - 1), *wants])
        return [int(r) for r in replies]


class TooMany(Exception):
    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"at most {limit} open {what} per credential; close some or retry later")
        self.limit = limit


class ConnectionCaps:
    """Counts of open long-lived requests per (kind, credential) in this process."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits
        self._open: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def hold(self, kind: str, bucket: str) -> Iterator[None]:
        key = (kind, bucket)
        current = self._open.get(key, 0)
        limit = self.limits.get(kind)
        if limit is not None and current >= limit:
            raise TooMany(kind, limit)
        self._open[key] = current + 1
        try:
            yield
        finally:
            left = self._open[key] - 1
            if left:
                self._open[key] = left
            else:
                del self._open[key]

    def open(self, kind: str, bucket: str) -> int:
        return self._open.get((kind, bucket), 0)


class ReadGate:
    """At most ``per_key`` holders per key (an environment) and ``total`` in all at once; the
    others wait their turn, a key's in its own queue before it takes one of the ``total`` turns
    (a busy key's queue holds no turn another key could use)."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self._total = asyncio.Semaphore(total)
        self._keys: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # key -> (its gate, [users])

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = (asyncio.Semaphore(self.per_key), [0])
        gate, users = entry
        users[0] += 1
        try:
            async with gate, self._total:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._keys[key]

    def waiting_or_reading(self, key: str) -> int:
        entry = self._keys.get(key)
        return entry[1][0] if entry else 0
