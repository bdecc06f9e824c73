"""One log line per state change of a run that matters, on the logger ``run_engine.runs``, with the
fields ``event``, ``run_id``, ``env_id``, ``snapshot_id`` and ``attempt`` (and the event's own:
``status``, ``error_type``, ``error_message``, ``delay_ms``, ``reason``, …).

Failures, retries, dead-lettering, cancels, redrives, requeues, suspensions and continuations,
runs waiting for a deployment: INFO or WARNING. The happy path of every run (created, dequeued,
attempt started, succeeded, waiting) is DEBUG, and those events are not even subscribed unless
DEBUG is enabled when the server starts: at the default level they cost nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from run_engine.events import EventBus, RunEvent

log = logging.getLogger("run_engine.runs")

DEBUG, INFO, WARNING = logging.DEBUG, logging.INFO, logging.WARNING
#: event → (the highest level it is logged at, message); run_failed and run_requeued go lower by case
EVENTS: dict[str, tuple[int, str]] = {
    "run_created": (DEBUG, "run created"),
    "run_dequeued": (DEBUG, "run dequeued"),
    "attempt_started": (DEBUG, "attempt started"),
    "run_succeeded": (DEBUG, "run succeeded"),
    "run_blocked": (DEBUG, "run waiting"),
    "run_failed": (WARNING, "run failed"),
    "retry_scheduled": (INFO, "attempt failed; retry scheduled"),
    "run_requeued": (WARNING, "run requeued"),
    "run_cancelled": (INFO, "run cancelled"),
    "run_dead_lettered": (WARNING, "run dead-lettered"),
    "run_redriven": (INFO, "run redriven from the dead-letter queue"),
    "run_pending_version": (INFO, "run waits for a deployment with its task"),
    "run_suspended": (INFO, "run suspended"),
    "run_continued": (INFO, "run continued"),
    "run_updated": (DEBUG, "run updated"),
}
MAX_ERROR_MESSAGE = 300


def level_of(event: RunEvent) -> int | None:
    """The level ``event`` is logged at; None: not logged (its state change is another event's)."""
    name, data = event.name, event.data
    if name == "run_failed":
        if not data.get("final"):
            return None  # the attempt's failure is logged with its retry (retry_scheduled)
        return INFO if str(data.get("status")) == "EXPIRED" else WARNING
    if name == "run_requeued":
        reason = data.get("reason")
        if reason == "delay":
            return DEBUG  # a delayed run whose time came: its ordinary path
        return WARNING if reason == "not started in time" else INFO
    return EVENTS[name][0]


def fields_of(event: RunEvent) -> dict[str, Any]:
    data = event.data
    out: dict[str, Any] = {"event": event.name, "run_id": event.run_id, "env_id": event.env_id,
                           "snapshot_id": event.snapshot_id, "attempt": event.attempt}
    status = data.get("status")
    if status is not None:
        out["status"] = str(status)
    error = data.get("error")
    if isinstance(error, dict):
        out["error_type"] = str(error.get("type") or "")
        message = str(error.get("message") or "")
        out["error_message"] = message[:MAX_ERROR_MESSAGE] + ("…" if len(message) > MAX_ERROR_MESSAGE else "")
    for key in ("delay_ms", "reason", "deliveries", "task", "checkpoint"):
        if data.get(key) is not None:
            out[key] = data[key]
    return out


class RunLog:
    """Subscribes the state-change log to an engine's events."""

    def install(self, events: EventBus) -> Callable[[], None]:
        """Subscribe to the events whose level is enabled now; returns the function that undoes it."""
        unsubscribe = [events.subscribe(name, self.on_event) for name, (highest, _) in EVENTS.items()
                       if log.isEnabledFor(highest)]

        def uninstall() -> None:
            for undo in unsubscribe:
                undo()

        return uninstall

    @staticmethod
    def on_event(event: RunEvent) -> None:
        level = level_of(event)
        if level is None or not log.isEnabledFor(level):
            return
        message = EVENTS[event.name][1]
        if event.name == "run_cancelled" and not event.data.get("final", True):
            message = "cancel requested: the executing attempt is being stopped"
        log.log(level, message, extra=fields_of(event))
