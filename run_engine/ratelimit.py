"""The API's limits per credential (API.md, "Limits"), so that one tenant cannot slow another:

* :class:`RequestLimiter`: requests per second per API key (its environment, run tokens included)
  and per worker group token, a GCRA in Redis (``lua/ratelimit_gcra.lua``) shared by every server
  process; concurrent requests are decided in one Lua call.
* :class:`ConnectionCaps`: open long-polls and realtime streams per credential in this process, so
  that idle or slow clients cannot hold the server's memory and connections.
* :class:`ReadGate`: reads in flight at once per environment and in all, in this process, for reads
  whose cost a tenant's own data decides (a realtime shape over a million tagged runs, a run list
  filtered by tag): they wait their turn instead of taking the database pool every tenant's work
  needs, and an environment whose reads queue up waits behind its own, not in front of others'.

Over a limit the API answers 429 with ``Retry-After``. A Redis error lets the request through (a
limiter must not take the API down with it) and is logged.
"""

from __future__ import annotations

import asyncio
import collections
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

    async def drain(self, within_s: float) -> None:
        """The decisions under way end (or are cancelled past ``within_s``) before Redis closes."""
        await self._batcher.drain(within_s)

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
    """At most ``per_key`` turns per key (an environment) and ``total`` in all at once. The keys
    with reads waiting take the turns given back in rotation, a key that holds fewer turns first: a
    key that holds none is served at the next turn given back unless others that hold none are
    ahead of it in the rotation, and then after one read of each, however many reads any key has
    queued (a key's queued reads wait behind each other, never in front of another key's). Taking
    a free turn costs O(1), giving one back O(keys waiting), nothing per read waiting.

    The key is the environment the caller authenticated as, never a name the request carries (a
    caller who could choose keys would count as many tenants)."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self._in_use = 0
        self._keys: dict[str, _Key] = {}  # keys holding or waiting for a turn
        # the keys with reads waiting, in rotation order (a key served goes to the back: dicts
        # keep their order)
        self._ring: dict[str, _Key] = {}

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = _Key()
        if not entry.waiters and entry.held < self.per_key and self._in_use < self.total:
            entry.held += 1
            self._in_use += 1
        else:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry.waiters.append(waiter)
            self._ring.setdefault(key, entry)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # given a turn as it was cancelled
                    self._give_back(key, entry)
                elif waiter in entry.waiters:  # (else a turn given back found it cancelled, dropped it)
                    entry.waiters.remove(waiter)
                    if not entry.waiters:
                        del self._ring[key]
                    self._forget(key, entry)
                raise
        try:
            yield
        finally:
            self._give_back(key, entry)

    def _give_back(self, key: str, entry: _Key) -> None:
        entry.held -= 1
        self._in_use -= 1
        self._forget(key, entry)
        while self._in_use < self.total:
            chosen: tuple[str, _Key] | None = None
            for name, candidate in self._ring.items():  # the fewest turns held, the first of those
                if candidate.held < self.per_key and (chosen is None or candidate.held < chosen[1].held):
                    chosen = (name, candidate)
                    if not candidate.held:
                        break
            if chosen is None:
                return
            name, served = chosen
            del self._ring[name]
            waiter = served.waiters.popleft()
            if served.waiters:
                self._ring[name] = served  # to the back of the rotation
            if waiter.cancelled():  # its task has not run since: nothing to give it
                self._forget(name, served)
                continue
            served.held += 1
            self._in_use += 1
            waiter.set_result(None)

    def _forget(self, key: str, entry: _Key) -> None:
        if not entry.held and not entry.waiters:
            del self._keys[key]

    def waiting_or_reading(self, key: str) -> int:
        entry = self._keys.get(key)
        return entry.held + len(entry.waiters) if entry else 0


class _Key:
    """A key's turns held and its reads waiting, oldest first."""

    __slots__ = ("held", "waiters")

    def __init__(self) -> None:
        self.held = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
