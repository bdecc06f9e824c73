"""The fair multi-tenant run queue (Redis + Lua)."""

from run_engine.run_queue.keys import QueueKeys, jump_hash
from run_engine.run_queue.models import (
    DequeuedMessage,
    DlqEntry,
    EnqueueItem,
    EnvStats,
    NackResult,
    QueueStats,
)
from run_engine.run_queue.queue import RunQueue

__all__ = [
    "DequeuedMessage",
    "DlqEntry",
    "EnqueueItem",
    "EnvStats",
    "NackResult",
    "QueueKeys",
    "QueueStats",
    "RunQueue",
    "jump_hash",
]
