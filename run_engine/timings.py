"""Durations the engine reports as it works (a dequeue call, a wait for a run lock). Observers are
no-ops until something (the API server's metrics) installs its own; a report costs one call."""

from __future__ import annotations

from collections.abc import Callable

#: ``observer(label, seconds)``
Observer = Callable[[str, float], None]
#: ``counter(label)``
Count = Callable[[str], None]


def _ignore(label: str, seconds: float) -> None:
    return None


def _uncounted(label: str) -> None:
    return None


class Timings:
    """``dequeue``: one engine dequeue call, label ``runs`` or ``empty``; ``lock_wait``: from asking
    for a run lock to holding it, label the lock's name (``start_attempt``, ``dequeue``, …).
    And two counts: ``schedule_tick``, a due schedule tick this process dealt with, label ``fired``
    (its run made), ``skipped`` (the environment refused its run: its queue full, its task not
    triggerable) or ``stopped`` (its next tick cannot be worked out: the schedule was deactivated);
    and ``leader_duty_timeout``, a leader duty's run cancelled past its timeout, label the duty.
    An observer must not raise: it is called in the middle of the work it times."""

    def __init__(self) -> None:
        self.dequeue: Observer = _ignore
        self.lock_wait: Observer = _ignore
        self.schedule_tick: Count = _uncounted
        self.leader_duty_timeout: Count = _uncounted

    def reset(self) -> None:
        self.dequeue = self.lock_wait = _ignore
        self.schedule_tick = self.leader_duty_timeout = _uncounted


TIMINGS = Timings()
