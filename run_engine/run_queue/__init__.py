"""The fair multi-tenant run queue (Redis + Lua): :class:`RunQueue` and the values it takes and
returns. Keys come from :class:`QueueKeys` (one hash tag per environment's shard); the scripts are
``lua/queue_*.lua``; the layout and each script's contract are in docs/ARCHITECTURE.md."""

from run_engine.run_queue.keys import QueueKeys, jump_hash
from run_engine.run_queue.models import (
    DeadMessage,
    DequeuedMessage,
    DequeuedRun,
    DlqEntry,
    EnqueueItem,
    EnvStats,
    Handed,
    NackResult,
    QueueSettings,
    QueueStats,
    RateLimit,
)
from run_engine.run_queue.queue import RunQueue

__all__ = [
    "DeadMessage",
    "DequeuedMessage",
    "DequeuedRun",
    "DlqEntry",
    "EnqueueItem",
    "EnvStats",
    "Handed",
    "NackResult",
    "QueueKeys",
    "QueueSettings",
    "QueueStats",
    "RateLimit",
    "RunQueue",
    "jump_hash",
]
