"""In-process event bus: run created, attempt started, succeeded, failed, retry scheduled,
cancelled, dead-lettered. Used by tests, realtime, metrics and the state-change log.

Handlers are called synchronously in emit order; a handler that raises is logged and does not
stop the others or the engine.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import field
from typing import Any

from run_engine.records import record

log = logging.getLogger(__name__)


@record
class RunEvent:
    """``name`` is one of :data:`EVENT_NAMES`; ``data`` carries event-specific fields; ``attempt`` is
    the run's attempt number at the change (0 before its first attempt; None when not known)."""

    name: str
    run_id: str
    env_id: str
    snapshot_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    attempt: int | None = None


EVENT_NAMES = (
    "run_created",
    "run_dequeued",
    "attempt_started",
    "run_succeeded",
    "run_failed",
    "retry_scheduled",
    "run_requeued",
    "run_cancelled",
    "run_dead_lettered",
    "run_redriven",
    "run_pending_version",
    "run_blocked",
    "run_suspended",
    "run_continued",
    "run_updated",  # not a state change: metadata, tags, a new date, a debounced trigger joined it
)

Handler = Callable[[RunEvent], None]


class EventBus:
    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = defaultdict(list)

    def subscribe(self, name: str, handler: Handler) -> Callable[[], None]:
        """Call ``handler`` for every event ``name`` (``"*"`` for all); returns an unsubscribe function."""
        if name != "*" and name not in EVENT_NAMES:
            raise ValueError(f"unknown event {name!r}")
        self._handlers[name].append(handler)
        return lambda: self._handlers[name].remove(handler)

    def emit(self, event: RunEvent) -> None:
        for handler in (*self._handlers.get(event.name, ()), *self._handlers.get("*", ())):
            try:
                handler(event)
            except Exception:
                log.exception("event handler failed for %s", event.name)
