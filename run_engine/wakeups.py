"""Wake-ups for long-polling dequeues.

When runs are enqueued for a worker group (or its runs finish and free concurrency), the engine
calls :meth:`WakeUps.notify`: waiters in this process wake at once, and a Redis PUBLISH wakes the
waiters of every other server process. A waiter re-checks the queue after each wake-up, so a lost
message only costs a bounded wait, never a lost run.

A server alone on a standalone Redis (its last PUBLISH reached only its own subscription) skips
the PUBLISH for :data:`ALONE_RECHECK_S`: nobody else would hear it. A server process that starts
meanwhile is heard from at the next PUBLISH, at most that long later; until then its waiters fall
back to their bounded wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from redis.asyncio import Redis

from run_engine.pubsub import Subscription
from run_engine.redis_connect import clustered
from run_engine.tasks import stop_task

log = logging.getLogger(__name__)
ALONE_RECHECK_S = 1.0


class WakeUps:
    def __init__(self, redis: Redis, *, channel: str) -> None:
        self.redis = redis
        self.channel = channel
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}  # waiters per key, so an idle key's event is dropped
        self._pending: set[str] = set()
        self._flush: asyncio.Task[None] | None = None
        self._subscription = Subscription(redis, [channel], self._on_message, "wake-up")
        self._released: dict[str, float] = {}  # worker instance -> when it said it is stopping
        self._stopping = False
        self._alone_until = 0.0  # no other process subscribed when last looked: no PUBLISH till then
        self.published = 0

    def _event(self, group: str) -> asyncio.Event:
        event = self._events.get(group)
        if event is None:
            event = self._events[group] = asyncio.Event()
        return event

    def _wake_local(self, group: str) -> None:
        event = self._events.pop(group, None)
        if event is not None:
            event.set()

    def notify(self, group: str) -> None:
        """Wake the waiters of ``group`` here now, and elsewhere with one PUBLISH per loop tick."""
        self._wake_local(group)
        self._pending.add(group)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        await asyncio.sleep(0)
        groups, self._pending = self._pending, set()
        now = time.monotonic()
        if now < self._alone_until and self._subscription.subscribed:
            return  # nobody else listens: the local wake-up was all there was to do
        try:
            receivers = await self.redis.publish(self.channel, ",".join(sorted(groups)))
        except Exception:  # waiters fall back to their bounded wait
            log.warning("could not publish wake-ups", exc_info=True)
            return
        self.published += 1
        # only our own subscription heard it (a cluster counts one node's subscribers: always publish)
        alone = receivers == 1 and self._subscription.subscribed and not clustered(self.redis)
        self._alone_until = now + ALONE_RECHECK_S if alone else 0.0

    def release(self, instance: str, group: str) -> None:
        """A worker instance is stopping: its long-polls here and elsewhere end without runs."""
        key = self._instance_key(instance)
        self._mark_released(key)
        self._wake_local(group)
        self._pending.add(f"!{key}")
        self._pending.add(group)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._publish())

    @staticmethod
    def _instance_key(instance: str) -> str:  # names may hold any character, a comma too
        return hashlib.blake2b(instance.encode(), digest_size=12).hexdigest()

    def _mark_released(self, key: str) -> None:
        now = time.monotonic()
        if len(self._released) > 1000:  # marks only matter for the polls open at the time
            self._released = {k: t for k, t in self._released.items() if now - t < 120}
            if len(self._released) > 10_000:  # a flood of names: forgetting costs a poll its full wait, no more
                self._released.clear()
        self._released[key] = now

    def released(self, instance: str, *, since: float) -> bool:
        """Whether ``instance`` said it is stopping after ``since`` (a monotonic time)."""
        at = self._released.get(self._instance_key(instance))
        return at is not None and at >= since

    @property
    def stopping(self) -> bool:
        """The server is stopping: long-polls answer now instead of being cut off."""
        return self._stopping

    def stop_waiting(self) -> None:
        """Wake every waiter now and let no new wait block (the server is stopping)."""
        self._stopping = True
        for event in self._events.values():
            event.set()

    async def wait(self, group: str, timeout_s: float) -> bool:
        """Wait until ``group`` may have work, at most ``timeout_s``; True if woken."""
        if timeout_s <= 0 or self._stopping:
            return False
        event = self._event(group)
        self._waiters[group] = self._waiters.get(group, 0) + 1
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            left = self._waiters.pop(group) - 1
            if left:
                self._waiters[group] = left
            elif self._events.get(group) is event:
                del self._events[group]  # nobody waits on it: keys of runs never woken do not pile up

    async def start(self) -> None:
        self._subscription.start()

    def _on_message(self, channel: str, data: str) -> None:
        for group in data.split(","):
            if group.startswith("!"):
                self._mark_released(group[1:])
            else:
                self._wake_local(group)

    async def stop(self) -> None:
        await self._subscription.stop()
        await stop_task(self._flush)
