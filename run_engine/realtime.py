"""Realtime run updates across server processes (Redis pub/sub), for Server-Sent Events.

Only watched runs cost anything: a process serving an SSE client for run X records X in the
``<prefix>:rt:watching`` sorted set (scored by an expiry it keeps pushing back; what expired is
dropped, here and in every process's memory, at most once per ``WATCH_TTL_S``) and announces it on
``<prefix>:rt:ctl``; every process keeps that set in memory, and when its engine emits an event
for a watched run it publishes the run id on ``<prefix>:rt:run`` (one PUBLISH per loop tick for all
such runs). The process holding the client then re-reads the run. A whole environment is watched
the same way under ``env:<env id>`` (run ids never contain a colon). Clients also re-read every few
seconds, so a lost message only delays an update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

from redis.asyncio import Redis

from run_engine.events import RunEvent
from run_engine.pubsub import Subscription
from run_engine.tasks import stop_task

log = logging.getLogger(__name__)
WATCH_TTL_S = 60.0


def env_key(env_id: str) -> str:
    """What to watch to hear of every run of an environment (the dashboard's runs list)."""
    return f"env:{env_id}"


class RealtimeHub:
    def __init__(self, redis: Redis, *, prefix: str) -> None:
        self.redis = redis
        self.ctl = f"{prefix}:rt:ctl"
        self.channel = f"{prefix}:rt:run"
        self.watch_key = f"{prefix}:rt:watching"
        self._watched: dict[str, float] = {}  # run id → expiry (monotonic), cluster-wide
        self._pruned = time.monotonic()
        self._renewals: set[asyncio.Task[None]] = set()
        self._local: dict[str, set[asyncio.Event]] = {}
        self._pending: set[str] = set()
        self._flush: asyncio.Task[None] | None = None
        self._subscription = Subscription(redis, [self.ctl, self.channel], self._on_message, "realtime")

    # --- the engine's side: publish changes of watched runs -------------------------------------

    def on_event(self, event: RunEvent) -> None:
        if not self._watched:
            return
        for key in (event.run_id, env_key(event.env_id)):
            expiry = self._watched.get(key)
            if expiry is None:
                continue
            if expiry < time.monotonic():
                del self._watched[key]
                continue
            self._pending.add(key)
            if self._flush is None or self._flush.done():
                self._flush = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        await asyncio.sleep(0)
        runs, self._pending = self._pending, set()
        try:
            await self.redis.publish(self.channel, ",".join(sorted(runs)))
        except Exception:  # subscribers fall back to re-reading the run
            log.warning("could not publish run changes", exc_info=True)

    # --- the SSE side -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(self, run_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever the run may have changed (anywhere in the cluster); with
        ``env_key(env_id)``, whenever any run of the environment may have."""
        changed = asyncio.Event()
        self._local.setdefault(run_id, set()).add(changed)
        keeper: asyncio.Task[None] | None = None
        try:
            await self._announce(run_id)  # before the caller reads the run: later changes are published
            keeper = asyncio.create_task(self._keep_watching(run_id))
            yield changed
        finally:
            if keeper is not None:
                keeper.cancel()
            subs = self._local.get(run_id)
            if subs is not None:
                subs.discard(changed)
                if not subs:
                    del self._local[run_id]

    async def _announce(self, run_id: str) -> None:
        self._watched[run_id] = time.monotonic() + WATCH_TTL_S
        with contextlib.suppress(Exception):
            now = time.time()
            await self.redis.zadd(self.watch_key, {run_id: now + WATCH_TTL_S})
            await self.redis.publish(self.ctl, f"{run_id} {WATCH_TTL_S}")
            if self._prune():
                await self.redis.zremrangebyscore(self.watch_key, "-inf", now)

    def _prune(self) -> bool:
        """Forget the watches that expired (runs nobody streams any more), at most once per
        ``WATCH_TTL_S``; True when it did (the caller drops them from Redis too)."""
        now = time.monotonic()
        if now - self._pruned < WATCH_TTL_S:
            return False
        self._pruned = now
        self._watched = {key: expiry for key, expiry in self._watched.items() if expiry > now}
        return True

    async def _keep_watching(self, run_id: str) -> None:
        while True:
            await asyncio.sleep(WATCH_TTL_S / 3)
            # a watch that ends meanwhile cancels this task, not the announcement: cancelled in the
            # middle of its Redis call, the connection was dropped without being closed
            renewal = asyncio.ensure_future(self._announce(run_id))
            self._renewals.add(renewal)
            renewal.add_done_callback(self._renewals.discard)
            await asyncio.shield(renewal)

    async def start(self) -> None:
        if self._subscription.running:
            return
        with contextlib.suppress(Exception):
            now = time.time()
            await self.redis.zremrangebyscore(self.watch_key, "-inf", now)
            watching = cast("list[tuple[bytes | str, float]]",
                            await self.redis.zrange(self.watch_key, 0, -1, withscores=True))
            for run, expires in watching:
                self._watched[run.decode() if isinstance(run, bytes) else run] = time.monotonic() + expires - now
        self._subscription.start()

    def _on_message(self, channel: str, data: str) -> None:
        if channel == self.ctl:
            run_id, ttl = data.split(" ", 1)
            self._watched[run_id] = time.monotonic() + float(ttl)
            self._prune()
        else:
            for run_id in data.split(","):
                for event in self._local.get(run_id, ()):
                    event.set()

    async def stop(self) -> None:
        await self._subscription.stop()
        await stop_task(self._flush)
        if self._renewals:
            await asyncio.wait(self._renewals, timeout=5)
