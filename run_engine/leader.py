"""Leader lease (the dex technique): one row per lease name in the UNLOGGED ``engine_lease`` table.
A candidate takes the lease when it is free or expired and its holder extends it; time is
PostgreSQL's, so the candidates' clocks do not matter. The holder counts itself leader only until
``ttl_s`` after it sent its last successful take or renewal (by its own monotonic clock, which
runs on through a pause): a process stopped past its lease's end (SIGSTOP, a long GC, a blocked
event loop, a renewal stuck waiting for a connection) runs no duty when it resumes, before it has
asked again. Work that must run once per cluster
(reconciler, retention) runs only on the holder; schedule planning runs on every process (a
tick's idempotency key makes one run of it, `systems/schedules.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from run_engine.db.repository import Repository
from run_engine.dependencies import log_failure
from run_engine.ids import new_id
from run_engine.tasks import stop_task

log = logging.getLogger(__name__)

Duty = tuple[str, float, Callable[[], Awaitable[object]]]  # name, interval s, coroutine function


class LeaderLease:
    def __init__(self, repo: Repository, *, name: str = "engine", ttl_s: float = 30.0, renew_s: float = 15.0,
                 holder: str | None = None) -> None:
        self.repo = repo
        self.name = name
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{new_id('lease')[-6:]}"
        self._held = False  # the last take or renewal succeeded
        self._valid_until = 0.0  # time.monotonic() at which that lease ends at the latest
        self._duties: list[Duty] = []
        self._last_run: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._duty_task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def is_leader(self) -> bool:
        """Whether this process holds the lease now: its last take or renewal succeeded and was
        sent less than ``ttl_s`` ago."""
        return self._held and time.monotonic() < self._valid_until

    def add_duty(self, name: str, interval_s: float, fn: Callable[[], Awaitable[object]]) -> None:
        """Run ``fn`` every ``interval_s`` while this process leads."""
        self._duties.append((name, interval_s, fn))

    async def try_acquire(self) -> float:
        """Take or extend the lease; returns seconds until it is worth trying again."""
        sent = time.monotonic()  # the lease ends ttl_s after PostgreSQL's now(), which is later
        held, expires_in = await self.repo.maintenance.acquire_lease(self.name, self.holder, self.ttl_s)
        if held != self.is_leader:
            log.info("%s %s the %r lease", self.holder, "took" if held else "lost", self.name)
        self._held = held
        self._valid_until = sent + self.ttl_s if held else 0.0
        if held:
            return self.renew_s
        # someone else holds it: try again as soon as it can have expired, at most every renew_s
        return max(0.05, min(self.renew_s, expires_in + 0.05))

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._loop(), name="leader-lease")

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                wait = await self.try_acquire()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log_failure(log, exc, "lease %r: could not be taken or renewed", self.name)
                self._held = False
                wait = 1.0
            if self.is_leader and (self._duty_task is None or self._duty_task.done()):
                self._duty_task = asyncio.create_task(self._run_duties())
            await asyncio.sleep(wait)

    async def _run_duties(self) -> None:
        """Run each duty on its own interval for as long as this process leads."""
        while self.is_leader and not self._stopping:
            for name, interval, fn in self._duties:
                if time.monotonic() - self._last_run.get(name, -1e9) < interval or not self.is_leader:
                    continue
                self._last_run[name] = time.monotonic()
                try:
                    await fn()
                except Exception as exc:
                    log_failure(log, exc, "leader duty %s failed", name)
            now = time.monotonic()
            due = [self._last_run.get(name, now) + interval - now for name, interval, _ in self._duties]
            await asyncio.sleep(min([1.0, *due]))

    async def stop(self) -> None:
        """Stop campaigning and give the lease up at once (another process takes it next try)."""
        self._stopping = True
        for task in (self._task, self._duty_task):
            await stop_task(task)
        self._task = self._duty_task = None
        if self._held:  # (only where the holder is still this process)
            with contextlib.suppress(Exception):
                await self.repo.maintenance.release_lease(self.name, self.holder)
        self._held = False
