"""One Redis pub/sub listener loop, for the wake-ups of long-polls and the realtime hub: it
resubscribes after a lost connection (Redis restarted, a failover) and stops within a second.

On a Redis Cluster it subscribes on one node over a plain connection (a cluster forwards every
PUBLISH to every node), the next known node after a lost connection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from redis.asyncio import ConnectionPool, Redis

from run_engine.redis_connect import clustered
from run_engine.tasks import stop_task

log = logging.getLogger(__name__)


class Subscription:
    """Calls ``on_message(channel, data)`` for each message published on ``channels`` (both as
    ``str``). A message published while the connection was lost is not seen: subscribers must
    fall back to a bounded wait or a re-read."""

    def __init__(self, redis: Redis, channels: Sequence[str], on_message: Callable[[str, str], None],
                 name: str) -> None:
        self.redis = redis
        self.channels = tuple(channels)
        self.on_message = on_message
        self.name = name
        self._task: asyncio.Task[None] | None = None
        self._attempt = 0
        self.subscribed = False  # the connection is subscribed now (messages published now are seen)

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name=f"{self.name}-subscription")

    async def stop(self) -> None:
        task, self._task = self._task, None  # the loop ends when it sees None
        await stop_task(task)

    def _client(self) -> Redis:
        if not clustered(self.redis):
            return self.redis
        nodes = sorted(self.redis.get_nodes(), key=lambda n: n.name)  # type: ignore[attr-defined]
        node = nodes[self._attempt % len(nodes)]
        self._attempt += 1
        return Redis(connection_pool=ConnectionPool(connection_class=node.connection_class, max_connections=1,
                                                    **node.connection_kwargs))

    async def _listen(self) -> None:
        while self._task is not None:
            client = None
            try:
                client = self._client()
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(*self.channels)
                self.subscribed = True
                try:
                    # get_message with a timeout, not listen(): a stop is seen within a second even
                    # when redis-py swallows the cancel (it can, mid-connect)
                    while self._task is not None:
                        message = await pubsub.get_message(timeout=1.0)
                        data = message.get("data") if message else None
                        if isinstance(data, bytes):
                            channel = message["channel"] if message else b""
                            self.on_message(channel.decode() if isinstance(channel, bytes) else str(channel),
                                            data.decode())
                finally:
                    self.subscribed = False
                    await pubsub.aclose()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._task is None:
                    return
                log.warning("%s subscription lost (%s); resubscribing", self.name, exc)
                await asyncio.sleep(0.5)
            finally:
                if client is not None and client is not self.redis:
                    await client.aclose(close_connection_pool=True)
