"""Durations the engine reports as it works (a dequeue call, a wait for a run lock). Observers are
no-ops until something (the API server's metrics) installs its own; a report costs one call."""

from __future__ import annotations

from collections.abc import Callable

#: ``observer(label, seconds)``
Observer = Callable[[str, float], None]


def _ignore(label: str, seconds: float) -> None:
    return None


class Timings:
    """``dequeue``: one engine dequeue call, label ``runs`` or ``empty``; ``lock_wait``: from asking
    for a run lock to holding it, label the lock's name (``start_attempt``, ``dequeue``, …).
    An observer must not raise: it is called in the middle of the work it times."""

    def __init__(self) -> None:
        self.dequeue: Observer = _ignore
        self.lock_wait: Observer = _ignore

    def reset(self) -> None:
        self.dequeue = self.lock_wait = _ignore


TIMINGS = Timings()
