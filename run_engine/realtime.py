"""Realtime run updates across server processes (Redis pub/sub), for Server-Sent Events.

Only watched runs cost anything: a process serving an SSE client for run X records X in the
``<prefix>:rt:watch`` hash (with an expiry it keeps pushing back) and announces it on
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
        self.watch_key = f"{prefix}:rt:watch"
        self._watched: dict[str, float] = {}  # run id → expiry (monotonic), cluster-wide
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
        await self._announce(run_id)  # before the caller reads the run: later changes are published
        keeper = asyncio.create_task(self._keep_watching(run_id))
        try:
            yield changed
        finally:
            keeper.cancel()
            subs = self._local.get(run_id)
            if subs is not None:
                subs.discard(changed)
                if not subs:
                    del self._local[run_id]

    async def _announce(self, run_id: str) -> None:
        self._watched[run_id] = time.monotonic() + WATCH_TTL_S
        with contextlib.suppress(Exception):
            await self.redis.hset(self.watch_key, run_id, str(time.time() + WATCH_TTL_S))
            await self.redis.publish(self.ctl, f"{run_id} {WATCH_TTL_S}")

    async def _keep_watching(self, run_id: str) -> None:
        while True:
            await asyncio.sleep(WATCH_TTL_S / 3)
            await self._announce(run_id)

    async def start(self) -> None:
        if self._subscription.running:
            return
        with contextlib.suppress(Exception):
            now = time.time()
            for run, expires in (await self.redis.hgetall(self.watch_key)).items():
                left = float(expires) - now
                if left > 0:
                    self._watched[run.decode() if isinstance(run, bytes) else run] = time.monotonic() + left
                else:
                    await self.redis.hdel(self.watch_key, run)
        self._subscription.start()

    def _on_message(self, channel: str, data: str) -> None:
        if channel == self.ctl:
            run_id, ttl = data.split(" ", 1)
            self._watched[run_id] = time.monotonic() + float(ttl)
        else:
            for run_id in data.split(","):
                for event in self._local.get(run_id, ()):
                    event.set()

    async def stop(self) -> None:
        await self._subscription.stop()
        await stop_task(self._flush)
