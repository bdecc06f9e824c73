"""A check of the server's connections every ``check_s`` while it has any to look at: a timer on
the running loop, set when the first is noted and again after each check that leaves some (the
guards on unread answers, api/stalls.py, and on requests that stop arriving, api/slow_requests.py)."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Any

log = logging.getLogger(__name__)


class PeriodicSweep(ABC):
    #: what the sweep looks at, for the log line of a check that failed
    WHAT = "connections"

    def __init__(self, check_s: float) -> None:
        self.check_s = check_s
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    @abstractmethod
    def __len__(self) -> int:
        """How many connections are watched (the timer is set again while any are)."""

    @abstractmethod
    def sweep(self) -> list[Any]:
        """Act on the connections due; those acted on."""

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test calling sweep itself)
            return
        # (a timer of another loop, closed since, would never fire: one is set on this one)
        if self._timer is None or self._timer_loop is not loop:
            self._timer = loop.call_later(self.check_s, self._tick)
            self._timer_loop = loop

    def _tick(self) -> None:
        self._timer = None
        try:
            self.sweep()
        except Exception:  # never let the loop's callback fail: look again next time
            log.exception("%s could not be checked", self.WHAT)
        if len(self):
            self._timer = asyncio.get_running_loop().call_later(self.check_s, self._tick)
