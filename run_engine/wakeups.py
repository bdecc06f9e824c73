"""Wake-ups for long-polling dequeues.

When runs are enqueued for a worker group (or its runs finish and free concurrency), the engine
calls :meth:`WakeUps.notify`: waiters in this process wake at once, and a Redis PUBLISH wakes the
waiters of every other server process. A waiter re-checks the queue after each wake-up, so a lost
message only costs a bounded wait, never a lost run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis

log = logging.getLogger(__name__)


class WakeUps:
    def __init__(self, redis: Redis, *, channel: str) -> None:
        self.redis = redis
        self.channel = channel
        self._events: dict[str, asyncio.Event] = {}
        self._pending: set[str] = set()
        self._flush: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None

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
        try:
            await self.redis.publish(self.channel, ",".join(sorted(groups)))
        except Exception:  # waiters fall back to their bounded wait
            log.warning("could not publish wake-ups", exc_info=True)

    async def wait(self, group: str, timeout_s: float) -> bool:
        """Wait until ``group`` may have work, at most ``timeout_s``; True if woken."""
        if timeout_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._event(group).wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel)
                try:
                    async for message in pubsub.listen():
                        data = message.get("data")
                        if isinstance(data, bytes):
                            for group in data.decode().split(","):
                                self._wake_local(group)
                finally:
                    await pubsub.aclose()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("wake-up subscription lost; resubscribing", exc_info=True)
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        for task in (self._listener, self._flush):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._listener = None
